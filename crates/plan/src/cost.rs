//! The cost model of one layout ([`estimate`]): bytes on the fullest rank (state from
//! [`crate::memory::state_bytes`], activations of the in-flight micro-batches, transients)
//! and the step time by part ([`StepTime`]), for a model, a cluster and a [`Request`].

use crate::cluster::ClusterSpec;
use crate::layout::{Layout, Precision, Schedule, ZeroStage};
use crate::memory::{
    FormulaBytes, activation_bytes, bytes_per_param, gradients_at_peak, state_bytes,
    transient_bytes,
};
use crate::model::ModelSpec;
use crate::time::{StepTime, all_gather, all_reduce, p2p};

/// What is trained: sequences per step, tokens per sequence, which precisions may be used,
/// and the share of a device's memory a plan may fill.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Sequences per optimizer step, over all replicas.
    pub global_batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The precisions to try.
    pub precisions: Vec<Precision>,
    /// The fraction of `device.memory` a rank may use (the rest: allocator fragmentation,
    /// the runtime's own buffers).
    pub memory_fraction: f64,
}

/// One pipeline rank's share of the model under a (tp, pp, schedule).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankShape {
    /// Parameters (its tp shard of its pieces).
    pub params: usize,
    /// Transformer blocks it runs.
    pub blocks: usize,
    /// Whether it runs piece 0 (the embeddings).
    pub has_embedding: bool,
    /// Whether it runs the head (and the loss).
    pub has_head: bool,
    /// Forward FLOPs per token of its pieces, and of its blocks alone.
    pub flops: f64,
    pub block_flops: f64,
}

/// Every pipeline rank's [`RankShape`] for `layout`'s tp, pp and schedule.
pub fn rank_shapes(model: &ModelSpec, layout: &Layout, seq: usize) -> Vec<RankShape> {
    (0..layout.pp)
        .map(|r| {
            let pieces = layout.rank_pieces(model, r);
            let is_block = |p: &usize| *p >= 1 && *p <= model.n_layers;
            let flops = |p: &usize| model.piece_flops_per_token(layout.tp, *p, seq);
            RankShape {
                params: pieces
                    .iter()
                    .map(|p| model.piece_params(layout.tp, *p))
                    .sum(),
                blocks: pieces.iter().filter(|p| is_block(p)).count(),
                has_embedding: pieces.contains(&0),
                has_head: pieces.contains(&(model.n_layers + 1)),
                flops: pieces.iter().map(flops).sum(),
                block_flops: pieces.iter().filter(|p| is_block(p)).map(flops).sum(),
            }
        })
        .collect()
}

/// Bytes on one rank, by part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryParts {
    /// Parameters, gradients, optimizer state (as held after backward).
    pub state: FormulaBytes,
    /// The part of the state's gradients live at the peak ([`gradients_at_peak`]).
    pub peak_grads: f64,
    pub activations: f64,
    pub transient: f64,
}

impl MemoryParts {
    /// The state live at the peak: parameters, optimizer state and [`Self::peak_grads`].
    pub fn peak_state(&self) -> f64 {
        self.state.params + self.state.optim + self.peak_grads
    }
    /// The peak, the larger of two moments: backward's start (the state live then, every
    /// activation kept, transients) and backward's end (the whole state, gradients made,
    /// activations freed — what `examples/tests/planner.rs` measures as held).
    pub fn total(&self) -> f64 {
        let start = self.peak_state() + self.activations + self.transient;
        start.max(self.state.total())
    }
}

/// A layout's predicted cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub layout: Layout,
    /// The fullest rank's bytes, by part.
    pub memory: MemoryParts,
    pub time: StepTime,
}

impl Estimate {
    pub fn bytes(&self) -> f64 {
        self.memory.total()
    }
    pub fn step_ms(&self) -> f64 {
        self.time.total() * 1e3
    }
}

/// The cost of `layout` (which must pass [`Layout::check`]) with its ranks' `shapes`.
pub fn estimate(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    req: &Request,
    layout: &Layout,
    shapes: &[RankShape],
) -> Estimate {
    let m = layout.microbatches;
    let tokens = (req.global_batch / layout.dp / m * req.seq) as f64;
    let in_flight = match layout.schedule.filter(|_| layout.pp > 1) {
        Some(s) => s.in_flight(layout.pp, m),
        None => 1.0,
    };
    let memory = shapes
        .iter()
        .map(|s| {
            let state = state_bytes(layout.zero, s.params, layout.dp, layout.precision, false);
            MemoryParts {
                state,
                peak_grads: gradients_at_peak(layout, &state),
                activations: activation_bytes(
                    model, layout, s.blocks, s.has_head, tokens, req.seq, in_flight,
                ),
                transient: transient_bytes(model, layout, s.params),
            }
        })
        .fold(None::<MemoryParts>, |a, b| match a {
            Some(a) if a.total() >= b.total() => Some(a),
            _ => Some(b),
        })
        .expect("at least one pipeline rank");
    let time = step_time(model, cluster, layout, shapes, tokens);
    Estimate {
        layout: layout.clone(),
        memory,
        time,
    }
}

