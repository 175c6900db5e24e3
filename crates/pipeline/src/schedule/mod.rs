//! Schedules as data: a per-rank list of [`Action`]s.
//!
//! A pipeline of `S = p·v` *stages* is spread over `p` ranks, `v` *chunks* (virtual stages)
//! per rank, by a [`StageMap`]. A [`Schedule`] says, for every rank, in which order it runs
//! the forward and backward of each (micro-batch, chunk) and when it sends or receives
//! activations and gradients. The generators ([`gpipe`], [`one_f_one_b`], [`interleaved`],
//! [`zero_bubble`]) build schedules; [`crate::check`] verifies any schedule (generated or
//! hand-made) before [`crate::runtime`] executes it.

mod gpipe;
mod greedy;
mod interleaved;
mod one_f_one_b;
mod zero_bubble;

pub use gpipe::gpipe;
pub use greedy::{Costs, Policy, list_schedule};
pub use interleaved::interleaved;
pub use one_f_one_b::one_f_one_b;
pub use zero_bubble::{zb_h1, zb_v};

use std::fmt;

/// One step of one rank's program. `chunk` is the rank-local chunk index (`0..v`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward of micro-batch `mb` through local chunk `chunk`.
    Forward {
        /// The micro-batch.
        mb: usize,
        /// The rank-local chunk.
        chunk: usize,
    },
    /// Full backward (input and weight gradients) of `mb` through `chunk`.
    Backward {
        /// The micro-batch.
        mb: usize,
        /// The rank-local chunk.
        chunk: usize,
    },
    /// Zero-bubble "B": the gradient with respect to the chunk's input (what the previous
    /// stage waits for).
    BackwardInput {
        /// The micro-batch.
        mb: usize,
        /// The rank-local chunk.
        chunk: usize,
    },
    /// Zero-bubble "W": the gradient with respect to the chunk's weights (nobody waits).
    BackwardWeight {
        /// The micro-batch.
        mb: usize,
        /// The rank-local chunk.
        chunk: usize,
    },
    /// Send the output activation of (`mb`, `chunk`) to rank `to`.
    SendActivation {
        /// The micro-batch.
        mb: usize,
        /// The rank-local chunk that produced the activation.
        chunk: usize,
        /// The rank that runs the next stage.
        to: usize,
    },
    /// Receive the input activation of (`mb`, `chunk`) from rank `from`.
    RecvActivation {
        /// The micro-batch.
        mb: usize,
        /// The rank-local chunk that consumes the activation.
        chunk: usize,
        /// The rank that runs the previous stage.
        from: usize,
    },
    /// Send the gradient with respect to the input of (`mb`, `chunk`) to rank `to`.
    SendGrad {
        /// The micro-batch.
        mb: usize,
        /// The rank-local chunk whose backward produced the gradient.
        chunk: usize,
        /// The rank that runs the previous stage.
        to: usize,
    },
    /// Receive the gradient with respect to the output of (`mb`, `chunk`) from rank `from`.
    RecvGrad {
        /// The micro-batch.
        mb: usize,
        /// The rank-local chunk whose backward consumes the gradient.
        chunk: usize,
        /// The rank that runs the next stage.
        from: usize,
    },
}

impl Action {
    /// The micro-batch this action works on.
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. }
            | Action::SendActivation { mb, .. }
            | Action::RecvActivation { mb, .. }
            | Action::SendGrad { mb, .. }
            | Action::RecvGrad { mb, .. } => mb,
        }
    }

    /// The rank-local chunk this action works on.
    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::BackwardInput { chunk, .. }
            | Action::BackwardWeight { chunk, .. }
            | Action::SendActivation { chunk, .. }
            | Action::RecvActivation { chunk, .. }
            | Action::SendGrad { chunk, .. }
            | Action::RecvGrad { chunk, .. } => chunk,
        }
    }

    /// Whether this is computation (forward or some backward), as opposed to communication.
    pub fn is_compute(&self) -> bool {
        matches!(
            self,
            Action::Forward { .. }
                | Action::Backward { .. }
                | Action::BackwardInput { .. }
                | Action::BackwardWeight { .. }
        )
    }

    /// A short label: `F3.1` is the forward of micro-batch 3 on chunk 1.
    pub fn label(&self) -> String {
        let (k, mb, c) = match *self {
            Action::Forward { mb, chunk } => ("F", mb, chunk),
            Action::Backward { mb, chunk } => ("B", mb, chunk),
            Action::BackwardInput { mb, chunk } => ("Bi", mb, chunk),
            Action::BackwardWeight { mb, chunk } => ("W", mb, chunk),
            Action::SendActivation { mb, chunk, .. } => ("sa", mb, chunk),
            Action::RecvActivation { mb, chunk, .. } => ("ra", mb, chunk),
            Action::SendGrad { mb, chunk, .. } => ("sg", mb, chunk),
            Action::RecvGrad { mb, chunk, .. } => ("rg", mb, chunk),
        };
        format!("{k}{mb}.{c}")
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Action::Forward { mb, chunk } => write!(f, "Forward(mb={mb}, chunk={chunk})"),
            Action::Backward { mb, chunk } => write!(f, "Backward(mb={mb}, chunk={chunk})"),
            Action::BackwardInput { mb, chunk } => {
                write!(f, "BackwardInput(mb={mb}, chunk={chunk})")
            }
            Action::BackwardWeight { mb, chunk } => {
                write!(f, "BackwardWeight(mb={mb}, chunk={chunk})")
            }
            Action::SendActivation { mb, chunk, to } => {
                write!(f, "SendActivation(mb={mb}, chunk={chunk}, to={to})")
            }
            Action::RecvActivation { mb, chunk, from } => {
                write!(f, "RecvActivation(mb={mb}, chunk={chunk}, from={from})")
            }
            Action::SendGrad { mb, chunk, to } => {
                write!(f, "SendGrad(mb={mb}, chunk={chunk}, to={to})")
            }
            Action::RecvGrad { mb, chunk, from } => {
                write!(f, "RecvGrad(mb={mb}, chunk={chunk}, from={from})")
            }
        }
    }
}

