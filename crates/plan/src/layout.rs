//! What the planner adds to a layout (`bonfire_layout::ParallelDims`, the trainer's own,
//! searched and costed here as it is): the pieces and parameters each pipeline rank gets and
//! whether a model and a batch admit the layout ([`PlannedLayout`]), and what a schedule
//! implies ([`ScheduleModel`]): its bubble and the micro-batches a rank keeps ([`Held`]).
//! Context parallelism (cp) splits every sequence over cp ranks; parameters are
//! data-parallel over dp_replicate × dp × cp ([`PlannedLayout::replicas`]) and ZeRO shards
//! them over dp × cp ([`PlannedLayout::shard_ranks`]): under HSDP the dp_replicate replicas
//! hold the same shards. Expert parallelism (ep, [`expert_layout`]) splits a mixture of
//! experts' experts over groups of ep consecutive dp × cp ranks; its expert parameters are
//! data-parallel (and ZeRO-sharded) over the dp·cp/ep ranks holding the same experts.

use crate::model::{ModelSpec, stage_ranges};
use bonfire_layout::{Axis, Recompute};

use bonfire_layout::{ParallelDims, ScheduleKind};

/// The schedules the planner tries.
pub const SEARCHED_SCHEDULES: [ScheduleKind; 5] = [
    ScheduleKind::GPipe,
    ScheduleKind::OneFOneB,
    ScheduleKind::Interleaved { chunks: 2 },
    ScheduleKind::ZbH1,
    ScheduleKind::ZbV,
];

/// The planner's model of a [`ScheduleKind`] (the kind itself is `bonfire-layout`'s, shared
/// with the trainer): its bubble and what a rank holds at its fullest moment.
pub trait ScheduleModel {
    /// The idle fraction of a step with equal forward, input-backward and weight-backward
    /// times: the kind's theoretical bubble ([`ScheduleKind::theory_bubble`]) and for ZB-V —
    /// no closed form — the planner's assumption `(p−1)/(6m+p−1)` (ZB-H1's with two chunks).
    fn bubble(&self, p: usize, m: usize) -> f64;
    /// What pipeline rank `rank` of `p` keeps at its fullest moment with `m` micro-batches.
    fn held(&self, p: usize, m: usize, rank: usize) -> Held;
    /// Whether rank `rank`'s fullest moment comes after every chunk's gradients were summed.
    fn sums_before_peak(&self, p: usize, m: usize, rank: usize) -> bool;
}

impl ScheduleModel for ScheduleKind {
    fn bubble(&self, p: usize, m: usize) -> f64 {
        self.theory_bubble(p, m).unwrap_or_else(|| {
            let (p, m) = (p as f64, m as f64);
            (p - 1.0) / (6.0 * m + p - 1.0)
        })
    }

    /// What pipeline rank `rank` of `p` keeps at its fullest moment with `m` micro-batches,
    /// per local chunk — the counts of `bonfire_pipeline`'s generated programs
    /// (`examples/tests/planner.rs` checks them against every schedule for p ≤ 4, m ≤ 16):
    /// GPipe every forward; 1F1B and ZB-H1 Megatron's `p − rank` (capped at `m`); ZB-H1 also
    /// its W's waiting (`2p − 1 − rank` micro-batches may lack their W); ZB-V `2p − 1 − rank`
    /// forwards of its first chunk and `rank + 1` of its second, with the second chunk's W's
    /// waiting when `m` is too small to fill the first; interleaved Megatron's warm-up of
    /// `(v−1)·p + 2(p−1) + 1` chunk-forwards spread over the chunks (rank 0's, for every rank).
    fn held(&self, p: usize, m: usize, rank: usize) -> Held {
        let one = |f: usize, w: usize| Held {
            forwards: vec![f as f64],
            weights: vec![w as f64],
        };
        match *self {
            Self::GPipe => one(m, 0),
            Self::OneFOneB => one(m.min(p - rank), 0),
            Self::ZbH1 => {
                let f = m.min(p - rank);
                one(f, (2 * p - 1 - rank - f).min(m - f))
            }
            Self::ZbV => {
                let (f0, f1) = (m.min(2 * p - 1 - rank), m.min(rank + 1));
                Held {
                    forwards: vec![f0 as f64, f1 as f64],
                    weights: vec![0.0, (2 * p - f0 - f1).min(m - f1) as f64],
                }
            }
            Self::Interleaved { chunks: v } => {
                let warm = ((v - 1) * p + 2 * (p - 1) + 1) as f64 / v as f64;
                Held {
                    forwards: vec![warm.min(m as f64); v],
                    weights: vec![0.0; v],
                }
            }
        }
    }

