//! The cost model of one layout ([`estimate`]): bytes on the fullest rank (state from
//! [`crate::memory::state_bytes`], activations of the in-flight micro-batches, transients)
//! and the step time by part ([`StepTime`]), for a model, a cluster and a [`Request`].

use crate::cluster::{ClusterSpec, LinkSpec};
use crate::experts::ep_per_layer;
use crate::layout::{Held, PlannedLayout, ScheduleModel};
use crate::memory::{
    FormulaBytes, activation_bytes, bytes_per_param, gradients_at_peak, held_bytes,
    rank_gradient_copy_bytes, rank_state, transient_bytes,
};
use crate::model::ModelSpec;
use crate::shape::{RankShape, rank_shapes};
use crate::time::{
    KERNELS_EMBEDDING, KERNELS_HEAD, KERNELS_MOE_ROUTING, KERNELS_PER_BLOCK,
    KERNELS_PER_LOCAL_EXPERT, KERNELS_PER_RING_STEP, StepTime, all_gather, all_reduce, p2p,
    ring_transfer,
};
use bonfire_layout::{Axis, MixedPrecision, ParallelDims, ScheduleKind, ZeroStage};

/// What is trained: sequences per step, tokens per sequence, which precisions may be used,
/// and the share of a device's memory a plan may fill.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Sequences per optimizer step, over all replicas.
    pub global_batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The precisions to try.
    pub precisions: Vec<MixedPrecision>,
    /// The fraction of `device.memory` a rank may use (the rest: allocator fragmentation,
    /// the runtime's own buffers).
    pub memory_fraction: f64,
}

/// Bytes on one rank, by part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryParts {
    /// Parameters, gradients, optimizer state (as held after backward).
    pub state: FormulaBytes,
    /// The part of the state's gradients live at the peak ([`gradients_at_peak`]).
    pub peak_grads: f64,
    /// Activations kept for backward at a backward's start ([`activation_bytes`]).
    pub activations: f64,
    /// Beyond the state and the activations at backward's start.
    pub transient: f64,
    /// Beyond the whole state while a micro-batch's gradients are summed into the held ones
    /// and in the optimizer step: gradient copies ([`rank_gradient_copy_bytes`]) and the
    /// activations other micro-batches still hold then.
    pub sum_transient: f64,
    /// The activations the other micro-batches still hold during that sum (0 for the
    /// optimizer step).
    pub sum_activations: f64,
}

impl MemoryParts {
    /// The state live at the peak: parameters, optimizer state and [`Self::peak_grads`].
    pub fn peak_state(&self) -> f64 {
        self.state.params + self.state.optim + self.peak_grads
    }
    /// The peak, the larger of two moments: a backward's start (the state live then, every
    /// held activation, transients) and a gradient sum (the whole state — what
    /// `examples/tests/planner.rs` measures as held after backward —, the copies of the
    /// gradients being summed or stepped on, and the other micro-batches' activations).
    pub fn total(&self) -> f64 {
        self.at_backward().max(self.at_gradient_sum())
    }
    /// The bytes at a backward's start.
    pub fn at_backward(&self) -> f64 {
        self.peak_state() + self.activations + self.transient
    }
    /// The bytes while a micro-batch's gradients are summed (the optimizer step without a
    /// pipeline).
    pub fn at_gradient_sum(&self) -> f64 {
        self.state.total() + self.sum_transient + self.sum_activations
    }
    /// Which moment is the peak, and its parts.
    pub fn describe(&self) -> String {
        use crate::bytes::format_bytes as b;
        if self.at_backward() >= self.at_gradient_sum() {
            format!(
                "at a backward's start: parameters, gradients and optimizer state live then {}, \
                 activations {}, transients {}",
                b(self.peak_state()),
                b(self.activations),
                b(self.transient)
            )
        } else {
            format!(
                "at a gradient sum: parameters, gradients and optimizer state {}, gradient \
                 copies {}, other micro-batches' activations {}",
                b(self.state.total()),
                b(self.sum_transient),
                b(self.sum_activations)
            )
        }
    }
}

/// A layout's predicted cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    /// The layout costed.
    pub layout: ParallelDims,
    /// The fullest rank's bytes, by part.
    pub memory: MemoryParts,
    /// The predicted step time, by part.
    pub time: StepTime,
}

impl Estimate {
    /// The fullest rank's peak bytes ([`MemoryParts::total`]).
    pub fn bytes(&self) -> f64 {
        self.memory.total()
    }
    /// The predicted step time in milliseconds ([`StepTime::total`]).
    pub fn step_ms(&self) -> f64 {
        self.time.total() * 1e3
    }
}

