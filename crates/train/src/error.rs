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
    /// The layout does not fit the world, the model or the batch (`bonfire-layout`'s
    /// [`LayoutError`]), found before anything is built.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A collective or the process group failed (`bonfire-comm`'s [`CommError`]).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Building the device mesh or a distributed tensor failed (`bonfire-dtensor`'s
    /// [`DTensorError`]).
    #[error(transparent)]
    Mesh(#[from] DTensorError),
    /// The DDP wrapper failed (`bonfire-ddp`'s [`DdpError`]).
    #[error(transparent)]
    Ddp(#[from] DdpError),
    /// The ZeRO wrapper failed (`bonfire-zero`'s [`ZeroError`]).
    #[error(transparent)]
    Zero(#[from] ZeroError),
    /// The pipeline schedule or a stage failed (`bonfire-pipeline`'s [`PipelineError`]).
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// Tensor-parallelizing the model failed (`bonfire-dtensor`'s `ParallelError`).
    #[error("tensor parallelism: {0}")]
    Parallel(#[from] bonfire_tp::ParallelError),
    /// The model's own description is inconsistent (pipeline pieces that do not cover its
    /// parameters, …).
    #[error("model: {0}")]
    Model(String),
    /// A rank thread failed (panicked, or its peers gave up on it).
    #[error(transparent)]
    Launch(#[from] bonfire_comm::LaunchError),
    /// A file the run writes (the metrics file) cannot be written, or fault tolerance cannot
    /// recover: the survivors cannot regroup, a rank's state was lost with its buddy, or an
    /// in-memory copy is damaged. The message says which.
    #[error("{0}")]
    Io(String),
    /// A checkpoint that cannot be saved or loaded (raised before any state changes).
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
}
