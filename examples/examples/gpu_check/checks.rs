//! The checks a device other than Flex must pass, as functions of that device: every strategy
//! trains to the same run as on Flex ([`parity`]), the parity harness trains transformers'
//! Llama checkpoint to transformers' float64 run ([`llama_against_transformers`]), and the
//! bench models' training speed on one rank ([`tokens_per_second`]). `tests/wgpu.rs` runs them on Mesa's software Vulkan; the GPU
//! kit (`gpu_check`, built by `cargo xtask gpu-kit`, docs/gpu.md) on CUDA.

use crate::throughput::{self, Hosts, Steps};
use bonfire_comm::testing::{Tolerance, assert_close};
use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::harness::{self, gpt_lr};
use bonfire_kernels::FusedAdamWConfig;
use bonfire_layout::{MixedPrecision, ParallelDims};
use bonfire_models::data::{Batches, TokenBatch};
use bonfire_models::gpt::{Gpt, GptConfig};
use bonfire_models::llama::{Llama, LlamaConfig};
use bonfire_module::params;
use bonfire_parallel::ParallelModel;
use bonfire_train::parity::{Outcome, assert_same_run};
use bonfire_train::{OptimizerKind, Trainer};
use burn::optim::SgdConfig;
use burn::tensor::Device;
use std::path::Path;

/// Steps of every parity run.
pub const STEPS: usize = 2;
/// Rows of every parity step's global batch.
pub const ROWS: usize = 4;

/// The GPT every device is checked with (the tiny one: vocab 32, d 16, 2 layers, seq 8), its
/// parameters drawn on Flex after seeding it with 5, and `STEPS` global batches of `ROWS`
/// random sequences (seed 11).
pub fn gpt_fixture() -> (Gpt, Batches) {
    let cfg = GptConfig::tiny();
    let model = params::seeded(5, &bonfire_examples::default_device(), |d| {
        Gpt::new(&cfg, d)
    });
    let batches = throughput::random_batches(cfg.vocab_size, cfg.max_seq_len, ROWS, STEPS, 11);
    (model, batches)
}

/// `mesh` with ZeRO stage `zero` (offloaded or not), one replica group.
fn dims(mesh: &str, zero: usize, offload: bool) -> ParallelDims {
    LayoutArgs {
        zero,
        offload,
        ..LayoutArgs::mesh(mesh)
    }
    .dims("dp=1")
    .expect("a valid layout")
}

/// The layouts a device is checked under: DDP, ZeRO 1–3, offload, TP and a 1F1B pipeline on
/// two ranks (the ranks share the device), and one rank alone.
pub fn layouts() -> Vec<ParallelDims> {
    vec![
        dims("dp=1", 0, false),
        dims("dp=2", 0, false),
        dims("dp=2", 1, false),
        dims("dp=2", 2, false),
        dims("dp=2", 3, false),
        dims("dp=2", 2, true),
        dims("tp=2", 0, false),
        LayoutArgs {
            schedule: Some("1f1b".into()),
            microbatches: Some(2),
            ..LayoutArgs::mesh("pp=2")
        }
        .dims("dp=1")
        .expect("a valid layout"),
    ]
}

/// How close a run on another backend must come to Flex's. Two backends round differently
/// (GPU kernels fuse multiply-adds, reduce in other trees and have their own `exp`): the
/// layouts' relative tolerance 1e-5, with an absolute floor of 1e-6 under SGD (measured on
/// wgpu: 1.2e-7 on a gradient of 7e-4) and 5e-3·lr under AdamW (2.5× the layouts' floor:
/// measured 2.3e-3·lr on wgpu, an element whose gradient is a cancellation, which Adam's
/// normalisation turns into a step of up to lr).
pub fn tolerance(optim: OptimizerKind) -> Tolerance {
    match optim {
        OptimizerKind::Sgd => Tolerance::new(1e-5, 1e-6),
        OptimizerKind::AdamW => Tolerance::new(1e-5, 5e-3 * gpt_lr(optim) as f32),
    }
}

/// `STEPS` steps of `model` under `dims` with `optim` through the parity harness.
fn train(model: &Gpt, batches: &Batches, dims: &ParallelDims, optim: OptimizerKind) -> Outcome {
    harness::train(model, batches, dims, optim, STEPS, gpt_lr(optim))
        .unwrap_or_else(|e| panic!("{dims} {}: {e}", optim.name()))
}

