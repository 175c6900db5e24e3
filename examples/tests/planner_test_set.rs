//! The planner's bytes judged on its *test set*: shapes no change of the planner was tuned
//! on, and none will be (docs/planner.md, "Test set"). The fit set (`tests/planner.rs`)
//! shaped the constants, the validation set (`tests/planner_validation.rs`) the structure;
//! these rows only judge. Each shape differs from both sets' in its depth, width, sequence
//! length and head count, and the Llama's rows bring the zoo's grouped-query attention,
//! SwiGLU and RMSNorm: a GPT three times as wide as it is deep at a short sequence, a thin
//! GPT with 2 heads at a long one, a Llama with 10 heads over 2 key/value heads. The layouts spread over
//! every kind the planner searches.
//!
//! Every layout trains 2 AdamW steps on rank threads under the counting allocator; for every
//! rank its held bytes and its steady peak must be within 15 % of the planner's for that rank
//! (`common/planner_rows.rs`, as the validation set) — but the rows that were outside at
//! the set's first run ([`KNOWN_MISSES`], each pinned within 0.02 of its first value). A change
//! of the planner that moves a row (into or out of band) fails here: it is reported with its
//! numbers, never refitted on these rows; each row's first run is in docs/planner.md with its
//! commit.

use bonfire_comm::testing::rank_alloc::RankAllocator;
#[path = "../benches/common/measure.rs"]
#[allow(dead_code)]
mod measure;
#[path = "common/planner_rows.rs"]
mod rows;
use bonfire_examples::default_device;
use bonfire_layout::{MixedPrecision, ParallelDims, ScheduleKind, ZeroStage};
use bonfire_models::llama::{Llama, LlamaConfig};
use bonfire_models::{Gpt, GptConfig};
use bonfire_plan::{Request, base_layout, hsdp_layout};
use rows::{KnownMiss, Row, check, measure_model_row};
use std::time::Instant;

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

/// The test set's misses at its first run (commit recorded in docs/planner.md), out of 70
/// ratios: the planner overestimates the peak of these recompute and tp rows on shapes it
/// was not tuned on. Kept as measured, not refitted: each must stay within `MOVED` of this.
/// gqa/tp2+sp+ac moved from 0.796 to 0.847 on 2026-12-05, reported: the vocabulary-parallel
/// loss became the fused cross-entropy (fewer logits-sized buffers) and the planner counts
/// its one buffer (derived from the implementation, not fitted to this row). Later that day,
/// reported: the f32 products write their outputs once (lower measured peaks) and the loss
/// buffers without tp went from two to one (fitted on the fit set): thin-long/zero1+ac moved
/// from 0.839 into the band (0.968 / 0.973) and is no longer a miss; gqa/dp2xtp2-zero1
/// (its tp count unchanged) moved from 0.822 / 0.828 / 0.822 / 0.823 with the products alone.
/// On the fourth stop, reported: the product's backward writes a weight's gradient `[out, in]`
/// contiguous where `out ≤ in` (no transposed view to copy); gqa/tp2+sp+ac's measured peak rose
/// 0.41 MB (19,364,191 → 19,779,072 bytes, +2.1 %) and the row moved from 0.847 into the band
/// (0.865): no longer a miss. The other known misses did not move and the fit and validation
/// sets passed unchanged in their ranges (the Llama's rows with every weight written so moved
/// 2–6 %, so wider weights keep the transposed view). On the fifth stop, reported: the fused
/// attention reads its heads in place and writes its output sequence-major, so the heads'
/// merge the output projection keeps is a view of the output, not a second copy — the planner
/// counts the op's `h` a token beyond the attention output instead of `d + h` (derived from
/// the code; the fit set's rows returned within 0.006 of their previous ratios but ZeRO-1
/// (1.010 → 1.033) and ZeRO-3 (1.040 → 1.062), whose measured peaks did not fall, all within
/// the fit set's 10 %). The ZeRO-3
/// rows' measured peaks did not move (thin-long/hsdp2x2-zero3: 12,130,304–12,151,442 bytes
/// before, 12,130,384–12,151,874 after — the merged copy was not live at their peak, so the
/// old count was over for them), and the prediction's drop
/// moved that row from 1.140–1.143 out of the band (1.164–1.167): a miss of the ZeRO-3
/// model's own (the validation set's deep/zero3 moved alike), not refitted here. On
/// 2026-12-06, reported: a linear layer's product and bias became one node
/// (`bonfire_kernels::linear`), so under ZeRO-3's Balanced checkpointing the bias is added in
/// place instead of into a second buffer beside the kept product; thin-long/hsdp2x2-zero3's
/// measured peaks fell and the row came into the band (1.029 / 1.049 / 1.029 / 1.048): no
/// longer a miss. The planner was not changed.
const KNOWN_MISSES: [KnownMiss; 4] = [
    ("gqa/dp2xtp2-zero1", 0, "peak", 0.810),
    ("gqa/dp2xtp2-zero1", 1, "peak", 0.804),
    ("gqa/dp2xtp2-zero1", 2, "peak", 0.804),
    ("gqa/dp2xtp2-zero1", 3, "peak", 0.804),
];

