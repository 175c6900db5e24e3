//! The planner's bytes for a head fused with its loss (`ModelSpec::fused_loss_rows`, the
//! models' `with_fused_loss`): what the node keeps from forward to backward (the gradients of
//! its input and weight, `N × d + V × d`) and what one block makes at the loss (its logits),
//! in place of the unfused head's logits (`N × V`) and loss buffers — derived from
//! `bonfire_kernels::linear_cross_entropy`, no constant fitted. Judged, as the validation set
//! is, on a GPT whose head would dominate its memory unfused (vocabulary 16,384, width 64,
//! 1,024 tokens a step: the unfused logits are 67 MB, its whole state 35 MB): one rank in f32
//! and bf16, DDP, ZeRO-2, ZeRO-3, ZeRO-1 and ZeRO-3 with activation checkpointing, 1F1B,
//! GPipe (whose last stage keeps a fused node per micro-batch in flight), ZB-H1 and ZB-V
//! (whose last stage is on the first rank), DDP and 1F1B in bf16. Every rank's held bytes and
//! steady peak within `BAND` of the planner's for the fused model (but [`KNOWN_MISSES`]);
//! and the unfused model's prediction for the same runs far outside it on every rank holding
//! the head (the check can fail: a planner that ignored the fusion would).
//!
//! Fitted is not validated: the bf16 weight-gradient term of `head_loss_bytes` was derived
//! after the one-rank bf16 row measured 1.169 without it (1.052 with it); DDP and 1F1B in
//! bf16 were added after and judge it (1.032, 1.034 on the head's rank).

use bonfire_comm::testing::rank_alloc::RankAllocator;
#[path = "../benches/common/measure.rs"]
#[allow(dead_code)]
mod measure;
#[path = "common/planner_rows.rs"]
mod rows;
use bonfire_examples::default_device;
use bonfire_layout::{MixedPrecision, ParallelDims, ScheduleKind, ZeroStage};
use bonfire_models::{Gpt, GptConfig};
use bonfire_plan::{Request, predict_ranks};
use rows::{BAND, KnownMiss, Row, check, measure_model_row};
use std::time::Instant;

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

/// The ratio outside the band at this set's first run, not on a rank holding the head: the
/// unfused model's run measures the same there (ZB-H1's rank 0 peak 1.202) — the zero-bubble
/// schedule's miss on this narrow shape, not the fusion's.
const KNOWN_MISSES: [KnownMiss; 1] = [("vocab16k/pp2-zbh1-m4", 0, "peak", 1.202)];

/// Layouts whose rank 1 is not judged: ZB-V's rank 1 holds only the two middle stages (2 MB
/// of this 2-block GPT), where the allocator's figures move by more than the band between runs
/// (held 1.187 then 1.243 of the prediction, +90 KB; the unfused runs read the same): too
/// little for this set to judge. Its rank 0, with the embedding and the head, is.
const RANK_0_ONLY: [&str; 1] = ["pp2-zbv-m4"];

/// Rows a block of the fused head.
const BLOCK: usize = 64;

const CFG: GptConfig = GptConfig {
    vocab_size: 16_384,
    d_model: 64,
    n_heads: 2,
    n_layers: 2,
    max_seq_len: 128,
    d_ff: 256,
};

fn layouts() -> Vec<(&'static str, ParallelDims)> {
    use ScheduleKind::{GPipe, OneFOneB, ZbH1, ZbV};
    use ZeroStage::{Zero0, Zero1, Zero2, Zero3};
    use rows::layouts::*;
    vec![
        ("single", dp(1, Zero0)),
        (
            "single-bf16",
            dp(1, Zero0).with_precision(MixedPrecision::bf16()),
        ),
        ("ddp", dp(2, Zero0)),
        ("zero2", dp(2, Zero2)),
        ("zero3", dp(2, Zero3)),
        ("zero1+ac", ac(dp(2, Zero1))),
        ("zero3+ac", ac(dp(2, Zero3))),
        ("pp2-1f1b-m2", pp(OneFOneB, 2)),
        ("pp2-gpipe-m4", pp(GPipe, 4)),
        ("pp2-zbh1-m4", pp(ZbH1, 4)),
        ("pp2-zbv-m4", pp(ZbV, 4)),
        ("ddp-bf16", bf16(dp(2, Zero0))),
        ("pp2-1f1b-m2-bf16", bf16(pp(OneFOneB, 2))),
    ]
}

#[test]
fn a_fused_heads_bytes_match_the_planner() {
    let clock = Instant::now();
    let req = Request {
        global_batch: 8,
        seq: CFG.max_seq_len,
        precisions: vec![MixedPrecision::f32()],
        memory_fraction: 1.0,
    };
    let model = bonfire_module::params::seeded(79, &default_device(), |d| Gpt::new(&CFG, d))
        .with_fused_loss(BLOCK);
    let (fused, unfused) = (CFG.spec().with_fused_loss(BLOCK), CFG.spec());
    let (mut rows, mut slot) = (Vec::<Row>::new(), 0);
    let mut unfused_peaks = Vec::new();
    for (name, layout) in layouts() {
        let at = (&req, slot);
        let (mut row, _) = measure_model_row(
            "fused-head",
            ("vocab16k", name),
            &layout,
            (&model, &fused),
            at,
        );
        slot += layout.world_size();
        if RANK_0_ONLY.contains(&name) {
            row.state.truncate(1);
            row.peak.truncate(1);
        }
        // The head's ranks' measured peaks over the unfused model's prediction (a pipeline's
        // first stage has no head: both predictions are the same there).
        let p_fused = predict_ranks(&fused, &req, &layout).unwrap();
        let p_unfused = predict_ranks(&unfused, &req, &layout).unwrap();
        for ((ratio, f), u) in row.peak.iter().zip(&p_fused).zip(&p_unfused) {
            if f.total() != u.total() {
                unfused_peaks.push((name, ratio * f.total() / u.total()));
            }
        }
        rows.push(row);
    }
    eprintln!("fused-head: measured peaks over the unfused prediction {unfused_peaks:.3?}");
    // The head's ranks: the two single ones, the data-parallel layouts' two each, each
    // pipeline's last stage's.
    assert_eq!(
        unfused_peaks.len(),
        19,
        "every rank holding the head: {unfused_peaks:?}"
    );
    let inside: Vec<_> = unfused_peaks
        .iter()
        .filter(|(_, r)| (r - 1.0).abs() <= BAND)
        .collect();
    assert!(
        inside.is_empty(),
        "the unfused prediction fits these fused runs too, so the check could not fail: {inside:.3?}"
    );
    check(
        "fused-head",
        &rows,
        clock.elapsed().as_secs_f64(),
        &KNOWN_MISSES,
    );
}
