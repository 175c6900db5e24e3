//! GPipe: every forward, then every backward (activation memory grows with `m`).

use super::greedy::{megatron_backward, megatron_forward};
use super::{BackwardKind, Costs, Policy, Schedule, StageMap, list_schedule};

/// GPipe on `ranks` ranks (one chunk each) with `microbatches` micro-batches: rank `r` runs
/// `F0 … F(m−1)` then `B0 … B(m−1)`. Bubble `(p−1)/(m+p−1)`.
pub fn gpipe(ranks: usize, microbatches: usize) -> Schedule {
    let policy = Policy {
        backward: BackwardKind::Full,
        backward_first: false,
        in_flight: vec![usize::MAX; ranks],
        weight_limit: None,
        forward_key: megatron_forward,
        backward_key: megatron_backward,
    };
    list_schedule(
        "gpipe",
        StageMap::Looped { ranks, chunks: 1 },
        microbatches,
        &policy,
        Costs::default(),
    )
}