    /// Whether rank `rank`'s fullest moment comes after every chunk's gradients were summed
    /// once, so that the running sums are live beside the held micro-batches: never under
    /// GPipe (its forwards all precede the backwards); under 1F1B and interleaved once a
    /// forward follows the first backward (`m > p − rank`); under ZB-H1 and ZB-V, whose sums
    /// wait for W, from `m ≥ 2p − rank` (the generated programs' counts for p ≤ 4, m ≤ 16,
    /// checked in `examples/tests/planner.rs`).
    fn sums_before_peak(&self, p: usize, m: usize, rank: usize) -> bool {
        match self {
            Self::GPipe => false,
            Self::OneFOneB | Self::Interleaved { .. } => m > p - rank,
            Self::ZbH1 | Self::ZbV => m >= 2 * p - rank,
        }
    }
}

/// Micro-batches a pipeline rank keeps, per local chunk: `forwards` whose backward (B) has
/// not run (every activation), and `weights` whose B ran and whose deferred W has not (the
/// linear layers' inputs and output gradients).
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    /// Per chunk, micro-batches whose backward (B) has not run.
    pub forwards: Vec<f64>,
    /// Per chunk, micro-batches whose B ran and whose deferred W has not.
    pub weights: Vec<f64>,
}

impl Held {
    /// One micro-batch, no pipeline.
    pub fn single() -> Self {
        Self {
            forwards: vec![1.0],
            weights: vec![0.0],
        }
    }

    /// What is held while one micro-batch's gradients are summed in: the others — one W
    /// fewer on some chunk where W's wait (zero-bubble schedules sum at W), else one forward
    /// fewer (the backward that just ran); every possibility, with the chunk whose
    /// micro-batch it was.
    pub fn one_fewer(&self) -> Vec<(usize, Held)> {
        let waiting = self.weights.iter().any(|&w| w >= 1.0);
        let counts = if waiting {
            &self.weights
        } else {
            &self.forwards
        };
        (0..counts.len())
            .filter(|&c| counts[c] >= 1.0)
            .map(|c| {
                let mut h = self.clone();
                let v = if waiting {
                    &mut h.weights
                } else {
                    &mut h.forwards
                };
                v[c] -= 1.0;
                (c, h)
            })
            .collect()
    }
}

/// The planner's questions about a layout.
pub trait PlannedLayout {
    /// The pieces pipeline rank `pp_rank` runs, per local chunk (every piece in one chunk
    /// without a pipeline).
    fn chunk_pieces(&self, model: &ModelSpec, pp_rank: usize) -> Vec<Vec<usize>>;
    /// The pieces pipeline rank `pp_rank` runs.
    fn rank_pieces(&self, model: &ModelSpec, pp_rank: usize) -> Vec<usize> {
        self.chunk_pieces(model, pp_rank).concat()
    }
    /// This rank's parameters before ZeRO: its tp shard of its pipeline pieces.
    fn rank_params(&self, model: &ModelSpec, pp_rank: usize) -> usize;
    /// Whether every layer recomputes its activations in backward.
    fn recomputes(&self) -> bool;
    /// The ranks a parameter is replicated over and its gradients averaged over:
    /// dp_replicate × dp × cp (cp ranks hold the same parameters).
    fn replicas(&self) -> usize;
    /// The ranks ZeRO shards a parameter's state over (its *shard group*): dp × cp. Under
    /// HSDP (dp_replicate > 1) each of the dp_replicate replicas holds the same shards and
    /// all-reduces its reduced gradient shard across them; without ZeRO every one of the
    /// [`Self::replicas`] holds everything.
    fn shard_ranks(&self) -> usize;
    /// Whether sequences of `seq` tokens cut under the layout: into `2·cp` equal chunks
    /// (the balanced split of `bonfire_cp::ContextSplit`), and a rank's
    /// `seq / cp` tokens over tp under sequence parallelism. `Err` says what does not.
    fn check_sequence(&self, seq: usize) -> Result<(), String>;
    /// Whether the planner can cost the layout for `model` on `global_batch` sequences:
    /// options it models (no offload, no split points, checkpointing off or every layer,
    /// loss parallelism exactly when tp > 1, HSDP with a dp or cp axis to shard over, ep
    /// only for a mixture of experts, dividing its experts and dp × cp, without HSDP or
    /// sequence parallelism) and
    /// shapes that fit (tp divides the heads, key/value heads, d_ff and the vocabulary; each
    /// stage gets a piece; the batch splits into dp_replicate × dp replicas and
    /// micro-batches). `Err` says what does not.
    fn check_model(&self, model: &ModelSpec, global_batch: usize) -> Result<(), String>;
    /// One `key=value` line: `dp=… cp=… zero=… tp=… sp=… pp=… schedule=… microbatches=…
    /// recompute=… precision=… reduce=…`, led by `dp_replicate=…` when it is above 1.
    fn record(&self) -> String;
}

