//! The training recipe (issue 46) against plain Burn, in every layout class: AdamW's settings
//! (β, ε, weight decay kept off 1-d parameters by Burn's own parameter groups on the plain
//! side), clipping by the global L2 norm (written on the plain side with `GradientsParams`
//! alone; the clip active on some steps and not on others, asserted), a warmup then linear
//! decay of the rate, and gradient accumulation (`--grad-accum 2` on Bonfire's side, none on
//! the plain side: the step's loss and gradients are those of the whole batch). Each layout
//! — DDP, ZeRO 1–3, offload, activation checkpointing, HSDP, tp with sequence parallelism, a
//! pipeline, cp, and a composition — gives every step's loss and gradient norm, every step-0 gradient and every
//! parameter after the steps as plain Burn does, within the suites' tolerances.

mod common;

use bonfire_comm::testing::{Tolerance, assert_close};
use bonfire_examples::harness;
use bonfire_layout::ParallelDims;
use bonfire_models::data::Batches;
use bonfire_models::gpt::Gpt;
use bonfire_train::parity::Outcome;
use bonfire_train::{AdamWSettings, Decay, FitConfig, LrSchedule, OptimizerKind, OptimizerSpec};
use burn::tensor::Device;
use common::plain::{Recipe, plain_burn};
use std::sync::OnceLock;

const STEPS: usize = 4;
const ROWS: usize = 8;

/// A layout in the suites' shorthand (`common::layout`): mesh, ZeRO stage, pipeline schedule
/// and micro-batches, flags.
type Case = (
    &'static str,
    usize,
    Option<&'static str>,
    Option<usize>,
    &'static str,
);

/// The layout classes.
const LAYOUTS: &[Case] = &[
    ("dp=1", 0, None, None, ""),
    ("dp=2", 0, None, None, ""),
    ("dp=2", 1, None, None, ""),
    ("dp=2", 2, None, None, ""),
    ("dp=2", 3, None, None, ""),
    ("dp=2", 1, None, None, "offload"),
    ("dp=2", 0, None, None, "ac"),
    ("dp_replicate=2,dp=2", 3, None, None, ""),
    ("tp=2", 0, None, None, "sp"),
    ("pp=2", 0, Some("1f1b"), Some(2), ""),
    ("cp=2", 0, None, None, ""),
    ("dp=2,tp=2", 3, None, None, "sp"),
];

struct Fixture {
    model: Gpt,
    batches: Batches,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let cfg = common::gpt_cfg();
        Fixture {
            model: common::seeded(3, &Device::flex().autodiff(), |d| Gpt::new(&cfg, d)),
            batches: common::random_batches(&cfg, STEPS, ROWS, 11),
        }
    })
}

/// Warmup 1, then linear decay to lr/4 (Bonfire's side).
fn schedule(lr: f64) -> LrSchedule {
    LrSchedule {
        warmup: 1,
        decay: Decay::Linear,
        min_lr: lr / 4.0,
    }
}

/// The contract's rates of [`schedule`] written out (W = 1, S = 4): lr·1/1, then
/// lr − (lr − min)·f for f = 0, 1/3, 2/3.
fn contract_rates(lr: f64) -> Vec<f64> {
    let min = lr / 4.0;
    let linear = |f: f64| lr - (lr - min) * f;
    vec![lr, linear(0.0), linear(1.0 / 3.0), linear(2.0 / 3.0)]
}

/// The optimizer of the recipe runs: SGD, or AdamW with settings other than the defaults and
/// the decay kept off 1-d parameters.
fn optimizer(kind: OptimizerKind) -> OptimizerSpec {
    OptimizerSpec {
        kind,
        adamw: AdamWSettings {
            betas: (0.8, 0.99),
            epsilon: 1e-8,
            weight_decay: 0.05,
            no_decay_1d: true,
        },
    }
}

/// A clipping norm between the smallest and the largest of plain Burn's unclipped norms,
/// and plain Burn's run clipped to it; asserts the clip acted on some steps, not on others.
fn clipped_reference(spec: OptimizerSpec, lr: f64) -> (f64, Outcome) {
    let f = fixture();
    let mut recipe = Recipe {
        optim: spec,
        lrs: contract_rates(lr),
        clip: None,
    };
    let probe = plain_burn(&f.model, &f.batches, &recipe).grad_norms;
    let (lo, hi) = probe
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), &n| (lo.min(n), hi.max(n)));
    let max = (lo + hi) / 2.0;
    recipe.clip = Some(max);
    let reference = plain_burn(&f.model, &f.batches, &recipe);
    let clipped = reference.grad_norms.iter().filter(|&&n| n > max).count();
    assert!(
        clipped > 0 && clipped < STEPS,
        "the clip at {max} must act on some steps and not others: norms {:?}",
        reference.grad_norms
    );
    (max, reference)
}

