//! Bytes per rank. The one owner of the ZeRO paper's formula ([`formula`]: parameters,
//! gradients and optimizer state that a rank should hold, which `cargo xtask bench memory`
//! checks against a counting allocator), of what Bonfire's engines actually hold
//! ([`state_bytes`]: the formula with the two departures that table measured), and of the
//! rest of a rank's peak: the activations its in-flight micro-batches keep
//! ([`activation_bytes`], per token of the rank's share of each sequence: [`block_elems`]) and the transient buffers of backward and the optimizer step
//! ([`transient_bytes`]). Under expert parallelism a rank's experts' state is sharded over
//! the ranks holding the same experts ([`rank_state`]).

use crate::layout::{Held, PlannedLayout};
use crate::model::ModelSpec;
use crate::shape::ChunkShape;
use bonfire_layout::{MixedPrecision, ParallelDims, ZeroStage};

/// Bytes one rank holds, by part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FormulaBytes {
    /// Parameters (the rank's shard under ZeRO-3).
    pub params: f64,
    /// Gradients (in the reduce dtype).
    pub grads: f64,
    /// Optimizer state (and the fp32 master under mixed precision).
    pub optim: f64,
}

impl FormulaBytes {
    /// Parameters, gradients and optimizer state together.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optim
    }
}

/// Per-parameter bytes of `precision`: (param pb, reduced gradient rb, optimizer K). K is 8
/// for Adam's two fp32 moments, 12 with the fp32 master of a half param dtype.
pub fn bytes_per_param(precision: MixedPrecision) -> (f64, f64, f64) {
    let pb = precision.param.bytes() as f64;
    let rb = precision.reduce.bytes() as f64;
    let k = if precision.is_mixed() { 12.0 } else { 8.0 };
    (pb, rb, k)
}

/// The ZeRO paper's bytes per rank for `psi` parameters (this rank's, after tensor and
/// pipeline sharding) on `n` data-parallel ranks with Adam under `precision`:
/// stage 0 Ψpb + Ψrb + ΨK; 1 Ψpb + Ψrb + ΨK/N; 2 Ψpb + Ψrb/N + ΨK/N; 3 (Ψpb + Ψrb + ΨK)/N.
pub fn formula(stage: ZeroStage, psi: usize, n: usize, precision: MixedPrecision) -> FormulaBytes {
    let (pb, rb, k) = bytes_per_param(precision);
    let (psi, n) = (psi as f64, n as f64);
    let (p, g, o) = (psi * pb, psi * rb, psi * k);
    let (p, g, o) = match stage {
        ZeroStage::Zero0 => (p, g, o),
        ZeroStage::Zero1 => (p, g, o / n),
        ZeroStage::Zero2 => (p, g / n, o / n),
        ZeroStage::Zero3 => (p / n, g / n, o / n),
    };
    FormulaBytes {
        params: p,
        grads: g,
        optim: o,
    }
}

/// What Bonfire's engine holds for `psi` parameters on `n` dp ranks: the formula, except
/// that ZeRO-3 under mixed precision keeps one fp32 shard (the master, gathered in the half
/// type) instead of a half shard beside it (16/N bytes a parameter, not 18/N), and that
/// offload keeps an fp32 master of the rank's range even in f32 (K = 12). Measured in
/// `docs/zero.md`: within 0.3 % for every layout of `bench memory` but DDP (0.94: reduced
/// buffers charged to the communication thread).
pub fn state_bytes(
    stage: ZeroStage,
    psi: usize,
    n: usize,
    precision: MixedPrecision,
    offload: bool,
) -> FormulaBytes {
    let mut f = formula(stage, psi, n, precision);
    let (psi, n) = (psi as f64, n as f64);
    if stage == ZeroStage::Zero3 && precision.is_mixed() {
        f.params = psi * 4.0 / n;
        f.optim = psi * 8.0 / n;
    }
    if offload && !precision.is_mixed() && stage != ZeroStage::Zero0 {
        f.optim += psi * 4.0 / n;
    }
    f
}