/// Where the `p·v` stages live: which rank and local chunk runs global stage `s`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageMap {
    /// Round robin (Megatron interleaving): stage `s` is chunk `s / p` of rank `s % p`.
    /// With `v = 1` this is the plain pipeline, stage `s` on rank `s`.
    Looped {
        /// Number of ranks `p`.
        ranks: usize,
        /// Chunks per rank `v`.
        chunks: usize,
    },
    /// V shape (ZB-V, two chunks): stage `s < p` on rank `s` (chunk 0), stage `s ≥ p` on rank
    /// `2p − 1 − s` (chunk 1); the last stage shares rank 0 with the first.
    VShape {
        /// Number of ranks `p`.
        ranks: usize,
    },
}

impl StageMap {
    /// Number of ranks `p`.
    pub fn ranks(&self) -> usize {
        match *self {
            StageMap::Looped { ranks, .. } | StageMap::VShape { ranks } => ranks,
        }
    }
    /// Chunks per rank `v`.
    pub fn chunks(&self) -> usize {
        match *self {
            StageMap::Looped { chunks, .. } => chunks,
            StageMap::VShape { .. } => 2,
        }
    }
    /// Number of stages `p·v`.
    pub fn stages(&self) -> usize {
        self.ranks() * self.chunks()
    }
    /// The global stage run by `rank`'s local `chunk`.
    pub fn stage(&self, rank: usize, chunk: usize) -> usize {
        match *self {
            StageMap::Looped { ranks, .. } => chunk * ranks + rank,
            StageMap::VShape { ranks } => {
                if chunk == 0 {
                    rank
                } else {
                    2 * ranks - 1 - rank
                }
            }
        }
    }
    /// The (rank, local chunk) running global stage `stage`.
    pub fn locate(&self, stage: usize) -> (usize, usize) {
        match *self {
            StageMap::Looped { ranks, .. } => (stage % ranks, stage / ranks),
            StageMap::VShape { ranks } => {
                if stage < ranks {
                    (stage, 0)
                } else {
                    (2 * ranks - 1 - stage, 1)
                }
            }
        }
    }
}

/// Which backward the schedule uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardKind {
    /// One [`Action::Backward`] per (micro-batch, chunk).
    Full,
    /// [`Action::BackwardInput`] then [`Action::BackwardWeight`] (zero-bubble schedules).
    Split,
}

