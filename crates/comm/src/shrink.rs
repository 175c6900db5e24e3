//! Shrinking a group after a failure: the survivors agree on who is alive and continue on a
//! fresh group without the dead ranks ([`ProcessGroup::shrink`](crate::ProcessGroup::shrink)),
//! as ULFM's `MPI_Comm_shrink` does for MPI and TorchFT's quorum for torch.distributed.
//!
//! The contract every backend that can shrink keeps:
//! - **agreement**: every survivor that returns `Ok` gets the same member list, in the old
//!   group's order, and the same new group;
//! - **bounded**: the agreement waits at most the group's timeout for the ranks that are
//!   alive but have not joined it; if some are still missing then, no group is made and every
//!   caller gets the same error naming them (a live rank is never silently dropped);
//! - **fresh**: the new group shares nothing with the old one (its own barrier, mailbox and
//!   sequence numbers), so no message or call of the failed step can leak into it; the old
//!   group is aborted for the caller, so peers still blocked on it fail fast;
//! - a rank that dies *after* the agreement is in the new group, and the first collective
//!   there fails naming it: shrink again.
//!
//! The threads backend shrinks (the agreement is a decision in shared memory, made once).
//! MPI cannot here (that needs ULFM): there a failure ends the job with an error naming the
//! dead rank, and the run resumes from a checkpoint on fewer processes (docs/checkpoint.md).

pub use crate::backend::Shrink;
pub use crate::group::Shrunk;
