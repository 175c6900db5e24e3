//! A plain Burn classifier: [`model`] (three linear layers) and [`parallelize`] (its
//! `ParallelModel`: the loss, all DDP and ZeRO need).

pub mod model;
pub mod parallelize;

pub use model::{Classifier, blobs};
