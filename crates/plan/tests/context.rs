//! Context parallelism (cp) in the planner: the search tries cp degrees whose `2·cp` chunks
//! cut the sequence; a rank keeps activations for its `T/cp` tokens (each attending over all
//! `T`: ring attention's blocks, `T/cp × T` scores per head) and holds state as data
//! parallelism over dp × cp; the ring's transfers are hidden behind the blocks they travel
//! beside up to the cluster's overlap. A sequence too long for a device without cp gets a cp
//! layout first; a short one does not, where cp costs more. No machine is measured here
//! (`examples/tests/planner_heldout.rs` measures cp layouts).

use bonfire_plan::memory::{block_elems, formula};
mod common;
use bonfire_layout::{MixedPrecision, ParallelDims, ZeroStage};
use bonfire_plan::{
    AttentionKind, ClusterSpec, MemoryParts, ModelSpec, PlannedLayout, Request, candidates,
    context_layout, estimate, estimate_all, plan, rank_memory, rank_shapes,
};
use common::h100s;

/// The bench GPT with a position table of `seq` rows, its attention materialized (as in
/// 16-bit types: the accounting these tests check term by term).
fn bench_gpt(seq: usize) -> ModelSpec {
    let mut m = ModelSpec::preset("gpt-bench").unwrap();
    m.seq_len = seq;
    m.attention = AttentionKind::Materialized;
    m
}

/// Bonfire's fused attention keeps no scores in f32 — its log-sum-exp (`heads` a token)
/// beside its output, which is the attention output (the heads' merge is a view of it);
/// under cp ring attention's fused blocks instead (for cp = 2 on the fullest rank: the
/// received block's keys and values `2d`, two calls' outputs and log-sum-exps and their merge
/// `2·(2d + 3h) + h`) — and is counted as materialized in bf16, with or without cp.
#[test]
fn fused_attention_keeps_scores_only_in_16_bit_types() {
    let t = 1024;
    let fused = ModelSpec::preset("gpt-bench").unwrap();
    assert_eq!(fused.attention, AttentionKind::Fused);
    let (flash, materialized) = (
        ModelSpec {
            attention: AttentionKind::Flash,
            ..fused.clone()
        },
        bench_gpt(fused.seq_len),
    );
    let f32_layout = context_layout(1, 1, 1, 1);
    let bf16_layout = f32_layout.clone().with_precision(MixedPrecision::bf16());
    let cp2 = context_layout(1, 2, 1, 1);
    let elems = |m: &ModelSpec, l: &ParallelDims| block_elems(m, l, t);
    let (d, h) = (256.0, 8.0);
    assert_eq!(elems(&fused, &f32_layout), elems(&flash, &f32_layout) + h);
    assert!(elems(&fused, &f32_layout) < elems(&materialized, &f32_layout));
    assert_eq!(
        elems(&fused, &bf16_layout),
        elems(&materialized, &bf16_layout)
    );
    assert_eq!(
        elems(&fused, &cp2),
        elems(&flash, &cp2) + 2.0 * d + 2.0 * (2.0 * d + 3.0 * h) + h
    );
    assert!(elems(&fused, &cp2) < elems(&materialized, &cp2));
    let bf16_cp2 = cp2.clone().with_precision(MixedPrecision::bf16());
    assert_eq!(elems(&fused, &bf16_cp2), elems(&materialized, &bf16_cp2));
}

fn request(global_batch: usize, seq: usize, precision: MixedPrecision) -> Request {
    Request {
        global_batch,
        seq,
        precisions: vec![precision],
        memory_fraction: 1.0,
    }
}

fn memory(model: &ModelSpec, req: &Request, layout: &bonfire_layout::ParallelDims) -> MemoryParts {
    let shapes = rank_shapes(model, layout, req.seq);
    rank_memory(model, req, layout, &shapes, 0)
}