impl PlannedLayout for ParallelDims {
    fn chunk_pieces(&self, model: &ModelSpec, pp_rank: usize) -> Vec<Vec<usize>> {
        let Some(schedule) = self.pp_options.schedule.filter(|_| self.pp() > 1) else {
            return vec![(0..model.pieces()).collect()];
        };
        let points = self
            .pp_options
            .default_split(model.pieces(), schedule, self.pp());
        let ranges = stage_ranges(model.pieces(), self.pp() * schedule.chunks(), Some(&points));
        (0..schedule.chunks())
            .map(|c| {
                let (a, b) = ranges[schedule.stage(self.pp(), pp_rank, c)];
                (a..b).collect()
            })
            .collect()
    }

    fn rank_params(&self, model: &ModelSpec, pp_rank: usize) -> usize {
        self.rank_pieces(model, pp_rank)
            .into_iter()
            .map(|p| model.piece_params(self.tp(), p))
            .sum()
    }

    fn recomputes(&self) -> bool {
        self.recompute.is_on()
    }

    fn replicas(&self) -> usize {
        self.data_replicas() * self.cp()
    }

    fn shard_ranks(&self) -> usize {
        self.dp() * self.cp()
    }

    fn check_sequence(&self, seq: usize) -> Result<(), String> {
        let cp = self.cp();
        if !seq.is_multiple_of(2 * cp) {
            return Err(format!(
                "a sequence of {seq} tokens does not cut into 2·cp = {} equal chunks (cp = {cp})",
                2 * cp
            ));
        }
        if self.tp_options.sequence_parallel && !(seq / cp).is_multiple_of(self.tp()) {
            return Err(format!(
                "sequence parallelism: {} tokens per cp rank do not split over tp={}",
                seq / cp,
                self.tp()
            ));
        }
        Ok(())
    }

    fn check_model(&self, model: &ModelSpec, global_batch: usize) -> Result<(), String> {
        if self.is_hsdp() && self.shard_ranks() == 1 {
            return Err(format!(
                "HSDP (dp_replicate={}) with ZeRO needs a dp or cp axis to shard over",
                self.dp_replicate()
            ));
        }
        if self.offload {
            return Err("the planner does not model ZeRO-Offload".into());
        }
        if self.pp_options.split_points.is_some() {
            return Err(
                "the planner splits pipelines evenly or by piece costs: no split points".into(),
            );
        }
        if let Some(costs) = &self.pp_options.piece_costs
            && costs.len() != model.pieces()
        {
            return Err(format!(
                "{} piece costs for the model's {} pipeline pieces",
                costs.len(),
                model.pieces()
            ));
        }
        if !matches!(self.recompute, Recompute::Off | Recompute::Every(1)) {
            return Err(format!(
                "the planner models activation checkpointing of every layer or none, not {}",
                self.recompute
            ));
        }
        check_experts(self, model)?;
        let t = self.tp();
        if self.tp_options.loss_parallel != (t > 1) {
            return Err(format!(
                "the planner models loss parallelism exactly when tp > 1 (tp={t})"
            ));
        }
        let moe = model.moe().unwrap_or_default();
        for (name, n) in [
            ("n_heads", model.n_heads),
            ("n_kv_heads", model.n_kv_heads),
            ("d_ff", model.d_ff),
            ("vocab_size", model.vocab_size),
            ("shared_ff", moe.shared_ff),
            ("dense_ff", moe.dense_ff),
        ] {
            // A mixture of experts' experts are whole on every tp rank.
            if name == "d_ff" && model.moe().is_some() {
                continue;
            }
            if n % t != 0 {
                return Err(format!("tp={t} does not divide {name} {n}"));
            }
        }
        let chunks = self.pp_options.schedule.map_or(1, |s| s.chunks());
        if self.pp() * chunks > model.pieces() {
            return Err(format!(
                "{} stages for {} pieces",
                self.pp() * chunks,
                model.pieces()
            ));
        }
        if !global_batch.is_multiple_of(self.data_replicas() * self.microbatches()) {
            let replicate = match self.dp_replicate() {
                1 => String::new(),
                r => format!("dp_replicate={r} × "),
            };
            return Err(format!(
                "the global batch {global_batch} does not split into {replicate}dp={} × {} \
                 micro-batches",
                self.dp(),
                self.microbatches()
            ));
        }
        Ok(())
    }

