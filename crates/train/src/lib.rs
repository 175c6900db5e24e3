//! # bonfire-train
//!
//! One layout and one training loop for any Burn model on any `pp × dp_replicate × dp × cp × tp` mesh, with DDP
//! or ZeRO 1–3 on dp, tensor (± sequence and loss) parallelism on tp and any pipeline
//! schedule on pp — torchtitan's structure in Rust:
//!
//! - [`ParallelDims`] (`bonfire-layout`'s, shared with the planner) owns the layout: the
//!   degree of each [`Axis`], each axis's options, their validation; the trainer builds its
//!   one `DeviceMesh` (`[pp, dp_replicate, dp, cp, tp]`, tp innermost).
//! - [`ParallelModel`] is what a model implements: its loss, and, for each further axis, its
//!   description from outside the model's code (a tensor-parallel plan, pipeline pieces by
//!   module path, its layers). A plain Burn model needs only the loss.
//! - [`Trainer::build`] checks everything first, then applies tensor parallelism, cuts the
//!   pipeline and wraps the dp axis ([`DpWrapper`]: DDP or ZeRO, behind
//!   [`bonfire_module::DataParallel`]), returning this rank's [`Engine`].
//! - [`fit`] is the loop: batches from a [`DataSource`], steps, reports (progress bar,
//!   `--metrics` JSON lines, tokens/s), hooks for gradients and checkpoints.
//! - [`checkpoint`]: the whole training state saved in any layout (each rank its own slices,
//!   an index, atomically, in the background) and resumed on any other layout and world size.
//! - [`fault`]: fault-tolerant data parallelism — survivors of a dead rank shrink the group
//!   and keep training from their in-memory state ([`fit_fault_tolerant`]).
//! - [`Launcher`]: ranks as threads, or as processes under `mpirun` (feature `mpi`).
//!
//! ```
//! use bonfire_train::{fit, FitConfig, Launcher, OptimizerKind, Trainer};
//! use bonfire_layout::ParallelDims;
//! use bonfire_parallel::ParallelModel;
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::tensor::{Device, Tensor};
//!
//! // An ordinary Burn model: nothing of Bonfire inside.
//! #[derive(Module, Debug)]
//! struct Regressor {
//!     linear: Linear,
//! }
//!
//! // All DDP and ZeRO need: the loss of a batch (inputs, targets).
//! impl ParallelModel for Regressor {
//!     type Batch = (Tensor<2>, Tensor<2>);
//!     fn loss(&self, (x, y): Self::Batch) -> Tensor<1> {
//!         (self.linear.forward(x) - y).powi_scalar(2).mean()
//!     }
//! }
//!
//! let device = Device::flex().autodiff();
//! let model = Regressor { linear: LinearConfig::new(4, 1).init(&device) };
//! // Two data-parallel ranks with ZeRO-3 and Burn's AdamW.
//! let dims = ParallelDims::parse_mesh("dp=2").unwrap().with_zero(bonfire_layout::ZeroStage::Zero3);
//! let trainer = Trainer::new(dims, || OptimizerKind::AdamW.build());
//! let data = |step: usize, device: &Device| {
//!     let x = Tensor::<2>::ones([4, 4], device) * (step as f32 + 1.0);
//!     let y = Tensor::<2>::ones([4, 1], device);
//!     (x, y)
//! };
//! let losses = Launcher::Threads { ranks: 2 }
//!     .run("doc", |pg| {
//!         let first = data(0, &device);
//!         let mut engine = trainer.build(model.clone(), &pg, &first).unwrap();
//!         let reports = fit(engine.as_mut(), &data, &FitConfig::new(3, 0.01), &mut ()).unwrap();
//!         reports.iter().map(|r| r.loss).collect::<Vec<_>>()
//!     })
//!     .unwrap();
//! assert_eq!(losses[0], losses[1]); // every rank reports the global loss
//! ```
//!
//! See `docs/architecture.md` and `docs/train.md`.

#![forbid(unsafe_code)]

pub mod checkpoint;
mod engine;
mod error;
mod eval;
pub mod fault;
mod fit;
mod launch;
mod mesh;
mod optim;
pub mod parity;
mod rss;
pub use rss::peak_bytes as peak_rss_bytes;
mod scaler;
pub mod schedule;
mod tensorboard;
mod trainer;
mod wrapper;

pub use checkpoint::{CheckpointConfig, Checkpointer, resume};
pub use engine::Engine;
pub use error::{CheckpointError, TrainError};
pub use eval::Evaluation;
pub use fault::{FaultTolerance, KillAt, fit_fault_tolerant};
pub use fit::{FitConfig, Hooks, StepPhases, StepReport, fit};
pub use launch::Launcher;
pub use mesh::RankMesh;
pub use optim::{AdamWSettings, OptimizerKind, OptimizerSpec};
pub use scaler::{LossScaler, LossScaling};
pub use schedule::{Decay, LrSchedule};
pub use tensorboard::TensorBoard;
pub use trainer::Trainer;
pub use wrapper::{DpSpec, DpWrapper, OptimizerFactory, Staged, WrapperReport};