/// T = 8192 on the bench GPT, 4 sequences a step on 4 nodes of 4 H100s, each device's
/// memory below what the smallest layout without cp needs. Without cp one sequence's
/// activations on a rank shrink only by tp, at most the 4 devices of a node (dp ≤ 4
/// sequences; a pipeline holds at least one micro-batch of one sequence and recompute keeps
/// one block's whole activations): every layout without cp — tp 4, pipelines, ZeRO-3,
/// recompute, all tried — needs more. With cp a rank holds T/cp of the sequence: the
/// planner's first choice, and every layout that fits, splits it.
#[test]
fn a_sequence_too_long_for_a_device_is_split_over_cp() {
    let (model, req) = (bench_gpt(8192), request(4, 8192, MixedPrecision::bf16()));
    let mut cluster = h100s(4, 4);
    let (all, _) = estimate_all(&model, &cluster, &req);
    let smallest = |cp1: bool| {
        all.iter()
            .filter(|e| (e.layout.cp() == 1) == cp1)
            .min_by(|a, b| a.bytes().total_cmp(&b.bytes()))
            .unwrap()
    };
    let (without, with) = (smallest(true), smallest(false));
    eprintln!(
        "smallest without cp: {} {:.0} MB; with cp: {} {:.0} MB",
        without.layout,
        without.bytes() / 1e6,
        with.layout,
        with.bytes() / 1e6
    );
    assert!(with.bytes() < 0.8 * without.bytes());
    cluster.device.memory = (0.9 * without.bytes()) as usize;
    let p = plan(&model, &cluster, &req).unwrap();
    let top = &p.ranked[0];
    eprintln!("first: {} {:.3} ms", top.layout, top.step_ms());
    assert!(top.layout.cp() > 1, "{}", top.layout);
    assert!(p.ranked.iter().all(|e| e.layout.cp() > 1));
    assert!(
        top.layout
            .record()
            .contains(&format!(" cp={} ", top.layout.cp()))
    );
    assert!(
        p.why
            .iter()
            .any(|w| w.starts_with("with context parallelism: the winner"))
    );
}

/// The bench GPT at its own 128 tokens on the same node: cp is searched (2·cp divides 128)
/// but costs more than the layouts without it (kernel launches per ring step, the ring's
/// calls), so the first choice has none.
#[test]
fn a_short_sequence_does_not_pick_cp() {
    let (model, req) = (bench_gpt(128), request(64, 128, MixedPrecision::bf16()));
    let p = plan(&model, &h100s(1, 8), &req).unwrap();
    let top = &p.ranked[0];
    assert_eq!(top.layout.cp(), 1, "{}", top.layout);
    let best_cp = p
        .ranked
        .iter()
        .find(|e| e.layout.cp() > 1)
        .expect("cp tried");
    eprintln!(
        "first {} {:.3} ms; best with cp {} {:.3} ms",
        top.layout,
        top.step_ms(),
        best_cp.layout,
        best_cp.step_ms()
    );
    assert!(best_cp.step_ms() > top.step_ms());
}

/// cp degrees are powers of two dividing the ranks left whose 2·cp chunks cut the sequence:
/// 24 tokens on 8 ranks admit cp 1, 2 and 4, not 8 (16 chunks).
#[test]
fn cp_degrees_cut_the_sequence() {
    let (model, req) = (bench_gpt(24), request(8, 24, MixedPrecision::f32()));
    let (layouts, _) = candidates(&model, &h100s(1, 8), &req);
    let mut cps: Vec<usize> = layouts.iter().map(|l| l.cp()).collect();
    cps.sort();
    cps.dedup();
    assert_eq!(cps, vec![1, 2, 4]);
    assert!(context_layout(1, 8, 1, 1).check_sequence(24).is_err());
    let sp = context_layout(1, 4, 4, 1).with_sequence_parallel(true);
    assert!(
        sp.check_sequence(24).is_err(),
        "6 tokens a cp rank over tp 4"
    );
}

