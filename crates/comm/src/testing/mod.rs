//! Test support shared by every crate: the conformance suite every backend passes, the
//! counting allocator (per rank and for the process), bench argument helpers, and the one tolerance of parity tests.
//!
//! The suite is written once against [`ProcessGroup`](crate::ProcessGroup) and run on every
//! backend — threads in-process, MPI processes under `mpirun`, NCCL on GPUs — so a backend
//! is "done" when it passes the same checks.

pub mod bench;
pub mod conformance;
pub mod rank_alloc;
pub mod tolerance;

pub use tolerance::{Closeness, Tolerance, assert_close, is_close};
