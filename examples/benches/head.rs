//! `cargo xtask bench head`: a language model's head and its loss — `hidden · Wᵀ`, then the
//! mean cross-entropy, forward and backward — unfused (the `[N, V]` logits whole, then
//! `bonfire_kernels::cross_entropy`, as the models run it by default) and as one node by
//! blocks of rows (`bonfire_kernels::linear_cross_entropy`, the models' `with_fused_loss`),
//! on one thread of Flex in f32: time from a clock (the median of at least 3 runs after one
//! warm-up) and the bytes a run adds at its peak over what was live before it, counted by the
//! allocator ([`RankAllocator`], this binary's global allocator: every block the run's
//! thread allocates, the gradients of `hidden` and `W` included).
//!
//! Shapes: the bench models' head (1,024 tokens, d 256, V 4,096), and the same tokens and
//! width with a 32K vocabulary and Llama 3's 128,256. Prints one line per shape and mode:
//! `bench head shape=… n=… d=… v=… mode=unfused|fused rows=… ms=… peak_bytes=…`, and for
//! fused `ms_ratio=… bytes_ratio=…` (over the unfused run of the same shape).
//!
//! Then the head on a pipeline's last stage (`head/pipeline.rs`: pp = 2 under 1F1B, each
//! rank's peak bytes unfused and fused) at the 32K and 128,256 vocabularies; `--no-pipeline`
//! skips those rows.

use bonfire_comm::testing::rank_alloc::{self, RankAllocator};
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
use std::time::Instant;

mod common;
#[path = "head/pipeline.rs"]
mod pipeline;

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

/// `(name, tokens, width, vocabulary)`.
const SHAPES: &[(&str, usize, usize, usize)] = &[
    ("bench", 1024, 256, 4096),
    ("vocab32k", 1024, 256, 32_768),
    ("llama3_vocab", 1024, 256, 128_256),
];

/// One forward and backward of the head with its loss (`rows`: fused by blocks of that many
/// rows; `None`: unfused), its gradients read back as the optimizer would take them.
fn step(h: &Tensor<2>, w: &Tensor<2>, t: &Tensor<1, Int>, rows: Option<usize>) {
    let (h, w) = (h.clone().require_grad(), w.clone().require_grad());
    let loss = match rows {
        Some(rows) => bonfire_kernels::linear_cross_entropy(h.clone(), w.clone(), t.clone(), rows),
        None => bonfire_kernels::cross_entropy(
            bonfire_kernels::matmul(h.clone(), w.clone().transpose()),
            t.clone(),
        ),
    };
    let grads = loss.backward();
    let (dh, dw) = (h.grad(&grads).expect("dh"), w.grad(&grads).expect("dW"));
    std::hint::black_box((
        dh.slice([0..1, 0..1]).into_data(),
        dw.slice([0..1, 0..1]).into_data(),
    ));
}

/// The median milliseconds of `step` and the bytes it added at its peak (the largest of the
/// runs), after one warm-up run.
fn measure(h: &Tensor<2>, w: &Tensor<2>, t: &Tensor<1, Int>, rows: Option<usize>) -> (f64, usize) {
    step(h, w, t, rows);
    let (mut times, mut peak, clock) = (Vec::new(), 0, Instant::now());
    while times.len() < 3 || (clock.elapsed().as_secs_f64() < 1.0 && times.len() < 15) {
        let before = rank_alloc::live(0);
        rank_alloc::reset_peak(0);
        let start = Instant::now();
        step(h, w, t, rows);
        times.push(start.elapsed().as_secs_f64() * 1e3);
        peak = peak.max(rank_alloc::peak(0).saturating_sub(before));
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], peak)
}

fn main() {
    bonfire_kernels::keep_freed_memory();
    let _rank = rank_alloc::enter_rank(0);
    let device = Device::flex().autodiff();
    device.seed(1);
    for &(name, n, d, v) in SHAPES {
        let h = Tensor::<2>::random([n, d], Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<2>::random([v, d], Distribution::Normal(0.0, 0.02), &device);
        let ids: Vec<i64> = (0..n).map(|i| ((i * 7919) % v) as i64).collect();
        let t = Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), &device);
        let (base_ms, base_bytes) = measure(&h, &w, &t, None);
        println!(
            "bench head shape={name} n={n} d={d} v={v} mode=unfused ms={base_ms:.2} \
             peak_bytes={base_bytes}"
        );
        let budget_rows = bonfire_kernels::rows_within(32 << 20, v);
        let mut blocks = vec![n, 256, budget_rows.min(n)];
        blocks.sort_unstable_by(|a, b| b.cmp(a));
        blocks.dedup();
        for rows in blocks {
            let (ms, bytes) = measure(&h, &w, &t, Some(rows));
            println!(
                "bench head shape={name} n={n} d={d} v={v} mode=fused rows={rows} ms={ms:.2} \
                 peak_bytes={bytes} ms_ratio={:.3} bytes_ratio={:.3}",
                ms / base_ms,
                bytes as f64 / base_bytes as f64
            );
        }
    }
    if !std::env::args().any(|a| a == "--no-pipeline") {
        pipeline::rows(&[32_768, 128_256]);
    }
}
