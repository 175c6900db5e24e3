//! # bonfire-parallel
//!
//! The contract between a Burn model and Bonfire's trainer, below both: `bonfire-models`
//! implements it, `bonfire-train` consumes it, and neither depends on the other.
//!
//! - [`ParallelModel`]: what a model implements — its loss (all data parallelism needs) and,
//!   axis by axis, its description from outside its code: a tensor-parallel plan, the checks
//!   a plan cannot see, its layers, its experts, how its sequences split over cp, and its
//!   [`Pipeline`] pieces (taken by the trainer through a [`PipelineVisitor`]).
//! - [`Rows`], [`DataSource`], [`Replica`]: its batches — cut by rows, made per step, each
//!   data-parallel replica reading its rows.
//! - [`ParameterSource`], [`Region`]: whole-tensor weights it loads, read a slice at a time.
//!
//! A plain Burn model implements only [`ParallelModel::loss`]; see `docs/train.md`.

#![forbid(unsafe_code)]

mod data;
mod model;
mod pipeline;
mod region;
mod weights;

pub use data::{DataSource, Replica, Rows};
pub use model::ParallelModel;
pub use pipeline::{HeadLossFn, InputFn, LossFn, Pipeline, PipelineVisitor};
pub use region::{Region, Run};
pub use weights::ParameterSource;
