//! Test support shared by every backend: the conformance suite.
//!
//! The suite is written once against [`ProcessGroup`](crate::ProcessGroup) and run on every
//! backend — threads in-process, MPI processes under `mpirun`, NCCL on GPUs — so a backend
//! is "done" when it passes the same checks.

pub mod bench;
pub mod conformance;
pub mod memory;
