//! # bonfire-dtensor
//!
//! Differentiable collectives on Burn tensors, device meshes and distributed tensors — the
//! joint through which every parallelism in Bonfire is expressed once. The model is
//! PyTorch's `DeviceMesh` / `DTensor`.
//!
//! - [`functional`]: collectives on `Tensor<D>` that autodiff understands — all-reduce,
//!   broadcast, reduce, all-gather, reduce-scatter, all-to-all (even and uneven), send/recv,
//!   Megatron's "copy to group" / "reduce from group", and split / gather along a dim. Each
//!   is one operation of a Burn backend extension ([`CollectiveBackend`], for `Flex`,
//!   `Autodiff` and, with the `cuda` feature, `Cube`) whose backward runs the dual
//!   collective. A collective can be marked recomputable so that it is re-run in backward
//!   instead of keeping its output (ZeRO-3 parameter gathers).
//! - [`DeviceMesh`]: an n-dimensional grid of ranks with named axes, a process group per
//!   axis slice, sub-meshes.
//! - [`DTensor`]: a local tensor plus its placements — [`Placement::Shard`],
//!   [`Placement::Replicate`], [`Placement::Partial`] — on each mesh axis;
//!   [`distribute_tensor`], [`DTensor::from_local`], [`DTensor::redistribute`] (each
//!   transition by the cheapest collective, see [`redistribute::plan`]),
//!   [`DTensor::full_tensor`].
//! - [`graph`]: placing operations in Burn's deepest-first backward — [`graph::anchored`]
//!   (an identity that sits below an anchor) and [`graph::hooked`] (a gradient hook that
//!   hands a parameter's finished gradient to a closure), the building blocks of DDP's
//!   overlapped buckets and ZeRO's layer-by-layer gradient reduction.
//! - [`layer`]: the one call a model makes per layer so that data-parallel wrappers (DDP's
//!   overlapped buckets, ZeRO-3's per-layer gathers) see its layers — see [`scope`].
//! - [`recompute()`]: activation checkpointing (recompute in backward) of one region (a layer, a block) — its
//!   activations recomputed in backward instead of kept, inside any wrapper's hooks.
//! - [`weight_grad`]: the zero-bubble pipeline's B/W split — linear layers run under
//!   [`weight_grad::deferring`] leave their weight gradients (`dW = xᵀ·dy`) out of the
//!   backward, to be computed later from what it kept.
//! - [`CommCounter`]: counts the collectives a region issued, backward included, like
//!   PyTorch's `CommDebugMode`.
//! - [`DataParallel`]: the one interface of the data-parallel wrappers (DDP, ZeRO 0–3), and
//!   [`params`]: the parameter inventory they share, with [`params::sync_from_root`].
//!
//! Uneven shards follow torch.chunk ([`chunk_sizes`]): ⌈N/k⌉ per rank, the last non-empty
//! rank the remainder, later ranks empty.
//!
//! ## Errors and failures
//! Invalid arguments (shard dims, shapes, mesh sizes, reduce ops) are returned as
//! [`DTensorError`] before anything is exchanged. A communication failure *inside* a Burn
//! operation (a timeout, a peer that died) panics with the communicator's message, because
//! Burn's tensor operations are infallible; with [`bonfire_comm::launch`] the panic is
//! reported for the rank and its peers fail fast instead of hanging.
//!
//! ## Rules for ranks as threads
//! Each rank builds its own autodiff leaves (never share a `require_grad` tensor between
//! rank threads), and every rank must run the same collectives in the same order, forward
//! and backward: a rank whose collective's output does not reach its loss makes its peers
//! wait in backward until they time out.
//!
//! ## Example
//!
//! Two ranks shard a 4×2 matrix by rows, gather it back, and differentiate through both
//! collectives:
//!
//! ```
//! use bonfire_comm::launch;
//! use bonfire_comm::OpKind;
//! use bonfire_dtensor::{CommCounter, DeviceMesh, Placement, distribute_tensor};
//! use burn::tensor::{Device, Tensor};
//!
//! let grads = launch(2, |pg| {
//!     let mesh = DeviceMesh::new(&pg, &[2], &["dp"]).unwrap();
//!     let device = Device::flex().autodiff();
//!     // Every rank builds its own leaf holding the same full tensor.
//!     let full = Tensor::<2>::from_floats([[0., 1.], [2., 3.], [4., 5.], [6., 7.]], &device)
//!         .require_grad();
//!
//!     // Shard(0): rank r keeps rows 2r and 2r+1 — a local slice, no communication.
//!     let sharded = distribute_tensor(full.clone(), &mesh, &[Placement::Shard(0)]).unwrap();
//!     assert_eq!(sharded.local().dims(), [2, 2]);
//!
//!     // Back to Replicate: exactly one all-gather.
//!     let counter = CommCounter::start();
//!     let replicated = sharded.redistribute(&[Placement::Replicate]).unwrap();
//!     assert_eq!(counter.count(OpKind::AllGather), 1);
//!     assert_eq!(counter.total(), 1);
//!
//!     let loss = (replicated.to_local() * 2.0).sum();
//!     let grads = loss.backward();
//!     full.grad(&grads).unwrap().into_data().try_to_vec::<f32>().unwrap()
//! })
//! .unwrap();
//! // The gradient of the logical program (2 · Σ x) on every rank.
//! assert!(grads.iter().all(|g| g == &vec![2.0; 8]));
//! ```

mod collectives;
pub mod context;
pub mod data_parallel;
mod debug;
mod dtensor;
mod error;
pub mod expert;
pub mod graph;
mod mesh;
pub mod parallel;
pub mod params;
mod placement;
pub mod plane;
pub mod precision;
pub mod recompute;
pub mod redistribute;
pub mod scope;
pub mod timing;
pub mod weight_grad;

pub use collectives::{
    BACKWARD_TAG_BIT, CollectiveBackend, CollectiveKind, CollectiveSpec, functional,
};
pub use data_parallel::DataParallel;
pub use debug::CommCounter;
pub use dtensor::{DTensor, DTensorSpec, distribute_tensor};
pub use error::{DTensorError, Result};
pub use mesh::DeviceMesh;
pub use placement::{Placement, chunk_range, chunk_sizes};
pub use precision::{MixedPrecision, PrecisionDTypes};
pub use recompute::{RecomputeBackend, recompute};
pub use scope::{
    LayerHook, LayerHookGuard, LayerInput, install_layer_hook, layer, without_layer_hooks,
};
