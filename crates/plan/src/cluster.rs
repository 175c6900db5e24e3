//! [`ClusterSpec`]: the machine a plan is for — nodes × devices per node, each device's
//! memory, FLOP rate and memory bandwidth ([`DeviceSpec`], presets `h100`, `a100`, `cpu`), the
//! links inside a node and between nodes ([`LinkSpec`], presets `nvlink`, `nvlink3`, `pcie`,
//! `ib`, `ethernet`, `shm`) — and which link a parallel group of the `[pp, dp_replicate, dp, cp, tp]` mesh
//! crosses. The figures and their sources are listed in `docs/planner.md`.

use crate::error::PlanError;
use crate::json::Fields;
use bonfire_layout::MixedPrecision;

/// One accelerator (or one CPU rank).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSpec {
    /// The device's name in the planner's reasons: the preset's (`h100`, `a100`), `cpu` or
    /// `custom`.
    pub name: String,
    /// Bytes a rank may hold.
    pub memory: usize,
    /// Peak dense matrix-product rate in f32, FLOP/s.
    pub flops_f32: f64,
    /// Peak dense matrix-product rate in bf16, FLOP/s.
    pub flops_bf16: f64,
    /// Memory bandwidth, bytes/s (the optimizer step is bound by it).
    pub mem_bw: f64,
    /// The fraction of peak a training step sustains (model FLOPs utilisation); 1.0 for a
    /// rate that was measured on this machine.
    pub efficiency: f64,
    /// Seconds every kernel (operation) costs however little it computes: its launch and
    /// the framework's dispatch. Paid per operation, per layer, per micro-batch.
    pub launch: f64,
    /// Whether Bonfire's fused attention op runs here in f32: on the CPU (Flex) it does; on a
    /// CubeCL device (CUDA, wgpu) Bonfire's models run Burn's materialized attention for now,
    /// so a model whose attention is Bonfire's ([`crate::AttentionKind::Fused`]) is costed
    /// with its scores kept ([`crate::ModelSpec::on_device`]).
    pub fused_attention: bool,
}

impl DeviceSpec {
    /// A preset: `h100` (SXM, 80 GB), `a100` (SXM, 80 GB); `cpu` needs a measured rate, see
    /// [`DeviceSpec::cpu`].
    pub fn preset(name: &str) -> Option<Self> {
        let gib = 1usize << 30;
        Some(match name {
            "h100" => Self {
                name: name.into(),
                memory: 80 * gib,
                flops_f32: 67e12,
                flops_bf16: 989e12,
                mem_bw: 3.35e12,
                efficiency: 0.5,
                launch: GPU_LAUNCH,
                fused_attention: false,
            },
            "a100" => Self {
                name: name.into(),
                memory: 80 * gib,
                flops_f32: 19.5e12,
                flops_bf16: 312e12,
                mem_bw: 2.039e12,
                efficiency: 0.5,
                launch: GPU_LAUNCH,
                fused_attention: false,
            },
            _ => return None,
        })
    }

    /// A CPU rank with a measured matrix-product rate `flops` (both dtypes: Bonfire's CPU
    /// backend computes bf16 through f32), `memory` bytes, `mem_bw` bytes/s and `launch`
    /// seconds of fixed cost per operation.
    pub fn cpu(flops: f64, memory: usize, mem_bw: f64, launch: f64) -> Self {
        Self {
            name: "cpu".into(),
            memory,
            flops_f32: flops,
            flops_bf16: flops,
            mem_bw,
            efficiency: 1.0,
            launch,
            fused_attention: true,
        }
    }

    /// The sustained rate for products in `precision`'s compute dtype.
    pub fn rate(&self, precision: MixedPrecision) -> f64 {
        let peak = if precision.is_mixed() {
            self.flops_bf16
        } else {
            self.flops_f32
        };
        peak * self.efficiency
    }
}

/// The fixed seconds of one GPU kernel (launch and dispatch): CUDA's launch overhead is
/// a few µs (about 5 µs from the host, NVIDIA's CUDA graphs material), an eager framework's
/// per-operation dispatch adds more; 5 µs is the low end.
pub const GPU_LAUNCH: f64 = 5e-6;

/// A link between ranks: bandwidth per rank and direction, latency per message, and the
/// fixed cost of every call.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkSpec {
    /// The link's name in the planner's reasons: the preset's (`nvlink`, `ib`, …) or the one
    /// a measured link was given.
    pub name: String,
    /// Bytes/s each rank can send (and receive) at once.
    pub bandwidth: f64,
    /// Seconds per message (a ring step).
    pub latency: f64,
    /// Seconds every collective or point-to-point call costs beyond its ring steps (its
    /// kernel's launch and the peers' handshake): NCCL's small-message times are 10–30 µs
    /// inside a node (nccl-tests on DGX machines); 0 for a measured link, whose latency
    /// was measured per call.
    pub call: f64,
}