/// Every layout of `layouts`, with SGD and with AdamW, trained from `model` (on Flex) once on
/// Flex and once on a copy on `device`: losses, step-0 gradients and parameters within
/// [`tolerance`]. Panics naming the first layout that differs; returns one line per run.
pub fn parity(
    model: &Gpt,
    batches: &Batches,
    device: &Device,
    layouts: &[ParallelDims],
) -> Vec<String> {
    assert!(!layouts.is_empty(), "no layout to check");
    let on_device = params::fork(model.clone(), device);
    let mut lines = Vec::new();
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        for dims in layouts {
            let what = format!("{dims} {} {device:?} vs flex", optim.name());
            let got = train(&on_device, batches, dims, optim);
            let want = train(model, batches, dims, optim);
            let closeness = assert_same_run(&what, &got, &want, tolerance(optim));
            lines.push(format!("parity {what}: {closeness}"));
        }
    }
    lines
}

/// [`parity`] on a device whose f32 products are TF32's (CUDA, [`TF32`]): every layout on
/// `device` against the same device's one-rank run (the engines on the same arithmetic:
/// under SGD within [`tolerance`], per element; under AdamW normwise), and that one-rank run
/// against Flex's normwise within [`TF32`], tensor by tensor. Under AdamW the parameters are
/// compared by their updates ([`ADAMW_TF32_UPDATE`]), not element by element.
pub fn parity_tf32(
    model: &Gpt,
    batches: &Batches,
    device: &Device,
    layouts: &[ParallelDims],
) -> Vec<String> {
    assert!(!layouts.is_empty(), "no layout to check");
    let on_device = params::fork(model.clone(), device);
    let infos = params::inventory(model);
    let initial = params::named(&infos, &params::flatten_values(model, &infos));
    let initial = initial.into_iter().map(|p| (p.path, p.values)).collect();
    let one = dims("dp=1", 0, false);
    let mut lines = Vec::new();
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        // Per element under SGD; under AdamW by the updates (below).
        let floor = match optim {
            OptimizerKind::Sgd => 0.0,
            OptimizerKind::AdamW => f32::INFINITY,
        };
        let compare = |what: &str, got: &Outcome, want: &Outcome| {
            let closeness =
                bonfire_train::parity::assert_same_run_normwise(what, got, want, TF32, floor);
            match optim {
                OptimizerKind::Sgd => format!("{closeness}"),
                OptimizerKind::AdamW => {
                    let updates = bonfire_train::parity::assert_updates_agree(
                        what,
                        got,
                        want,
                        &initial,
                        ADAMW_TF32_UPDATE,
                    );
                    format!("{closeness}; {updates} (bound {ADAMW_TF32_UPDATE})")
                }
            }
        };
        let reference = train(&on_device, batches, &one, optim);
        let what = format!("{one} {} {device:?} vs flex", optim.name());
        let flex = train(model, batches, &one, optim);
        lines.push(format!(
            "parity {what}: {}",
            compare(&what, &reference, &flex)
        ));
        for dims in layouts.iter().filter(|d| **d != one) {
            let what = format!("{dims} {} vs {one} on {device:?}", optim.name());
            let got = train(&on_device, batches, dims, optim);
            // The engines on the same arithmetic: under SGD the layouts' own per-element
            // tolerance (measured on the H200: 4.8e-7 at most); under AdamW as against Flex.
            let closeness = match optim {
                OptimizerKind::Sgd => {
                    format!(
                        "{}",
                        assert_same_run(&what, &got, &reference, tolerance(optim))
                    )
                }
                OptimizerKind::AdamW => compare(&what, &got, &reference),
            };
            lines.push(format!("parity {what}: {closeness}"));
        }
    }
    lines
}

/// A bench model on one rank: its name, and the tokens per second it trains at.
pub struct Speed {
    /// `gpt` or `llama`.
    pub model: &'static str,
    /// Median step time over the timed steps, in ms.
    pub step_ms: f64,
    /// Tokens per second at that step time.
    pub tokens_per_s: f64,
    /// The first and the last step's loss (rank 0's).
    pub losses: (f32, f32),
}

