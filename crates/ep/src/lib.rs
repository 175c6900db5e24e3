//! # bonfire-ep
//!
//! Expert parallelism, all of it, for a mixture-of-experts layer written with Burn tensors:
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
//! - [`check_experts`] / [`shard_experts`] / [`expert_subgroup`]: a rank's slice of the
//!   expert parameters, and the [`bonfire_module::Subgroup`] that tells the data-parallel
//!   engines (DDP, ZeRO 1–3, HSDP) over which ranks their gradients are reduced and how
//!   they are scaled — the engines partition and reduce any such subgroup; which parameters
//!   are experts, who replicates them and the `1/ep` scale are decided here alone.
//!
//! See `docs/moe.md`.

mod dispatch;
mod params;
mod permute;
mod scope;

pub use dispatch::{ExpertDispatch, combine, dispatch};
pub use params::{check_experts, expert_subgroup, shard_experts};
pub use permute::{TokenPermutation, permute, unpermute};
pub use scope::{ExpertGuard, ExpertScope, run_experts};
