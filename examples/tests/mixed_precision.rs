//! Mixed precision in every layout: bf16 (and f16) compute with fp32 master weights and
//! optimizer state, gradients reduced in fp32 or bf16.
//!
//! - Every layout under a policy equals the same policy on one device, within a tolerance
//!   of a few bf16 roundings of the update (`HALF`): the layouts differ only in where the
//!   half-precision weight gradients are rounded (each rank rounds its rows' partial sum).
//! - bf16 tracks the fp32 run within `BF16_VS_F32` (losses and parameters after the steps).
//! - f16 with dynamic loss scaling: a first scale that overflows is skipped and lowered on
//!   every rank alike, and training recovers.

mod common;

use bonfire_comm::testing::Tolerance;
use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_examples::harness::HarnessResult;
use bonfire_train::{
    FitConfig, Launcher, LossScaling, MixedPrecision, OptimizerKind, ParallelDims, TrainError,
    Trainer, fit,
};
use burn::tensor::Device;
use std::sync::OnceLock;

const STEPS: usize = 3;
const ROWS: usize = 8;

type Fixture = common::GptFixture;

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    common::gpt_fixture(&F, STEPS, ROWS, 3, 7)
}

fn dims(mesh: &str, zero: usize, schedule: Option<&str>, flags: &str) -> ParallelDims {
    LayoutArgs {
        mesh: Some(mesh.into()),
        zero,
        schedule: schedule.map(str::to_string),
        sequence_parallel: flags.contains("sp"),
        loss_parallel: flags.contains("lp"),
        offload: flags.contains("offload"),
        ..LayoutArgs::default()
    }
    .dims("dp=1")
    .unwrap()
}

fn train(dims: &ParallelDims, optim: OptimizerKind) -> HarnessResult {
    let f = fixture();
    common::train_layout(&f.model, &f.batches, dims, optim, STEPS)
}

/// Layouts under `policy` against the same policy on one device.
fn check(policy: MixedPrecision, cases: &[ParallelDims]) {
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        let single = train(&ParallelDims::new().with_precision(policy), optim);
        for case in cases {
            let dims = case.clone().with_precision(policy);
            let got = train(&dims, optim);
            let what = format!("{dims} {}", optim.name());
            match optim {
                OptimizerKind::Sgd => {
                    let closeness = common::assert_same_run(&what, &got, &single, SGD_HALF);
                    println!("parity {what}: {closeness}");
                }
                OptimizerKind::AdamW => {
                    let worst = assert_same_updates(&what, &got, &single, ADAMW_HALF);
                    println!("parity {what}: worst rms(diff)/rms(update) {worst:.3}");
                }
            }
        }
    }
}

/// Under SGD: a few bf16 roundings (2⁻⁸ relative) of the values, plus an absolute floor of
/// a few roundings of one update (lr·|g|), for losses, step-0 gradients and parameters.
const SGD_HALF: Tolerance = Tolerance::new(2e-2, 2e-3);

/// Under AdamW, element-wise bounds say little: Adam divides each gradient element by its
/// RMS, so where the exact gradient cancels to ≈ 0 (the attention key biases: softmax
/// ignores a constant added to every score) bf16 rounding noise becomes a step of up to lr
/// whose sign depends on where the rounding happened. So the losses must agree within 2 %,
/// and for every parameter tensor the RMS of the difference must stay under this fraction
/// of the RMS of the one-device run's update (a wrong layout differs by ~100 %; bf16
/// against fp32 differs by `bf16_tracks_f32`'s figure). Tensor parallelism rounds more
/// (its row-parallel partial sums are bf16 before their all-reduce), hence 0.2, not 0.1.
const ADAMW_HALF: f32 = 0.2;

/// Losses within 2 % and, per tensor, rms(got − want) ≤ `bound` · rms(want − init).
fn assert_same_updates(what: &str, got: &HarnessResult, want: &HarnessResult, bound: f32) -> f32 {
    let f = fixture();
    bonfire_comm::testing::assert_close(
        &format!("{what} loss"),
        &got.losses,
        &want.losses,
        Tolerance::new(2e-2, 0.0),
    );
    let infos = bonfire_dtensor::params::inventory(&f.model);
    let init = bonfire_dtensor::params::flatten_values(&f.model, &infos);
    let offsets = bonfire_dtensor::params::offsets_of(&infos);
    let rms = |v: &mut dyn Iterator<Item = f32>| {
        let (s, n) = v.fold((0.0f64, 0usize), |(s, n), x| (s + f64::from(x * x), n + 1));
        (s / n.max(1) as f64).sqrt() as f32
    };
    let mut worst = 0.0f32;
    // The key biases' exact gradient is 0 (softmax ignores a constant added to every score):
    // their updates are Adam-normalized rounding noise in every run, compared with nothing.
    for (i, p) in infos.iter().enumerate() {
        if p.path.ends_with("attn.k.bias") {
            continue;
        }
        let (g, w) = (&got.params[&p.path].1, &want.params[&p.path].1);
        let before = &init[offsets[i]..offsets[i + 1]];
        let diff = rms(&mut g.iter().zip(w).map(|(a, b)| a - b));
        let update = rms(&mut w.iter().zip(before).map(|(a, b)| a - b));
        let ratio = diff / update.max(f32::MIN_POSITIVE);
        assert!(
            ratio <= bound,
            "{what} {}: rms(diff) {diff:e} is {ratio:.3} of rms(update) {update:e} > {bound}",
            p.path
        );
        worst = worst.max(ratio);
    }
    worst
}