/// What a rank holding `params` parameters under `layout` holds ([`state_bytes`]), of
/// which `experts` are a mixture of experts' (its `E/ep` experts): under ep > 1 those are
/// data-parallel over the dp·cp/ep ranks holding the same experts
/// (`ParallelDims::expert_replicas`) — ZeRO shards their state over those, at stage 3
/// their values too (Bonfire's ZeRO-3 gathers a layer's experts over their replicas) — and
/// the rest over dp × cp
/// ([`PlannedLayout::shard_ranks`]) as without ep. With ep = 1 every parameter is dp × cp's.
pub fn rank_state(layout: &ParallelDims, params: usize, experts: usize) -> FormulaBytes {
    let state = |psi, n| state_bytes(layout.zero, psi, n, layout.precision, false);
    if layout.ep() == 1 || experts == 0 {
        return state(params, layout.shard_ranks());
    }
    let (d, e) = (
        state(params - experts, layout.shard_ranks()),
        state(experts, layout.expert_replicas()),
    );
    FormulaBytes {
        params: d.params + e.params,
        grads: d.grads + e.grads,
        optim: d.optim + e.optim,
    }
}

/// The gradient bytes of `state` live at the step's peak (backward's start, every
/// activation kept): all of them where the reduced gradients outlive the step (DDP's
/// buckets; the single-replica engines of tp and pp layouts, measured) and under ZeRO-3,
/// whose rank holds its whole state's bytes between steps — a shard-sized buffer beside the
/// parameter shard and the optimizer state where the next gradient shard will be (measured:
/// the bytes live at a forward's start equal those held after backward from the third step
/// on, on the fit set's bench GPT and the held-out shapes alike; the second step holds one
/// shard more, the first step's). None under ZeRO-1/2: they take their averaged gradients in
/// the optimizer step, and stage 2 reduce-scatters the next ones during backward, as the
/// activations are freed.
pub fn gradients_at_peak(layout: &ParallelDims, state: &FormulaBytes) -> f64 {
    match layout.zero {
        ZeroStage::Zero0 | ZeroStage::Zero3 => state.grads,
        ZeroStage::Zero1 | ZeroStage::Zero2 => 0.0,
    }
}

/// What one pipeline rank keeps for backward, in bytes, for micro-batches of `tokens`
/// tokens (sequences of `seq`) with `held` of them in flight per local chunk (or one, without
/// a pipeline): [`held_bytes`], and while a backward runs one block's activations as it is
/// recomputed and, on the rank with the head, one more logits-sized buffer at the loss
/// ([`LOSS_BUFFERS`]); under a half param dtype also the half-precision logits the f32 ones
/// are cast from.
pub fn activation_bytes(
    model: &ModelSpec,
    layout: &ParallelDims,
    chunks: &[ChunkShape],
    held: &Held,
    tokens: f64,
    seq: usize,
) -> f64 {
    let mut bytes = held_bytes(model, layout, chunks, held, tokens, seq);
    if layout.recomputes() && chunks.iter().any(|c| c.blocks > 0) {
        let ab = layout.precision.param.bytes() as f64;
        bytes += block_elems(model, layout, seq) * tokens * ab;
    }
    if chunks.iter().any(|c| c.has_head) {
        bytes += head_loss_bytes(model, layout, tokens);
    }
    bytes
}

/// The head's bytes at the loss beyond what it keeps ([`head_kept_bytes`]). Unfused,
/// [`LOSS_BUFFERS`] logits-sized f32 buffers; under a half param dtype the head's logits come
/// out in it and are cast to f32 for the loss, the half copy live beside the f32 ones
/// (derived, not fitted). Fused ([`fused_rows`]), one block's: its f32 logits, which the
/// cross-entropy's gradient overwrites (the block's `dlogits`), and under a half dtype the
/// product's output in it and the gradient cast back to it (derived from
/// `bonfire_kernels::linear_cross_entropy`); and under a half dtype, where backward starts,
/// the weight's gradient scaled out of the kept one (`V × d` in it) and its cast to the f32
/// master's (`V × d` f32) while every activation is still kept — in f32 the scaling is in
/// place and the gradient is the master's (derived, not fitted; the unfused head's like
/// buffers are inside its fitted [`LOSS_BUFFERS`]).
pub fn head_loss_bytes(model: &ModelSpec, layout: &ParallelDims, tokens: f64) -> f64 {
    let (mixed, ab) = (
        layout.precision.is_mixed(),
        layout.precision.param.bytes() as f64,
    );
    let half = if mixed { ab / 4.0 } else { 0.0 };
    match fused_rows(model, layout, tokens) {
        None => (LOSS_BUFFERS + half) * logits_bytes(model, layout, tokens),
        Some(rows) => {
            let weight_grad = match mixed {
                true => (ab + 4.0) * (model.vocab_size * model.d_model) as f64,
                false => 0.0,
            };
            (1.0 + 2.0 * half) * logits_bytes(model, layout, rows) + weight_grad
        }
    }
}

