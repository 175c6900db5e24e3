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
use bonfire_layout::ParallelDims;
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
/// against Flex's normwise within [`TF32`] (under AdamW the parameters are not compared:
/// [`ADAMW_TF32_FLOOR`]).
pub fn parity_tf32(
    model: &Gpt,
    batches: &Batches,
    device: &Device,
    layouts: &[ParallelDims],
) -> Vec<String> {
    assert!(!layouts.is_empty(), "no layout to check");
    let on_device = params::fork(model.clone(), device);
    let one = dims("dp=1", 0, false);
    let mut lines = Vec::new();
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        let floor = match optim {
            OptimizerKind::Sgd => 0.0,
            OptimizerKind::AdamW => ADAMW_TF32_FLOOR,
        };
        let note = match floor.is_finite() {
            true => "",
            false => " (losses and step-0 gradients; parameters not compared)",
        };
        let reference = train(&on_device, batches, &one, optim);
        let what = format!("{one} {} {device:?} vs flex{note}", optim.name());
        let flex = train(model, batches, &one, optim);
        let closeness =
            bonfire_train::parity::assert_same_run_normwise(&what, &reference, &flex, TF32, floor);
        lines.push(format!("parity {what}: {closeness}"));
        for dims in layouts.iter().filter(|d| **d != one) {
            let what = format!("{dims} {} vs {one} on {device:?}{note}", optim.name());
            let got = train(&on_device, batches, dims, optim);
            // The engines on the same arithmetic: under SGD the layouts' own per-element
            // tolerance (measured on the H200: 4.8e-7 at most); under AdamW normwise.
            let closeness = match optim {
                OptimizerKind::Sgd => assert_same_run(&what, &got, &reference, tolerance(optim)),
                OptimizerKind::AdamW => bonfire_train::parity::assert_same_run_normwise(
                    &what, &got, &reference, TF32, floor,
                ),
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
}

/// The bench GPT (SGD, lr 0.01) and the bench Llama (AdamW lr 1e-3, β 0.9/0.95, ε 1e-6,
/// weight decay 0.1) trained on one rank on `device`, batch 8 of their full sequence length,
/// `steps` timed after 2 warm-up steps: the models and settings of `cargo xtask bench train`.
pub fn tokens_per_second(device: &Device, steps: usize) -> Result<Vec<Speed>, String> {
    let gpt = GptConfig::bench();
    let llama = LlamaConfig::bench();
    let sgd = || SgdConfig::new().init();
    let adamw = || {
        FusedAdamWConfig::new()
            .with_beta_1(0.9)
            .with_beta_2(0.95)
            .with_epsilon(1e-6)
            .with_weight_decay(0.1)
            .init()
    };
    let one = dims("dp=1", 0, false);
    Ok(vec![
        speed(
            "gpt",
            &Gpt::new(&gpt, device),
            &Trainer::new(one.clone(), sgd),
            (gpt.vocab_size, gpt.max_seq_len, 0.01),
            steps,
        )?,
        speed(
            "llama",
            &Llama::new(&llama, device),
            &Trainer::new(one, adamw),
            (llama.vocab_size, llama.max_position_embeddings, 1e-3),
            steps,
        )?,
    ])
}

/// `model` trained by `trainer` on 8 random rows of `(vocab, seq)` per step at `lr`.
fn speed<M: ParallelModel<Batch = TokenBatch> + Sync>(
    name: &'static str,
    model: &M,
    trainer: &Trainer,
    (vocab, seq, lr): (usize, usize, f64),
    steps: usize,
) -> Result<Speed, String> {
    const BATCH: usize = 8;
    let schedule = Steps {
        warmup: 2,
        timed: steps,
    };
    let data = throughput::random_batches(vocab, seq, BATCH, schedule.total(), 3);
    let rows = |_: usize, s: usize, d: &Device| data.rows(s, 0, BATCH, d);
    let hosts = Hosts::Threads { ranks: 1 };
    let per_rank = throughput::train_at(model, trainer, hosts, schedule, &rows, lr)
        .map_err(|e| format!("{name}: {e}"))?;
    let step_ms = schedule.slowest(&per_rank);
    Ok(Speed {
        model: name,
        step_ms,
        tokens_per_s: (BATCH * seq) as f64 / (step_ms / 1e3),
    })
}

/// How close an f32 run comes to transformers' float64 run of the Llama fixture: relative
/// 1e-5 with a floor for elements that cancel.
pub const F64: Tolerance = Tolerance::new(1e-5, 1e-6);

/// The normwise bound ([`bonfire_train::parity::assert_same_run_normwise`]) of a run on CUDA. Burn 0.22.1's
/// CUDA backend computes f32 matrix products on TF32 tensor cores (burn-cubecl's matmul tuner
/// promotes f32 operands to tf32: 10 mantissa bits, unit roundoff 2⁻¹¹ ≈ 4.9e-4), so no f32
/// bound holds there: measured on an H200 (2026-11-27, the Llama fixture, 2 SGD steps),
/// parameters 3.6e-4 of their largest magnitude from transformers' float64 run (Flex: 2.3e-7),
/// step-0 gradients up to 1.0e-3 from Flex's. Four unit roundoffs: 2e-3.
pub const TF32: f32 = 2e-3;

/// Under AdamW on CUDA the parameters are not compared (only their shapes and that they are
/// finite): Adam's normalised step turns TF32's rounding of a near-zero gradient into a whole
/// step of the other sign. Measured on the H200, one rank against Flex after 2 steps at
/// lr 0.01: an fc1 weight 0.24·lr apart, another 1.0·lr (−0.0294 vs −0.0394) — no bound
/// below the 2·lr·steps Adam can move at all. The step-0 gradients (before any update) and
/// both losses (the second after the first update) are compared normwise, as under SGD, whose
/// parameters are compared too.
pub const ADAMW_TF32_FLOOR: f32 = f32::INFINITY;

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
