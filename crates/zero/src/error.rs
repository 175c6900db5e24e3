//! Errors.

use bonfire_comm::CommError;

/// Why a ZeRO call failed.
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    /// A collective on the process group failed (timeout, peer failure, mismatch...).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A dtensor operation failed, e.g. ranks holding different parameters when the wrapper
    /// is built (`DTensorError::ParamMismatch`).
    #[error(transparent)]
    DTensor(#[from] bonfire_dtensor::DTensorError),
    /// Ranks disagree on the parameters (not raised at present: that check reports through
    /// [`ZeroError::DTensor`]).
    #[error("ranks disagree on the parameters: {0}")]
    Mismatch(String),
    /// API misuse or a setup ZeRO cannot run: step without backward, an optimizer that clips
    /// gradients, stage 3 with a rank owning no element, gradient arriving after its bucket
    /// was reduced.
    #[error("usage: {0}")]
    Usage(String),
    /// A checkpoint could not be written or read, or does not fit this model and partition.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
}

/// Result alias for ZeRO calls.
pub type Result<T> = std::result::Result<T, ZeroError>;