/// The rows of a block of the head fused with its loss under `layout`, at most a micro-batch's
/// `tokens`: [`ModelSpec::fused_loss_rows`] where the head is not tp-sharded (the models run a
/// sharded head unfused); `None`: unfused.
pub fn fused_rows(model: &ModelSpec, layout: &ParallelDims, tokens: f64) -> Option<f64> {
    let rows = model.fused_loss_rows.filter(|_| layout.tp() == 1)?;
    Some((rows as f64).min(tokens))
}

/// What the head keeps from a micro-batch's forward to its backward: unfused its f32 logits
/// (`N × V/tp`); fused ([`fused_rows`]) the gradients of its input and its weight for a loss
/// gradient of 1 (`N × d` and `V × d` in the compute dtype) instead — less where the
/// micro-batch's `N` tokens outnumber the width `d`.
pub fn head_kept_bytes(model: &ModelSpec, layout: &ParallelDims, tokens: f64) -> f64 {
    match fused_rows(model, layout, tokens) {
        None => logits_bytes(model, layout, tokens),
        Some(_) => {
            let ab = layout.precision.param.bytes() as f64;
            (model.vocab_size as f64 + tokens) * model.d_model as f64 * ab
        }
    }
}

/// Logits-sized f32 buffers live at the loss beside the kept logits, with or without tp:
/// one. The fused cross-entropy writes its gradient into the logits it keeps (a buffer
/// nothing else holds: the head's output without tp, the vocabulary-parallel loss's padded
/// copy of the rank's slice under tp); the one counted is what the loss and the head's
/// backward leave live beside it, fitted on the fit set (`examples/tests/planner.rs`).
/// Without tp it was two until 2026-12-05, when every f32 product on the CPU backend wrote
/// its output through a zero-filled buffer copied into an aligned one — two logits-sized
/// buffers for a moment at the head's forward; `bonfire_kernels::matmul` now writes it once
/// (docs/planner.md, "The f32 products written once"). Under tp it was three until the
/// vocabulary-parallel loss became the fused cross-entropy (2026-12-05, derived).
pub const LOSS_BUFFERS: f64 = 1.0;

/// Elements a block keeps per token of a rank under `layout` for sequences of `seq` tokens:
/// [`ModelSpec::block_activation_elems`] and, under context parallelism, what ring attention
/// keeps beyond it ([`ModelSpec::ring_attention_elems`]). The rank holds `seq / cp` tokens of
/// each sequence (the caller's token count), each attending over all `seq`. Counted in
/// elements of the compute dtype: ring attention's probabilities are f32 under a 16-bit one,
/// each `4 / bytes` such elements ([`ModelSpec::ring_score_elems`]). Attention as it runs
/// under the layout's dtype ([`ModelSpec::attention_under`]).
pub fn block_elems(model: &ModelSpec, layout: &ParallelDims, seq: usize) -> f64 {
    let (tp, cp) = (layout.tp(), layout.cp());
    let bytes = layout.precision.param.bytes();
    let model = &ModelSpec {
        attention: model.attention_under(bytes),
        ..model.clone()
    };
    let widened = 4.0 / bytes as f64 - 1.0;
    model.block_activation_elems(tp, layout.tp_options.sequence_parallel, seq)
        + model.ring_attention_elems(tp, cp, seq)
        + widened * model.ring_score_elems(tp, cp, seq)
}

/// The f32 logits of one micro-batch on one tp rank (the vocabulary split by the parallel
/// loss).
fn logits_bytes(model: &ModelSpec, layout: &ParallelDims, tokens: f64) -> f64 {
    model.vocab_size as f64 / layout.tp() as f64 * tokens * 4.0
}