fn check(kind: OptimizerKind) {
    let f = fixture();
    let lr = common::gpt_lr(kind);
    let spec = optimizer(kind);
    let (max, reference) = clipped_reference(spec, lr);
    let config = FitConfig {
        schedule: schedule(lr),
        clip_grad_norm: Some(max),
        grad_accum: 2,
        ..FitConfig::new(STEPS, lr)
    };
    let tol = match kind {
        OptimizerKind::Sgd => common::SGD,
        OptimizerKind::AdamW => common::adamw(lr),
    };
    let norms = Tolerance::new(1e-5, 0.0);
    assert!(!LAYOUTS.is_empty());
    for &(mesh, zero, schedule, m, flags) in LAYOUTS {
        let dims: ParallelDims = common::layout(mesh, zero, schedule, m, flags)
            .dims("dp=1")
            .unwrap();
        let what = format!("plain Burn {} recipe vs {dims}", kind.name());
        let got = harness::train_with(&f.model, &f.batches, &dims, spec, &config)
            .unwrap_or_else(|e| panic!("{what}: {e}"))
            .0;
        assert_eq!(got.grad_norms.len(), STEPS, "{what}: a norm per step");
        let closeness = common::assert_same_run(&what, &got, &reference, tol);
        let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
        let (a, b) = (f32s(&got.grad_norms), f32s(&reference.grad_norms));
        let n = assert_close(&format!("{what}: grad_norm"), &a, &b, norms);
        println!("{what}: {closeness}; grad_norm {n}");
    }
}

#[test]
fn sgd_recipe_in_every_layout_class_equals_plain_burn() {
    check(OptimizerKind::Sgd);
}

#[test]
fn adamw_recipe_in_every_layout_class_equals_plain_burn() {
    check(OptimizerKind::AdamW);
}

/// `--grad-accum 2` (and 4) gives what no accumulation gives — on one device, under DDP and
/// under ZeRO-2 (one reduce-scatter after the last part) — and a batch that does not split
/// into equal parts is refused before any step.
#[test]
fn accumulation_equals_one_pass() {
    let f = fixture();
    let lr = common::gpt_lr(OptimizerKind::AdamW);
    let spec = OptimizerSpec::from(OptimizerKind::AdamW);
    for (mesh, zero) in [("dp=1", 0), ("dp=2", 0), ("dp=2", 2)] {
        let dims = common::layout(mesh, zero, None, None, "")
            .dims("dp=1")
            .unwrap();
        let run = |k: usize| {
            let config = FitConfig {
                grad_accum: k,
                ..FitConfig::new(2, lr)
            };
            harness::train_with(&f.model, &f.batches, &dims, spec, &config).map(|r| r.0)
        };
        let whole = run(1).unwrap();
        for k in [2, 4] {
            let what = format!("{dims}: --grad-accum {k} vs 1");
            let got = run(k).unwrap();
            println!(
                "{what}: {}",
                common::assert_same_run(&what, &got, &whole, common::adamw(lr))
            );
        }
        let err = run(3).expect_err("8 rows do not split into 3 parts");
        assert!(err.contains("--grad-accum 3"), "{dims}: {err}");
    }
}

/// Expert parallelism counts each expert once in the global norm: the Mixtral fixture (idle
/// experts included) with SGD clipped between its two unclipped norms, at ep = 2 and 4 under
/// DDP, ZeRO 1–3 and HSDP, gives the norms, losses, step-0 gradients and parameters of one
/// device (itself clipped as plain Burn is above).
#[test]
fn experts_count_once_in_the_global_norm() {
    let model = common::mixtral_fixture();
    let shape = bonfire_models::GptConfig {
        vocab_size: 64,
        max_seq_len: 8,
        ..common::gpt_cfg()
    };
    let batches = common::random_batches(&shape, 2, 4, 11);
    let spec = OptimizerSpec::from(OptimizerKind::Sgd);
    let lr = common::gpt_lr(OptimizerKind::Sgd);
    let run = |dims: &ParallelDims, clip: Option<f64>| {
        let config = FitConfig {
            clip_grad_norm: clip,
            grad_norm: true,
            ..FitConfig::new(2, lr)
        };
        harness::train_with(&model, &batches, dims, spec, &config)
            .unwrap_or_else(|e| panic!("mixtral {dims}: {e}"))
            .0
    };
    let one = ParallelDims::new();
    let probe = run(&one, None).grad_norms;
    let max = (probe[0] + probe[1]) / 2.0;
    let reference = run(&one, Some(max));
    let clipped = reference.grad_norms.iter().filter(|&&n| n > max).count();
    assert_eq!(
        clipped, 1,
        "one step clipped at {max}: {:?}",
        reference.grad_norms
    );
    for (mesh, zero) in [
        ("dp=2,ep=2", 0),
        ("dp=4,ep=4", 0),
        ("dp=4,ep=2", 1),
        ("dp=4,ep=2", 2),
        ("dp=2,ep=2", 3),
        ("dp_replicate=2,dp=2,ep=2", 2),
    ] {
        let dims = common::layout(mesh, zero, None, None, "")
            .dims("dp=1")
            .unwrap();
        let what = format!("mixtral clipped {dims}");
        let got = run(&dims, Some(max));
        let closeness = common::assert_same_run(&what, &got, &reference, common::SGD);
        let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
        let (a, b) = (f32s(&got.grad_norms), f32s(&reference.grad_norms));
        let n = assert_close(
            &format!("{what}: grad_norm"),
            &a,
            &b,
            Tolerance::new(1e-5, 0.0),
        );
        println!("{what}: {closeness}; grad_norm {n}");
    }
}

