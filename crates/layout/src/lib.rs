//! # bonfire-layout
//!
//! The vocabulary of a training layout that the trainer (`bonfire-train`, `bonfire-pipeline`,
//! `bonfire-zero`) and the planner (`bonfire-plan`) share, with no dependencies, so that it is
//! spelt once: the mesh's axes ([`Axis`]), the layout itself ([`ParallelDims`]: degrees, each
//! axis's options, precision, activation checkpointing, the checks that need no model, and
//! [`LayoutError`]), the pipeline schedule kinds ([`ScheduleKind`]: name, parse, chunks per
//! rank, stage map, theoretical bubble), the ZeRO stages ([`ZeroStage`]), the precision
//! policy ([`MixedPrecision`]) and the even split of pipeline pieces into stages
//! ([`even_split_points`]). Building a mesh, generating a schedule's program and casting
//! tensors are the trainer's crates'; predicting a layout's cost is the planner's.

#![forbid(unsafe_code)]

mod axis;
mod dims;
mod error;
mod options;
mod precision;
mod schedule;
mod split;
mod zero;

pub use axis::Axis;
pub use dims::ParallelDims;
pub use error::LayoutError;
pub use options::{PpOptions, Recompute, TpOptions};
pub use precision::{FloatFormat, MixedPrecision};
pub use schedule::ScheduleKind;
pub use split::{balanced_split_points, even_split_points};
pub use zero::ZeroStage;
