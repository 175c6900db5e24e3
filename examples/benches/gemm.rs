//! `cargo xtask bench gemm`: the bench models' matrix products (issue 49, point 1) as Bonfire
//! runs them on Flex — Burn's matmul, which is the `gemm` crate — on one thread, next to the
//! machine's measured peak; the xtask runs PyTorch's side (`pytorch/gemm.py`: MKL/oneDNN, one
//! thread) after it in the same run and prints the ratios.
//!
//! Shapes: every linear layer of the bench GPT (d 256, d_ff 1024, vocab 4096) and the bench
//! Llama (d 256, kv 128, intermediate 688, vocab 4096) at batch 8 × 128 tokens (1,024 rows), each
//! as its three products — forward `x Wᵀ` `[T, in] × [in, out]`, input gradient `dY W`
//! `[T, out] × [out, in]`, weight gradient `dYᵀ x` `[out, T] × [T, in]` where `out ≤ in`, else
//! its transpose `xᵀ dY` `[in, T] × [T, out]` (the same sums: the orientation the product's
//! backward takes, 9–13 % faster in `gemm` for the wide layers here) — in the layouts the
//! models use (the transposes are views), f32 and bf16. Time from a clock: the median of at
//! least 5 repetitions and 0.2 s after 0.1 s of warm-up, each forced to finish by reading one
//! element, and the fastest of them (`best_gflops=`: a product's work is fixed, so its fastest
//! repetition is the one a neighbour on a shared VM slowed least — on the 2-core Zen 3 VM of
//! 2026-12-06 one product's median moved by 30 % between back-to-back timings).
//! The C allocator is tuned as `train` tunes it (`bonfire_kernels::keep_freed_memory`;
//! `-- --default-allocator` keeps glibc's defaults, under which the products with 4–16 MB
//! outputs lose a third to fresh pages).
//! Prints `bench gemm side=bonfire shape=… m= n= k= dtype= gflops= best_gflops=` (Bonfire's product,
//! `bonfire_kernels::matmul`: Burn's in f32, in bf16 the CPU's bf16 kernel, `bf16_kernel=`),
//! for bf16 also `bench gemm side=burn …` (Burn's own product on the same operands: Flex converts bf16 to
//! f32 and back around its f32 `gemm`), and `bench gemm peak_gflops=… peak_best_gflops=… isa=…`: the FMA
//! micro-kernel, 12 independent accumulators of the widest vectors the core has (AVX-512
//! where present, else AVX2), so the figure is the FMA ports × width × clock the core
//! sustains. On the AMD EPYC of earlier runs (Zen 4 executes a 512-bit FMA as two 256-bit
//! halves) both widths measured the same, 115.4–117.4 GFLOP/s; a core with two 512-bit FMA
//! units (the Intel Xeon of 2026-12-05) reaches twice its AVX2 figure.

use burn::tensor::{DType, Device, Distribution, Tensor};
use std::time::{Duration, Instant};

/// `(name, in, out)` of each linear layer of the bench GPT and Llama (`GptConfig::bench`,
/// `LlamaConfig::bench`).
const LAYERS: &[(&str, usize, usize)] = &[
    ("gpt.qkvo", 256, 256),
    ("gpt.fc1", 256, 1024),
    ("gpt.fc2", 1024, 256),
    ("llama.kv", 256, 128),
    ("llama.gate_up", 256, 688),
    ("llama.down", 688, 256),
    ("head", 256, 4096),
];

/// Rows of every product: batch 8 × 128 tokens.
const ROWS: usize = 1024;

/// The median and the fastest seconds of `f`, run until 5 repetitions and 0.2 s, after warming
/// up for 2 calls and 0.1 s (the first product measured after 2 calls alone read 68.8 GFLOP/s,
/// 107.6 when measured again: the core's clock ramps up).
fn time(mut f: impl FnMut()) -> Timing {
    let warm = Instant::now();
    for i in 0.. {
        f();
        if i >= 1 && warm.elapsed() >= Duration::from_millis(100) {
            break;
        }
    }
    let (mut times, start) = (Vec::new(), Instant::now());
    while times.len() < 5 || start.elapsed() < Duration::from_millis(200) {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Timing {
        median: times[times.len() / 2],
        best: times[0],
    }
}

/// A timing's median and fastest repetition, seconds.
struct Timing {
    median: f64,
    best: f64,
}

/// `a × b` (Bonfire's product, or Burn's with `burn`) forced to finish (one element read
/// back).
fn product(a: &Tensor<2>, b: &Tensor<2>, burn: bool) {
    let y = match burn {
        true => a.clone().matmul(b.clone()),
        false => bonfire_kernels::matmul(a.clone(), b.clone()),
    };
    let _ = y.slice([0..1, 0..1]).into_data();
}

/// The measured f32 FMA peak of one core, GFLOP/s (median and fastest repetitions), and the
/// instruction set it used.
fn peak() -> ((f64, f64), &'static str) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (checked above).
            return (time_peak(|n| unsafe { fma512(n) }, 16), "avx512");
        }
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return (time_peak(|n| unsafe { fma256(n) }, 8), "avx2");
        }
    }
    ((0.0, 0.0), "none")
}

