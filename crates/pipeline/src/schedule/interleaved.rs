//! Interleaved 1F1B (Megatron-LM, PTD-P): each rank holds `v` chunks placed round robin, so
//! stage `s` is chunk `s / p` of rank `s % p`; the bubble shrinks by `v`.

use super::greedy::{megatron_backward, megatron_forward};
use super::{Action, BackwardKind, Costs, Policy, Schedule, StageMap, list_schedule};
use crate::check::check;

/// Interleaved 1F1B with `chunks` (`v`) chunks per rank, Megatron's order: forwards go
/// through micro-batches in groups of `p`, chunk by chunk (a last group may be smaller);
/// backwards likewise, deepest chunk first; rank `r` warms up with `2(p − r − 1) + (v − 1)p`
/// forwards, then strictly alternates one forward and one backward, then drains. Bubble
/// `(p−1)/(v·m+p−1)`. Should that order not pass the checker (it always does for `m`
/// divisible by `p`), the list scheduler with the same priorities is used instead.
pub fn interleaved(ranks: usize, chunks: usize, microbatches: usize) -> Schedule {
    let schedule = megatron_order(ranks, chunks, microbatches);
    if check(&schedule).is_ok() {
        return schedule;
    }
    let (p, v, m) = (ranks, chunks, microbatches);
    let policy = Policy {
        backward: BackwardKind::Full,
        backward_first: true,
        in_flight: (0..p).map(|r| 2 * (p - r - 1) + (v - 1) * p + 1).collect(),
        weight_limit: None,
        forward_key: megatron_forward,
        backward_key: megatron_backward,
    };
    list_schedule(
        "interleaved",
        StageMap::Looped { ranks, chunks },
        m,
        &policy,
        Costs::default(),
    )
}

/// Megatron's interleaved order, unchecked.
pub(crate) fn megatron_order(ranks: usize, chunks: usize, microbatches: usize) -> Schedule {
    let stage_map = StageMap::Looped { ranks, chunks };
    let (p, v, m) = (ranks, chunks, microbatches);
    let mut forwards = Vec::with_capacity(m * v);
    let mut backwards = Vec::with_capacity(m * v);
    for g0 in (0..m).step_by(p) {
        for c in 0..v {
            for mb in g0..(g0 + p).min(m) {
                forwards.push(Action::Forward { mb, chunk: c });
                backwards.push(Action::Backward {
                    mb,
                    chunk: v - 1 - c,
                });
            }
        }
    }
    let total = m * v;
    let order = (0..p)
        .map(|r| {
            let warmup = (2 * (p - r - 1) + (v - 1) * p).min(total);
            let mut list = forwards[..warmup].to_vec();
            for i in 0..total - warmup {
                list.push(forwards[warmup + i]);
                list.push(backwards[i]);
            }
            list.extend_from_slice(&backwards[total - warmup..]);
            list
        })
        .collect();
    Schedule::from_compute_order("interleaved", stage_map, m, order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_order_passes_except_two_short_group_cases() {
        let mut fallback = Vec::new();
        for p in 1..=4 {
            for v in 1..=3 {
                for m in 1..=9 {
                    if check(&megatron_order(p, v, m)).is_err() {
                        fallback.push((p, v, m));
                    }
                }
            }
        }
        // Short last groups with deep interleaving can deadlock Megatron's order; those use
        // the list scheduler (whose result passes: see generated_schedules_pass_the_checker).
        assert_eq!(fallback, vec![(4, 3, 5), (4, 3, 9)]);
        for (p, v, m) in fallback {
            check(&interleaved(p, v, m)).unwrap();
        }
    }
}