/// The cost of `layout` (which must pass [`crate::PlannedLayout::check_model`]) with its ranks' `shapes`.
pub fn estimate(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    req: &Request,
    layout: &ParallelDims,
    shapes: &[RankShape],
) -> Estimate {
    let model = &model.on_device(&cluster.device);
    let tokens = micro_batch_tokens(req, layout);
    let memory = (0..shapes.len())
        .map(|r| rank_memory(model, req, layout, shapes, r))
        .fold(None::<MemoryParts>, |a, b| match a {
            Some(a) if a.total() >= b.total() => Some(a),
            _ => Some(b),
        })
        .expect("at least one pipeline rank");
    let time = step_time(model, cluster, layout, shapes, (tokens, req.seq));
    Estimate {
        layout: layout.clone(),
        memory,
        time,
    }
}

/// Tokens of one micro-batch on one rank: its replica's sequences (one of dp_replicate × dp),
/// `seq / cp` tokens of each.
fn micro_batch_tokens(req: &Request, layout: &ParallelDims) -> f64 {
    let sequences = req.global_batch / layout.data_replicas() / layout.microbatches();
    (sequences * req.seq) as f64 / layout.cp() as f64
}

/// The bytes of pipeline rank `r` (of `shapes`) under `layout`.
pub fn rank_memory(
    model: &ModelSpec,
    req: &Request,
    layout: &ParallelDims,
    shapes: &[RankShape],
    r: usize,
) -> MemoryParts {
    let (p, m) = (layout.pp(), layout.microbatches());
    let schedule = layout.pp_options.schedule.filter(|_| p > 1);
    let held = schedule.map_or_else(Held::single, |sc| sc.held(p, m, r));
    let s = &shapes[r];
    let tokens = micro_batch_tokens(req, layout);
    let state = rank_state(layout, s.params, s.expert_params);
    let head_rank = s.chunks.iter().any(|c| c.has_head);
    // The DDP engine's running sums of earlier micro-batches' gradients, live at the peak in
    // a pipeline's steady state (beside the reduced buckets the state counts).
    let sums = match schedule {
        Some(sc) if layout.zero == ZeroStage::Zero0 && sc.sums_before_peak(p, m, r) => state.grads,
        _ => 0.0,
    };
    // The gradient sums: the optimizer step (its copies of every gradient, no activation),
    // and, in a pipeline, after each chunk's backward its gradients' copies beside the other
    // micro-batches' activations and, once sums run, the rank's other chunks' running sums
    // (a rank-0 trace of ZB-V on the held-out *small* GPT: its peak is the head chunk's W
    // with the embedding chunk's sums live; derived, the fitted copies are the chunk's own).
    let (at_sum, at_step) = rank_gradient_copy_bytes(layout, (s.params, s.expert_params), &state);
    let chunk_sums = if schedule.is_some() {
        held.one_fewer()
    } else {
        Vec::new()
    };
    let (sum_transient, sum_activations) = chunk_sums
        .into_iter()
        .map(|(c, h)| {
            let share = s.chunks[c].params as f64 / s.params.max(1) as f64;
            let others = held_bytes(model, layout, &s.chunks, &h, tokens, req.seq);
            (at_sum * share + sums * (1.0 - share), others)
        })
        .fold(
            (at_step, 0.0),
            |a, b| if b.0 + b.1 > a.0 + a.1 { b } else { a },
        );
    MemoryParts {
        state,
        peak_grads: gradients_at_peak(layout, &state),
        activations: activation_bytes(model, layout, &s.chunks, &held, tokens, req.seq),
        transient: transient_bytes(model, layout, s.params)
            + sums
            + if head_rank {
                3.0 * tied_table_bytes(model, layout)
            } else {
                0.0
            },
        sum_transient,
        sum_activations,
    }
}

/// Under a pipeline, a tied head's table as it travels between the first stage, which owns
/// it, and the last, which borrows it each step (f32, the rank's tp shard): sent there
/// before the forwards, its gradient sent back after the backwards; the borrowing rank holds
/// its stale initial values, the lent copy and the gradient's sum (`bonfire_module::tied`).
/// Zero otherwise.
pub fn tied_table_bytes(model: &ModelSpec, layout: &ParallelDims) -> f64 {
    match model.tied && layout.pp() > 1 {
        true => (model.vocab_size * model.d_model / layout.tp()) as f64 * 4.0,
        false => 0.0,
    }
}

