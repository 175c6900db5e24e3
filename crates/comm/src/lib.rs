//! # bonfire-comm
//!
//! Collectives for distributed training: the floor every other Bonfire crate stands on.
//!
//! A [`ProcessGroup`] is one rank's handle on a group of ranks. It offers the collectives of
//! torch.distributed — all-reduce (sum, avg, max, min, product), broadcast, reduce,
//! all-gather and reduce-scatter (even and uneven), all-to-all, send/recv with tags, barrier —
//! on typed host buffers (`f32`, `f64`, `f16`, `bf16`, `i32`, `i64`, `u8`), each with an
//! asynchronous form that returns a [`Work`] handle, plus sub-groups ([`ProcessGroup::new_group`]).
//!
//! Backends implement the small [`Backend`] trait; the in-process [`threads`] backend (ranks
//! as threads, shared-memory algorithms) is always available.
//!
//! ## Nothing hangs
//! Every blocking call honours a timeout ([`ProcessGroup::set_timeout`]) and fails with the
//! ranks that did not arrive. Every collective carries a [`Fingerprint`] (sequence number,
//! kind, dtype, count, root) compared across ranks: a mismatch fails on every rank and shows
//! both views. A rank that panics or returns early makes its peers fail fast. Timeouts and
//! mismatches print the rank's [`FlightRecorder`] — its last calls on the group.
//!
//! ```
//! use bonfire_comm::{launch, ReduceOp};
//!
//! let results = launch(2, |pg| {
//!     // Each rank contributes its rank + 1; everyone gets the sum.
//!     let mut grads = vec![(pg.rank() + 1) as f32; 4];
//!     pg.all_reduce(&mut grads, ReduceOp::Sum)?;
//!
//!     // Rank r receives the r-th piece of the element-wise maximum.
//!     let mut piece = vec![0i64; 2];
//!     pg.reduce_scatter(&[1, 2, 3, pg.rank() as i64], &mut piece, ReduceOp::Max)?;
//!
//!     // Overlap: start an all-reduce, compute, then wait.
//!     let work = pg.all_reduce_async(vec![1.0f64; 8], ReduceOp::Avg);
//!     let busy: f64 = (0..1000).map(|i| i as f64).sum();
//!     let averaged = work.wait()?;
//!     Ok::<_, bonfire_comm::CommError>((grads, piece, averaged.len(), busy))
//! })
//! .unwrap();
//! assert_eq!(results[0].as_ref().unwrap().0, vec![3.0; 4]);
//! assert_eq!(results[1].as_ref().unwrap().1, vec![3, 1]);
//! ```

mod backend;
pub mod blocked;
mod collective;
pub mod device;
mod dtype;
mod error;
mod fingerprint;
mod group;
mod memops;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod recorder;
pub mod reduce;
pub mod rendezvous;
pub mod shrink;
pub mod testing;
pub mod threads;
#[cfg(any(feature = "mpi", feature = "nccl"))]
mod wire;
mod work;
pub mod world;

pub use backend::{Backend, CallContext};
pub use collective::{AllToAllCounts, Collective, Counts, Shape, even_piece, offsets_into};
pub use device::{DeviceBuf, DeviceCollective};
pub use dtype::{BufMut, BufRef, DType, Element};
pub use error::{CommError, Result};
pub use fingerprint::{Fingerprint, OpKind, digest_counts};
pub use group::{DEFAULT_TIMEOUT, ProcessGroup, default_timeout};
pub use half::{bf16, f16};
pub use recorder::{CallRecord, CallState, FlightRecorder, RECORDER_CAPACITY};
pub use reduce::ReduceOp;
pub use shrink::Shrunk;
pub use threads::{LaunchError, RankFailure, ThreadWorld, launch};
pub use work::Work;
pub use work::overlapping;
pub use world::{LaunchEnv, StartedBy, World};
