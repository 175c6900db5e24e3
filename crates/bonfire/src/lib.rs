//! Bonfire: distributed training for the [Burn](https://burn.dev) deep-learning
//! framework (Burn 0.22.1).
//!
//! This crate is the facade: it re-exports Bonfire's layered crates under one
//! name so that applications depend on `bonfire` alone. Each layer depends only
//! on the layers below it:
//!
//! - [`comm`] (`bonfire-comm`): process groups and collectives (all-reduce,
//!   broadcast, ...) over in-process threads, MPI or NCCL, with timeouts,
//!   mismatch detection and a flight recorder so a broken job fails loudly
//!   instead of hanging.
//! - [`dtensor`] (`bonfire-dtensor`): differentiable collectives as a Burn backend
//!   extension, device meshes, distributed tensors (`DTensor` with `Shard`,
//!   `Replicate` and `Partial` placements) and redistribution between placements;
//!   `dtensor::parallel`: tensor and sequence parallelism (parallel-aware layers,
//!   column-/row-wise and sequence-parallel styles, `parallelize_module` plans,
//!   `loss_parallel`).
//! - [`ddp`] (`bonfire-ddp`): data parallelism — `DistributedDataParallel` with
//!   bucketed gradient all-reduce overlapped with backward.
//! - [`zero`] (`bonfire-zero`): ZeRO sharded data parallelism — stages 1–3
//!   (optimizer state, gradients, parameters), CPU offload of optimizer state,
//!   checkpoints that reshard from N ranks to M.
//! - [`pipeline`] (`bonfire-pipeline`): pipeline parallelism — stages, schedules as
//!   data (GPipe, 1F1B, interleaved, zero-bubble), a static checker, timelines.
//! - [`layout`] (`bonfire-layout`): the layout itself, shared by trainer and planner —
//!   `ParallelDims` (degrees per `Axis`, their options, precision, checks), schedule
//!   kinds, ZeRO stages; no dependencies.
//! - [`train`] (`bonfire-train`): one layout (`ParallelDims` over a `[pp, dp_replicate, dp, cp, tp]` mesh)
//!   and one training loop (`Trainer`, `fit`) for any Burn model implementing
//!   `ParallelModel`, with DDP or ZeRO on dp, tensor parallelism on tp and any pipeline
//!   schedule on pp.
//! - [`plan`] (`bonfire-plan`): the planner — a cost model (bytes per rank, step time) of
//!   every layout and a search that ranks the ones that fit a cluster, with the reasons;
//!   on no crate but `layout` (`docs/planner.md`).
//! - [`models`] (`bonfire-models`): the reference GPT and a plain-Burn classifier, each
//!   with its `ParallelModel` description (tensor-parallel plan, pipeline pieces, layers).
//!
//! See `docs/architecture.md` in the repository for the full picture.
//!
//! # Example
//!
//! Four ranks, each a thread, sum their rank numbers (0 + 1 + 2 + 3 = 6):
//!
//! ```rust
//! use bonfire::prelude::*;
//! let sums = launch(4, |pg: ProcessGroup| {
//!     let mut v = vec![pg.rank() as f32; 3];
//!     pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
//!     v
//! }).unwrap();
//! assert!(sums.iter().all(|v| v == &vec![6.0; 3]));
//! ```

#![forbid(unsafe_code)]

pub use bonfire_comm as comm;
pub use bonfire_ddp as ddp;
pub use bonfire_dtensor as dtensor;
pub use bonfire_layout as layout;
pub use bonfire_models as models;
pub use bonfire_pipeline as pipeline;
pub use bonfire_plan as plan;
pub use bonfire_train as train;
pub use bonfire_zero as zero;

/// The names almost every Bonfire program needs, for `use bonfire::prelude::*;`.
pub mod prelude {
    pub use bonfire_comm::{CommError, ProcessGroup, ReduceOp, launch};
    pub use bonfire_dtensor::{DTensor, DeviceMesh, Placement, distribute_tensor};
    pub use bonfire_module::DataParallel;
    pub use bonfire_parallel::ParallelModel;
    pub use bonfire_tp::{
        ColwiseParallel, ParallelPlan, RowwiseParallel, SequenceParallel, parallelize_module,
    };
    pub use bonfire_train::{FitConfig, Launcher, OptimizerKind, ParallelDims, Trainer, fit};
}