/// The bytes of the micro-batches `held` per chunk. For each chunk: per micro-batch whose
/// backward has not run, its blocks' activations ([`ModelSpec::block_activation_elems`]) —
/// or, recomputing, each block's input only — and, with the head, the kept
/// log-probabilities; per micro-batch waiting for its deferred weight gradients, the linear
/// layers' inputs and output gradients ([`ModelSpec::block_weight_grad_elems`]; the head's
/// are its input and the logits' gradient; a recomputed block computes its weight gradients
/// in backward and keeps none) and the gradients B produced (embeddings, norms, biases; a
/// recomputed block's weights), summed in only at W. Activations are in the compute dtype,
/// the logits in f32.
pub fn held_bytes(
    model: &ModelSpec,
    layout: &ParallelDims,
    chunks: &[ChunkShape],
    held: &Held,
    tokens: f64,
    seq: usize,
) -> f64 {
    let ab = layout.precision.param.bytes() as f64;
    let t = layout.tp() as f64;
    let (kept_block, waiting_block) = if layout.recomputes() {
        let input = model.d_model as f64
            / if layout.tp_options.sequence_parallel {
                t
            } else {
                1.0
            };
        (input * tokens * ab, 0.0)
    } else {
        let per_block = block_elems(model, layout, seq) * tokens * ab;
        (
            per_block,
            model.block_weight_grad_elems(layout.tp()) * tokens * ab,
        )
    };
    let recomputed_weights = if layout.recomputes() {
        // A block's linear weights (its experts, B's anyway, are in the chunk's non-linear;
        // the largest block's where they differ).
        let linear = |p: usize| {
            model.piece_params(layout.tp(), p)
                - model.piece_expert_params(p)
                - model.piece_non_linear_params(layout.tp(), p)
        };
        model
            .distinct_blocks()
            .into_iter()
            .map(linear)
            .max()
            .unwrap_or(0) as f64
    } else {
        0.0
    };
    let kept_head = head_kept_bytes(model, layout, tokens);
    // Zero-bubble's W of the head: its input and the logits' gradient, kept from B; none
    // fused (the node's weight gradient is made in forward, not deferred).
    let head_waiting = match fused_rows(model, layout, tokens) {
        None => logits_bytes(model, layout, tokens) + model.d_model as f64 * tokens * ab,
        Some(_) => 0.0,
    };
    let mut bytes = 0.0;
    for (c, chunk) in chunks.iter().enumerate() {
        let blocks = chunk.blocks as f64;
        let head = if chunk.has_head { 1.0 } else { 0.0 };
        bytes += held.forwards[c] * (blocks * kept_block + head * kept_head);
        let b_grads = (chunk.non_linear_params as f64 + blocks * recomputed_weights) * ab;
        bytes += held.weights[c] * (blocks * waiting_block + head * head_waiting + b_grads);
    }
    bytes
}

/// Transient bytes at a backward's start beyond the state and the activations, for a rank
/// of `psi` parameters: ZeRO-3's two gathered layers (the one computing and the prefetched
/// one; under ep > 1 with the rank's `E/ep` experts, gathered over their replicas), in the param
/// dtype; with tensor parallelism [`TP_GRADIENT_COPIES`] gradient-sized
/// buffers in the reduce dtype (its collectives' copies). Nothing else of size Ψ is live then:
/// the linear layers' weight gradients are single products with no per-sequence buffers.
pub fn transient_bytes(model: &ModelSpec, layout: &ParallelDims, psi: usize) -> f64 {
    let pb = layout.precision.param.bytes() as f64;
    let mut bytes = 0.0;
    if layout.zero == ZeroStage::Zero3 {
        let layer = model.largest_layer_params_ep(layout.tp(), layout.ep());
        bytes += 2.0 * layer as f64 * pb;
    }
    if layout.tp() > 1 {
        bytes += TP_GRADIENT_COPIES * psi as f64 * layout.precision.reduce.bytes() as f64;
    }
    bytes
}

/// Gradient-sized buffers a tensor-parallel rank holds beyond its state and activations at
/// backward's start: 1.1 (Ψ = 67 M, `bench memory`), 1.4 (`train --mesh auto`'s budget
/// GPT), 1.2 (the bench GPT, with one logits buffer more) measured.
pub const TP_GRADIENT_COPIES: f64 = 1.25;

/// Bytes beyond the whole state while gradients are moved, as `(a pipeline micro-batch's sum,
/// the optimizer step)`, for a rank of `psi` parameters. The DDP engine (every layout without
/// ZeRO, pipelines and tp included) takes a micro-batch's gradients from autodiff, flattens
/// them and adds them to the held sums ([`SUM_GRADIENT_COPIES`] copies of its gradients in
/// the param dtype, which autodiff produces — bf16 and f32 pipelines measured the same peak
/// —, scaled by the caller to the chunk that ran), and its step packs the sums into buckets
/// and reduces them ([`STEP_GRADIENT_COPIES`], in the reduce dtype). ZeRO's backward leaves
/// whole, unreduced gradients that are flattened and reduce-scattered into the rank's shard
/// ([`ZERO_STEP_GRADIENT_COPIES`] of the whole gradients). All measured.
pub fn gradient_copy_bytes(layout: &ParallelDims, psi: usize, state: &FormulaBytes) -> (f64, f64) {
    match layout.zero {
        ZeroStage::Zero0 => (
            SUM_GRADIENT_COPIES * psi as f64 * layout.precision.param.bytes() as f64,
            (STEP_GRADIENT_COPIES * state.grads).max(last_bucket_packed(layout, state)),
        ),
        _ => {
            let whole = psi as f64 * layout.precision.reduce.bytes() as f64;
            (0.0, ZERO_STEP_GRADIENT_COPIES * whole)
        }
    }
}