fn step_time(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    layout: &ParallelDims,
    shapes: &[RankShape],
    (tokens, seq): (f64, usize),
) -> StepTime {
    let m = layout.microbatches() as f64;
    let rate = cluster.device.rate(layout.precision);
    let flops_mb = |s: &RankShape| {
        let recompute = if layout.recomputes() {
            s.block_flops
        } else {
            0.0
        };
        (3.0 * s.flops + recompute) * tokens / rate
    };
    let launch_mb =
        |s: &RankShape| kernels_per_micro_batch(model, layout, s) * cluster.device.launch;
    let per_mb = |s: &RankShape| flops_mb(s) + launch_mb(s);
    let slowest = shapes
        .iter()
        .max_by(|a, b| per_mb(a).total_cmp(&per_mb(b)))
        .expect("at least one pipeline rank");
    let t_mb = per_mb(slowest);
    let compute = m * flops_mb(slowest);
    let launch = m * launch_mb(slowest);
    // The fill and drain: with equal stages (p−1) micro-batch times over the schedule's
    // share of them (its bubble fraction β: idle = β/(1−β) of the compute); with unequal
    // ones every stage but the slowest passes once, `Σ t_r − t_max` in place of (p−1)·t.
    let bubble = match layout.pp_options.schedule.filter(|_| layout.pp() > 1) {
        Some(s) => {
            let beta = s.bubble(layout.pp(), layout.microbatches());
            let others = shapes.iter().map(per_mb).sum::<f64>() - t_mb;
            m * beta / (1.0 - beta) * others / (layout.pp() - 1) as f64
        }
        None => 0.0,
    };
    let ab = layout.precision.param.bytes() as f64;
    let act = tokens * model.d_model as f64 * ab;
    let tp_link = cluster.group_link(layout.tp(), 1);
    let tp_comm = shapes
        .iter()
        .map(|s| {
            let per_block = if layout.recomputes() { 6.0 } else { 4.0 };
            let n = per_block * s.blocks as f64 + if s.has_embedding { 2.0 } else { 0.0 };
            n * all_reduce(act, layout.tp(), tp_link)
        })
        .fold(0.0, f64::max)
        * m;
    let pp_comm = if layout.pp() > 1 {
        let chunks = layout.pp_options.schedule.map_or(1, |s| s.chunks()) as f64;
        let msg = act
            / if layout.tp_options.sequence_parallel {
                layout.tp() as f64
            } else {
                1.0
            };
        let link = cluster.group_link(layout.pp(), layout.replicas() * layout.tp());
        2.0 * chunks * m * p2p(msg, link) + 2.0 * p2p(tied_table_bytes(model, layout), link)
    } else {
        0.0
    };
    let blocks = shapes.iter().map(|s| s.blocks).max().unwrap_or(0) as f64;
    let cp_comm = m * blocks * ring_per_block(model, cluster, layout, tokens, seq);
    let moe_blocks = shapes.iter().map(|s| s.moe_blocks).max().unwrap_or(0) as f64;
    let ep_comm = m * moe_blocks * ep_per_layer(model, cluster, layout, tokens);
    let fullest = shapes
        .iter()
        .max_by_key(|s| s.params)
        .expect("at least one pipeline rank");
    let head = |s: &RankShape| s.chunks.iter().any(|c| c.has_head);
    let layers = shapes
        .iter()
        .map(|s| s.blocks + usize::from(s.has_embedding) + usize::from(head(s)))
        .max();
    let dp = dp_and_optimizer(
        cluster,
        layout,
        fullest,
        layers.unwrap_or(1),
        compute + launch,
    );
    StepTime {
        compute,
        launch,
        bubble,
        tp_comm,
        pp_comm,
        cp_comm,
        ep_comm,
        dp_comm: dp.exposed,
        replica_comm: dp.replica,
        optimizer: dp.optimizer,
        dp_hidden: dp.hidden,
    }
}

/// Seconds of context parallelism's ring one block adds per micro-batch on a rank of
/// `tokens` tokens (its `seq / cp` of each sequence): `cp − 1` transfers of the block's keys
/// and values (`2·tokens·kv_dim/tp` values) in forward, as many of their gradients in
/// backward, and the forward's again when recomputing, each on the cp group's link beside
/// one block of attention — `4·(seq/cp)·d/tp` FLOPs a token forward, twice that backward —
/// which hides it up to the cluster's overlap fraction ([`ring_transfer`]).
fn ring_per_block(
    model: &ModelSpec,
    cluster: &ClusterSpec,
    layout: &ParallelDims,
    tokens: f64,
    seq: usize,
) -> f64 {
    let (cp, tp) = (layout.cp(), layout.tp() as f64);
    if cp <= 1 {
        return 0.0;
    }
    let bytes = 2.0 * tokens * model.kv_dim() as f64 / tp * layout.precision.param.bytes() as f64;
    let rate = cluster.device.rate(layout.precision);
    let forward = 4.0 * (seq / cp) as f64 * model.d_model as f64 / tp * tokens / rate;
    let link = cluster.group_link(cp, layout.tp());
    let step = |compute: f64| ring_transfer(bytes, compute, cluster.overlap, link);
    let passes = step(forward)
        + step(2.0 * forward)
        + if layout.recomputes() {
            step(forward)
        } else {
            0.0
        };
    (cp - 1) as f64 * passes
}

