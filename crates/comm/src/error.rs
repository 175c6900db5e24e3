//! The error type of every communication call.

use crate::{Fingerprint, OpKind};
use std::time::Duration;

/// Result alias for communication calls.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Why a communication call failed.
///
/// Errors caused by this rank's own arguments ([`CommError::InvalidArgument`]) are detected
/// before anything is exchanged, so the group stays usable. Errors that involve peers
/// (timeouts, failures) leave the group aborted: later calls return [`CommError::Aborted`]
/// at once rather than waiting on a peer that will never come. A [`CommError::Mismatch`] is
/// seen by every rank of the call at the same point, so the group stays usable after it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// This rank's arguments cannot describe a valid call (bad root, wrong buffer length…).
    #[error("invalid argument to {op} on group `{group}`: {message}")]
    InvalidArgument {
        group: String,
        op: OpKind,
        message: String,
    },

    /// A group could not be created from the given ranks.
    #[error("cannot create group from `{group}`: {message}")]
    InvalidGroup { group: String, message: String },

    /// Some ranks did not reach the call within the timeout.
    #[error(
        "timeout after {waited:?} in {fingerprint} on group `{group}` (rank {rank}): \
         ranks {missing:?} did not arrive\n{recorder}"
    )]
    Timeout {
        group: String,
        rank: usize,
        fingerprint: Box<Fingerprint>,
        waited: Duration,
        missing: Vec<usize>,
        recorder: String,
    },

    /// Ranks disagree on what this call is: different kind, dtype, count, root or order.
    #[error(
        "collective mismatch on group `{group}`: rank {rank} called [{local}] \
         but rank {peer} called [{remote}]\n{recorder}"
    )]
    Mismatch {
        group: String,
        rank: usize,
        local: Box<Fingerprint>,
        peer: usize,
        remote: Box<Fingerprint>,
        recorder: String,
    },

    /// In an uneven all-to-all, a sender and a receiver disagree on a piece's length.
    #[error(
        "all_to_all count mismatch on group `{group}` (call #{seq}): rank {sender} sends \
         {sent} elements to rank {receiver}, which expects {expected}"
    )]
    CountMismatch {
        group: String,
        seq: u64,
        sender: usize,
        receiver: usize,
        sent: usize,
        expected: usize,
    },

    /// A peer this call was waiting on panicked, returned, or failed.
    #[error(
        "rank {peer} of group `{group}` failed while rank {rank} waited in {fingerprint}: {reason}"
    )]
    PeerFailed {
        group: String,
        rank: usize,
        peer: usize,
        fingerprint: Box<Fingerprint>,
        reason: String,
    },

    /// The group was aborted by an earlier failure and can no longer be used.
    #[error("group `{group}` is aborted: {reason}")]
    Aborted { group: String, reason: String },

    /// The call is not available on this backend.
    #[error("{what} is not supported by the {backend} backend")]
    Unsupported { backend: &'static str, what: String },

    /// An error reported by the underlying transport (MPI, NCCL…).
    #[error("{backend} backend error: {message}")]
    Backend {
        backend: &'static str,
        message: String,
    },
}

impl CommError {
    /// True when the group can no longer be used after this error.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            CommError::Timeout { .. }
                | CommError::PeerFailed { .. }
                | CommError::Aborted { .. }
                | CommError::Backend { .. }
        )
    }
}
