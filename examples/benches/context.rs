//! `cargo xtask bench cp`: one long sequence (2,048 tokens by default, `--seq N`) through the
//! bench GPT (vocab 4096, d 256, 8 heads, 4 layers, d_ff 1024) and the bench Llama (hidden
//! 256, 8 heads, 4 kv heads, 4 layers, intermediate 688), f32, under context parallelism
//! cp = 1, 2, 4 (ranks as threads, balanced chunks, ring attention).
//!
//! One line per (model, cp): `bench cp model=… seq=… cp=N activation_bytes=…
//! activation_fraction=… peak_bytes=… step_ms=… hidden=…`.
//! - `activation_bytes`: what the forward leaves allocated for backward, per rank (the
//!   counting allocator's live bytes of the rank after the loss minus before the forward;
//!   the fullest rank). `activation_fraction`: over cp = 1's (goal ≤ 0.55 at cp = 2,
//!   ≤ 0.30 at cp = 4).
//! - `peak_bytes`: the rank's highest live bytes during forward and backward above the same
//!   baseline (the fullest rank).
//! - `step_ms`: forward + backward wall time of rank 0, the faster of two steps after a
//!   warm-up (ranks are threads sharing this machine's cores: cp = 4 on 2 cores is not 4×
//!   faster).
//! - `hidden`: the fraction of the ring's transfer time (post to arrival, forward and
//!   backward) that ran while the rank computed the block before it (`n/a` at cp = 1).

use bonfire_comm::ThreadWorld;
use bonfire_comm::testing::rank_alloc::{self, RankAllocator};
use bonfire_cp::{ContextScope, ContextSplit};
use bonfire_dtensor::timing::take_shift_overlap;
use bonfire_examples::default_device;
use bonfire_models::data::TokenBatch;
use bonfire_models::{Gpt, GptConfig, Llama, LlamaConfig};
use bonfire_parallel::ParallelModel;
use burn::tensor::{Int, Tensor, TensorData};
use std::time::{Duration, Instant};

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

/// What one rank measured.
#[derive(Clone, Copy)]
struct Measured {
    activation: usize,
    peak: usize,
    step_ms: f64,
    hidden: Option<f64>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seq = args
        .iter()
        .position(|a| a == "--seq")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.parse().expect("--seq takes a number of tokens"))
        .unwrap_or(2048);
    let device = default_device();
    let gpt = Gpt::new(
        &GptConfig {
            max_seq_len: seq,
            ..GptConfig::bench()
        },
        &device,
    );
    let llama = Llama::new(
        &LlamaConfig {
            max_position_embeddings: seq,
            ..LlamaConfig::bench()
        },
        &device,
    );
    let batch = tokens(seq, 4096);
    sweep("gpt", &gpt, &batch, seq);
    sweep("llama", &llama, &batch, seq);
}

/// One sequence of `seq` deterministic tokens and its targets.
fn tokens(seq: usize, vocab: i64) -> TokenBatch {
    let device = default_device();
    let ids: Vec<i64> = (0..seq as i64).map(|i| (i * 7919) % vocab).collect();
    let tg: Vec<i64> = (0..seq as i64).map(|i| (i * 104_729 + 1) % vocab).collect();
    let t = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [1, seq]), &device);
    (t(ids), t(tg))
}

fn sweep<M: ParallelModel<Batch = TokenBatch> + Sync>(
    name: &str,
    model: &M,
    batch: &TokenBatch,
    seq: usize,
) {
    let mut base = None;
    for cp in [1usize, 2, 4] {
        let ranks = measure(model, batch, cp);
        let fullest = |f: fn(&Measured) -> usize| ranks.iter().map(f).max().unwrap_or(0);
        let activation = fullest(|m| m.activation);
        let base = *base.get_or_insert(activation as f64);
        let hidden = ranks[0]
            .hidden
            .map_or("n/a".to_string(), |h| format!("{h:.3}"));
        println!(
            "bench cp model={name} seq={seq} cp={cp} activation_bytes={activation} \
             activation_fraction={:.3} peak_bytes={} step_ms={:.0} hidden={hidden}",
            activation as f64 / base,
            fullest(|m| m.peak),
            ranks[0].step_ms,
        );
    }
}

/// Every rank's measurements of forward + backward on its chunks of `batch` under cp.
fn measure<M: ParallelModel<Batch = TokenBatch> + Sync>(
    model: &M,
    batch: &TokenBatch,
    cp: usize,
) -> Vec<Measured> {
    let split = ContextSplit::new(batch.0.dims()[1], cp, true).expect("the sequence splits");
    ThreadWorld::new(cp)
        .timeout(Duration::from_secs(600))
        .launch(|pg| {
            let r = pg.rank();
            let _rank = rank_alloc::enter_rank(r);
            let local = || {
                (
                    split.local(batch.0.clone(), 1, r),
                    split.local(batch.1.clone(), 1, r),
                )
            };
            let _scope = (cp > 1).then(|| {
                ContextScope {
                    group: pg.clone(),
                    split,
                }
                .enter()
            });
            drop(model.loss(local()).backward()); // warm-up
            let _ = take_shift_overlap();
            let mut best = f64::INFINITY;
            let (mut activation, mut peak) = (0, 0);
            for _ in 0..2 {
                let batch = local();
                pg.barrier().expect("barrier");
                let before = rank_alloc::live(r);
                rank_alloc::reset_peak(r);
                let started = Instant::now();
                let loss = model.loss(batch);
                activation = rank_alloc::live(r).saturating_sub(before);
                drop(loss.backward());
                best = best.min(started.elapsed().as_secs_f64() * 1e3);
                peak = rank_alloc::peak(r).saturating_sub(before);
            }
            Measured {
                activation,
                peak,
                step_ms: best,
                hidden: take_shift_overlap().hidden_fraction(),
            }
        })
        .expect("the cp ranks ran")
}