/// Kernels pipeline rank `s` launches for one micro-batch: its pieces' forward kernels
/// ([`KERNELS_PER_BLOCK`], with ring attention [`KERNELS_PER_RING_STEP`] for each of its
/// `cp` steps, with a mixture of experts [`KERNELS_MOE_ROUTING`] and
/// [`KERNELS_PER_LOCAL_EXPERT`] for each of its `E/ep` experts, [`KERNELS_EMBEDDING`],
/// [`KERNELS_HEAD`]), twice as many in backward, and the blocks' forward again when
/// recomputing.
fn kernels_per_micro_batch(model: &ModelSpec, layout: &ParallelDims, s: &RankShape) -> f64 {
    let ring = if layout.cp() > 1 {
        layout.cp() as f64 * KERNELS_PER_RING_STEP
    } else {
        0.0
    };
    let moe = model.moe().map_or(0.0, |m| {
        KERNELS_MOE_ROUTING + (m.experts / layout.ep()) as f64 * KERNELS_PER_LOCAL_EXPERT
    });
    let blocks = s.blocks as f64 * (KERNELS_PER_BLOCK + ring + moe);
    let embedding = if s.has_embedding {
        KERNELS_EMBEDDING
    } else {
        0.0
    };
    let head = if s.chunks.iter().any(|c| c.has_head) {
        KERNELS_HEAD
    } else {
        0.0
    };
    let recompute = if layout.recomputes() { blocks } else { 0.0 };
    3.0 * (blocks + embedding + head) + recompute
}

/// Gradients a data-parallel reduction call carries at most (PyTorch DDP's default bucket,
/// 25 MiB): a rank's gradients take one call per bucket.
pub const BUCKET_BYTES: f64 = 25.0 * 1024.0 * 1024.0;

/// `cost` of `bytes` in calls of at most [`BUCKET_BYTES`] each.
fn bucketed(bytes: f64, cost: impl Fn(f64) -> f64) -> f64 {
    let calls = (bytes / BUCKET_BYTES).ceil().max(1.0);
    calls * cost(bytes / calls)
}

/// A step's data-parallel seconds ([`dp_and_optimizer`]).
#[derive(Debug, Clone, Copy, PartialEq)]
struct DpTime {
    /// The reduction (and ZeRO's gathers) not hidden behind compute.
    exposed: f64,
    /// The part hidden behind compute.
    hidden: f64,
    /// HSDP's all-reduce across the replicas ([`replica_all_reduce`]).
    replica: f64,
    /// The optimizer step on the rank's owned parameters.
    optimizer: f64,
}

/// Data-parallel communication and the optimizer step for the parameters of rank `s` in
/// `layers` pieces (ZeRO-3 gathers each piece in its own call). Without ZeRO, DDP's
/// bucketed all-reduce over every replica (dp_replicate × dp × cp); with ZeRO, its
/// collectives over the shard group (dp × cp, [`PlannedLayout::shard_ranks`], on the link
/// its span needs: inside a node when it fits one) — hidden behind backward (ZeRO-3: forward
/// and backward) up to the cluster's overlap — and, under HSDP, [`replica_all_reduce`]
/// after them. Under ep > 1 the rank's experts go the same way over the dp·cp/ep ranks
/// holding the same experts (ranks `ep·tp` apart), beside the rest over dp × cp. The
/// optimizer steps the rank's owned parameters (Ψ / (dp·cp) under ZeRO, experts Ψₑ/(dp·cp/ep)).
fn dp_and_optimizer(
    cluster: &ClusterSpec,
    layout: &ParallelDims,
    s: &RankShape,
    layers: usize,
    compute: f64,
) -> DpTime {
    let (pb, rb, k) = bytes_per_param(layout.precision);
    let n = if layout.zero == ZeroStage::Zero0 {
        layout.replicas()
    } else {
        layout.shard_ranks()
    };
    let experts = if layout.ep() > 1 { s.expert_params } else { 0 };
    let psi = (s.params - experts) as f64;
    let stride = layout.ep() * layout.tp();
    let (ne, psi_e) = (layout.expert_replicas(), experts as f64);
    let comm = dp_comm(layout, psi, n, cluster.group_link(n, layout.tp()), layers)
        + dp_comm(layout, psi_e, ne, cluster.group_link(ne, stride), layers);
    // ZeRO-3's gathers run beside forward and backward; the others' reductions beside
    // backward (two thirds of the compute).
    let window = if layout.zero == ZeroStage::Zero3 {
        compute
    } else {
        compute * 2.0 / 3.0
    };
    let exposed = (comm - cluster.overlap * window).max(0.0);
    let owned = |psi: f64, n: usize| {
        if layout.zero == ZeroStage::Zero0 || n == 1 {
            psi
        } else {
            psi / n as f64
        }
    };
    DpTime {
        exposed,
        hidden: comm - exposed,
        replica: replica_all_reduce(cluster, layout, psi, psi_e),
        optimizer: (owned(psi, n) + owned(psi_e, ne)) * (pb + rb + 2.0 * k) / cluster.device.mem_bw,
    }
}