/// The bench GPT (SGD, lr 0.01) and the bench Llama (AdamW lr 1e-3, β 0.9/0.95, ε 1e-6,
/// weight decay 0.1) trained on one rank on `device`, batch 8 of their full sequence length,
/// `steps` timed after 2 warm-up steps: the models and settings of `cargo xtask bench train`.
pub fn tokens_per_second(device: &Device, steps: usize) -> Result<Vec<Speed>, String> {
    let gpt = GptConfig::bench();
    let llama = LlamaConfig::bench();
    let sgd = || SgdConfig::new().init();
    let one = dims("dp=1", 0, false);
    Ok(vec![
        speed(
            "gpt",
            &Gpt::new(&gpt, device),
            &Trainer::new(one.clone(), sgd),
            (gpt.vocab_size, gpt.max_seq_len, 0.01),
            (8, steps),
        )?,
        speed(
            "llama",
            &Llama::new(&llama, device),
            &Trainer::new(one, bench_adamw),
            (llama.vocab_size, llama.max_position_embeddings, 1e-3),
            (8, steps),
        )?,
    ])
}

/// `model` trained by `trainer` on `batch` random rows of `(vocab, seq)` per step at `lr`.
fn speed<M: ParallelModel<Batch = TokenBatch> + Sync>(
    name: &'static str,
    model: &M,
    trainer: &Trainer,
    (vocab, seq, lr): (usize, usize, f64),
    (batch, steps): (usize, usize),
) -> Result<Speed, String> {
    let schedule = Steps {
        warmup: 2,
        timed: steps,
    };
    let data = throughput::random_batches(vocab, seq, batch, schedule.total(), 3);
    let rows = |_: usize, s: usize, d: &Device| data.rows(s, 0, batch, d);
    let hosts = Hosts::Threads { ranks: 1 };
    let per_rank = throughput::train_at(model, trainer, hosts, schedule, &rows, lr)
        .map_err(|e| format!("{name}: {e}"))?;
    let step_ms = schedule.slowest(&per_rank);
    let losses = &per_rank[0].losses;
    Ok(Speed {
        model: name,
        step_ms,
        tokens_per_s: (batch * seq) as f64 / (step_ms / 1e3),
        losses: (losses[0], losses[losses.len() - 1]),
    })
}

/// AdamW as the benches run it: β 0.9/0.95, ε 1e-6, weight decay 0.1, Bonfire's fused kernel.
pub fn bench_adamw() -> burn::optim::ModuleOptimizer {
    FusedAdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.95)
        .with_epsilon(1e-6)
        .with_weight_decay(0.1)
        .init()
}

/// Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 heads of 64, 8 kv heads, intermediate
/// 8192, vocabulary 128,256, RoPE θ 500,000, at 2,048 positions. Its head is untied (the Llama
/// here has no tie yet): 1.50 B parameters where the tied checkpoint has 1.24 B.
pub fn llama_1b() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 128_256,
        hidden_size: 2048,
        intermediate_size: 8192,
        num_hidden_layers: 16,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        max_position_embeddings: 2048,
        // Tied, as Llama-3.2-1B is (one table: 1,235,814,400 parameters); without Llama 3's
        // RoPE scaling, as PyTorch's side (gpu_bench.py) builds it: the scaling changes the
        // tables, not the work.
        variant: bonfire_models::llama::LlamaVariant {
            tie_word_embeddings: true,
            ..Default::default()
        },
    }
}

/// Training FLOPs a token (the count MFU is taken over, docs/gpu.md): 6·N + 12·L·d·T, N the
/// parameters that multiply (all but the input embedding, a lookup — a tied table multiplies
/// as the head, so all of them), L layers, d the width of attention (heads × head_dim), T the
/// sequence length (attention's scores and their use).
pub fn flops_per_token(cfg: &LlamaConfig, params: usize, seq: usize) -> f64 {
    let lookup = match cfg.variant.tie_word_embeddings {
        true => 0,
        false => cfg.vocab_size * cfg.hidden_size,
    };
    let n = (params - lookup) as f64;
    let attention = cfg.num_attention_heads * cfg.head_dim;
    6.0 * n + 12.0 * (cfg.num_hidden_layers * attention * seq) as f64
}

