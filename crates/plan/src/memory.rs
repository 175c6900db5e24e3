//! Bytes per rank. The one owner of the ZeRO paper's formula ([`formula`]: parameters,
//! gradients and optimizer state that a rank should hold, which `cargo xtask bench memory`
//! checks against a counting allocator), of what Bonfire's engines actually hold
//! ([`state_bytes`]: the formula with the two departures that table measured), and of the
//! rest of a rank's peak: the activations its in-flight micro-batches keep
//! ([`activation_bytes`]) and the transient buffers of backward and the optimizer step
//! ([`transient_bytes`]).

use crate::layout::{Layout, Precision, ZeroStage};
use crate::model::ModelSpec;

/// Bytes one rank holds, by part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FormulaBytes {
    pub params: f64,
    pub grads: f64,
    /// Optimizer state (and the fp32 master under mixed precision).
    pub optim: f64,
}

impl FormulaBytes {
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optim
    }
}

/// Per-parameter bytes of `precision`: (param pb, reduced gradient rb, optimizer K). K is 8
/// for Adam's two fp32 moments, 12 with the fp32 master of a half param dtype.
pub fn bytes_per_param(precision: Precision) -> (f64, f64, f64) {
    let pb = precision.param_bytes as f64;
    let rb = precision.reduce_bytes as f64;
    let k = if precision.is_mixed() { 12.0 } else { 8.0 };
    (pb, rb, k)
}

/// The ZeRO paper's bytes per rank for `psi` parameters (this rank's, after tensor and
/// pipeline sharding) on `n` data-parallel ranks with Adam under `precision`:
/// stage 0 Ψpb + Ψrb + ΨK; 1 Ψpb + Ψrb + ΨK/N; 2 Ψpb + Ψrb/N + ΨK/N; 3 (Ψpb + Ψrb + ΨK)/N.
pub fn formula(stage: ZeroStage, psi: usize, n: usize, precision: Precision) -> FormulaBytes {
    let (pb, rb, k) = bytes_per_param(precision);
    let (psi, n) = (psi as f64, n as f64);
    let (p, g, o) = (psi * pb, psi * rb, psi * k);
    let (p, g, o) = match stage {
        ZeroStage::Z0 => (p, g, o),
        ZeroStage::Z1 => (p, g, o / n),
        ZeroStage::Z2 => (p, g / n, o / n),
        ZeroStage::Z3 => (p / n, g / n, o / n),
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
    precision: Precision,
    offload: bool,
) -> FormulaBytes {
    let mut f = formula(stage, psi, n, precision);
    let (psi, n) = (psi as f64, n as f64);
    if stage == ZeroStage::Z3 && precision.is_mixed() {
        f.params = psi * 4.0 / n;
        f.optim = psi * 8.0 / n;
    }
    if offload && !precision.is_mixed() && stage != ZeroStage::Z0 {
        f.optim += psi * 4.0 / n;
    }
    f
}

/// The gradient bytes of `state` live at the step's peak (backward's start, every
/// activation kept): all of them where the reduced gradients outlive the step (DDP's
/// buckets; the single-replica engines of tp and pp layouts, measured), none under ZeRO —
/// every stage takes its averaged gradients in the optimizer step, and stages 2–3
/// reduce-scatter the next ones during backward, as the activations are freed.
pub fn gradients_at_peak(layout: &Layout, state: &FormulaBytes) -> f64 {
    match layout.zero {
        ZeroStage::Z0 => state.grads,
        ZeroStage::Z1 | ZeroStage::Z2 | ZeroStage::Z3 => 0.0,
    }
}

/// What one pipeline rank keeps for backward, in bytes, for micro-batches of `tokens`
/// tokens (sequences of `seq`): its blocks' activations ([`ModelSpec::block_activation_elems`])
/// times the micro-batches in flight — or, recomputing, each block's input only and one
/// block's activations at a time — and, on the rank with the head, the logits (vocabulary
/// split over tp by the parallel loss): the kept log-probabilities of each in-flight
/// micro-batch and two more logits-sized buffers in backward (four but under ZeRO-3). Activations are in the compute
/// dtype, the logits in f32.
#[allow(clippy::too_many_arguments)]
pub fn activation_bytes(
    model: &ModelSpec,
    layout: &Layout,
    blocks: usize,
    has_head: bool,
    tokens: f64,
    seq: usize,
    in_flight: f64,
) -> f64 {
    let ab = layout.precision.param_bytes as f64;
    let t = layout.tp as f64;
    let per_block = model.block_activation_elems(layout.tp, layout.sp, seq) * tokens * ab;
    let blocks_f = blocks as f64;
    let kept = if layout.recompute {
        let input = model.d_model as f64 / if layout.sp { t } else { 1.0 };
        blocks_f * input * tokens * ab * in_flight + if blocks > 0 { per_block } else { 0.0 }
    } else {
        blocks_f * per_block * in_flight
    };
    let head = if has_head {
        let head_flight = if layout.pp > 1 {
            match layout.schedule {
                Some(crate::layout::Schedule::GPipe) => layout.microbatches as f64,
                _ => 1.0,
            }
        } else {
            1.0
        };
        // Two more logits-sized buffers live at the loss's backward: the logits' gradient
        // and the cross-entropy's kept probabilities (measured: `examples/tests/planner.rs`).
        let backward = 2.0;
        model.vocab_size as f64 / t * tokens * 4.0 * (head_flight + backward)
    } else {
        0.0
    };
    kept + head
}

/// Transient bytes beyond the state and the activations at the step's peak, as multiples of
/// the rank's parameters in the param dtype (Ψ·pb): none for DDP, ZeRO and pipelines (the
/// peak is backward's start, before most gradients exist, and the linear layers' weight
/// gradients are single products with no per-sequence buffers); 2 Ψ·pb with tensor
/// parallelism (its collectives' send and receive copies); ZeRO-3 adds two gathered layers
/// (the one computing and the prefetched one). Measured on the bench GPT's layouts of
/// `examples/tests/planner.rs` (the fitted part of the model; docs/planner.md).
pub fn transient_bytes(model: &ModelSpec, layout: &Layout, psi: usize) -> f64 {
    let pb = layout.precision.param_bytes as f64;
    let c = if layout.tp > 1 { 2.0 } else { 0.0 };
    let mut bytes = c * psi as f64 * pb;
    if layout.zero == ZeroStage::Z3 {
        bytes += 2.0 * model.largest_layer_params(layout.tp) as f64 * pb;
    }
    bytes
}