/// A rank's activations are its T/cp tokens' (each keeping `heads·T` scores of its blocks —
/// the probabilities, once — and, under ring attention, its blocks' keys and values and the
/// running numerator: `(2·(cp−1) + 1)·d + cp·heads`), the head's buffers for T/cp tokens; parameters,
/// gradients and optimizer state are data parallelism's over dp × cp.
#[test]
fn activations_divide_by_cp_and_state_shards_over_dp_times_cp() {
    let (t, b) = (8192, 2);
    let (model, req) = (bench_gpt(t), request(b, t, MixedPrecision::f32()));
    let (d, h, v) = (256.0, 8.0, 4096.0);
    for cp in [2usize, 4] {
        let m = memory(&model, &req, &context_layout(1, cp, 1, 1));
        let tokens = (b * t / cp) as f64;
        // Each block's keys and values and the running numerator; one buffer of scores per
        // block (T/cp × T per head) where one attention keeps two (T × T).
        let ring = (2.0 * (cp as f64 - 1.0) + 1.0) * d + cp as f64 * h - h * t as f64;
        let block = model.block_activation_elems(1, false, t) + ring;
        // Four blocks; the head's kept logits and the loss's one buffer more (f32).
        let expected = (4.0 * block + 2.0 * v) * tokens * 4.0;
        assert!(
            (m.activations / expected - 1.0).abs() < 1e-12,
            "cp={cp}: {} vs {expected}",
            m.activations
        );
    }
    // Under bf16 the ring's probabilities stay f32: one more bf16-sized element each.
    let bf16 = context_layout(1, 2, 1, 1).with_precision(MixedPrecision::bf16());
    let widened =
        block_elems(&model, &bf16, t) - block_elems(&model, &context_layout(1, 2, 1, 1), t);
    assert_eq!(widened, h * t as f64);
    let one = memory(&model, &req, &context_layout(1, 1, 1, 1));
    let two = memory(&model, &req, &context_layout(1, 2, 1, 1));
    let ratio = two.activations / one.activations;
    assert!(ratio > 0.25 && ratio < 0.3, "{ratio}");
    let psi = model.num_params();
    for zero in [ZeroStage::Zero1, ZeroStage::Zero3] {
        let l = context_layout(2, 2, 1, 1).with_zero(zero);
        let state = memory(&model, &req, &l).state;
        assert_eq!(state, formula(zero, psi, 4, MixedPrecision::f32()), "{l}");
    }
}

/// The ring's time: compute halves with cp = 2 (each rank's T/2 tokens over all T keys);
/// with no overlap every one of the `2·(cp−1)` transfers per block is paid whole
/// (`S/β + α + c`, S = 2·tokens·kv_dim·bytes), with full overlap on a fast link only
/// `α + c`; the gradient reduction runs over dp × cp.
#[test]
fn the_ring_is_paid_where_it_is_not_hidden() {
    let (t, b) = (8192, 2);
    let (model, req) = (bench_gpt(t), request(b, t, MixedPrecision::bf16()));
    let cost = |cluster: &ClusterSpec, cp: usize| {
        let l = context_layout(1, cp, 1, 1);
        estimate(&model, cluster, &req, &l, &rank_shapes(&model, &l, t)).time
    };
    let mut cluster = h100s(1, 8);
    let (one, two) = (cost(&cluster, 1), cost(&cluster, 2));
    assert!((two.compute / one.compute - 0.5).abs() < 1e-12);
    assert_eq!(one.cp_comm, 0.0);
    let link = cluster.intra.clone();
    let blocks = 4.0;
    assert!((two.cp_comm - blocks * 2.0 * (link.latency + link.call)).abs() < 1e-15);
    cluster.overlap = 0.0;
    let four = cost(&cluster, 4);
    // Keys and values of the rank's T/4 tokens, in the layout's f32.
    let bytes = 2.0 * (b * t / 4) as f64 * 256.0 * 4.0;
    let paid = blocks * 2.0 * 3.0 * (bytes / link.bandwidth + link.latency + link.call);
    assert!((four.cp_comm / paid - 1.0).abs() < 1e-12, "{four:?}");
    // dp × cp = 2 ranks reduce the gradients: DDP over dp = 2 moves the same.
    let dp2 = context_layout(2, 1, 1, 1);
    let req2 = request(2 * b, t, MixedPrecision::bf16());
    let dp2 = estimate(&model, &cluster, &req2, &dp2, &rank_shapes(&model, &dp2, t)).time;
    assert_eq!(two.dp_comm + two.dp_hidden, dp2.dp_comm + dp2.dp_hidden);
}
