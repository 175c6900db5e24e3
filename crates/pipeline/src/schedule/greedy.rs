//! The list scheduler every generator uses: simulate the pipeline with unit costs and let each
//! idle rank pick its highest-priority ready action.
//!
//! Because each rank's order comes out of one simulated execution in which every action ran
//! after the actions it depends on, the resulting schedule is deadlock-free for *any* real
//! timing (sends never block; a receive waits only for a send that comes earlier in that
//! global order). It works for every micro-batch count, including `m < p` and `m` not
//! divisible by `p`. The policies reproduce the textbook schedules: GPipe (forwards first),
//! 1F1B (backward first, at most `p − r` forwards in flight on rank `r`), Megatron's
//! interleaved order, and zero-bubble (weight gradients fill the idle slots).

use super::{Action, BackwardKind, Schedule, StageMap};
use std::collections::HashMap;

/// Simulated costs in abstract time units. A full backward costs `backward_input +
/// backward_weight`.
#[derive(Clone, Copy, Debug)]
pub struct Costs {
    /// Forward of one micro-batch through one chunk.
    pub forward: u64,
    /// Backward with respect to the input (ZB's "B").
    pub backward_input: u64,
    /// Backward with respect to the weights (ZB's "W").
    pub backward_weight: u64,
}

impl Default for Costs {
    /// F = B = W = 1 (full backward = 2 F), the usual assumption of the papers.
    fn default() -> Self {
        Self {
            forward: 1,
            backward_input: 1,
            backward_weight: 1,
        }
    }
}

/// How a rank picks among ready actions.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Full backward, or B/W split.
    pub backward: BackwardKind,
    /// Prefer a ready backward over a ready forward (1F1B); otherwise forwards first (GPipe).
    pub backward_first: bool,
    /// `in_flight[r]`: the most forwards rank `r` may have run whose backward has not run yet
    /// (activation memory). Relaxed only if the simulation would otherwise stall.
    pub in_flight: Vec<usize>,
    /// For split backwards: `weight_limit[r]` caps the forwards whose W has not run yet
    /// (activation memory, since W still needs the layer inputs); `None` for no cap.
    pub weight_limit: Option<Vec<usize>>,
    /// Priority of a ready forward `(mb, chunk)` (smaller runs first).
    pub forward_key:
        fn(mb: usize, chunk: usize, ranks: usize, chunks: usize) -> (usize, usize, usize),
    /// Priority of a ready backward `(mb, chunk)` (smaller runs first).
    pub backward_key:
        fn(mb: usize, chunk: usize, ranks: usize, chunks: usize) -> (usize, usize, usize),
}

/// Forward priority of plain pipelines and Megatron interleaving: micro-batches in groups of
/// `p`; within a group, chunk by chunk.
pub(crate) fn megatron_forward(
    mb: usize,
    chunk: usize,
    p: usize,
    _v: usize,
) -> (usize, usize, usize) {
    (mb / p, chunk, mb)
}

/// Backward priority matching [`megatron_forward`], deepest chunk first.
pub(crate) fn megatron_backward(
    mb: usize,
    chunk: usize,
    p: usize,
    v: usize,
) -> (usize, usize, usize) {
    (mb / p, v - 1 - chunk, mb)
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    F,
    B,
    W,
}

