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
//! - [`dtensor`] (`bonfire-dtensor`): the primitives — device meshes, distributed tensors
//!   (`DTensor` with `Shard`, `Replicate` and `Partial` placements), redistribution,
//!   differentiable collectives, the data plane.
//! - [`module`] (`bonfire-module`): a Burn module as the engines see it — its parameters,
//!   layer and gradient hooks, precision, the `DataParallel` interface.
//! - One crate per parallelism: [`tp`] (tensor and sequence: parallel-aware layers, styles,
//!   `parallelize_module` plans, `loss_parallel`), [`cp`] (context: ring attention), [`ep`]
//!   (expert: token dispatch, the experts' shards), [`recompute`] (activation
//!   checkpointing), [`ddp`] (`DistributedDataParallel`, bucketed all-reduce overlapped
//!   with backward), [`zero`] (ZeRO stages 1–3, offload, HSDP), [`pipeline`] (stages,
//!   schedules as data, a static checker, timelines).
//! - [`layout`] (`bonfire-layout`): the layout itself, shared by trainer and planner —
//!   `ParallelDims` (degrees per `Axis`, their options, precision, checks), schedule
//!   kinds, ZeRO stages; no dependencies.
//! - [`parallel`] (`bonfire-parallel`): the contract a model implements —
//!   `ParallelModel`, its pipeline pieces, its batches' rows, its weights.
//! - [`train`] (`bonfire-train`): one layout over a `[pp, dp_replicate, dp, cp, tp]` mesh
//!   and one training loop (`Trainer`, `fit`) for any `ParallelModel`; checkpoints.
//! - [`plan`] (`bonfire-plan`): the planner — a cost model (bytes per rank, step time) of
//!   every layout and a search that ranks the ones that fit a cluster, with the reasons.
//! - [`models`] (`bonfire-models`): the GPT, the Llama, the Mixtral and a plain-Burn
//!   classifier, each with its `ParallelModel`; Hugging Face directories in and out.
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
pub use bonfire_cp as cp;
pub use bonfire_ddp as ddp;
pub use bonfire_dtensor as dtensor;
pub use bonfire_ep as ep;
pub use bonfire_layout as layout;
pub use bonfire_models as models;
pub use bonfire_module as module;
pub use bonfire_parallel as parallel;
pub use bonfire_pipeline as pipeline;
pub use bonfire_plan as plan;
pub use bonfire_recompute as recompute;
pub use bonfire_tp as tp;
pub use bonfire_train as train;
pub use bonfire_zero as zero;

/// The names almost every Bonfire program needs, for `use bonfire::prelude::*;`.
pub mod prelude {
    pub use bonfire_comm::{CommError, ProcessGroup, ReduceOp, launch};
    pub use bonfire_dtensor::{DTensor, DeviceMesh, Placement, distribute_tensor};
    pub use bonfire_layout::ParallelDims;
    pub use bonfire_module::DataParallel;
    pub use bonfire_parallel::ParallelModel;
    pub use bonfire_tp::{
        ColwiseParallel, ParallelPlan, RowwiseParallel, SequenceParallel, parallelize_module,
    };
    pub use bonfire_train::{FitConfig, Launcher, OptimizerKind, Trainer, fit};
}
