//! Errors.

use bonfire_comm::CommError;

#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    DTensor(#[from] bonfire_dtensor::DTensorError),
    #[error("ranks disagree on the parameters: {0}")]
    Mismatch(String),
    #[error("usage: {0}")]
    Usage(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
}

pub type Result<T> = std::result::Result<T, ZeroError>;