/// The 1 B Llama's training speed on one rank of `device`: bf16 compute with f32 masters and
/// AdamW state ([`bench_adamw`], lr 1e-4), `batch` rows of 2,048 tokens, `steps` timed after 2.
/// Its speed and its parameter count. `fused_loss`: the head and its loss by blocks of that
/// many rows (`Llama::with_fused_loss`; `None`: the logits whole, as transformers runs it).
pub fn bench_1b(
    device: &Device,
    batch: usize,
    steps: usize,
    fused_loss: Option<usize>,
) -> Result<(Speed, usize), String> {
    let layout = dims("dp=1", 0, false).with_precision(MixedPrecision::bf16());
    train_llama(device, &llama_1b(), layout, (batch, steps), fused_loss)
}

/// The Llama of `cfg`, drawn on `device` (seeding draws on the host), trained under `layout`
/// with [`bench_adamw`] at lr 1e-4 on `batch` random rows of its positions, `steps` timed
/// after 2, with the head's loss by blocks of `fused_loss` rows where given. Its speed and
/// its parameter count.
pub fn train_llama(
    device: &Device,
    cfg: &LlamaConfig,
    layout: ParallelDims,
    (batch, steps): (usize, usize),
    fused_loss: Option<usize>,
) -> Result<(Speed, usize), String> {
    let model = Llama::new(cfg, device).with_fused_loss(fused_loss);
    let n = burn::module::Module::num_params(&model);
    let trainer = Trainer::new(layout, bench_adamw);
    let shape = (cfg.vocab_size, cfg.max_position_embeddings, 1e-4);
    Ok((speed("llama", &model, &trainer, shape, (batch, steps))?, n))
}

/// Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 heads, 8 kv heads, intermediate 14,336,
/// vocabulary 128,256, untied: 8,030,261,248 parameters) at 2,048 positions, without Llama
/// 3's RoPE scaling (the tables, not the work).
pub fn llama_8b() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 128_256,
        hidden_size: 4096,
        intermediate_size: 14_336,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 128,
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        max_position_embeddings: 2048,
        variant: bonfire_models::llama::LlamaVariant::default(),
    }
}

/// ZeRO-Offload on one rank of `device`: the Llama of `cfg` computing in `precision` on the
/// device (the kit: bf16), its f32 master weights and AdamW state on the host (ZeRO-1 with
/// offload over a group of one: the optimizer steps on the host, the updated values go back
/// each step), `batch` rows of the model's positions, `steps` timed after 2. Its speed and
/// parameter count.
pub fn offload_llama(
    device: &Device,
    cfg: &LlamaConfig,
    precision: MixedPrecision,
    run: (usize, usize),
) -> Result<(Speed, usize), String> {
    let layout = dims("dp=1", 1, true).with_precision(precision);
    train_llama(device, cfg, layout, run, None)
}

/// bf16 matrix products of `[m, k] × [k, n]` and `[m, n] × [n, k]` on `device`, timed: a chain
/// `x ← (x·B)·C` of `reps` links after 3 warm-ups (each product needs the one before, so none
/// can be skipped or reordered), the host clock read after the device finished (the sum of the
/// last link read back); TFLOP/s over both products. Random normal operands, `B` and `C`
/// scaled to keep `x` near unit size. Also the first product's error: a 4 × 4 corner of `x·B`
/// against dot products on the host (f64 over the same bf16 operands), the largest difference
/// over `Σ|x_i·b_i|` (bf16's output rounding is about 4e-3 of it; a product not computed is
/// far off).
pub fn gemm_tflops(device: &Device, (m, k, n): (usize, usize, usize), reps: usize) -> (f64, f64) {
    use burn::tensor::{DType, Distribution, Tensor};
    let draw = |shape: [usize; 2], std: f64| {
        Tensor::<2>::random(shape, Distribution::Normal(0.0, std), device).cast(DType::BF16)
    };
    let x = draw([m, k], 1.0);
    let (b, c) = (
        draw([k, n], (k as f64).powf(-0.5)),
        draw([n, k], (n as f64).powf(-0.5)),
    );
    let host = |t: Tensor<2>| -> Vec<f64> {
        let v = t
            .cast(DType::F32)
            .into_data()
            .try_to_vec::<f32>()
            .expect("f32");
        v.into_iter().map(f64::from).collect()
    };
    let corner = host(x.clone().matmul(b.clone()).slice([0..4, 0..4]));
    let (rows, cols) = (
        host(x.clone().slice([0..4, 0..k])),
        host(b.clone().slice([0..k, 0..4])),
    );
    let mut error: f64 = 0.0;
    for i in 0..4 {
        for j in 0..4 {
            let terms = (0..k).map(|t| rows[i * k + t] * cols[t * 4 + j]);
            let (dot, size) = terms.fold((0.0, 0.0), |(d, s), v| (d + v, s + v.abs()));
            error = error.max((corner[i * 4 + j] - dot).abs() / size.max(f64::MIN_POSITIVE));
        }
    }
    let link = |x: Tensor<2>| x.matmul(b.clone()).matmul(c.clone());
    let finish = |t: &Tensor<2>| {
        t.clone().sum().into_data();
    };
    let mut y = x.clone();
    for _ in 0..3 {
        y = link(y);
    }
    finish(&y);
    let start = std::time::Instant::now();
    for _ in 0..reps {
        y = link(y);
    }
    finish(&y);
    let seconds = start.elapsed().as_secs_f64() / reps as f64;
    (4.0 * (m * k * n) as f64 / seconds / 1e12, error)
}