/// PyTorch's float64 run of the recipe (`fixtures/recipe/`, written by its `generate.py` with
/// transformers' Llama: AdamW's two parameter groups with β = (0.8, 0.99), ε = 1e-8, decay
/// 0.05; `clip_grad_norm_` acting on some steps and not others; warmup 1 then linear decay
/// to lr/4 by `LambdaLR`; no accumulation) against the parity harness with the contract's
/// flags and `--grad-accum 2`, in a layout of each class: every loss, gradient norm and step-0
/// gradient within [`common::F64`], every parameter within it (SGD) or the suites' AdamW
/// floor.
#[test]
fn the_recipe_matches_pytorch_in_float64() {
    let (llama, dir) = (common::fixture_dir("llama"), common::fixture_dir("recipe"));
    let reference = common::fixture_reference("recipe");
    let out = std::env::temp_dir().join(format!("bonfire-recipe-{}", std::process::id()));
    let cases: [Case; 6] = [
        ("dp=1", 0, None, None, ""),
        ("dp=2", 3, None, None, ""),
        ("tp=2", 0, None, None, "sp"),
        ("pp=2", 0, Some("1f1b"), Some(2), ""),
        ("cp=2", 0, None, None, ""),
        ("dp=2,tp=2", 1, None, None, "sp offload"),
    ];
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        let (name, lr) = (optim.name(), common::gpt_lr(optim));
        let want = |key: &str| -> &[f32] {
            let key = format!("{name}.{key}");
            reference
                .get(&key)
                .unwrap_or_else(|| panic!("fixture: no {key}"))
        };
        let recipe = bonfire_examples::cli::RecipeArgs {
            lr_warmup: 1,
            lr_decay: "linear".into(),
            lr_min: lr / 4.0,
            adamw_betas: "0.8,0.99".into(),
            adamw_eps: 1e-8,
            weight_decay: 0.05,
            no_decay_1d: true,
            clip_grad_norm: Some(want("max_norm")[0] as f64),
            grad_accum: 2,
            expert_bias_update: None,
        };
        let params = match optim {
            OptimizerKind::Sgd => common::F64,
            OptimizerKind::AdamW => common::adamw(lr),
        };
        for (mesh, zero, schedule, m, flags) in cases {
            let dims = common::layout(mesh, zero, schedule, m, flags)
                .dims("dp=1")
                .unwrap();
            let what = format!("PyTorch float64 {name} recipe vs {dims}");
            let args = harness::HarnessArgs {
                config: llama.join("config.json"),
                weights: llama.join("model.safetensors"),
                data: dir.join("batch.safetensors"),
                dims,
                optim,
                device: "flex".into(),
                steps: want("loss").len(),
                lr,
                recipe: recipe.clone(),
                out: out.join(format!("{name}-{mesh}-{zero}.safetensors")),
            };
            let got = harness::run(&args).unwrap_or_else(|e| panic!("{what}: {e}"));
            let norms: Vec<f32> = got.grad_norms.iter().map(|&n| n as f32).collect();
            let mut worst = assert_close(
                &format!("{what}: loss"),
                &got.losses,
                want("loss"),
                common::F64,
            );
            worst = worst.max(assert_close(
                &format!("{what}: grad_norm"),
                &norms,
                want("grad_norm"),
                common::F64,
            ));
            assert_eq!(got.params.len(), got.grad0.len());
            for (p, (_, values)) in &got.params {
                let g0 = &reference[&format!("grad0.{p}")];
                worst = worst.max(assert_close(
                    &format!("{what}: grad0.{p}"),
                    &got.grad0[p],
                    g0,
                    common::F64,
                ));
                worst = worst.max(assert_close(
                    &format!("{what}: {p}"),
                    values,
                    want(p),
                    params,
                ));
            }
            println!("{what}: {worst}");
        }
    }
    std::fs::remove_dir_all(out).ok();
}
