//! # bonfire-plan
//!
//! From a model and a cluster to the layout that trains it fastest, with its memory and
//! time predicted — and the reasons. A pure cost model (no Burn; of Bonfire only the layout
//! vocabulary, `bonfire-layout`):
//!
//! - [`model`]: [`ModelSpec`] (Bonfire's GPT, Llama or Mixtral, presets `gpt-bench`,
//!   `gpt3-175b`, `llama3-8b`, `llama3-70b`, `llama3-405b`, `mixtral-8x7b`), parameters per pipeline piece and tp rank,
//!   FLOPs, activations kept for backward;
//! - [`cluster`]: [`ClusterSpec`] (nodes, devices per node, [`DeviceSpec`] presets `h100`,
//!   `a100` or a measured CPU rate, [`LinkSpec`] presets `nvlink`, `pcie`, `ib`, `ethernet`);
//! - [`layout`]: what the planner asks of a layout ([`PlannedLayout`] on `bonfire-layout`'s
//!   [`ParallelDims`], the trainer's own type) and of a schedule ([`ScheduleModel`]);
//! - [`memory`]: the ZeRO paper's formula ([`memory::formula`], which `cargo xtask bench
//!   memory` checks against a counting allocator), what Bonfire holds, activations and
//!   transients;
//! - [`time`] and [`cost`]: step time from FLOPs, ring collectives on the links a group
//!   crosses, overlap, the pipeline bubble per schedule, the optimizer step;
//! - expert parallelism: for a mixture of experts ([`Arch::Mixtral`]), ep over groups of ep
//!   consecutive dp × cp ranks, each holding `E/ep` experts, their state sharded over the
//!   dp·cp/ep ranks holding the same experts ([`memory::rank_state`]), tokens exchanged by
//!   all-to-alls on the links the group spans ([`experts::ep_per_layer`]);
//! - HSDP: a `dp_replicate` axis outside dp, ZeRO sharded over dp × cp only
//!   ([`PlannedLayout::shard_ranks`]), each rank's gradient shard all-reduced across the
//!   replicas ([`cost::replica_all_reduce`]);
//! - [`search`]: [`plan`] ranks every layout that fits and says why the first won, or fails
//!   with [`PlanError::Infeasible`] naming what does not fit where.
//!
//! Descriptions read from JSON ([`ModelSpec::from_json`], [`ClusterSpec::from_json`]) fail
//! with one [`PlanError::Field`] naming the missing or impossible field.
//!
//! ```
//! use bonfire_plan::{ClusterSpec, DeviceSpec, LinkSpec, ModelSpec, Request, plan};
//! use bonfire_layout::MixedPrecision;
//! let model = ModelSpec::preset("llama3-8b").unwrap();
//! let cluster = ClusterSpec {
//!     nodes: 1,
//!     gpus_per_node: 8,
//!     device: DeviceSpec::preset("h100").unwrap(),
//!     intra: LinkSpec::preset("nvlink").unwrap(),
//!     inter: LinkSpec::preset("ib").unwrap(),
//!     overlap: 1.0,
//! };
//! let req = Request { global_batch: 64, seq: 8192, precisions: vec![MixedPrecision::bf16()], memory_fraction: 0.9 };
//! let plan = plan(&model, &cluster, &req).unwrap();
//! let top = &plan.ranked[0];
//! assert_eq!(top.layout.world_size(), 8);
//! assert!(top.bytes() <= 0.9 * (80u64 << 30) as f64);
//! ```
//!
//! `docs/planner.md` explains the model and its measured accuracy.

#![forbid(unsafe_code)]

pub mod bytes;
pub mod cluster;
pub mod cost;
mod describe;
pub mod error;
pub mod experts;
mod json;
pub mod layout;
#[cfg(feature = "machine")]
pub mod machine;
pub mod memory;
pub mod model;
mod presets;
pub mod search;
pub mod shape;
pub mod time;

pub use bytes::{format_bytes, parse_bytes};
pub use cluster::{ClusterSpec, DeviceSpec, LinkSpec};
pub use cost::{Estimate, MemoryParts, Request, estimate, predict_ranks, rank_memory};
pub use error::PlanError;
pub use layout::{
    Held, PlannedLayout, SEARCHED_SCHEDULES, ScheduleModel, base_layout, context_layout,
    expert_layout, hsdp_layout,
};
pub use model::{
    Arch, AttentionKind, LatentAttention, ModelSpec, Moe, RING_KEPT_SCORES, stage_ranges,
};
pub use presets::PRESETS;
pub use search::{Plan, candidates, estimate_all, expert_degrees, plan};
pub use shape::{ChunkShape, RankShape, rank_shapes};
