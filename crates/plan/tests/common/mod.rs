//! The clusters and requests the planner's test suites share.
#![allow(dead_code)]

use bonfire_layout::MixedPrecision;
use bonfire_plan::{ClusterSpec, DeviceSpec, LinkSpec, Request};

/// `nodes` × `g` devices of the preset `device`, linked by the presets `intra` and `inter`.
pub fn cluster(nodes: usize, g: usize, device: &str, intra: &str, inter: &str) -> ClusterSpec {
    ClusterSpec {
        nodes,
        gpus_per_node: g,
        device: DeviceSpec::preset(device).unwrap(),
        intra: LinkSpec::preset(intra).unwrap(),
        inter: LinkSpec::preset(inter).unwrap(),
        overlap: 1.0,
    }
}

/// `nodes` × `g` H100s, NVLink inside a node, InfiniBand between.
pub fn h100s(nodes: usize, g: usize) -> ClusterSpec {
    cluster(nodes, g, "h100", "nvlink", "ib")
}

/// `global_batch` sequences of `seq` tokens in bf16, 90 % of a device's memory usable.
pub fn bf16(global_batch: usize, seq: usize) -> Request {
    Request {
        global_batch,
        seq,
        precisions: vec![MixedPrecision::bf16()],
        memory_fraction: 0.9,
    }
}