impl LinkSpec {
    /// A preset: `nvlink` (NVLink 4, H100: 450 GB/s per direction), `nvlink3` (A100:
    /// 300 GB/s), `pcie` (Gen4 x16: 32 GB/s), `ib` (NDR 400 Gb/s per GPU: 50 GB/s),
    /// `ethernet` (100 GbE: 12.5 GB/s), `shm` (rank threads of one process: a default to
    /// be replaced by a measured one).
    pub fn preset(name: &str) -> Option<Self> {
        let (bandwidth, latency, call) = match name {
            "nvlink" => (450e9, 3e-6, 10e-6),
            "nvlink3" => (300e9, 3e-6, 10e-6),
            "pcie" => (32e9, 10e-6, 10e-6),
            "ib" => (50e9, 5e-6, 20e-6),
            "ethernet" => (12.5e9, 30e-6, 20e-6),
            "shm" => (5e9, 50e-6, 0.0),
            _ => return None,
        };
        Some(Self {
            name: name.into(),
            bandwidth,
            latency,
            call,
        })
    }

    /// A link with a measured `bandwidth` (bytes/s) and `latency` (s).
    pub fn measured(name: &str, bandwidth: f64, latency: f64) -> Self {
        Self {
            name: name.into(),
            bandwidth,
            latency,
            call: 0.0,
        }
    }
}

/// Nodes of identical devices.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSpec {
    /// Nodes in the cluster.
    pub nodes: usize,
    /// Devices (ranks) per node; tensor-parallel groups stay inside one.
    pub gpus_per_node: usize,
    /// Every rank's device.
    pub device: DeviceSpec,
    /// Between the devices of one node.
    pub intra: LinkSpec,
    /// Between nodes.
    pub inter: LinkSpec,
    /// The fraction of the backward pass that data-parallel communication can hide behind
    /// (1 on GPUs, where collectives run on their own engines; 0 for CPU rank threads, which
    /// share the cores with the compute).
    pub overlap: f64,
}

const FIELDS: [&str; 11] = [
    "nodes",
    "gpus_per_node",
    "device",
    "device_memory",
    "intra",
    "inter",
    "flops",
    "flops_bf16",
    "mem_bw",
    "efficiency",
    "overlap",
];

fn link(f: &Fields, field: &str, name: &str) -> Result<LinkSpec, PlanError> {
    LinkSpec::preset(name).ok_or_else(|| {
        f.error(
            field,
            format!("`{name}` is unknown (nvlink, nvlink3, pcie, ib, ethernet, shm)"),
        )
    })
}

impl ClusterSpec {
    /// Ranks in all.
    pub fn world(&self) -> usize {
        self.nodes * self.gpus_per_node
    }

    /// The link a group of `size` ranks spaced `stride` apart uses: the node's when the
    /// group's span (`size · stride` consecutive ranks) stays in one node, else the
    /// inter-node one (the slower link bounds a ring).
    pub fn group_link(&self, size: usize, stride: usize) -> &LinkSpec {
        if size * stride <= self.gpus_per_node {
            &self.intra
        } else {
            &self.inter
        }
    }

    /// A cluster from a JSON object: `nodes`, `gpus_per_node`, `device` (`h100`, `a100`)
    /// required unless `flops` is given (a custom device: `flops` (f32 FLOP/s),
    /// `flops_bf16`, `mem_bw`, `device_memory` required); `device_memory` (`"80GiB"` or
    /// bytes) overrides the preset's, `intra` (default nvlink), `inter` (default ib),
    /// `efficiency`, `overlap`.
    pub fn from_json(what: &str, text: &str) -> Result<Self, PlanError> {
        let mut f = Fields::parse(what, text)?;
        let nodes = f.count("nodes")?;
        let gpus_per_node = f.count("gpus_per_node")?;
        let preset = f.string_opt("device")?;
        let memory = f.bytes_opt("device_memory")?;
        let flops = f.number_opt("flops")?;
        let flops_bf16 = f.number_opt("flops_bf16")?;
        let mem_bw = f.number_opt("mem_bw")?;
        let mut device = match (&preset, flops) {
            (Some(name), _) => DeviceSpec::preset(name)
                .ok_or_else(|| f.error("device", format!("`{name}` is unknown (h100, a100)")))?,
            (None, Some(flops)) => DeviceSpec {
                name: "custom".into(),
                memory: memory
                    .ok_or_else(|| f.error("device_memory", "missing (a custom device)"))?,
                flops_f32: flops,
                flops_bf16: flops_bf16.unwrap_or(flops),
                mem_bw: mem_bw.ok_or_else(|| f.error("mem_bw", "missing (a custom device)"))?,
                efficiency: 1.0,
                launch: GPU_LAUNCH,
                fused_attention: false,
            },
            (None, None) => {
                return Err(f.error("device", "missing (a preset: h100, a100; or give `flops`)"));
            }
        };
        if let Some(m) = memory {
            device.memory = m;
        }
        if let Some(x) = flops.filter(|_| preset.is_some()) {
            device.flops_f32 = x;
        }
        if let Some(x) = flops_bf16.filter(|_| preset.is_some()) {
            device.flops_bf16 = x;
        }
        if let Some(e) = f.fraction_opt("efficiency")? {
            if e == 0.0 {
                return Err(f.error("efficiency", "must be above 0"));
            }
            device.efficiency = e;
        }
        let intra = f.string_opt("intra")?.unwrap_or_else(|| "nvlink".into());
        let inter = f.string_opt("inter")?.unwrap_or_else(|| "ib".into());
        let (intra, inter) = (link(&f, "intra", &intra)?, link(&f, "inter", &inter)?);
        let overlap = f.fraction_opt("overlap")?.unwrap_or(1.0);
        f.finish(&FIELDS)?;
        Ok(Self {
            nodes,
            gpus_per_node,
            device,
            intra,
            inter,
            overlap,
        })
    }
}
