//! The planner's bytes judged on its *validation set* (issue 26's "held-out" rows, named for
//! what they are since issue 45: changes of the planner's structure were checked on them, so
//! they informed the model; its *test set*, which no change is tuned on, is
//! `tests/planner_test_set.rs`) — three GPT shapes that were never used to fit its constants (`bonfire_plan::memory`'s gradient copies, tp's
//! transient, the loss buffers were fitted on `tests/planner.rs`'s bench GPT, the *fit set*,
//! and on `cargo xtask bench memory`'s Ψ = 67 M rows). Each shape differs from the bench GPT
//! (vocab 4096, d 256, 8 heads, 4 layers, seq 128, d_ff 1024, 8 sequences a step) in every
//! dimension; the layouts are spread over them so that every kind the planner searches
//! appears at least once: DDP, ZeRO 1, 2 and 3, TP = 2 ± SP, PP = 2 under GPipe, 1F1B,
//! interleaved, ZB-H1 and ZB-V, recompute, bf16, two 4-rank meshes (dp × tp, pp × dp), and
//! HSDP (issue 30: `dp_replicate=2,dp=2` on 4 ranks under ZeRO-1 on *small*, ZeRO-2 and
//! ZeRO-3 on *deep* — the state sharded over the 2-rank shard group only, each replica
//! training on its own quarter of the batch; no constant was fitted on these rows; *small*
//! under HSDP ZeRO-3, one sequence a rank, reads 1.12–1.18 as plain dp = 2 ZeRO-3 on the
//! same per-rank batch does, docs/planner.md).
//!
//! Every layout trains 2 AdamW steps on rank threads under this binary's counting allocator
//! ([`RankAllocator`]). For **every rank**, its held bytes (after the last forward+backward)
//! must be within 15 % of the planner's state *for that rank* and its steady peak (the second
//! step's; printed split into its forward+backward and its optimizer step) within 15 %
//! of the planner's bytes *for that rank* ([`predict_ranks`]: `rank_memory` of its pipeline
//! stage) — not the largest against the largest. Every line says `set=validation`; all rows are
//! printed before any is asserted. Bytes only: no clock is asserted here.
//!
//! The CPU backend's per-thread matrix-product workspace (`gemm`'s packing buffer, sized to
//! the core's L2 cache: 2 MiB here) is allocated on each rank thread before its baseline and
//! printed (`workspace=`), not counted ([`measure_layout`]): it is the backend's, the same on
//! every rank of every layout. Counted, it was the "about 2.3 MB per rank" that the first run
//! of this set (issue 26) found above the planner's state on every shape, putting every row
//! of the small shape (state 0.9–14 MB) outside.
//!
//! Context parallelism (cp) is held out the same way ([`context_rows`]): the bench GPT's
//! sizes at 512 tokens, one sequence a step, on one rank and on cp = 2 (± ZeRO-1 over
//! dp × cp): every rank's bytes within the same band (asserted); the step times' order
//! wherever the planner separates them by 35 % or more is printed, not asserted
//! ([`check_time_order`] says why). No constant was fitted on them.
//!
//! Expert parallelism is held out the same way ([`experts`]): the bench Mixtral (8 experts
//! of width 344, top 2) at 64 tokens, one sequence a rank on 4 ranks. One run (2026-11-27,
//! a loaded VM; the rows 13.5 s alone, 21.5 s in this test), measured / predicted per rank:
//!
//! | row | held / state | peak |
//! |---|---|---|
//! | dp4 | 1.001 ×4 | 1.088 / 1.088 / 1.089 / 1.088 |
//! | dp4 ep2 | 1.002 ×4 | 1.037 ×4 |
//! | dp4 ep4 | 1.002 ×4 | 1.052 / 1.052 / 1.052 / 1.054 |
//! | dp4 ep2 ZeRO-1 | 1.002 / 1.004 / 1.002 / 1.002 | 1.001 / 1.003 / 1.002 / 1.001 |
//! | dp4 ep2 ZeRO-2 | 0.956 / 1.002 / 1.002 / 0.956 | 0.969 / 0.999 / 0.999 / 0.969 |
//! | dp4 ep2 ZeRO-3 | 1.003 ×4 | 1.039 / 1.059 / 1.137 / 1.123 |
//! | dp4 ep4 ZeRO-3 | 1.003 / 1.003 / 1.003 / 1.010 | 1.074 / 1.098 / 1.116 / 1.120 |
//! | dp4 ep2 bf16 | 1.003 / 1.002 / 1.002 / 1.002 | 1.034 ×4 |
//!
//! The experts' state follows 1/ep as predicted; with it not divided by ep (a break of
//! `rank_state`, then restored) 44 rank ratios fell outside (state 0.31–0.63). Two changes
//! to the planner's structure came from these rows, so the rows they moved are not strictly
//! held out any more (docs/planner-moe.md): under ep the ZeRO-1/2 engine reduces the
//! experts' own flat vector inside backward after the other parameters and its step copies
//! only the other parameters' gradients (`bonfire_plan::memory::rank_gradient_copy_bytes`;
//! ep2 ZeRO-1 read 0.839 before), and ZeRO-3 now shards the experts' values over their
//! replicas (engine commit 906b229, the planner kept them whole: ep2 ZeRO-3's state 0.846).
//!
//! Every row is asserted. On the GPT rows three changes to the *structure* (no constant)
//! were found and checked on the fit set before they were adopted, so the rows they moved
//! have informed the model and are not strictly held out any more (docs/planner.md): ZeRO-3
//! counts its gradient shard at backward's start (deep/zero3 1.16, mid/zero3 bf16 1.27
//! before), a half-precision copy of the logits under bf16 (small/ddp bf16 1.15), and a
//! pipeline chunk's gradient sum beside the running sums of the rank's other chunks
//! (small/pp2 zb-v m = 4, rank 0, 1.16).

