//! [`PipelineError`]: what can go wrong while running a pipeline step.

use crate::check::CheckError;
use bonfire_comm::CommError;
use bonfire_dtensor::DTensorError;

/// What can go wrong while running a pipeline step.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The schedule was rejected by the static checker.
    #[error(transparent)]
    Schedule(#[from] CheckError),
    /// A send or receive failed (timeout, peer failure, mismatch).
    #[error("communication failed: {0}")]
    Comm(#[from] CommError),
    /// The mesh has no such axis, or the axis does not match the schedule.
    #[error(transparent)]
    Mesh(#[from] DTensorError),
    /// The process group and the schedule disagree, or the stage misbehaved.
    #[error("{0}")]
    Invalid(String),
}