/// Seconds a call of `run` takes: `warm` calls first, then the mean of `reps`, each ended by
/// `finish` (which waits for the device: a sum read back costs tens of µs, small against
/// these calls).
fn timed<T>(warm: usize, reps: usize, run: impl Fn() -> T, finish: impl Fn(&T)) -> f64 {
    for _ in 0..warm {
        finish(&run());
    }
    let start = std::time::Instant::now();
    for _ in 0..reps {
        finish(&run());
    }
    start.elapsed().as_secs_f64() / reps as f64
}

/// Causal grouped-query attention of `b` rows, `h` query heads over `h_kv` kv heads, `t`
/// positions of `dh` features in bf16, timed on `device` (ms a call): the models' own
/// ([`causal_attention`](bonfire_models::gpt::attention::causal_attention): in bf16 Burn's ops with the
/// scores materialized) forward and forward + backward, and Burn's `attention` op forward
/// (CubeCL's flash kernel where it applies; kv heads repeated first).
pub fn attention_ms(
    device: &Device,
    (b, h, h_kv, t, dh): (usize, usize, usize, usize, usize),
) -> Vec<(&'static str, f64)> {
    use burn::tensor::module::attention;
    use burn::tensor::ops::AttentionModuleOptions;
    use burn::tensor::{DType, Distribution, Tensor};
    let plain = device.clone().inner();
    let draw = |heads: usize, d: &Device| {
        Tensor::<4>::random([b, heads, t, dh], Distribution::Normal(0.0, 1.0), d).cast(DType::BF16)
    };
    let finish = |y: &Tensor<4>| {
        y.clone().sum().into_data();
    };
    let (q, k, v) = (draw(h, &plain), draw(h_kv, &plain), draw(h_kv, &plain));
    let models =
        || bonfire_models::gpt::attention::causal_attention(q.clone(), k.clone(), v.clone());
    let forward = timed(2, 10, models, finish);
    let (qa, ka, va) = (
        q.clone().autodiff().require_grad(),
        k.clone().autodiff().require_grad(),
        v.clone().autodiff().require_grad(),
    );
    let both = timed(
        2,
        10,
        || {
            let y = bonfire_models::gpt::attention::causal_attention(
                qa.clone(),
                ka.clone(),
                va.clone(),
            );
            let grads = y.sum().backward();
            qa.grad(&grads).expect("q's gradient")
        },
        finish,
    );
    let (kr, vr) = bonfire_kernels::fallback::repeat_kv_heads(k, v, h);
    let options = AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: true,
    };
    let burn_op = || attention(q.clone(), kr.clone(), vr.clone(), None, None, options);
    // A kernel that refuses these shapes panics: reported as NaN, the rest still measured.
    let burn_forward = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        timed(2, 10, burn_op, finish)
    }))
    .unwrap_or(f64::NAN);
    vec![
        ("bonfire_fwd", forward * 1e3),
        ("bonfire_fwd_bwd", both * 1e3),
        ("burn_attention_fwd", burn_forward * 1e3),
    ]
}

pub use bonfire_train::parity::F64;