    fn record(&self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        let replicate = match self.dp_replicate() {
            1 => String::new(),
            r => format!("dp_replicate={r} "),
        };
        let ep = match self.ep() {
            1 => String::new(),
            e => format!(" ep={e}"),
        };
        format!(
            "{replicate}dp={} cp={}{ep} zero={} tp={} sp={} pp={} schedule={} microbatches={} \
             recompute={} precision={} reduce={}",
            self.dp(),
            self.cp(),
            self.zero.index(),
            self.tp(),
            on(self.tp_options.sequence_parallel),
            self.pp(),
            self.pp_options.schedule.map_or("none".into(), |s| s.name()),
            self.microbatches(),
            on(self.recomputes()),
            self.precision.param.name(),
            self.precision.reduce.name(),
        )
    }
}

/// Expert parallelism as the planner models it: ep only for a mixture of experts, dividing
/// its E experts and borrowing its ranks from dp × cp (which it must divide; under HSDP inside
/// each replica — `ParallelDims::validate`'s rules); no sequence parallelism for a mixture of
/// experts (Bonfire's Mixtral refuses it: its router and experts are replicated over tp).
fn check_experts(l: &ParallelDims, model: &ModelSpec) -> Result<(), String> {
    let ep = l.ep();
    let Some(moe) = model.moe() else {
        return match ep {
            1 => Ok(()),
            _ => Err(format!(
                "ep={ep} needs a mixture of experts ({} is dense)",
                model.name
            )),
        };
    };
    if l.tp_options.sequence_parallel {
        return Err(
            "sequence parallelism is not modelled for a mixture of experts (Bonfire's Mixtral \
             replicates its router and experts over tp)"
                .into(),
        );
    }
    if moe.experts % ep != 0 {
        return Err(format!(
            "ep={ep} does not divide the {} experts",
            moe.experts
        ));
    }
    let ranks = l.dp() * l.cp();
    if !ranks.is_multiple_of(ep) {
        return Err(format!(
            "ep={ep} does not divide dp × cp = {ranks}, whose ranks it borrows"
        ));
    }
    Ok(())
}

/// [`context_layout`] with each group of `ep` consecutive dp × cp ranks splitting a mixture
/// of experts' experts (ep borrows its ranks from dp × cp: no more ranks).
pub fn expert_layout(dp: usize, cp: usize, ep: usize, tp: usize, pp: usize) -> ParallelDims {
    context_layout(dp, cp, tp, pp).with_degree(Axis::Ep, ep)
}

/// The layout the planner starts from for a (dp, tp, pp): DDP in f32, loss parallelism on
/// tp (as the planner models it), nothing else (cp = 1; [`context_layout`] adds it).
pub fn base_layout(dp: usize, tp: usize, pp: usize) -> ParallelDims {
    ParallelDims::new()
        .with_degree(Axis::Dp, dp)
        .with_degree(Axis::Tp, tp)
        .with_degree(Axis::Pp, pp)
        .with_loss_parallel(tp > 1)
}

/// [`base_layout`] with the sequences split over `cp` ranks (mesh `[pp, dp, cp, tp]`).
pub fn context_layout(dp: usize, cp: usize, tp: usize, pp: usize) -> ParallelDims {
    base_layout(dp, tp, pp).with_degree(Axis::Cp, cp)
}

/// HSDP: `replicate` replicas (the `dp_replicate` axis, outside dp: mesh
/// `[pp, dp_replicate, dp, cp, tp]`) of [`context_layout`]'s layout, each holding the same
/// ZeRO shards over its dp × cp ranks; set a ZeRO stage (1–3) on it.
pub fn hsdp_layout(replicate: usize, dp: usize, cp: usize, tp: usize, pp: usize) -> ParallelDims {
    context_layout(dp, cp, tp, pp).with_degree(Axis::DpReplicate, replicate)
}
