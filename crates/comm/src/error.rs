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
        /// Name of the group the call ran on.
        group: String,
        /// The collective that was called.
        op: OpKind,
        /// What is wrong with the arguments.
        message: String,
    },

    /// A group could not be created from the given ranks.
    #[error("cannot create group from `{group}`: {message}")]
    InvalidGroup {
        /// Name of the group the new one was to be made from.
        group: String,
        /// Why the ranks do not form a group.
        message: String,
    },

    /// Some ranks did not reach the call within the timeout.
    #[error(
        "timeout after {waited:?} in {fingerprint} on group `{group}` (rank {rank}): \
         ranks {missing:?} did not arrive\n{recorder}"
    )]
    Timeout {
        /// Name of the group the call ran on.
        group: String,
        /// This rank, in that group.
        rank: usize,
        /// The call this rank was waiting in.
        fingerprint: Box<Fingerprint>,
        /// How long this rank waited before giving up.
        waited: Duration,
        /// Ranks that had not reached the call.
        missing: Vec<usize>,
        /// This rank's flight recorder dump: its last calls on the group.
        recorder: String,
    },

    /// Ranks disagree on what this call is: different kind, dtype, count, root or order.
    #[error(
        "collective mismatch on group `{group}`: rank {rank} called [{local}] \
         but rank {peer} called [{remote}]\n{recorder}"
    )]
    Mismatch {
        /// Name of the group the call ran on.
        group: String,
        /// This rank, in that group.
        rank: usize,
        /// The call as this rank described it.
        local: Box<Fingerprint>,
        /// A rank that described the call differently.
        peer: usize,
        /// The call as `peer` described it.
        remote: Box<Fingerprint>,
        /// This rank's flight recorder dump: its last calls on the group.
        recorder: String,
    },

    /// In an uneven all-to-all, a sender and a receiver disagree on a piece's length.
    #[error(
        "all_to_all count mismatch on group `{group}` (call #{seq}): rank {sender} sends \
         {sent} elements to rank {receiver}, which expects {expected}"
    )]
    CountMismatch {
        /// Name of the group the call ran on.
        group: String,
        /// Sequence number of the call on the group.
        seq: u64,
        /// The rank sending the piece.
        sender: usize,
        /// The rank receiving the piece.
        receiver: usize,
        /// Elements `sender` sends to `receiver`.
        sent: usize,
        /// Elements `receiver` expects from `sender`.
        expected: usize,
    },

    /// A peer this call was waiting on panicked, returned, or failed.
    #[error(
        "rank {peer} of group `{group}` failed while rank {rank} waited in {fingerprint}: {reason}"
    )]
    PeerFailed {
        /// Name of the group the call ran on.
        group: String,
        /// This rank, in that group.
        rank: usize,
        /// The rank that failed.
        peer: usize,
        /// The call this rank was waiting in.
        fingerprint: Box<Fingerprint>,
        /// How the peer failed.
        reason: String,
    },

    /// The group was aborted by an earlier failure and can no longer be used.
    #[error("group `{group}` is aborted: {reason}")]
    Aborted {
        /// Name of the aborted group.
        group: String,
        /// The failure that aborted it.
        reason: String,
    },

    /// The call is not available on this backend.
    #[error("{what} is not supported by the {backend} backend")]
    Unsupported {
        /// Name of the backend.
        backend: &'static str,
        /// The call or feature it lacks.
        what: String,
    },

    /// An error reported by the underlying transport (MPI, NCCL…).
    #[error("{backend} backend error: {message}")]
    Backend {
        /// Name of the backend.
        backend: &'static str,
        /// The transport's error message.
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
