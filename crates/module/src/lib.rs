//! # bonfire-module
//!
//! A Burn module as Bonfire's engines see it from outside — the ground that data parallelism
//! (DDP, ZeRO), pipelines, recompute and the parallel layers stand on, without any of them
//! owning the model:
//!
//! - [`params`]: its parameters — a flat, ordered inventory (the order every rank agrees on),
//!   flat views of values and gradients, host copies, [`params::sync_from_root`],
//!   [`params::fork`] and [`params::seeded`] draws.
//! - [`layer`]: its layers — the one call a model makes per layer so that an engine's
//!   [`LayerHook`] (DDP's overlapped buckets, ZeRO-3's per-layer gathers, recompute) sees it.
//! - [`graph`]: its gradients — placing operations in Burn's deepest-first backward
//!   ([`graph::anchored`], [`graph::hooked`], [`graph::SinkHook`]).
//! - [`weight_grad`]: the zero-bubble pipeline's B/W split of its linear layers.
//! - [`tied`]: a parameter two pipeline stages use (a tied embedding and head), kept one.
//! - [`state`]: its state besides its parameters (parameters without gradient) and the
//!   statistics a forward records to move it after each optimizer step.
//! - [`precision`]: its precision — a layout's `MixedPrecision` as Burn dtypes, casts, and
//!   what the layers really ran in ([`precision::observe`]).
//! - [`DataParallel`]: the one interface of the engines that hold a whole replica of it (DDP,
//!   ZeRO 0–3), and [`Subgroup`]: parameters only part of their group holds (expert
//!   parallelism's experts), which they reduce over their own replicas; [`DecaySplit`]: the
//!   weight decay kept off 1-d parameters that every wrapper applies alike.
//!
//! Every item acts on an ordinary Burn `Module`: a model written for Burn needs nothing of
//! this crate but, for the engines that work layer by layer, its [`layer`] calls.

mod data_parallel;
mod decay;
pub mod graph;
mod layer;
pub mod params;
pub mod precision;
pub mod state;
pub mod tied;
pub mod weight_grad;

pub use data_parallel::{DataParallel, Subgroup, scale_and_check, weighted_square_sum};
pub use decay::DecaySplit;
pub use layer::{
    LayerHook, LayerHookGuard, LayerInput, install_layer_hook, layer, without_layer_hooks,
};
pub use precision::PrecisionDTypes;
