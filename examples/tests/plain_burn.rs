//! An independent reference (issue 26, point 6): the layout suites (`layouts.rs`,
//! `loss_curves.rs`) compare every layout with Bonfire's own one-device run, so a bug every
//! layout shares — in the fused kernels, the layer wrappers, the training loop — cancels.
//! Here the reference is plain Burn (`common::plain`): the GPT's math written with Burn
//! tensor ops on the parameters of the same `Gpt` module (its own `forward` is not plain Burn
//! even outside an engine: every layer runs through `bonfire_module::layer`, linears through
//! `bonfire_module::weight_grad::linear_matmul`, and GELU, the causal softmax and the
//! cross-entropy are `bonfire_kernels`' fused ops with hand-written backwards), Burn's
//! `loss.backward()`, `GradientsParams::from_grads` and Burn's own `SgdConfig` /
//! `AdamWConfig` (β1 0.9, β2 0.95, ε 1e-6, weight decay 0.1). Against it, with SGD and AdamW:
//! Bonfire's one-device run and one layout per axis (DDP dp=2, ZeRO-3 dp=2, tp=2, pp=2 1F1B,
//! cp=2 with ring attention) through the parity harness — the loss of every step, every step-0 gradient and every
//! parameter after 3 steps, within the suites' tolerances (`common::SGD`, `common::adamw`).

mod common;

use bonfire_examples::cli::LayoutArgs;
use bonfire_models::data::Batches;
use bonfire_models::gpt::Gpt;
use bonfire_train::OptimizerKind;
use bonfire_train::parity::Outcome;
use burn::tensor::Device;
use common::plain::{Recipe, plain_burn as plain};
use std::sync::OnceLock;

/// Plain Burn (`common::plain`) stepped at `lrs`, with the contract's optimizer settings.
fn plain_burn(model: &Gpt, batches: &Batches, optim: OptimizerKind, lrs: &[f64]) -> Outcome {
    let recipe = Recipe {
        optim: optim.into(),
        lrs: lrs.to_vec(),
        clip: None,
    };
    plain(model, batches, &recipe)
}

const STEPS: usize = 3;
const ROWS: usize = 8;

// ---------------------------------------------------------------------------------------
// The comparisons
// ---------------------------------------------------------------------------------------

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
            batches: common::random_batches(&cfg, STEPS, ROWS, 7),
        }
    })
}

/// Bonfire's one-device run and one layout per axis: `(mesh, zero, schedule, microbatches)`.
const LAYOUTS: &[(&str, usize, Option<&str>, Option<usize>)] = &[
    ("dp=1", 0, None, None),
    ("dp=2", 0, None, None),
    ("dp=2", 3, None, None),
    ("tp=2", 0, None, None),
    ("pp=2", 0, Some("1f1b"), Some(4)),
    ("cp=2", 0, None, None),
];

/// [`LAYOUTS`] as layouts.
fn layouts() -> Vec<bonfire_layout::ParallelDims> {
    let layouts: Vec<_> = LAYOUTS
        .iter()
        .map(|&(mesh, zero, schedule, microbatches)| {
            LayoutArgs {
                mesh: Some(mesh.into()),
                zero,
                schedule: schedule.map(str::to_string),
                microbatches,
                ..LayoutArgs::default()
            }
            .dims("dp=1")
            .unwrap()
        })
        .collect();
    assert!(!layouts.is_empty());
    layouts
}

/// The suites' tolerance for `optim` at its rate `lr`.
fn tolerance(optim: OptimizerKind, lr: f64) -> bonfire_comm::testing::Tolerance {
    match optim {
        OptimizerKind::Sgd => common::SGD,
        OptimizerKind::AdamW => common::adamw(lr),
    }
}

/// Every layout of [`LAYOUTS`] trained by `train` (`steps` steps) equals `reference` within
/// `tol`; prints how close each came.
fn every_layout_equals(
    label: &str,
    reference: &Outcome,
    (steps, tol): (usize, bonfire_comm::testing::Tolerance),
    train: impl Fn(&bonfire_layout::ParallelDims) -> Outcome,
) {
    for dims in layouts() {
        let what = format!("plain Burn{label} vs {dims}");
        let got = train(&dims);
        assert_eq!(got.losses.len(), steps, "{what}: losses");
        let closeness = common::assert_same_run(&what, &got, reference, tol);
        println!("{what}: {closeness}");
    }
}

