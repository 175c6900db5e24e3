//! `bench head`'s pipeline rows: the head on a pipeline's last stage, which holds the whole
//! vocabulary's product for each micro-batch it runs. A GPT of the bench models' width (d 256,
//! 8 heads, d_ff 1,024, 2 layers) with a large vocabulary trains two AdamW steps of 8 rows of
//! 512 tokens on pp = 2 (1F1B, 4 micro-batches of 2 rows: 1,024 tokens each), ranks as
//! threads, through the one trainer (`common::measure::measure_layout`); each rank's bytes
//! are counted by the allocator ([`RankAllocator`]: every block its thread allocates) as the
//! most the second step's forward+backward added over what the rank held before it. Unfused
//! (the last piece's logits, then the loss) and fused (`Gpt::with_fused_loss`: the head piece
//! makes the loss by blocks, `Pipeline::with_head_loss`). Prints
//! `bench head pipeline layout=pp2-1f1b v=… mode=unfused|fused rows=… rank=r peak_bytes=…`
//! and for fused `bytes_ratio=…` (over the unfused run's same rank).
//!
//! The fused node keeps the head's weight gradient `[V, d]` from its forward instead of the
//! logits `[N, V]`: it saves memory where a micro-batch's `N` tokens outnumber the width `d`
//! (here 1,024 against 256); with `N = d` the two are the same size (measured with sequences
//! of 128 by this bench's first version, SGD: the last stage's peak 0.98–0.99 of the unfused
//! one).
//!
//! [`RankAllocator`]: bonfire_comm::testing::rank_alloc::RankAllocator

use crate::common::measure::measure_layout;
use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_models::{Gpt, GptConfig};

/// Rows a step (the global batch) and tokens a row.
const ROWS: usize = 8;
const SEQ: usize = 512;
/// Rows a block of the fused head.
const FUSED_ROWS: usize = 64;

/// Each rank's most bytes a forward+backward added over what was live before it (the second
/// of two AdamW steps: `measure_layout`'s `activation_peak`) for `model` on pp = 2 under 1F1B;
/// `first`: the allocator id of rank 0 (each run its own).
fn run(model: &Gpt, vocab: usize, first: usize) -> Vec<usize> {
    let mut args = LayoutArgs::mesh("pp=2");
    args.schedule = Some("1f1b".into());
    args.microbatches = Some(4);
    let dims = args.dims("pp=2").expect("pp=2 under 1F1B");
    let runs = measure_layout(vocab, &dims, model, (ROWS, SEQ, 2), first);
    runs.iter().map(|r| r.activation_peak).collect()
}

/// The pipeline rows for each vocabulary of `vocabs`.
pub fn rows(vocabs: &[usize]) {
    let mut first = 1;
    for &vocab in vocabs {
        let cfg = GptConfig {
            vocab_size: vocab,
            d_model: 256,
            n_heads: 8,
            n_layers: 2,
            max_seq_len: SEQ,
            d_ff: 1024,
        };
        let model = Gpt::new(&cfg, &default_device());
        let unfused = run(&model, vocab, first);
        let fused = run(&model.with_fused_loss(FUSED_ROWS), vocab, first + 2);
        first += 4;
        for (rank, (u, f)) in unfused.iter().zip(&fused).enumerate() {
            println!(
                "bench head pipeline layout=pp2-1f1b v={vocab} mode=unfused rank={rank} \
                 peak_bytes={u}"
            );
            println!(
                "bench head pipeline layout=pp2-1f1b v={vocab} mode=fused rows={FUSED_ROWS} \
                 rank={rank} peak_bytes={f} bytes_ratio={:.3}",
                *f as f64 / *u as f64
            );
        }
    }
}