/// The misses a CPU without AVX-512 adds to [`KNOWN_MISSES`], measured on an AVX2-only AMD
/// EPYC (Zen 3) on 2026-12-06 (where those above stayed within `MOVED` of their values):
/// gqa/tp2+sp+ac's peak 0.841 (19,088,443 bytes; 0.865, 19,779,072, on the Intel Xeon): 0.69
/// MB lower there, from what in the CPU's path was not found (the f32 products are `gemm`'s
/// AVX2 kernels; every other row of both sets moved by less). Reported, not refitted.
const ALSO_WITHOUT_AVX512: [KnownMiss; 2] = [
    ("gqa/tp2+sp+ac", 0, "peak", 0.841),
    ("gqa/tp2+sp+ac", 1, "peak", 0.841),
];

/// The test set's GPT shapes: (name, config, sequences a step).
fn gpt_shapes() -> [(&'static str, GptConfig, usize); 2] {
    [
        (
            "wide",
            GptConfig {
                vocab_size: 2560,
                d_model: 384,
                n_heads: 12,
                n_layers: 2,
                max_seq_len: 48,
                d_ff: 1536,
            },
            4,
        ),
        (
            "thin-long",
            GptConfig {
                vocab_size: 1024,
                d_model: 96,
                n_heads: 2,
                n_layers: 3,
                max_seq_len: 192,
                d_ff: 384,
            },
            4,
        ),
    ]
}

/// The test set's Llama: 10 heads over 2 key/value heads, 3 layers, sequence 64.
fn llama_shape() -> (LlamaConfig, usize) {
    let cfg = LlamaConfig {
        vocab_size: 2048,
        hidden_size: 160,
        num_attention_heads: 10,
        num_key_value_heads: 2,
        head_dim: 16,
        num_hidden_layers: 3,
        intermediate_size: 432,
        max_position_embeddings: 64,
        ..LlamaConfig::tiny()
    };
    (cfg, 8)
}

/// The layouts of each shape (by index: the two GPTs, then the Llama).
fn layouts() -> Vec<(usize, &'static str, ParallelDims)> {
    use ScheduleKind::{GPipe, OneFOneB, ZbH1, ZbV};
    use ZeroStage::{Zero0, Zero1, Zero2, Zero3};
    use rows::layouts::*;
    vec![
        (0, "ddp", dp(2, Zero0)),
        (0, "zero2", dp(2, Zero2)),
        (0, "tp2+sp", tp(true)),
        (0, "pp2-1f1b-m2", pp(OneFOneB, 2)),
        (0, "zero3-bf16", bf16(dp(2, Zero3))),
        (1, "single", dp(1, Zero0)),
        (1, "zero1+ac", ac(dp(2, Zero1))),
        (1, "tp2", tp(false)),
        (1, "pp2-zbh1-m4", pp(ZbH1, 4)),
        (
            1,
            "hsdp2x2-zero3",
            hsdp_layout(2, 2, 1, 1, 1).with_zero(Zero3),
        ),
        (2, "ddp", dp(2, Zero0)),
        (2, "zero3", dp(2, Zero3)),
        (2, "tp2+sp+ac", ac(tp(true))),
        (2, "pp2-gpipe-m4", pp(GPipe, 4)),
        (2, "pp2-zbv-m4", pp(ZbV, 4)),
        (2, "dp2xtp2-zero1", base_layout(2, 2, 1).with_zero(Zero1)),
    ]
}

fn request(rows: usize, seq: usize) -> Request {
    Request {
        global_batch: rows,
        seq,
        precisions: vec![MixedPrecision::f32()],
        memory_fraction: 1.0,
    }
}

#[test]
fn test_shapes_match_the_planner_per_rank() {
    let clock = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut slot = 0;
    let cases = layouts();
    for (i, (shape, cfg, n)) in gpt_shapes().into_iter().enumerate() {
        let req = request(n, cfg.max_seq_len);
        let model = bonfire_module::params::seeded(71, &default_device(), |d| Gpt::new(&cfg, d));
        for (_, name, layout) in cases.iter().filter(|c| c.0 == i) {
            let at = (&req, slot);
            let (row, _) =
                measure_model_row("test", (shape, name), layout, (&model, &cfg.spec()), at);
            slot += layout.world_size();
            rows.push(row);
        }
    }
    let (cfg, n) = llama_shape();
    let req = request(n, cfg.max_position_embeddings);
    let model = bonfire_module::params::seeded(73, &default_device(), |d| Llama::new(&cfg, d));
    for (_, name, layout) in cases.iter().filter(|c| c.0 == 2) {
        let at = (&req, slot);
        let (row, _) = measure_model_row("test", ("gqa", name), layout, (&model, &cfg.spec()), at);
        slot += layout.world_size();
        rows.push(row);
    }
    assert_eq!(rows.len(), cases.len());
    let also: &[KnownMiss] = match std::arch::is_x86_feature_detected!("avx512f") {
        true => &[],
        false => &ALSO_WITHOUT_AVX512,
    };
    let known: Vec<KnownMiss> = KNOWN_MISSES.iter().chain(also).copied().collect();
    check("test", &rows, clock.elapsed().as_secs_f64(), &known);
}