/// A complete pipeline schedule: one action list per rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// Name for reports (`gpipe`, `1f1b`, `interleaved`, `zb-h1`, `zb-v`, or anything).
    pub name: String,
    /// How stages map to ranks.
    pub stage_map: StageMap,
    /// Number of micro-batches per step.
    pub microbatches: usize,
    /// `actions[r]` is rank `r`'s program.
    pub actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.stage_map.ranks()
    }
    /// Number of global stages.
    pub fn stages(&self) -> usize {
        self.stage_map.stages()
    }
    /// Whether `rank`'s `chunk` is the first stage (it reads the micro-batch's data).
    pub fn is_first(&self, rank: usize, chunk: usize) -> bool {
        self.stage_map.stage(rank, chunk) == 0
    }
    /// Whether `rank`'s `chunk` is the last stage (it computes the loss).
    pub fn is_last(&self, rank: usize, chunk: usize) -> bool {
        self.stage_map.stage(rank, chunk) + 1 == self.stages()
    }

    /// The forwards alone (evaluation): every rank runs the forward of each micro-batch
    /// through its stages in stage order, micro-batch after micro-batch. Every rank's program
    /// follows the one global order (micro-batch, stage), and each send sits right after the
    /// forward that produced it, each receive right before the forward that consumes it, so
    /// it cannot deadlock; the checker, which asks for backwards, does not apply — run it
    /// with [`crate::runtime::run_unchecked`].
    pub fn forward_only(stage_map: StageMap, microbatches: usize) -> Self {
        let compute = (0..stage_map.ranks())
            .map(|rank| {
                (0..microbatches)
                    .flat_map(|mb| {
                        (0..stage_map.stages())
                            .map(|s| stage_map.locate(s))
                            .filter(|&(r, _)| r == rank)
                            .map(move |(_, chunk)| Action::Forward { mb, chunk })
                    })
                    .collect()
            })
            .collect();
        Self::from_compute_order("forward", stage_map, microbatches, compute)
    }

    /// Builds a schedule from per-rank *compute* orders (forward / backward actions only),
    /// inserting the communication: a receive right before a compute action whose input
    /// lives on another rank, a send right after one whose output goes to another rank.
    /// Stages on the same rank hand data over locally, with no action.
    pub fn from_compute_order(
        name: impl Into<String>,
        stage_map: StageMap,
        microbatches: usize,
        compute: Vec<Vec<Action>>,
    ) -> Self {
        let stages = stage_map.stages();
        let mut actions = Vec::with_capacity(compute.len());
        for (rank, order) in compute.into_iter().enumerate() {
            let mut list = Vec::with_capacity(order.len() * 2);
            for a in order {
                let (mb, chunk) = (a.mb(), a.chunk());
                let s = stage_map.stage(rank, chunk);
                match a {
                    Action::Forward { .. } => {
                        if s > 0 {
                            let (from, _) = stage_map.locate(s - 1);
                            if from != rank {
                                list.push(Action::RecvActivation { mb, chunk, from });
                            }
                        }
                        list.push(a);
                        if s + 1 < stages {
                            let (to, _) = stage_map.locate(s + 1);
                            if to != rank {
                                list.push(Action::SendActivation { mb, chunk, to });
                            }
                        }
                    }
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        if s + 1 < stages {
                            let (from, _) = stage_map.locate(s + 1);
                            if from != rank {
                                list.push(Action::RecvGrad { mb, chunk, from });
                            }
                        }
                        list.push(a);
                        if s > 0 {
                            let (to, _) = stage_map.locate(s - 1);
                            if to != rank {
                                list.push(Action::SendGrad { mb, chunk, to });
                            }
                        }
                    }
                    _ => list.push(a),
                }
            }
            actions.push(list);
        }
        Schedule {
            name: name.into(),
            stage_map,
            microbatches,
            actions,
        }
    }

    /// Activation memory per rank, in (micro-batch, chunk) units: the most forwards whose
    /// backward has not finished (the full backward, or W for split schedules — W still
    /// needs the layer inputs) at any point of the rank's program.
    pub fn peak_activations(&self) -> Vec<usize> {
        self.actions
            .iter()
            .map(|list| {
                let (mut live, mut peak) = (0usize, 0usize);
                for a in list {
                    match a {
                        Action::Forward { .. } => {
                            live += 1;
                            peak = peak.max(live);
                        }
                        Action::Backward { .. } | Action::BackwardWeight { .. } => {
                            live = live.saturating_sub(1)
                        }
                        _ => {}
                    }
                }
                peak
            })
            .collect()
    }

    /// The schedule as text, one line per rank (compute actions only unless `all`).
    pub fn render(&self, all: bool) -> String {
        let mut out = String::new();
        for (r, list) in self.actions.iter().enumerate() {
            out.push_str(&format!("rank {r}:"));
            for a in list.iter().filter(|a| all || a.is_compute()) {
                out.push(' ');
                out.push_str(&a.label());
            }
            out.push('\n');
        }
        out
    }
}

pub use bonfire_layout::ScheduleKind;

/// Generating a [`ScheduleKind`]'s program (the kind itself, its name, chunks and stage map,
/// is `bonfire-layout`'s, shared with the planner).
pub trait Generate {
    /// The schedule for `ranks` ranks and `microbatches` micro-batches.
    fn generate(&self, ranks: usize, microbatches: usize) -> Schedule;
}