fn step_time(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    layout: &Layout,
    shapes: &[RankShape],
    tokens: f64,
) -> StepTime {
    let m = layout.microbatches as f64;
    let rate = cluster.device.rate(layout.precision);
    let per_mb = |s: &RankShape| {
        let recompute = if layout.recompute { s.block_flops } else { 0.0 };
        (3.0 * s.flops + recompute) * tokens / rate
    };
    let t_mb = shapes.iter().map(per_mb).fold(0.0, f64::max);
    let compute = m * t_mb;
    let bubble = match layout.schedule.filter(|_| layout.pp > 1) {
        Some(s) => {
            let beta = s.bubble(layout.pp, layout.microbatches);
            compute * beta / (1.0 - beta)
        }
        None => 0.0,
    };
    let ab = layout.precision.param_bytes as f64;
    let act = tokens * model.d_model as f64 * ab;
    let tp_link = cluster.group_link(layout.tp, 1);
    let tp_comm = shapes
        .iter()
        .map(|s| {
            let per_block = if layout.recompute { 6.0 } else { 4.0 };
            let n = per_block * s.blocks as f64 + if s.has_embedding { 2.0 } else { 0.0 };
            n * all_reduce(act, layout.tp, tp_link)
        })
        .fold(0.0, f64::max)
        * m;
    let pp_comm = if layout.pp > 1 {
        let chunks = layout.schedule.map_or(1, |s| s.chunks()) as f64;
        let msg = act / if layout.sp { layout.tp as f64 } else { 1.0 };
        let link = cluster.group_link(layout.pp, layout.dp * layout.tp);
        2.0 * chunks * m * p2p(msg, link)
    } else {
        0.0
    };
    let psi = shapes.iter().map(|s| s.params).max().unwrap_or(0) as f64;
    let (dp_comm, dp_hidden, optimizer) = dp_and_optimizer(cluster, layout, psi, compute);
    StepTime {
        compute,
        bubble,
        tp_comm,
        pp_comm,
        dp_comm,
        optimizer,
        dp_hidden,
    }
}

/// Exposed and hidden data-parallel communication, and the optimizer step, for `psi`
/// parameters a rank.
fn dp_and_optimizer(
    cluster: &ClusterSpec,
    layout: &Layout,
    psi: f64,
    compute: f64,
) -> (f64, f64, f64) {
    let (pb, rb, k) = bytes_per_param(layout.precision);
    let n = layout.dp;
    let link = cluster.group_link(n, layout.tp);
    let comm = match layout.zero {
        ZeroStage::Z0 => all_reduce(psi * rb, n, link),
        ZeroStage::Z1 | ZeroStage::Z2 => {
            all_gather(psi * rb, n, link) + all_gather(psi * pb, n, link)
        }
        ZeroStage::Z3 => {
            let gathers = if layout.recompute { 3.0 } else { 2.0 };
            gathers * all_gather(psi * pb, n, link) + all_gather(psi * rb, n, link)
        }
    };
    // ZeRO-3's gathers run beside forward and backward; the others' reductions beside
    // backward (two thirds of the compute).
    let window = if layout.zero == ZeroStage::Z3 {
        compute
    } else {
        compute * 2.0 / 3.0
    };
    let exposed = (comm - cluster.overlap * window).max(0.0);
    let owned = if layout.zero == ZeroStage::Z0 || n == 1 {
        psi
    } else {
        psi / n as f64
    };
    let optimizer = owned * (pb + rb + 2.0 * k) / cluster.device.mem_bw;
    (exposed, comm - exposed, optimizer)
}

/// Whether `s` is a pipeline schedule the planner tries with `pp` ranks and `m` micro-batches.
pub fn schedule_fits(s: Schedule, pp: usize, m: usize) -> bool {
    match s {
        Schedule::Interleaved { .. } => m % pp == 0,
        _ => true,
    }
}