/// Runs the list scheduler and returns the schedule (communication inserted).
pub fn list_schedule(
    name: &str,
    stage_map: StageMap,
    microbatches: usize,
    policy: &Policy,
    costs: Costs,
) -> Schedule {
    let p = stage_map.ranks();
    let v = stage_map.chunks();
    let stages = stage_map.stages();
    let m = microbatches;
    let split = policy.backward == BackwardKind::Split;
    // Finish time of (kind, mb, stage).
    let mut done: HashMap<(Kind, usize, usize), u64> = HashMap::new();
    let mut order: Vec<Vec<Action>> = vec![Vec::new(); p];
    let mut busy_until = vec![0u64; p];
    let mut in_flight = vec![0usize; p];
    let mut alive = vec![0usize; p];
    let mut remaining: Vec<Vec<(Kind, usize, usize)>> = (0..p)
        .map(|r| {
            let mut todo = Vec::new();
            for c in 0..v {
                for mb in 0..m {
                    todo.push((Kind::F, mb, c));
                    todo.push((Kind::B, mb, c));
                    if split {
                        todo.push((Kind::W, mb, c));
                    }
                }
            }
            let _ = r;
            todo
        })
        .collect();
    let finished =
        |done: &HashMap<(Kind, usize, usize), u64>, k: Kind, mb: usize, s: usize, t: u64| {
            done.get(&(k, mb, s)).is_some_and(|&e| e <= t)
        };
    let mut t = 0u64;
    let mut relax = false;
    while remaining.iter().any(|r| !r.is_empty()) {
        let mut started = false;
        for r in 0..p {
            if busy_until[r] > t || remaining[r].is_empty() {
                continue;
            }
            let ready = |&(k, mb, c): &(Kind, usize, usize)| {
                let s = stage_map.stage(r, c);
                match k {
                    Kind::F => s == 0 || finished(&done, Kind::F, mb, s - 1, t),
                    Kind::B => {
                        finished(&done, Kind::F, mb, s, t)
                            && (s + 1 == stages || finished(&done, Kind::B, mb, s + 1, t))
                    }
                    Kind::W => finished(&done, Kind::B, mb, s, t),
                }
            };
            let best = |kind: Kind, key: &dyn Fn(usize, usize) -> (usize, usize, usize)| {
                remaining[r]
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.0 == kind && ready(a))
                    .min_by_key(|(_, a)| key(a.1, a.2))
                    .map(|(i, _)| i)
            };
            let fkey = |mb, c| (policy.forward_key)(mb, c, p, v);
            let bkey = |mb, c| (policy.backward_key)(mb, c, p, v);
            let f = best(Kind::F, &fkey).filter(|_| {
                relax
                    || (in_flight[r] < policy.in_flight[r].max(1)
                        && policy
                            .weight_limit
                            .as_ref()
                            .is_none_or(|l| alive[r] < l[r].max(1)))
            });
            let b = best(Kind::B, &bkey);
            let w = best(Kind::W, &bkey);
            let pick = if policy.backward_first {
                b.or(f).or(w)
            } else {
                f.or(b).or(w)
            };
            let Some(i) = pick else { continue };
            let (k, mb, c) = remaining[r].remove(i);
            let s = stage_map.stage(r, c);
            let cost = match (k, split) {
                (Kind::F, _) => costs.forward,
                (Kind::B, true) => costs.backward_input,
                (Kind::B, false) => costs.backward_input + costs.backward_weight,
                (Kind::W, _) => costs.backward_weight,
            };
            busy_until[r] = t + cost;
            done.insert((k, mb, s), t + cost);
            match k {
                Kind::F => {
                    in_flight[r] += 1;
                    alive[r] += 1;
                }
                Kind::B => {
                    in_flight[r] -= 1;
                    if !split {
                        alive[r] -= 1;
                    }
                }
                Kind::W => alive[r] -= 1,
            }
            order[r].push(match (k, split) {
                (Kind::F, _) => Action::Forward { mb, chunk: c },
                (Kind::B, false) => Action::Backward { mb, chunk: c },
                (Kind::B, true) => Action::BackwardInput { mb, chunk: c },
                (Kind::W, _) => Action::BackwardWeight { mb, chunk: c },
            });
            started = true;
            relax = false;
        }
        match busy_until.iter().copied().filter(|&b| b > t).min() {
            Some(next) => t = next,
            None if !started => relax = true,
            None => {}
        }
    }
    Schedule::from_compute_order(name, stage_map, microbatches, order)
}
