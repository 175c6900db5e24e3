//! # bonfire-zero
//!
//! ZeRO sharded data parallelism for [Burn](https://burn.dev): data-parallel training where
//! no rank holds every optimizer state (stage 1), gradient (stage 2) or parameter (stage 3),
//! with the optimizer state optionally kept in a host store between steps (ZeRO-Offload).
//!
//! - [`Zero`] wraps any Burn [`Module`](burn::module::Module) and any Burn optimizer —
//!   anything that converts into a [`ModuleOptimizer`](burn::optim::ModuleOptimizer):
//!   `AdamWConfig::new().init()`, `SgdConfig::new().build()`, … — on a data-parallel
//!   [`ProcessGroup`](bonfire_comm::ProcessGroup) (a mesh axis's group for 2-d layouts). The
//!   optimizer steps this rank's range of the flat parameter vector as one tensor, so its
//!   state is sharded. It implements [`DataParallel`], the interface it shares with DDP.
//! - [`Partition`]: parameters flattened in module order into one logical vector, cut into
//!   contiguous byte-balanced ranges; a parameter may straddle ranks.
//! - Models show their layers with [`bonfire_module::layer`]: stage 3 then gathers each
//!   layer's parameters when it is entered and frees them when it is done (re-gathered in
//!   backward under Balanced checkpointing, the next layer prefetched), and stage 2
//!   reduce-scatters gradient buckets while backward runs. Parameters used outside any layer
//!   still work, with less memory saved.
//! - Saving and resuming: the trainer's checkpoint (`bonfire_train::checkpoint`, any layout
//!   onto any other) takes a `Zero`'s slices and their optimizer state through
//!   [`optim::record_states`] / [`optim::with_states`] and [`Zero::load_state`].
//!
//! ```
//! use bonfire_comm::ThreadWorld;
//! use bonfire_module::layer;
//! use bonfire_zero::{Zero, ZeroConfig, held_param_bytes};
//! use bonfire_module::DataParallel;
//! use bonfire_layout::ZeroStage;
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::SgdConfig;
//! use burn::tensor::{Device, Tensor};
//!
//! #[derive(Module, Debug)]
//! struct Mlp {
//!     up: Linear,
//!     down: Linear,
//! }
//!
//! impl Mlp {
//!     fn loss(&self, x: Tensor<2>) -> Tensor<1> {
//!         // Each layer's copy drops at the end of its statement: under stage 3 its gathered
//!         // parameters go with it.
//!         let h = layer(&self.up, &x).forward(x);
//!         layer(&self.down, &h).forward(h).powi_scalar(2).mean()
//!     }
//! }
//!
//! // Built anywhere: stage 3 puts its parameters on `zero.device()` (Balanced gradient
//! // checkpointing, so backward re-gathers parameters instead of keeping them).
//! let device = Device::flex().autodiff();
//! let model = Mlp {
//!     up: LinearConfig::new(8, 32).init(&device),
//!     down: LinearConfig::new(32, 1).init(&device),
//! };
//! let runs = ThreadWorld::new(2).launch(|pg| {
//!     let config = ZeroConfig::new(ZeroStage::Zero3);
//!     let mut zero = Zero::new(model.clone().fork(&device), SgdConfig::new().build(),
//!         pg.clone(), config).unwrap();
//!     // Between steps a rank holds its shard only: no full parameter.
//!     assert_eq!(held_param_bytes(zero.model()), 0);
//!     let x = Tensor::<2>::ones([4, 8], zero.device()) * (pg.rank() as f32 + 1.0);
//!     let losses: Vec<f32> = (0..3)
//!         .map(|_| zero.train_step(1e-3, |m: &Mlp| m.loss(x.clone())).unwrap())
//!         .collect();
//!     let params = zero.parameters().unwrap(); // whole, gathered from the shards
//!     assert_eq!(params[0].path, "up.weight");
//!     (losses, zero.full_values().unwrap())
//! }).unwrap();
//! // Every rank ends with the same parameters, and the ranks' mean loss went down.
//! assert_eq!(runs[0].1, runs[1].1);
//! let mean = |s: usize| (runs[0].0[s] + runs[1].0[s]) / 2.0;
//! assert!(mean(2) < mean(0));
//! ```
//!
//! See `docs/zero.md`.

#![forbid(unsafe_code)]

mod config;
mod error;
mod experts;
mod experts3;
mod gather;
mod grads;
mod held;
pub mod optim;
pub mod partition;
mod reduce;
mod train;
mod zero;

pub use config::ZeroConfig;
pub use error::{Result, ZeroError};
pub use gather::GatherSummary;
pub use held::{MemoryReport, held_param_bytes};
pub use optim::{FlatState, ShardOptimizer};
pub use partition::{ParamSlice, Partition};
pub use zero::Zero;
