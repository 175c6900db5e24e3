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
//! - [`plane`]: the data plane — collectives on tensors wherever they live (host memory or a
//!   device's), with a transfer ledger of every host crossing ([`plane::ledger`]).
//! - [`CommCounter`]: counts the collectives a region issued, backward included, like
//!   PyTorch's `CommDebugMode`; [`timing`]: step spans and the ring shifts' hidden time.
//!
//! The parallelisms stand above these primitives, each in its own crate: `bonfire-tp`
//! (tensor and sequence), `bonfire-cp` (context), `bonfire-ep` (expert), `bonfire-recompute`
//! (activation checkpointing), `bonfire-ddp`, `bonfire-zero`, `bonfire-pipeline`; what they
//! share of a model (its parameters, layers and gradient hooks) is `bonfire-module`.
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

pub mod autodiff;
mod collectives;
mod debug;
mod dtensor;
mod error;
mod mesh;
mod placement;
pub mod plane;
pub mod redistribute;
pub mod timing;

pub use collectives::{
    BACKWARD_TAG_BIT, CollectiveBackend, CollectiveKind, CollectiveSpec, functional,
};
pub use debug::CommCounter;
pub use dtensor::{DTensor, DTensorSpec, distribute_tensor};
pub use error::{DTensorError, Result};
pub use mesh::DeviceMesh;
pub use placement::{Placement, chunk_range, chunk_sizes};
