//! 1F1B (PipeDream-flush): after a warm-up of `p − r − 1` forwards, rank `r` alternates one
//! forward and one backward, so at most `p − r` micro-batches' activations are alive.

use super::greedy::{megatron_backward, megatron_forward};
use super::{BackwardKind, Costs, Policy, Schedule, StageMap, list_schedule};

/// 1F1B on `ranks` ranks with `microbatches` micro-batches. Same bubble as GPipe,
/// `(p−1)/(m+p−1)`, with activation memory bounded by `p` micro-batches instead of `m`.
pub fn one_f_one_b(ranks: usize, microbatches: usize) -> Schedule {
    let policy = Policy {
        backward: BackwardKind::Full,
        backward_first: true,
        in_flight: (0..ranks).map(|r| ranks - r).collect(),
        weight_limit: None,
        forward_key: megatron_forward,
        backward_key: megatron_backward,
    };
    list_schedule(
        "1f1b",
        StageMap::Looped { ranks, chunks: 1 },
        microbatches,
        &policy,
        Costs::default(),
    )
}