use bonfire_comm::testing::rank_alloc::RankAllocator;
#[path = "../benches/common/measure.rs"]
mod measure;
#[path = "common/planner_rows.rs"]
mod rows;
use bonfire_examples::default_device;
use bonfire_layout::{Axis, ParallelDims};
use bonfire_layout::{MixedPrecision, ScheduleKind, ZeroStage};
use bonfire_models::{Gpt, GptConfig};
use bonfire_plan::machine::{calibrate, this_machine};
use bonfire_plan::{Request, base_layout, context_layout, estimate, hsdp_layout, rank_shapes};
use rows::{KnownMiss, Row, check, measure_model_row};
use std::time::Instant;

#[path = "planner_validation/experts.rs"]
mod experts;

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

/// The validation set's misses, each pinned within `MOVED` of its value (as the test set's):
/// deep/zero3 from the fifth stop of 2026-12-05 until 2026-12-06 (below). The fused attention's output is written
/// sequence-major and the heads' merge is a view of it, so the planner counts the op's `h` a
/// token beyond the attention output instead of `d + h` (derived; the fit set's ratios
/// returned within 0.006 of their previous values but ZeRO-1's and ZeRO-3's, 1.010 → 1.033
/// and 1.040 → 1.062, whose measured peaks did not fall; every other row here stayed in band).
/// deep/zero3's measured peak did not move (128,663,641 / 128,675,741 bytes before,
/// 128,668,585 / 128,679,549 after: the merged copy was not live at its peak, so the old
/// count was over for it) and the lower prediction moved it from 1.132 to 1.152 —
/// what the ZeRO-3 model leaves out (about 17 MB here, some 3.5 of the shape's gathered
/// layers) is no longer hidden by that over-count. Reported, not refitted. On 2026-12-06 a
/// linear layer's product and bias became one node (`bonfire_kernels::linear`): under ZeRO-3's
/// Balanced checkpointing the bias is added in place, not into a second buffer beside the kept
/// product, and deep/zero3's measured peaks fell into the band (1.055 / 1.071): no miss is
/// left in this set. The planner was not changed.
const KNOWN_MISSES: [KnownMiss; 0] = [];

/// The misses of a CPU without a bf16 kernel (`bonfire_kernels::bf16_kernel()` none: no AMX),
/// measured on an AVX2-only AMD EPYC (Zen 3) on 2026-12-06: there the bf16 products are
/// Burn's, which converts both operands and the output to f32 (the kernels pack bf16 operands
/// and write bf16 once), transients the planner does not count; mid/zero3-bf16's peak measured
/// 45.1 MB against 38.8 predicted. Reported, not refitted: the planner models the kernels'
/// path.
const KNOWN_MISSES_WITHOUT_BF16_KERNEL: [KnownMiss; 2] = [
    ("mid/zero3-bf16", 0, "peak", 1.164),
    ("mid/zero3-bf16", 1, "peak", 1.164),
];

/// Two layouts whose predicted step times differ by at least this factor must be measured in
/// that order (`tests/planner.rs`'s `SEPARATED`: above this VM's noise between layouts).
const SEPARATED: f64 = 1.35;
/// Rounds over the cp layouts for their step times (each layout timed this many times).
const TIME_ROUNDS: usize = 3;

