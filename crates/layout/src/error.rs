//! [`LayoutError`]: why a layout cannot train a model on a world.

use crate::Axis;
use std::fmt;

/// Why a layout cannot train a model on a world: one clear error naming the axis and the
/// numbers, raised before any state is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutError {
    /// A `--mesh` string that does not parse.
    Parse {
        /// The string as given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The product of the degrees is not the number of ranks.
    WorldSize {
        /// The layout, as [`crate::ParallelDims`] prints it.
        layout: String,
        /// The ranks the layout needs.
        product: usize,
        /// The ranks the world has.
        world: usize,
    },
    /// A size of the model or the batch that an axis must divide does not.
    NotDivisible {
        /// The axis that must divide it.
        axis: Axis,
        /// The axis's degree.
        degree: usize,
        /// What is not divisible (`n_heads`, `the global batch`, …).
        what: String,
        /// Its size.
        value: usize,
    },
    /// Anything else an axis cannot do with this model, batch or option.
    Axis {
        /// The axis at fault.
        axis: Axis,
        /// Its degree.
        degree: usize,
        /// Why.
        reason: String,
    },
    /// Activation checkpointing the model cannot do (it names no checkpointable layer, …).
    Recompute {
        /// The setting, as printed (`every-2`).
        setting: String,
        /// Why.
        reason: String,
    },
}

impl LayoutError {
    /// An [`LayoutError::Axis`] error.
    pub fn axis(axis: Axis, degree: usize, reason: impl Into<String>) -> Self {
        Self::Axis {
            axis,
            degree,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Parse { spec, reason } => write!(f, "--mesh {spec}: {reason}"),
            Self::WorldSize {
                layout,
                product,
                world,
            } => write!(
                f,
                "the layout {layout} needs {product} ranks, but the world has {world}"
            ),
            Self::NotDivisible {
                axis,
                degree,
                what,
                value,
            } => write!(
                f,
                "{axis}={degree}: {what} {value} is not divisible by {degree}"
            ),
            Self::Axis {
                axis,
                degree,
                reason,
            } => write!(f, "{axis}={degree}: {reason}"),
            Self::Recompute { setting, reason } => {
                write!(f, "recompute ({setting}): {reason}")
            }
        }
    }
}

impl std::error::Error for LayoutError {}
