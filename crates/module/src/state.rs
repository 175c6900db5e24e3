//! A model's state besides its parameters — float parameters that require no gradient
//! ([`crate::params::buffers`]: DeepSeek-V3's per-layer `e_score_correction_bias`) — and how it
//! moves: a forward [`record`]s statistics for a state tensor (the rows its router sent to each
//! expert), summed on this rank (thread) over the step's forwards — micro-batches,
//! accumulation parts —, and after the optimizer step the engine [`take`]s them, sums them
//! over the ranks that saw other data (its replicas and cp ranks) and applies the rule
//! ([`balance_step`]: auxiliary-loss-free balancing). A region's re-run in backward
//! (activation checkpointing) records nothing ([`replaying`]); the trainer [`clear`]s what
//! evaluation forwards recorded before each step.

use burn::module::ParamId;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

thread_local! {
    static RECORDS: RefCell<HashMap<ParamId, Vec<f64>>> = RefCell::new(HashMap::new());
    static REPLAYING: Cell<usize> = const { Cell::new(0) };
}

/// Adds `stats` to what this thread's forwards recorded for the state tensor `id` (ignored
/// while [`replaying`]).
pub fn record(id: ParamId, stats: impl IntoIterator<Item = f64>) {
    if REPLAYING.with(Cell::get) > 0 {
        return;
    }
    RECORDS.with(|r| {
        let mut r = r.borrow_mut();
        let sums = r.entry(id).or_default();
        for (i, s) in stats.into_iter().enumerate() {
            if i == sums.len() {
                sums.push(0.0);
            }
            sums[i] += s;
        }
    });
}

/// Everything recorded on this thread since the last [`take`] or [`clear`], by state tensor.
pub fn take() -> HashMap<ParamId, Vec<f64>> {
    RECORDS.with(|r| std::mem::take(&mut *r.borrow_mut()))
}

/// Forgets what this thread recorded.
pub fn clear() {
    drop(take());
}

/// While the guard lives, this thread's forwards record nothing: a recomputed region runs its
/// forward again in backward, and its statistics were recorded the first time.
pub fn replaying() -> ReplayGuard {
    REPLAYING.with(|r| r.set(r.get() + 1));
    ReplayGuard(())
}

/// See [`replaying`].
#[derive(Debug)]
pub struct ReplayGuard(());

impl Drop for ReplayGuard {
    fn drop(&mut self) {
        REPLAYING.with(|r| r.set(r.get() - 1));
    }
}

/// Auxiliary-loss-free balancing (DeepSeek-V3): `bias[e] += rate · sign(mean(load) − load[e])`,
/// `load` the rows each expert got in the step's whole batch (sign(0) = 0).
pub fn balance_step(bias: &mut [f32], load: &[f64], rate: f64) {
    let mean = load.iter().sum::<f64>() / load.len().max(1) as f64;
    for (b, &l) in bias.iter_mut().zip(load) {
        let sign = match (mean - l).partial_cmp(&0.0) {
            Some(std::cmp::Ordering::Greater) => 1.0,
            Some(std::cmp::Ordering::Less) => -1.0,
            _ => 0.0,
        };
        *b = (*b as f64 + rate * sign) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_sum_until_taken_and_replays_record_nothing() {
        let id = ParamId::new();
        record(id, [1.0, 2.0]);
        record(id, [3.0, 0.0]);
        {
            let _g = replaying();
            record(id, [100.0, 100.0]);
        }
        assert_eq!(take()[&id], [4.0, 2.0]);
        assert!(take().is_empty());
        record(id, [1.0]);
        clear();
        assert!(take().is_empty());
    }

    #[test]
    fn balance_moves_toward_the_mean_by_the_rate() {
        let mut bias = [0.5f32, 0.0, -0.25];
        balance_step(&mut bias, &[1.0, 2.0, 3.0], 0.125);
        assert_eq!(bias, [0.625, 0.0, -0.375]);
    }
}
