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
    let mut sim = Simulation::new(stage_map, microbatches, policy, costs);
    while sim.remaining.iter().any(|r| !r.is_empty()) {
        let started = sim.start_idle_ranks();
        sim.advance_clock(started);
    }
    Schedule::from_compute_order(name, stage_map, microbatches, sim.order)
}

/// A computation still to run on a rank: (kind, micro-batch, local chunk).
type Task = (Kind, usize, usize);

/// The list scheduler's simulated pipeline, one time step at a time.
struct Simulation<'a> {
    stage_map: StageMap,
    policy: &'a Policy,
    costs: Costs,
    /// Whether backwards are split into B and W.
    split: bool,
    /// Finish time of (kind, mb, stage).
    done: HashMap<(Kind, usize, usize), u64>,
    /// The computations each rank has started, in order.
    order: Vec<Vec<Action>>,
    busy_until: Vec<u64>,
    /// Forwards per rank whose backward has not started.
    in_flight: Vec<usize>,
    /// Forwards per rank whose weight gradient has not started.
    alive: Vec<usize>,
    remaining: Vec<Vec<Task>>,
    /// The simulated time.
    t: u64,
    /// Whether the in-flight and weight limits are lifted because the simulation stalled.
    relax: bool,
}

impl<'a> Simulation<'a> {
    /// The simulation at time 0, every rank with all its computations to run.
    fn new(stage_map: StageMap, microbatches: usize, policy: &'a Policy, costs: Costs) -> Self {
        let p = stage_map.ranks();
        let split = policy.backward == BackwardKind::Split;
        let mut todo = Vec::new();
        for c in 0..stage_map.chunks() {
            for mb in 0..microbatches {
                todo.push((Kind::F, mb, c));
                todo.push((Kind::B, mb, c));
                if split {
                    todo.push((Kind::W, mb, c));
                }
            }
        }
        Self {
            stage_map,
            policy,
            costs,
            split,
            done: HashMap::new(),
            order: vec![Vec::new(); p],
            busy_until: vec![0; p],
            in_flight: vec![0; p],
            alive: vec![0; p],
            remaining: vec![todo; p],
            t: 0,
            relax: false,
        }
    }

    /// Lets every idle rank with work left start its best ready computation, rank by rank;
    /// whether any started.
    fn start_idle_ranks(&mut self) -> bool {
        let mut started = false;
        for r in 0..self.stage_map.ranks() {
            if self.busy_until[r] > self.t || self.remaining[r].is_empty() {
                continue;
            }
            let Some(i) = self.pick(r) else { continue };
            self.start(r, i);
            started = true;
        }
        started
    }

    /// Moves the clock to the next finish time, or lifts the limits if nothing runs or starts.
    fn advance_clock(&mut self, started: bool) {
        let t = self.t;
        match self.busy_until.iter().copied().filter(|&b| b > t).min() {
            Some(next) => self.t = next,
            None if !started => self.relax = true,
            None => {}
        }
    }

    /// Whether `(kind, mb, stage)` has finished by now.
    fn finished(&self, kind: Kind, mb: usize, stage: usize) -> bool {
        self.done
            .get(&(kind, mb, stage))
            .is_some_and(|&e| e <= self.t)
    }

    /// Whether what `task` on rank `r` depends on has finished.
    fn ready(&self, r: usize, &(k, mb, c): &Task) -> bool {
        let s = self.stage_map.stage(r, c);
        match k {
            Kind::F => s == 0 || self.finished(Kind::F, mb, s - 1),
            Kind::B => {
                self.finished(Kind::F, mb, s)
                    && (s + 1 == self.stage_map.stages() || self.finished(Kind::B, mb, s + 1))
            }
            Kind::W => self.finished(Kind::B, mb, s),
        }
    }

    /// The index in rank `r`'s remaining work of its highest-priority ready task of `kind`.
    fn best(&self, r: usize, kind: Kind) -> Option<usize> {
        let (p, v) = (self.stage_map.ranks(), self.stage_map.chunks());
        let key = match kind {
            Kind::F => self.policy.forward_key,
            Kind::B | Kind::W => self.policy.backward_key,
        };
        self.remaining[r]
            .iter()
            .enumerate()
            .filter(|(_, a)| a.0 == kind && self.ready(r, a))
            .min_by_key(|(_, a)| key(a.1, a.2, p, v))
            .map(|(i, _)| i)
    }

    /// Whether rank `r` may start another forward under its activation-memory limits.
    fn may_start_forward(&self, r: usize) -> bool {
        let policy = self.policy;
        self.relax
            || (self.in_flight[r] < policy.in_flight[r].max(1)
                && policy
                    .weight_limit
                    .as_ref()
                    .is_none_or(|l| self.alive[r] < l[r].max(1)))
    }

    /// The index in rank `r`'s remaining work of the task the policy starts next, if any.
    fn pick(&self, r: usize) -> Option<usize> {
        let f = self.best(r, Kind::F).filter(|_| self.may_start_forward(r));
        let b = self.best(r, Kind::B);
        let w = self.best(r, Kind::W);
        if self.policy.backward_first {
            b.or(f).or(w)
        } else {
            f.or(b).or(w)
        }
    }

    /// Starts rank `r`'s remaining task `i` now: records its finish time and its action.
    fn start(&mut self, r: usize, i: usize) {
        let (k, mb, c) = self.remaining[r].remove(i);
        let s = self.stage_map.stage(r, c);
        let costs = self.costs;
        let cost = match (k, self.split) {
            (Kind::F, _) => costs.forward,
            (Kind::B, true) => costs.backward_input,
            (Kind::B, false) => costs.backward_input + costs.backward_weight,
            (Kind::W, _) => costs.backward_weight,
        };
        self.busy_until[r] = self.t + cost;
        self.done.insert((k, mb, s), self.t + cost);
        match k {
            Kind::F => {
                self.in_flight[r] += 1;
                self.alive[r] += 1;
            }
            Kind::B => {
                self.in_flight[r] -= 1;
                if !self.split {
                    self.alive[r] -= 1;
                }
            }
            Kind::W => self.alive[r] -= 1,
        }
        self.order[r].push(match (k, self.split) {
            (Kind::F, _) => Action::Forward { mb, chunk: c },
            (Kind::B, false) => Action::Backward { mb, chunk: c },
            (Kind::B, true) => Action::BackwardInput { mb, chunk: c },
            (Kind::W, _) => Action::BackwardWeight { mb, chunk: c },
        });
        self.relax = false;
    }
}