impl Generate for ScheduleKind {
    fn generate(&self, ranks: usize, microbatches: usize) -> Schedule {
        match *self {
            Self::GPipe => gpipe(ranks, microbatches),
            Self::OneFOneB => one_f_one_b(ranks, microbatches),
            Self::Interleaved { chunks } => interleaved(ranks, chunks, microbatches),
            Self::ZbH1 => zb_h1(ranks, microbatches),
            Self::ZbV => zb_v(ranks, microbatches),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::check;
    use crate::timeline::Timeline;

    const KINDS: [ScheduleKind; 6] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved { chunks: 2 },
        ScheduleKind::Interleaved { chunks: 3 },
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
    ];

    #[test]
    fn generated_schedules_pass_the_checker() {
        for kind in KINDS {
            for p in [1, 2, 3, 4] {
                for m in [1, 2, 3, 4, 5, 8] {
                    let s = kind.generate(p, m);
                    if let Err(e) = check(&s) {
                        panic!("{} p={p} m={m}: {e}\n{}", kind.name(), s.render(true));
                    }
                }
            }
        }
    }

    /// Every stage's forward of every micro-batch, once; every send matched by a receive on
    /// the rank it names; and, rank by rank, the forwards in the global (micro-batch, stage)
    /// order — which is what keeps the unchecked run from deadlocking.
    #[test]
    fn forward_only_runs_every_forward_once_in_the_global_order() {
        for kind in KINDS {
            for (p, m) in [(1, 1), (2, 3), (3, 4), (4, 2)] {
                let map = kind.generate(p, m).stage_map;
                let s = Schedule::forward_only(map, m);
                let mut seen = std::collections::HashSet::new();
                for (rank, actions) in s.actions.iter().enumerate() {
                    let mut last = None;
                    for a in actions {
                        match *a {
                            Action::Forward { mb, chunk } => {
                                let key = (mb, map.stage(rank, chunk));
                                assert!(seen.insert(key), "{} twice", a.label());
                                assert!(last < Some(key), "{} p={p}: out of order", kind.name());
                                last = Some(key);
                            }
                            Action::SendActivation { mb, chunk, to } => {
                                let next = map.locate(map.stage(rank, chunk) + 1);
                                assert_eq!(next.0, to);
                                let recv = Action::RecvActivation {
                                    mb,
                                    chunk: next.1,
                                    from: rank,
                                };
                                assert!(s.actions[to].contains(&recv), "{}", a.label());
                            }
                            Action::RecvActivation { .. } => {}
                            other => panic!("{} in a forward-only schedule", other.label()),
                        }
                    }
                }
                assert_eq!(seen.len(), m * map.stages(), "{} p={p} m={m}", kind.name());
            }
        }
    }

    #[test]
    fn simulated_bubbles_match_theory() {
        for kind in KINDS {
            for p in [2, 4] {
                for m in [4, 8, 16] {
                    let s = kind.generate(p, m);
                    let t = Timeline::simulate(&s, Costs::default()).unwrap();
                    let bubble = t.bubble();
                    let theory = kind.theory_bubble(p, m);
                    println!(
                        "{} p={p} m={m} sim={bubble:.4} theory={theory:?}",
                        kind.name()
                    );
                    if let Some(theory) = theory {
                        assert!(
                            (bubble - theory).abs() < 1e-9,
                            "{} p={p} m={m}: simulated {bubble} theory {theory}\n{}",
                            kind.name(),
                            s.render(false)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn activation_memory() {
        assert_eq!(gpipe(4, 8).peak_activations(), vec![8; 4]);
        assert_eq!(one_f_one_b(4, 8).peak_activations(), vec![4, 3, 2, 1]);
        assert_eq!(one_f_one_b(4, 2).peak_activations(), vec![2, 2, 2, 1]);
        // Megatron's interleaved warm-up: 2(p − r − 1) + (v − 1)p + 1 chunk-forwards.
        assert_eq!(interleaved(4, 2, 8).peak_activations(), vec![11, 9, 7, 5]);
        // ZB-H1 keeps B-done, W-pending micro-batches alive: at most 2p − 1 − r, whatever m.
        assert_eq!(zb_h1(4, 8).peak_activations(), vec![7, 6, 5, 4]);
        assert_eq!(zb_h1(4, 16).peak_activations(), vec![7, 6, 5, 4]);
        // ZB-V: 2p chunk-forwards (each half a rank's layers) = 1F1B's peak of p micro-batches.
        assert_eq!(zb_v(4, 16).peak_activations(), vec![8; 4]);
    }

    #[test]
    fn textbook_1f1b_order() {
        let s = one_f_one_b(4, 8);
        assert_eq!(
            s.render(false).lines().next().unwrap(),
            "rank 0: F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 F6.0 B3.0 F7.0 B4.0 B5.0 B6.0 B7.0"
        );
        assert_eq!(
            s.render(false).lines().nth(3).unwrap(),
            "rank 3: F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 F4.0 B4.0 F5.0 B5.0 F6.0 B6.0 F7.0 B7.0"
        );
    }
}
