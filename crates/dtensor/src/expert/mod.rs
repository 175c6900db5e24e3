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

mod dispatch;
mod permute;

pub use dispatch::{ExpertDispatch, combine, dispatch};
pub use permute::{TokenPermutation, permute, unpermute};
