//! The trainer's errors: [`LayoutError`] (`bonfire-layout`'s) for a layout that does not fit,
//! raised before anything is built, and [`TrainError`] for everything else.

use bonfire_comm::CommError;
use bonfire_ddp::DdpError;
use bonfire_dtensor::DTensorError;
pub use bonfire_layout::LayoutError;
use bonfire_pipeline::PipelineError;
use bonfire_zero::ZeroError;

/// Why building an engine or training failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Mesh(#[from] DTensorError),
    #[error(transparent)]
    Ddp(#[from] DdpError),
    #[error(transparent)]
    Zero(#[from] ZeroError),
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error("tensor parallelism: {0}")]
    Parallel(#[from] bonfire_dtensor::parallel::ParallelError),
    /// The model's own description is inconsistent (pipeline pieces that do not cover its
    /// parameters, …).
    #[error("model: {0}")]
    Model(String),
    /// A rank thread failed (panicked, or its peers gave up on it).
    #[error(transparent)]
    Launch(#[from] bonfire_comm::LaunchError),
    #[error("{0}")]
    Io(String),
    /// A checkpoint that cannot be saved or loaded (raised before any state changes).
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
}