/// The DDP engine's last bucket packed at the end of backward, beyond the state, where the
/// engine reduces in backward (no pipeline: a pipeline's engine reduces its sums in the
/// step): the gradient's other buckets, packed and in flight, and the last bucket both as
/// autodiff's gradients and as its packed copy — the whole gradient and one more last bucket.
/// The last bucket holds the first parameters (module order: the embeddings), bucketed at
/// [`DDP_TAIL_BUCKET_BYTES`], so it is the smaller of that and the whole gradient. Derived
/// from the engine (`bonfire_ddp`'s `BucketPlan` and reducer); docs/planner.md has the
/// allocation that a capped run named at this moment.
fn last_bucket_packed(layout: &ParallelDims, state: &FormulaBytes) -> f64 {
    if layout.pp() > 1 {
        return 0.0;
    }
    state.grads + state.grads.min(DDP_TAIL_BUCKET_BYTES)
}

/// The DDP engine's bucket for the first parameters: a quarter (`TAIL_SPLIT`) of the
/// trainer's 25 MiB cap (`DdpConfig`'s default).
pub const DDP_TAIL_BUCKET_BYTES: f64 = (25 << 20) as f64 / 4.0;

/// [`gradient_copy_bytes`] for a rank of `psi` parameters of which `experts` are its experts'
/// (`E/ep` of them). Under ep > 1 with ZeRO 1 or 2 the engine (`bonfire_zero`'s
/// `ExpertShards`) keeps the experts in a flat vector of their own, reduced inside backward
/// after the other parameters: their autodiff gradients and the packed copy it reduces
/// (2 · Ψ_e/ep) are live beside the other parameters' whole gradient (reduced at stage 1,
/// bucketed at stage 2: Ψ_d either way), the parameters and the optimizer state — and the
/// step's copies ([`ZERO_STEP_GRADIENT_COPIES`]) are of the other parameters' gradients
/// only. The larger of the two moments; derived from the code (held-out Mixtral rows of
/// `examples/tests/planner_heldout.rs`, docs/planner-moe.md). Without ep, or at stage 0 or 3,
/// [`gradient_copy_bytes`].
pub fn rank_gradient_copy_bytes(
    layout: &ParallelDims,
    (psi, experts): (usize, usize),
    state: &FormulaBytes,
) -> (f64, f64) {
    let split = matches!(layout.zero, ZeroStage::Zero1 | ZeroStage::Zero2);
    if layout.ep() == 1 || experts == 0 || !split {
        return gradient_copy_bytes(layout, psi, state);
    }
    let rb = layout.precision.reduce.bytes() as f64;
    let (dense, experts) = ((psi - experts) as f64 * rb, experts as f64 * rb);
    let reduction = dense + 2.0 * experts - state.grads;
    (0.0, reduction.max(ZERO_STEP_GRADIENT_COPIES * dense))
}

/// Gradient-sized buffers beyond the state while a pipeline micro-batch's gradients are
/// summed in: 2.4–3.2 measured at the sums of 1F1B, ZB-H1 and ZB-V with 4–8 micro-batches
/// (`examples/tests/planner.rs`), 2.3 in `bench memory`'s pipelines at Ψ = 67 M.
pub const SUM_GRADIENT_COPIES: f64 = 2.75;

/// Gradient-sized buffers beyond the state in the DDP engine's step: 0.9 (DDP, whose
/// reduced buckets the communication thread allocates) to 1.3 (TP = 4) in `bench memory`.
pub const STEP_GRADIENT_COPIES: f64 = 1.0;

/// Whole-gradient-sized buffers beyond the state in ZeRO's step: 1.0–1.5 in `bench memory`
/// (stages 1–3, f32 and bf16, ± recompute).
pub const ZERO_STEP_GRADIENT_COPIES: f64 = 1.25;
