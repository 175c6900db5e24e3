//! Expert parallelism's primitives, for a mixture-of-experts layer written with Burn tensors:
//!
//! - [`permute`] / [`unpermute`]: a batch's tokens grouped by the experts they are routed to
//!   (each once per choice) and summed back weighted by the routing weights.
//! - [`dispatch`] / [`combine`]: the grouped rows sent to the ranks of an ep group that hold
//!   their experts (`E/ep` consecutive experts each) and the outputs sent back, with
//!   `all_to_all_uneven` — dropless: no capacity, any count per expert, zero included.
//!
//! A layer on one rank: `permute` → its experts on each group of rows → `unpermute`. Under
//! expert parallelism: `permute` → `dispatch` → the rank's experts → `combine` →
//! `unpermute`. Everything is differentiable; only the counts per expert cross to the host.
//! - [`ExpertScope`] / [`run_experts`]: a model runs its experts through `run_experts`; the
//!   trainer enters the ep group's scope, and the experts run where they are held.
//! - [`shard_experts`] / [`ExpertParams`]: a rank's slice of the expert parameters and which
//!   ranks reduce their gradients together.

mod dispatch;
mod params;
mod permute;
mod scope;

pub use dispatch::{ExpertDispatch, combine, dispatch};
pub use params::{ExpertParams, check_experts, shard_experts};
pub use permute::{TokenPermutation, permute, unpermute};
pub use scope::{ExpertGuard, ExpertScope, run_experts};