fn check(optim: OptimizerKind) {
    let f = fixture();
    let lr = common::gpt_lr(optim);
    let reference = plain_burn(&f.model, &f.batches, optim, &[lr; STEPS]);
    assert_eq!(reference.params.len(), 16 * common::gpt_cfg().n_layers + 5);
    let label = format!(" {}", optim.name());
    every_layout_equals(&label, &reference, (STEPS, tolerance(optim, lr)), |dims| {
        common::train_layout(&f.model, &f.batches, dims, optim, STEPS)
    });
}

#[test]
fn sgd_layouts_equal_plain_burn() {
    check(OptimizerKind::Sgd);
}

#[test]
fn adamw_layouts_equal_plain_burn() {
    check(OptimizerKind::AdamW);
}

// ---------------------------------------------------------------------------------------
// The learning-rate schedule (issue 46): warmup then cosine decay, against plain Burn stepped
// at the contract's rates written out here (not Bonfire's `LrSchedule`)
// ---------------------------------------------------------------------------------------

/// Steps of the scheduled runs: 2 of warmup, then 2 of cosine decay to a tenth of the peak.
const SCHEDULED: usize = 4;

/// The contract's rates for W = 2, S = 4, cosine to lr/10: lr·1/2, lr·2/2, then
/// f = 0 and f = 1/2 of the decay (min + (lr − min)·(1 + cos πf)/2).
fn contract_rates(lr: f64) -> Vec<f64> {
    let min = lr / 10.0;
    let cosine = |f: f64| min + (lr - min) * (1.0 + (std::f64::consts::PI * f).cos()) / 2.0;
    vec![lr / 2.0, lr, cosine(0.0), cosine(0.5)]
}

/// The scheduled runs' batches: `SCHEDULED` global batches of `ROWS` (seed 9).
fn scheduled_batches() -> &'static Batches {
    static BATCHES: OnceLock<Batches> = OnceLock::new();
    BATCHES.get_or_init(|| common::random_batches(&common::gpt_cfg(), SCHEDULED, ROWS, 9))
}

/// Warmup 2, then cosine decay to `lr`/10 (Bonfire's side of [`contract_rates`]).
fn schedule(lr: f64) -> bonfire_train::LrSchedule {
    bonfire_train::LrSchedule {
        warmup: 2,
        decay: bonfire_train::Decay::Cosine,
        min_lr: lr / 10.0,
    }
}

fn check_scheduled(optim: OptimizerKind) {
    let (model, batches) = (&fixture().model, scheduled_batches());
    let lr = common::gpt_lr(optim);
    let reference = plain_burn(model, batches, optim, &contract_rates(lr));
    let config = bonfire_train::FitConfig {
        schedule: schedule(lr),
        ..bonfire_train::FitConfig::new(SCHEDULED, lr)
    };
    let label = format!(" (scheduled) {} warmup 2 cosine", optim.name());
    let tol = tolerance(optim, lr);
    every_layout_equals(&label, &reference, (SCHEDULED, tol), |dims| {
        bonfire_examples::harness::train_with(model, batches, dims, optim, &config)
            .unwrap_or_else(|e| panic!("{dims}{label}: {e}"))
            .0
    });
}

#[test]
fn sgd_layouts_follow_the_schedule_as_plain_burn() {
    check_scheduled(OptimizerKind::Sgd);
}

#[test]
fn adamw_layouts_follow_the_schedule_as_plain_burn() {
    check_scheduled(OptimizerKind::AdamW);
}

/// A run scheduled over 4 steps, saved after 2 under dp=2 ZeRO-1 and resumed under tp=2,
/// equals the uninterrupted scheduled run on one device (itself plain Burn's, above): the
/// schedule's position is the step, not the steps since the start (a schedule restarted at
/// the resume would train step 2 at lr/2).
#[test]
fn a_resumed_run_continues_the_schedule() {
    let layout = |mesh: &str, zero| {
        LayoutArgs {
            zero,
            ..LayoutArgs::mesh(mesh)
        }
        .dims("dp=1")
        .unwrap()
    };
    let adamw = common::adamw(common::gpt_lr(OptimizerKind::AdamW));
    common::resume::check_resume_scheduled(
        "schedule",
        &fixture().model,
        scheduled_batches(),
        ROWS,
        (&layout("dp=2", 1), &layout("tp=2", 0)),
        (SCHEDULED, 2),
        adamw,
        schedule,
    );
}