/// A validation model and its global batch (sequences per step; each is `max_seq_len` long).
struct Shape {
    name: &'static str,
    cfg: GptConfig,
    rows: usize,
}

fn shapes() -> [Shape; 3] {
    let gpt = |vocab_size, d_model, n_heads, n_layers, max_seq_len, d_ff| GptConfig {
        vocab_size,
        d_model,
        n_heads,
        n_layers,
        max_seq_len,
        d_ff,
    };
    [
        Shape {
            name: "small",
            cfg: gpt(2048, 128, 4, 2, 64, 384),
            rows: 4,
        },
        Shape {
            name: "mid",
            cfg: gpt(3072, 192, 6, 3, 96, 768),
            rows: 6,
        },
        Shape {
            name: "deep",
            cfg: gpt(1536, 320, 10, 6, 32, 1280),
            rows: 16,
        },
    ]
}

/// The layouts each shape runs (index into [`shapes`]): the planner's base layout for the
/// degrees (loss parallelism on tp), as the planner searches them.
fn layouts() -> Vec<(usize, &'static str, ParallelDims)> {
    let hsdp = |zero| hsdp_layout(2, 2, 1, 1, 1).with_zero(zero);
    use ScheduleKind::{GPipe, OneFOneB, ZbH1, ZbV};
    use ZeroStage::{Zero0, Zero1, Zero2, Zero3};
    use rows::layouts::*;
    vec![
        (0, "ddp", dp(2, Zero0)),
        (0, "zero1", dp(2, Zero1)),
        (0, "zero3+ac", ac(dp(2, Zero3))),
        (0, "tp2", tp(false)),
        (0, "pp2-1f1b-m2", pp(OneFOneB, 2)),
        (0, "pp2-zbv-m4", pp(ZbV, 4)),
        (0, "ddp-bf16", bf16(dp(2, Zero0))),
        (0, "dp2xtp2", base_layout(2, 2, 1)),
        (0, "hsdp2x2-zero1", hsdp(Zero1)),
        (1, "zero2", dp(2, Zero2)),
        (1, "tp2+sp", tp(true)),
        (1, "pp2-gpipe-m3", pp(GPipe, 3)),
        (1, "pp2-zbh1-m6", pp(ZbH1, 6)),
        (1, "ddp+ac", ac(dp(2, Zero0))),
        (1, "zero3-bf16", bf16(dp(2, Zero3))),
        (
            1,
            "pp2-interleaved-m2",
            pp(ScheduleKind::Interleaved { chunks: 2 }, 2),
        ),
        (2, "single", dp(1, Zero0)),
        (2, "zero3", dp(2, Zero3)),
        (2, "tp2+sp+ac", ac(tp(true))),
        (2, "pp2-1f1b-m8", pp(OneFOneB, 8)),
        (2, "pp2-zbh1-m4+ac", ac(pp(ZbH1, 4))),
        (2, "tp2-bf16", bf16(tp(false))),
        (2, "zero1-bf16", bf16(dp(2, Zero1))),
        (2, "pp2xdp2-zbv-m4", pp(ZbV, 4).with_degree(Axis::Dp, 2)),
        (2, "hsdp2x2-zero2", hsdp(Zero2)),
        (2, "hsdp2x2-zero3", hsdp(Zero3)),
    ]
}

#[test]
fn validation_shapes_match_the_planner_per_rank() {
    let clock = Instant::now();
    let shapes = shapes();
    let cases = layouts();
    for (i, shape) in shapes.iter().enumerate() {
        let used = cases.iter().filter(|c| c.0 == i).count();
        assert!(used >= 5, "{}: only {used} layouts", shape.name);
    }
    let mut rows = Vec::new();
    let mut slot = 0;
    for (i, shape) in shapes.iter().enumerate() {
        let seq = shape.cfg.max_seq_len;
        let req = Request {
            global_batch: shape.rows,
            seq,
            precisions: vec![MixedPrecision::f32()],
            memory_fraction: 1.0,
        };
        for (_, name, layout) in cases.iter().filter(|c| c.0 == i) {
            let (row, _) = measure_row(shape.name, name, layout, &shape.cfg, (&req, slot));
            slot += layout.world_size();
            rows.push(row);
        }
    }
    let times = context_rows(&mut rows, &mut slot);
    experts::expert_rows(&mut rows, slot);
    let known = match bonfire_kernels::bf16_kernel() {
        Some(_) => &KNOWN_MISSES[..],
        None => &KNOWN_MISSES_WITHOUT_BF16_KERNEL[..],
    };
    check("validation", &rows, clock.elapsed().as_secs_f64(), known);
    check_time_order(&times);
}

