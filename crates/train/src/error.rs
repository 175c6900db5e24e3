//! The trainer's errors: [`LayoutError`] (`bonfire-layout`'s) for a layout that does not fit,
//! raised before anything is built, [`CheckpointError`] for a checkpoint that cannot be saved or
//! loaded, and [`TrainError`] for everything else.

use bonfire_comm::CommError;
use bonfire_ddp::DdpError;
use bonfire_dtensor::DTensorError;
use bonfire_layout::LayoutError;
use bonfire_pipeline::PipelineError;
use bonfire_zero::ZeroError;
use std::path::Path;

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
    /// The training recipe's settings cannot be run (a schedule longer than the run, …).
    #[error("{0}")]
    Recipe(String),
    /// A checkpoint that cannot be saved or loaded (raised before any state changes).
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

/// Why a checkpoint could not be saved or loaded. Raised before any state changes.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CheckpointError {
    /// No checkpoint where one was named.
    #[error("checkpoint not found: {0}")]
    NotFound(String),
    /// A file the index lists is missing.
    #[error("checkpoint incomplete: {0}")]
    Missing(String),
    /// A file is truncated or its bytes do not match their checksum, or the index is unreadable.
    #[error("checkpoint corrupted: {0}")]
    Corrupt(String),
    /// The checkpoint is of another model (parameter names or shapes differ).
    #[error("{0}")]
    OtherModel(String),
    /// Reading or writing failed.
    #[error("checkpoint I/O: {path}: {message}")]
    Io {
        /// The file or directory concerned.
        path: String,
        /// The operating system's error.
        message: String,
    },
    /// Another rank failed (its error is quoted), or the ranks disagree.
    #[error("checkpoint: {0}")]
    Failed(String),
}

impl CheckpointError {
    pub(crate) fn io(path: &Path, e: std::io::Error) -> Self {
        Self::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        }
    }
}