/// Seconds of the data-parallel collectives of `psi` parameters over `n` ranks on `link`
/// (see [`dp_and_optimizer`]); 0 for no parameter.
fn dp_comm(layout: &ParallelDims, psi: f64, n: usize, link: &LinkSpec, layers: usize) -> f64 {
    if psi == 0.0 {
        return 0.0;
    }
    let (pb, rb, _) = bytes_per_param(layout.precision);
    let gather = |bytes: f64| bucketed(bytes, |b| all_gather(b, n, link));
    match layout.zero {
        ZeroStage::Zero0 => bucketed(psi * rb, |b| all_reduce(b, n, link)),
        ZeroStage::Zero1 | ZeroStage::Zero2 => gather(psi * rb) + gather(psi * pb),
        ZeroStage::Zero3 => {
            let gathers = if layout.recomputes() { 3.0 } else { 2.0 };
            let per_layer = layers as f64 * all_gather(psi * pb / layers as f64, n, link);
            gathers * per_layer.max(gather(psi * pb)) + gather(psi * rb)
        }
    }
}

/// Seconds of HSDP's all-reduce across the dp_replicate replicas (0 without HSDP): each rank
/// averages its reduced gradient with the ranks holding the same shard — its own range
/// (Ψ/(dp·cp) values, and of its `psi_e` experts' Ψₑ/(dp·cp/ep) under ep) at stages 2–3,
/// the full vectors (Ψ + Ψₑ) at stage 1 (`bonfire_zero`'s `with_replicas`) — in the reduce
/// dtype, on the replica group's link (ranks dp·cp·tp apart: across nodes once the replicas
/// do not fit one). Bonfire runs it after the shard group's reduction, before the step: on
/// the critical path, not hidden.
pub fn replica_all_reduce(
    cluster: &ClusterSpec,
    layout: &ParallelDims,
    psi: f64,
    psi_e: f64,
) -> f64 {
    if !layout.is_hsdp() {
        return 0.0;
    }
    let r = layout.dp_replicate();
    let (_, rb, _) = bytes_per_param(layout.precision);
    let n = layout.shard_ranks();
    let values = match layout.zero {
        ZeroStage::Zero1 => psi + psi_e,
        _ => psi / n as f64 + psi_e / layout.expert_replicas() as f64,
    };
    let link = cluster.group_link(r, n * layout.tp());
    all_reduce(values * rb, r, link)
}

/// Whether `s` is a pipeline schedule the planner tries with `pp` ranks and `m` micro-batches.
pub fn schedule_fits(s: ScheduleKind, pp: usize, m: usize) -> bool {
    match s {
        ScheduleKind::Interleaved { .. } => m.is_multiple_of(pp),
        _ => true,
    }
}

/// The planner's bytes for every world rank of `layout` ([`rank_memory`] of its pipeline
/// stage) training the model `spec` on `req`; `Err` for a layout the planner does not model
/// ([`PlannedLayout::check_model`]) or whose sequences do not cut
/// ([`PlannedLayout::check_sequence`]: `2·cp` chunks).
pub fn predict_ranks(
    spec: &ModelSpec,
    req: &Request,
    layout: &ParallelDims,
) -> Result<Vec<MemoryParts>, String> {
    layout.check_model(spec, req.global_batch)?;
    layout.check_sequence(req.seq)?;
    let shapes = rank_shapes(spec, layout, req.seq);
    Ok((0..layout.world_size())
        .map(|r| rank_memory(spec, req, layout, &shapes, layout.coordinate(r, Axis::Pp)))
        .collect())
}
