//! # bonfire-tp
//!
//! Tensor and sequence parallelism, like `torch.distributed.tensor.parallel`, on
//! `bonfire-dtensor`'s meshes and collectives:
//!
//! - Parallel styles ([`style`]): [`ColwiseParallel`], [`RowwiseParallel`] (also Megatron's
//!   vocab-parallel embedding, [`RowwiseParallel::vocab_embedding`]), [`SequenceParallel`],
//!   [`PrepareModuleInput`], [`PrepareModuleOutput`], with input/output [`StylePlacement`]s.
//! - Parallel-aware layers ([`layers`]): [`ParallelLinear`], [`ParallelEmbedding`],
//!   [`ParallelLayerNorm`], [`ParallelRmsNorm`], [`ParallelIo`] — ordinary Burn modules that
//!   are exactly the plain layers until a plan is applied, and load the same checkpoints.
//! - Plans ([`plan`]): [`ParallelPlan`] maps module paths with wildcards
//!   (`"blocks.*.attn.q"`) to styles; [`parallelize_module`] validates and applies one over a
//!   mesh axis; [`sharded_params`] says which parameters ended up sharded along which dim.
//! - [`loss_parallel`]: cross-entropy on vocabulary-sharded logits.
//! - [`sequence`]: layout transitions and sequence-parallel helpers.
//!
//! See `docs/tensor-parallel.md` for the design and the collective counts.
//!
//! ```
//! use bonfire_comm::launch;
//! use bonfire_dtensor::DeviceMesh;
//! use bonfire_tp::{
//!     ColwiseParallel, ParallelLinear, ParallelPlan, RowwiseParallel, parallelize_module,
//! };
//! use burn::module::Module;
//! use burn::tensor::{Device, Tensor};
//!
//! #[derive(Module, Debug)]
//! struct Mlp {
//!     up: ParallelLinear,
//!     down: ParallelLinear,
//! }
//!
//! let device = Device::flex();
//! let mlp = Mlp {
//!     up: ParallelLinear::new(4, 8, true, &device),
//!     down: ParallelLinear::new(8, 4, true, &device),
//! };
//! let x = Tensor::<2>::ones([3, 4], &device);
//! let reference = mlp.down.forward(mlp.up.forward(x.clone())).into_data();
//! let outs = launch(2, |pg| {
//!     let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
//!     let plan = ParallelPlan::new()
//!         .add("up", ColwiseParallel::default())
//!         .add("down", RowwiseParallel::default());
//!     let local = parallelize_module(mlp.clone().fork(&device), &mesh, "tp", &plan).unwrap();
//!     assert_eq!(local.up.weight.dims(), [4, 4]); // half the output features
//!     local.down.forward(local.up.forward(x.clone())).into_data()
//! })
//! .unwrap();
//! for out in outs {
//!     out.assert_approx_eq::<f32>(&reference, burn::tensor::Tolerance::default());
//! }
//! ```

mod assign;
pub mod layers;
pub mod loss;
pub mod plan;
pub mod sequence;
mod state;
pub mod style;

pub use assign::ParallelError;
pub use layers::{
    ParallelEmbedding, ParallelIo, ParallelLayerNorm, ParallelLinear, ParallelRmsNorm,
};
pub use loss::loss_parallel;
pub use plan::{ParallelPlan, parallelize_module, path_matches, sharded_params};
pub use state::{ParallelKey, clear_parallel_states};
pub use style::{
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput, ReplicateParallel,
    RowwiseParallel, SequenceParallel, StylePlacement,
};