/// Trains `layout` on `cfg` (`req`'s batch, allocator ranks from `slot`), prints its line and
/// returns its row and rank 0's fastest step in ms.
fn measure_row(
    shape: &str,
    name: &str,
    layout: &ParallelDims,
    cfg: &GptConfig,
    at: (&Request, usize),
) -> (Row, f64) {
    let model = bonfire_module::params::seeded(17, &default_device(), |d| Gpt::new(cfg, d));
    let row = measure_model_row(
        "validation",
        (shape, name),
        layout,
        (&model, &cfg.spec()),
        at,
    );
    (row.0, row.1.step_ms)
}

/// Context parallelism, in the validation set (no constant was fitted on these runs; the planner's cp
/// terms are derived from the code): the bench GPT's sizes with a 512-token position table —
/// sequences 4× the fit set's, the scores then 3/4 of a block's activations — one sequence a
/// step, on one rank and split over cp = 2 rank threads, with and without ZeRO-1 (sharded over
/// dp × cp). Adds the rows (allocator ranks from `slot`) and returns each layout's name,
/// measured and predicted step ms.
fn context_rows(rows: &mut Vec<Row>, slot: &mut usize) -> Vec<(String, f64, f64)> {
    let cfg = GptConfig {
        max_seq_len: 512,
        ..GptConfig::bench()
    };
    let req = Request {
        global_batch: 1,
        seq: cfg.max_seq_len,
        precisions: vec![MixedPrecision::f32()],
        memory_fraction: 1.0,
    };
    let calib = calibrate(2, cfg.max_seq_len / 2, cfg.d_model, cfg.d_ff);
    let cluster = this_machine(2, 8 << 30, &calib);
    let spec = cfg.spec();
    let cases = [
        ("single", context_layout(1, 1, 1, 1)),
        ("cp2", context_layout(1, 2, 1, 1)),
        (
            "cp2-zero1",
            context_layout(1, 2, 1, 1).with_zero(ZeroStage::Zero1),
        ),
    ];
    let mut times: Vec<(String, f64, f64)> = cases
        .iter()
        .map(|(name, layout)| {
            let shapes = rank_shapes(&spec, layout, req.seq);
            let predicted = estimate(&spec, &cluster, &req, layout, &shapes).step_ms();
            (format!("long/{name}"), f64::MAX, predicted)
        })
        .collect();
    // Round robin, the fastest step of each layout kept (a busy spell hits every layout);
    // the first round's bytes are the rows.
    for round in 0..TIME_ROUNDS {
        for ((name, layout), time) in cases.iter().zip(&mut times) {
            let (row, ms) = measure_row("long", name, layout, &cfg, (&req, *slot));
            *slot += layout.world_size();
            time.1 = time.1.min(ms);
            if round == 0 {
                rows.push(row);
            }
        }
    }
    for (name, measured, predicted) in &times {
        eprintln!(
            "planner-check set=validation layout={name} measured_ms={measured:.1} \
             predicted_ms={predicted:.1}"
        );
    }
    times
}

/// The pairs the planner separates by [`SEPARATED`] or more, and how many were measured in
/// the predicted order — printed, not asserted: on this 2-core VM cp = 2 under DDP measured
/// 1.0–1.5 × its prediction (no faster than one rank in two of three loaded runs) while
/// ZeRO-1 on the same mesh came within 1.1–1.6 ×, a cost of DDP beside the ring's transfer
/// threads the time model does not have (docs/planner.md). Asserting the order would assert
/// the load of the machine; the byte rows above are asserted.
fn check_time_order(times: &[(String, f64, f64)]) {
    let (mut pairs, mut agree) = (0, 0);
    for (i, a) in times.iter().enumerate() {
        for b in &times[i + 1..] {
            let (fast, slow) = if a.2 <= b.2 { (a, b) } else { (b, a) };
            if slow.2 / fast.2 < SEPARATED {
                continue;
            }
            pairs += 1;
            if slow.1 > fast.1 {
                agree += 1;
            } else {
                eprintln!(
                    "planner-check set=validation cp time order disagrees: {} predicted {:.2}× \
                     slower than {}, measured {:.0} vs {:.0} ms",
                    slow.0,
                    slow.2 / fast.2,
                    fast.0,
                    slow.1,
                    fast.1
                );
            }
        }
    }
    eprintln!(
        "planner-check set=validation cp time order: {agree} of {pairs} pairs separated by \
         {SEPARATED}× in the predicted order (printed, not asserted)"
    );
}
