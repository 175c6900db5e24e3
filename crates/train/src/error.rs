//! The trainer's errors: [`LayoutError`] for a layout that does not fit (raised before
//! anything is built), [`TrainError`] for everything else.

use crate::dims::Axis;
use bonfire_comm::CommError;
use bonfire_ddp::DdpError;
use bonfire_dtensor::DTensorError;
use bonfire_pipeline::PipelineError;
use bonfire_zero::ZeroError;

/// Why a layout cannot train a model on a world: one clear error naming the axis and the
/// numbers, raised before any state is built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A `--mesh` string that does not parse.
    #[error("--mesh {spec}: {reason}")]
    Parse { spec: String, reason: String },
    /// The product of the degrees is not the number of ranks.
    #[error("the layout {layout} needs {product} ranks, but the world has {world}")]
    WorldSize {
        layout: String,
        product: usize,
        world: usize,
    },
    /// A size of the model or the batch that an axis must divide does not.
    #[error("{axis}={degree}: {what} {value} is not divisible by {degree}")]
    NotDivisible {
        axis: Axis,
        degree: usize,
        what: String,
        value: usize,
    },
    /// Anything else an axis cannot do with this model, batch or option.
    #[error("{axis}={degree}: {reason}")]
    Axis {
        axis: Axis,
        degree: usize,
        reason: String,
    },
    /// Activation checkpointing the model cannot do (it names no checkpointable layer, …).
    #[error("activation checkpointing ({setting}): {reason}")]
    Checkpointing { setting: String, reason: String },
}

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