/// GFLOP/s of `kernel(n)` (median and fastest repetitions): n iterations of 12 FMAs of `lanes`
/// f32 each.
fn time_peak(kernel: impl Fn(usize) -> f32, lanes: usize) -> (f64, f64) {
    let n = std::hint::black_box(20_000_000);
    let mut sink = 0.0;
    let seconds = time(|| sink += kernel(n));
    std::hint::black_box(sink);
    let flops = (2 * 12 * lanes * n) as f64 / 1e9;
    (flops / seconds.median, flops / seconds.best)
}

/// 12 independent 256-bit FMA chains, `n` steps each; returns their sum's first lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma256(n: usize) -> f32 {
    use std::arch::x86_64::*;
    // Opaque to the optimizer: the chains must run (constants fold them away).
    let (a, b) = (
        std::hint::black_box(_mm256_set1_ps(0.999_9)),
        std::hint::black_box(_mm256_set1_ps(1e-7)),
    );
    let mut acc = [_mm256_set1_ps(1.0); 12];
    for _ in 0..n {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut sum = _mm256_set1_ps(0.0);
    for x in acc {
        sum = _mm256_fmadd_ps(x, _mm256_set1_ps(1.0), sum);
    }
    let mut out = [0.0f32; 8];
    // SAFETY: `out` holds the vector's 8 lanes.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
    out[0]
}

/// 12 independent 512-bit FMA chains, `n` steps each; returns their sum's mean lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma512(n: usize) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (
        std::hint::black_box(_mm512_set1_ps(0.999_9)),
        std::hint::black_box(_mm512_set1_ps(1e-7)),
    );
    let mut acc = [_mm512_set1_ps(1.0); 12];
    for _ in 0..n {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let sum = acc
        .iter()
        .fold(_mm512_set1_ps(0.0), |s, &x| _mm512_add_ps(s, x));
    _mm512_reduce_add_ps(sum) / 16.0
}

fn main() {
    // As `train` runs: large freed buffers kept (`--default-allocator`: glibc's defaults).
    let tuned = !std::env::args().any(|a| a == "--default-allocator")
        && bonfire_kernels::keep_freed_memory();
    let device = Device::flex();
    device.seed(1);
    let ((peak, peak_best), isa) = peak();
    println!(
        "bench gemm peak_gflops={peak:.1} peak_best_gflops={peak_best:.1} isa={isa} threads=1 \
         allocator_tuned={tuned} \
         bf16_kernel={}",
        bonfire_kernels::bf16_kernel().map_or("burn", |k| k.name())
    );
    let normal = |shape: [usize; 2], dtype: DType| {
        Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), &device).cast(dtype)
    };
    for dtype in [DType::F32, DType::BF16] {
        let name = match dtype {
            DType::F32 => "f32",
            _ => "bf16",
        };
        for &(layer, d_in, d_out) in LAYERS {
            let x = normal([ROWS, d_in], dtype);
            let w = normal([d_out, d_in], dtype);
            let dy = normal([ROWS, d_out], dtype);
            // The weight gradient as the product's backward runs it: `dYᵀ x` `[out, in]` where
            // `out ≤ in`, else `xᵀ dY` `[in, out]` (its transpose, the same sums; a view).
            let dw = match d_out <= d_in {
                true => (dy.clone().transpose(), x.clone(), (d_out, d_in, ROWS)),
                false => (x.clone().transpose(), dy.clone(), (d_in, d_out, ROWS)),
            };
            let cases = [
                ("fwd", x, w.clone().transpose(), (ROWS, d_out, d_in)),
                ("dx", dy, w, (ROWS, d_in, d_out)),
                ("dw", dw.0, dw.1, dw.2),
            ];
            for (part, a, b, (m, n, k)) in cases {
                let sides: &[(&str, bool)] = match dtype {
                    DType::F32 => &[("bonfire", false)],
                    _ => &[("bonfire", false), ("burn", true)],
                };
                for &(side, burn) in sides {
                    let seconds = time(|| product(&a, &b, burn));
                    let flops = 2.0 * (m * n * k) as f64 / 1e9;
                    println!(
                        "bench gemm side={side} shape={layer}.{part} m={m} n={n} k={k} \
                         dtype={name} gflops={:.1} best_gflops={:.1} ms={:.3}",
                        flops / seconds.median,
                        flops / seconds.best,
                        seconds.median * 1e3
                    );
                }
            }
        }
    }
}
