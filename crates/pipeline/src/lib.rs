//! # bonfire-pipeline
//!
//! Pipeline parallelism for Burn models: a model is a sequence of [`Block`]s split into
//! stages ([`split_at`], [`split_balanced`] by parameter count, [`balance_measured`] by measured
//! piece times), placed on ranks (several chunks per rank for
//! interleaving), and trained one batch at a time as micro-batches flowing through a
//! [`Schedule`] — a per-rank list of [`Action`]s, generated for GPipe, 1F1B, interleaved 1F1B,
//! ZB-H1 and ZB-V, checked statically by [`check()`](check::check) (every send has its
//! receive, no rank waits on a cycle, each backward follows its forward) and executed by one
//! runtime ([`run_schedule`], along an axis of a `bonfire_dtensor::DeviceMesh`). A stage
//! computes through [`StageParams`]: its own chunks ([`LocalChunks`]) or a data-parallel
//! wrapper of them (on a `dp × pp` mesh the trainer in `bonfire-train` hands it DDP or ZeRO).
//! The executed [`Timeline`] gives the bubble fraction and an SVG.
//!
//! ```
//! use bonfire_comm::launch;
//! use bonfire_dtensor::DeviceMesh;
//! use bonfire_pipeline::{BurnStage, Block, Generate, LocalChunks, ScheduleKind, chunks_for_rank,
//!     run_schedule, split_at, split_batch, microbatch_weights};
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::tensor::{Device, Tensor, activation::gelu};
//!
//! #[derive(Module, Debug)]
//! struct Mlp { linear: Linear }
//! impl Block<2> for Mlp {
//!     fn forward(&self, x: Tensor<2>) -> Tensor<2> { gelu(self.linear.forward(x)) }
//! }
//!
//! let losses = launch(2, |pg| {
//!     let device = Device::flex().autodiff();
//!     // Four blocks, two stages; every rank builds (or loads) the same model.
//!     let blocks: Vec<Mlp> = (0..4)
//!         .map(|_| Mlp { linear: LinearConfig::new(8, 8).init(&device) })
//!         .collect();
//!     let stages = split_at(blocks, &[2]).unwrap();
//!     let schedule = ScheduleKind::OneFOneB.generate(2, 4);
//!     let chunks = chunks_for_rank(&stages, &schedule, pg.rank()).unwrap();
//!     let x = Tensor::<2>::ones([8, 8], &device);
//!     let mesh = DeviceMesh::one_d(&pg, "pp").unwrap();
//!     let mut stage = BurnStage::new(LocalChunks::new(chunks), &schedule, pg.rank(),
//!             device.clone(), microbatch_weights(8, 4))
//!         .with_inputs(split_batch(x.clone(), 4))
//!         .with_loss(|_mb, out: Tensor<2>| out.powi_scalar(2).mean());
//!     let _timeline = run_schedule(&mesh, "pp", &schedule, &mut stage).unwrap();
//!     let (held, loss) = stage.finish();
//!     let (_chunks, _grads) = held.into_parts(); // gradients summed over micro-batches
//!     loss // Some(batch loss) on the last stage's rank
//! })
//! .unwrap();
//! assert!(losses[0].is_none() && losses[1].is_some());
//! ```
//!
//! See `docs/pipeline.md` for the schedules, the checker, the B/W split and the benchmark.

#![forbid(unsafe_code)]

pub mod balance;
pub mod check;
mod error;
pub mod runtime;
pub mod schedule;
pub mod stage;
pub mod timeline;

pub use balance::{balance_measured, imbalance, rank_loads, simulated_step};
pub use check::{CheckError, Problem, check};
pub use runtime::{Activation, PipelineError, StageCompute, run_schedule, run_unchecked};
pub use schedule::{Action, BackwardKind, Generate, Schedule, ScheduleKind, StageMap};
pub use stage::{
    Block, BlockLossFn, BurnStage, LocalChunks, LossFn, StageParams, balance, chunks_for_rank,
    forward_chunk, microbatch_sizes, microbatch_weights, split_at, split_balanced, split_batch,
};
pub use timeline::{RankTimeline, Span, Timeline};