#[test]
fn bf16_tensor_and_pipeline_parallel_equal_one_device() {
    let cases = [
        dims("tp=2", 0, None, ""),
        dims("tp=2", 0, None, "sp lp"),
        dims("pp=2", 0, Some("1f1b"), ""),
        dims("pp=2", 0, Some("zb"), ""),
        dims("dp=2,tp=2", 3, None, "sp"),
        dims("dp=2,pp=2", 1, Some("gpipe"), ""),
        dims("tp=2,pp=2", 0, Some("interleaved"), "lp"),
    ];
    check(MixedPrecision::bf16(), &cases);
}

#[test]
fn bf16_reduced_in_bf16_equals_one_device() {
    let policy = MixedPrecision::bf16().with_reduce_dtype(burn::tensor::DType::BF16);
    let cases = [
        dims("dp=2", 0, None, ""),
        dims("dp=2", 2, None, ""),
        dims("dp=2", 3, None, ""),
        dims("dp=2,pp=2", 3, Some("1f1b"), ""),
    ];
    check(policy, &cases);
}

#[test]
fn bf16_data_parallel_and_zero_equal_one_device() {
    let cases: Vec<ParallelDims> = (0..=3)
        .map(|z| dims("dp=2", z, None, ""))
        .chain([
            dims("dp=2", 1, None, "offload"),
            dims("dp=2", 3, None, "offload"),
        ])
        .collect();
    check(MixedPrecision::bf16(), &cases);
}

/// The same runs in bf16 and in fp32 on one device: within the stated bf16 tolerance
/// (`BF16_VS_F32`: losses within 2 %, every tensor's update within this fraction, RMS).
#[test]
fn bf16_tracks_f32() {
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        let f32_run = train(&ParallelDims::new(), optim);
        let policy = MixedPrecision::bf16();
        let half = train(&ParallelDims::new().with_precision(policy), optim);
        let what = format!("{policy} vs f32 {}", optim.name());
        let worst = assert_same_updates(&what, &half, &f32_run, BF16_VS_F32);
        println!("tracking {what}: worst rms(diff)/rms(update) {worst:.3}");
    }
}

/// How far a bf16 run's updates may stray from the fp32 run's (RMS per tensor).
const BF16_VS_F32: f32 = 0.3;

/// f16 with dynamic loss scaling, started at a scale that overflows (2²⁰): the first steps
/// are skipped on every rank alike (no update), the scale halves each time, then training
/// goes on; dp=2 under ZeRO-2 and DDP make the same decisions and losses as one device.
#[test]
fn f16_overflow_is_skipped_and_training_recovers() {
    let f = fixture();
    let scaling = LossScaling::default()
        .with_init_scale(1_048_576.0)
        .with_growth_interval(4);
    let run = |mesh: &str, zero: usize| {
        let dims = dims(mesh, zero, None, "").with_precision(MixedPrecision::f16());
        let trainer = Trainer::new(dims.clone(), || OptimizerKind::AdamW.build());
        let data = |s: usize, d: &Device| f.batches.rows(s % STEPS, 0, f.batches.batch, d);
        let first = data(0, &default_device());
        let config = FitConfig {
            loss_scaling: Some(scaling),
            ..FitConfig::new(16, 0.01)
        };
        Launcher::Threads {
            ranks: dims.world_size(),
        }
        .run("f16", |pg| -> Result<_, TrainError> {
            let mut engine = trainer.build(f.model.clone(), &pg, &first)?;
            let reports = fit(engine.as_mut(), &data, &config, &mut ())?;
            Ok((reports, engine.parameters()?))
        })
        .unwrap()
        .remove(0)
        .unwrap()
    };
    let (single, params) = run("dp=1", 0);
    let skipped: Vec<bool> = single.iter().map(|r| r.skipped).collect();
    let scales: Vec<f32> = single.iter().map(|r| r.loss_scale.unwrap()).collect();
    println!("f16 skipped {skipped:?}\nf16 scales {scales:?}");
    assert!(skipped[0], "2^20 must overflow f16 at the first step");
    let taken = skipped.iter().filter(|s| !**s).count();
    assert!(taken >= 8, "training recovers: {taken} of 16 steps taken");
    for w in scales.windows(2).zip(&skipped) {
        let ((a, b), skip) = ((w.0[0], w.0[1]), *w.1);
        assert!(
            !skip || b == a / 2.0,
            "an overflow halves the scale: {a} -> {b}"
        );
    }
    assert!(
        params
            .iter()
            .all(|p| p.values.iter().all(|v| v.is_finite()))
    );
    let losses: Vec<f32> = single.iter().map(|r| r.loss).collect();
    assert!(losses.iter().all(|l| l.is_finite()));
    let (last, first_taken) = (losses[15], losses[skipped.iter().position(|s| !s).unwrap()]);
    assert!(
        last < first_taken,
        "f16 training learns: {first_taken} -> {last}"
    );
    for (mesh, zero) in [("dp=2", 0), ("dp=2", 2)] {
        let (got, _) = run(mesh, zero);
        let got_skipped: Vec<bool> = got.iter().map(|r| r.skipped).collect();
        assert_eq!(
            got_skipped, skipped,
            "{mesh} zero={zero}: same skip decisions"
        );
        let got_losses: Vec<f32> = got.iter().map(|r| r.loss).collect();
        bonfire_comm::testing::assert_close(
            &format!("f16 {mesh} zero={zero} losses"),
            &got_losses,
            &losses,
            Tolerance::new(2e-2, 0.0),
        );
    }
}