/// The normwise bound ([`bonfire_train::parity::assert_same_run_normwise`]) of a run on CUDA. Burn 0.22.1's
/// CUDA backend computes f32 matrix products on TF32 tensor cores (burn-cubecl's matmul tuner
/// promotes f32 operands to tf32: 10 mantissa bits, unit roundoff 2⁻¹¹ ≈ 4.9e-4), so no f32
/// bound holds there: measured on an H200 (2026-11-27, the Llama fixture, 2 SGD steps),
/// parameters 3.6e-4 of their largest magnitude from transformers' float64 run (Flex: 2.3e-7),
/// step-0 gradients up to 1.0e-3 from Flex's. Four unit roundoffs: 2e-3.
pub const TF32: f32 = 2e-3;

/// Under AdamW on CUDA the parameters are compared by their updates, tensor by tensor
/// ([`bonfire_train::parity::assert_updates_agree`]): the two updates within this share of
/// the reference's, in the 2-norm. Not element by element: Adam's normalised step turns
/// TF32's rounding of a near-zero gradient into a whole step of the other sign (measured on
/// the H200, one rank against Flex after 2 steps at lr 0.01: an fc1 weight 0.24·lr apart,
/// another 1.0·lr — no per-element bound below the 2·lr·steps Adam can move at all). A few
/// flipped elements of a tensor move its update little (k of n flipped: about 2·√(k/n)); a
/// wrong gradient moves all of it (≥ 1). 0.25 admits ~1.5 % of a tensor flipped; not yet
/// measured on a GPU (the kit prints each ratio). A tensor whose gradient is rounding noise in
/// both runs (the key bias's: its update measured 1.3 of the reference's apart on lavapipe,
/// f32 against Flex) is listed, not compared; its gradient is checked normwise.
pub const ADAMW_TF32_UPDATE: f64 = 0.25;

/// The parity harness on `device` (a `--device` name) under `layout`, on the Llama fixture in
/// `fixture` (`config.json` and `model.safetensors` as transformers' `save_pretrained` wrote
/// them, `batch.safetensors`, and `reference.safetensors`: transformers' float64 run, written
/// by the fixture's `generate.py`): 2 SGD steps at lr 0.5, the result file's loss, every
/// parameter and step-0 gradient within [`F64`] of transformers'. Returns how close it came.
pub fn llama_against_transformers(
    fixture: &Path,
    device: &str,
    layout: LayoutArgs,
    out: &Path,
) -> Result<String, String> {
    let args = harness::HarnessArgs {
        config: fixture.join("config.json"),
        weights: fixture.join("model.safetensors"),
        data: fixture.join("batch.safetensors"),
        dims: layout.dims("dp=1")?,
        optim: OptimizerKind::Sgd,
        device: device.into(),
        steps: 2,
        lr: 0.5,
        recipe: Default::default(),
        out: out.join("result.safetensors"),
    };
    harness::run(&args)?;
    let got = harness::read_result(&args.out)?;
    let want = harness::read_result(fixture.join("reference.safetensors"))?;
    let params: Vec<&String> = want
        .keys()
        .filter(|k| k.starts_with("sgd.model.") || k.starts_with("sgd.lm_head"))
        .collect();
    if params.is_empty() || got.len() != 2 * params.len() + 1 {
        return Err(format!(
            "{} values in the result, for {} parameters (want each, its grad0, the loss)",
            got.len(),
            params.len()
        ));
    }
    // CUDA's products are TF32's ([`TF32`]): normwise there, F64 elsewhere.
    let tf32 = device == "cuda";
    let tol = |want: &[f32]| match tf32 {
        true => {
            bonfire_train::parity::normwise(TF32, bonfire_train::parity::largest_magnitude(want))
        }
        false => F64,
    };
    let mut worst = assert_close(
        "loss",
        &got["loss"],
        &want["sgd.loss"],
        tol(&want["sgd.loss"]),
    );
    for key in params {
        let name = key.trim_start_matches("sgd.");
        worst = worst.max(assert_close(name, &got[name], &want[key], tol(&want[key])));
        let g = format!("grad0.{name}");
        worst = worst.max(assert_close(&g, &got[&g], &want[&g], tol(&want[&g])));
    }
    let bound = if tf32 {
        " (TF32 products: normwise 2e-3)"
    } else {
        ""
    };
    Ok(format!(
        "llama {} on {device} vs transformers float64{bound}: {worst}",
        args.dims
    ))
}
