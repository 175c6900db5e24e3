//! Mixed precision in every layout: bf16 (and f16) compute with fp32 master weights and
//! optimizer state, gradients reduced in fp32 or bf16.
//!
//! - Every layout under a policy equals the same policy on one device, within a tolerance
//!   of a few bf16 roundings of the update (`sgd_half`, `adamw_half`): the layouts differ
//!   only in where the half-precision weight gradients are rounded (each rank rounds its
//!   rows' partial sum) and, under cp, how ring attention's blocks are rounded.
//! - The policy is in force in every layout, on every rank: the parameter values its layers
//!   compute with and the activations they receive are in the param dtype, the gradients
//!   handed to the data-parallel reduction in the reduce dtype (observed per rank thread,
//!   `bonfire_module::precision::observe`); and every bf16 layout without tp or cp is nearer
//!   the bf16 run on one device than the fp32 one (a layout computing in fp32 would be nearer
//!   fp32). Under tp and cp that distance says nothing: their own roundings (row-parallel
//!   partial sums in bf16, ring attention's f32 blocks) move them as far from the one-device
//!   bf16 run as bf16 is from fp32 — measured over 16 draws, 66 of 96 tp/cp cases under
//!   AdamW and 30 under SGD sat nearer fp32, no case without tp or cp — so there the
//!   observed dtypes are the check.
//! - bf16 tracks the fp32 run within `BF16_VS_F32_SGD` / `BF16_VS_F32_ADAMW` (losses and
//!   parameters after the steps), and differs from it by at least their lower bounds.
//! - f16 with dynamic loss scaling: a first scale that overflows is skipped and lowered on
//!   every rank alike, and training recovers.

mod common;

use bonfire_comm::testing::Tolerance;
use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_examples::harness;
use bonfire_layout::{MixedPrecision, ParallelDims};
use bonfire_module::PrecisionDTypes;
use bonfire_module::precision::observe::{Observed, observed};
use bonfire_train::parity::{Outcome, RankRecord};
use bonfire_train::{FitConfig, Launcher, LossScaling, OptimizerKind, TrainError, Trainer, fit};
use burn::tensor::Device;
use std::sync::OnceLock;

const STEPS: usize = 3;
const ROWS: usize = 8;

type Fixture = common::GptFixture;

/// The model's draw: `params::seeded(3)`, or `BONFIRE_MP_SEED` (how the bounds below were
/// measured over other draws).
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    let seed = std::env::var("BONFIRE_MP_SEED").map_or(3, |s| s.parse().expect("a seed"));
    common::gpt_fixture(&F, STEPS, ROWS, seed, 7)
}

// The bounds of this suite were fitted on 8 draws of the model (`BONFIRE_MP_SEED` = 3, 11,
// 17, 23, 31, 41, 53, 61: each bound 1.5× the largest of its case on them) and judged on 8
// draws they never saw (71, 83, 97, 101, 113, 127, 139, 151), issue 45. Before, each was set
// from one draw and was exceeded by others (the figures below).

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

/// A run under `dims`, after checking on every rank that its policy was in force.
fn train(dims: &ParallelDims, optim: OptimizerKind) -> Outcome {
    let f = fixture();
    let lr = common::gpt_lr(optim);
    let (result, ranks) = harness::train_recorded(&f.model, &f.batches, dims, optim, STEPS, lr)
        .unwrap_or_else(|e| panic!("{dims} {}: {e}", optim.name()));
    let records: Vec<Observed> = ranks.iter().map(|r: &RankRecord| r.precision).collect();
    assert_policy(&format!("{dims}"), dims, &records);
    result
}

/// Every rank of the run computed with `dims.precision`: each parameter value its layers ran
/// with and each activation they received in the param dtype, each gradient buffer handed to
/// the data-parallel reduction in the reduce dtype — at least one of each, none other.
fn assert_policy(what: &str, dims: &ParallelDims, ranks: &[Observed]) {
    let (param_dtype, reduce_dtype) = (dims.precision.param_dtype(), dims.precision.reduce_dtype());
    assert_eq!(
        ranks.len(),
        dims.world_size(),
        "{what}: one record per rank"
    );
    for (rank, seen) in ranks.iter().enumerate() {
        let ok = seen.params.only(param_dtype)
            && seen.activations.only(param_dtype)
            && seen.reduced.only(reduce_dtype);
        assert!(
            ok,
            "{what} rank {rank}: the policy ({param_dtype:?}, reduce {reduce_dtype:?}) is not in \
             force: {seen:?}"
        );
    }
    let r0 = &ranks[0];
    println!(
        "policy {what}: rank 0 saw {} params, {} activations, {} reduced buffers, all as required",
        r0.params.total(),
        r0.activations.total(),
        r0.reduced.total()
    );
}

/// The fp32 run on one device (per optimizer, computed once).
fn f32_run(optim: OptimizerKind) -> &'static Outcome {
    static RUNS: [OnceLock<Outcome>; 2] = [OnceLock::new(), OnceLock::new()];
    let k = usize::from(matches!(optim, OptimizerKind::AdamW));
    RUNS[k].get_or_init(|| train(&ParallelDims::new(), optim))
}

/// Layouts under `policy` against the same policy on one device, each nearer that run than
/// the fp32 one.
fn check(policy: MixedPrecision, cases: &[ParallelDims]) {
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        let single = train(&ParallelDims::new().with_precision(policy), optim);
        for case in cases {
            let dims = case.clone().with_precision(policy);
            let got = train(&dims, optim);
            let what = format!("{dims} {}", optim.name());
            match optim {
                OptimizerKind::Sgd => {
                    let tol = sgd_half(&dims);
                    let closeness = common::assert_same_run(&what, &got, &single, tol);
                    println!("parity {what}: {closeness}");
                }
                OptimizerKind::AdamW => {
                    let worst = assert_same_updates(&what, &got, &single, adamw_half(&dims));
                    println!("parity {what}: worst rms(diff)/rms(update) {worst:.3}");
                }
            }
            let (to_half, to_f32) = (distance(&got, &single), distance(&got, f32_run(optim)));
            println!("distance {what}: to {policy} {to_half:.3}, to f32 {to_f32:.3}");
            assert!(
                to_half < to_f32 || dims.tp() > 1 || dims.cp() > 1,
                "{what}: nearer the fp32 run ({to_f32:.3}) than the {policy} one ({to_half:.3})"
            );
        }
    }
}

/// Under SGD: a few bf16 roundings (2⁻⁸ relative) of the values, plus an absolute floor of
/// a few roundings of one update (lr·|g|), for losses, step-0 gradients and parameters.
/// Largest |diff| over the old tolerance allowed, on the fit / the test draws: without tp
/// or cp (DDP, ZeRO 1–3, offload, 1F1B, ZB-H1, dp × pp) 0.58 / 0.57 of (1.5e-2, 1.5e-3), kept;
/// with tensor parallelism (its row-parallel partial sums are rounded to bf16 before their
/// all-reduce) 1.04 / 1.43 of (2e-2, 2e-3), and with context parallelism 1.23 / 1.20 of
/// (1.5e-2, 1.5e-3) — both now (3e-2, 3e-3): 0.69 / 0.95 and 0.62 / 0.60 of it. (Before:
/// tp (2e-2, 2e-3), cp (1.5e-2, 1.5e-3), from one draw reading 0.56 and 0.39.)
fn sgd_half(dims: &ParallelDims) -> Tolerance {
    match dims.tp() > 1 || dims.cp() > 1 {
        false => Tolerance::new(1.5e-2, 1.5e-3),
        true => Tolerance::new(3e-2, 3e-3),
    }
}

/// Under AdamW, element-wise bounds say little: Adam divides each gradient element by its
/// RMS, so where the exact gradient cancels to ≈ 0 (the attention key biases: softmax
/// ignores a constant added to every score) bf16 rounding noise becomes a step of up to lr
/// whose sign depends on where the rounding happened. So the losses must agree within 2 %,
/// and for every parameter tensor the RMS of the difference must stay under this fraction
/// of the RMS of the one-device run's update (a wrong layout differs by ~100 %; bf16
/// against fp32 differs by `bf16_tracks_f32`'s figure). Worst ratios on the fit / the test
/// draws: DDP, ZeRO 1–3, offload, 1F1B and ZB-H1 (reduced in fp32 or bf16) 0.117 / 0.112 —
/// bound 0.18 (was 0.08); dp × pp (each replica's micro-batches of 2 rows are rounded
/// separately) 0.242 / 0.223 — bound 0.36 (was 0.2); tensor and context parallelism 0.371 /
/// 0.423 — bound 0.55 (was 0.2): ring attention sums P·V unrounded in f32 block by block
/// where one device rounds the normalized P to bf16 first (cp alone: 0.242 / 0.409).
fn adamw_half(dims: &ParallelDims) -> f32 {
    if dims.tp() > 1 || dims.cp() > 1 {
        0.55
    } else if dims.dp() > 1 && dims.pp() > 1 {
        0.36
    } else {
        0.18
    }
}

/// Losses within 2 % and, per tensor, rms(got − want) ≤ `bound` · rms(want − init); returns
/// the worst ratio.
fn assert_same_updates(what: &str, got: &Outcome, want: &Outcome, bound: f32) -> f32 {
    bonfire_comm::testing::assert_close(
        &format!("{what} loss"),
        &got.losses,
        &want.losses,
        Tolerance::new(2e-2, 0.0),
    );
    update_ratios(got, want, |path, ratio, diff, update| {
        assert!(
            ratio <= bound,
            "{what} {path}: rms(diff) {diff:e} is {ratio:.3} of rms(update) {update:e} > {bound}"
        );
    })
}

/// The worst, over parameter tensors, of rms(got − want) / rms(want − init).
fn distance(got: &Outcome, want: &Outcome) -> f32 {
    update_ratios(got, want, |_, _, _, _| {})
}

/// For every parameter tensor but the key biases, `each(path, ratio, rms(diff),
/// rms(update))` with ratio = rms(got − want) / rms(want − init); returns the worst ratio.
fn update_ratios(got: &Outcome, want: &Outcome, mut each: impl FnMut(&str, f32, f32, f32)) -> f32 {
    let f = fixture();
    let infos = bonfire_module::params::inventory(&f.model);
    let init = bonfire_module::params::flatten_values(&f.model, &infos);
    let offsets = bonfire_module::params::offsets_of(&infos);
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
        each(&p.path, ratio, diff, update);
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

/// Context parallelism in bf16: ring attention's blocks, their online softmax and the K/V
/// blocks (and dK/dV) around the ring in bf16, against one device's fused softmax.
#[test]
fn bf16_context_parallel_equals_one_device() {
    let cases = [
        dims("cp=2", 0, None, ""),
        dims("dp=2,cp=2", 1, None, ""),
        dims("cp=2,tp=2", 0, None, "sp"),
    ];
    check(MixedPrecision::bf16(), &cases);
}

#[test]
fn bf16_reduced_in_bf16_equals_one_device() {
    let policy = MixedPrecision::bf16().reduced_in_param();
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
/// (losses within 2 %, every tensor's update within `BF16_VS_F32_SGD` / `_ADAMW`, RMS), and
/// not equal to it.
#[test]
fn bf16_tracks_f32() {
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        let policy = MixedPrecision::bf16();
        let half = train(&ParallelDims::new().with_precision(policy), optim);
        let what = format!("{policy} vs f32 {}", optim.name());
        let (at_most, at_least) = match optim {
            OptimizerKind::Sgd => BF16_VS_F32_SGD,
            OptimizerKind::AdamW => BF16_VS_F32_ADAMW,
        };
        let worst = assert_same_updates(&what, &half, f32_run(optim), at_most);
        println!("tracking {what}: worst rms(diff)/rms(update) {worst:.3}");
        assert!(
            worst >= at_least,
            "{what}: the bf16 run is (nearly) the fp32 run: {worst:.3} < {at_least}"
        );
    }
}

/// How far a bf16 run's updates stray from the fp32 run's (the worst RMS ratio per tensor):
/// at most, and at least (a run that ignored the policy would be the fp32 run, 0). On the
/// fit / the test draws: SGD 0.019–0.029 / 0.020–0.033, AdamW 0.144–0.358 / 0.114–0.386;
/// bounds 1.5× the fit's largest and half its smallest. (Before, from one draw: SGD (0.19,
/// 0.02), AdamW (0.3, 0.075), which draws 41 and 3 fell outside.)
const BF16_VS_F32_SGD: (f32, f32) = (0.045, 0.0095);
const BF16_VS_F32_ADAMW: (f32, f32) = (0.54, 0.072);

/// f16 with dynamic loss scaling, started at a scale that overflows, on one device and on
/// dp = 2 under DDP and ZeRO-2. In every run: the first step overflows and is skipped, each
/// overflow halves the scale and skips the update, the scale doubles after 4 clean steps, at
/// least half the steps are taken, training learns and the weights stay finite; every rank
/// of a run makes the same decisions at the same scales.
///
/// A replica's loss is the mean over its own rows (as under PyTorch's DDP), so its backward
/// values are dp times one device's at the same scale: dp = 2 started at 2²⁰ must make every
/// decision of one device started at 2²¹, at half its scales, with its losses (within 2 %).
/// (Issue 45 measured the same start on both: the decisions part at the first taken step,
/// dp = 2 overflowing at 2¹⁴ where one device takes it — the old test compared those.)
#[test]
fn f16_overflow_is_skipped_and_training_recovers() {
    let f = fixture();
    let run = |mesh: &str, zero: usize, init_scale: f32| {
        let dims = dims(mesh, zero, None, "").with_precision(MixedPrecision::f16());
        let trainer = Trainer::new(dims.clone(), || OptimizerKind::AdamW.build());
        let data = |s: usize, d: &Device| f.batches.rows(s % STEPS, 0, f.batches.batch, d);
        let first = data(0, &default_device());
        let scaling = LossScaling::default()
            .with_init_scale(init_scale)
            .with_growth_interval(4);
        let config = FitConfig {
            loss_scaling: Some(scaling),
            ..FitConfig::new(16, 0.01)
        };
        let outcomes = Launcher::Threads {
            ranks: dims.world_size(),
        }
        .run("f16", |pg| -> Result<_, TrainError> {
            let start = observed();
            let mut engine = trainer.build(f.model.clone(), &pg, &first)?;
            let reports = fit(engine.as_mut(), &data, &config, &mut ())?;
            Ok((reports, engine.parameters()?, observed().since(&start)))
        })
        .unwrap();
        let mut ranks = Vec::new();
        let mut out: Option<F16Run> = None;
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            let (reports, params, seen) = outcome.unwrap();
            let this = F16Run::new(&reports, &params);
            let first = out.get_or_insert_with(|| this.clone());
            assert_eq!(
                (&this.skipped, &this.scales),
                (&first.skipped, &first.scales),
                "{dims} rank {rank}: the ranks' decisions and scales differ"
            );
            ranks.push(seen);
        }
        assert_policy(&format!("{dims}"), &dims, &ranks);
        let run = out.unwrap();
        run.assert_recovers(&format!("{dims}"));
        run
    };
    let single = run("dp=1", 0, 2_097_152.0);
    for (mesh, zero) in [("dp=2", 0), ("dp=2", 2)] {
        let got = run(mesh, zero, 1_048_576.0);
        let what = format!("f16 {mesh} zero={zero}");
        assert_eq!(
            got.skipped, single.skipped,
            "{what}: the decisions of one device"
        );
        let doubled: Vec<f32> = got.scales.iter().map(|s| 2.0 * s).collect();
        assert_eq!(doubled, single.scales, "{what}: half one device's scales");
        bonfire_comm::testing::assert_close(
            &format!("{what} losses"),
            &got.losses,
            &single.losses,
            Tolerance::new(2e-2, 0.0),
        );
    }
}

/// One f16 run's decisions, scales and losses (16 steps) and whether its weights are finite.
#[derive(Clone)]
struct F16Run {
    skipped: Vec<bool>,
    scales: Vec<f32>,
    losses: Vec<f32>,
    finite: bool,
}

impl F16Run {
    fn new(
        reports: &[bonfire_train::StepReport],
        params: &[bonfire_module::params::ParamValues],
    ) -> Self {
        Self {
            skipped: reports.iter().map(|r| r.skipped).collect(),
            scales: reports.iter().map(|r| r.loss_scale.unwrap()).collect(),
            losses: reports.iter().map(|r| r.loss).collect(),
            finite: params
                .iter()
                .all(|p| p.values.iter().all(|v| v.is_finite())),
        }
    }

    /// The first step skipped, each skip halving the scale, ≥ 8 of 16 steps taken, finite
    /// weights and losses, and a last loss under the first taken step's.
    fn assert_recovers(&self, what: &str) {
        println!(
            "{what} f16 skipped {:?}\n{what} f16 scales {:?}",
            self.skipped, self.scales
        );
        assert_eq!(self.skipped.len(), 16, "{what}: 16 steps");
        assert!(
            self.skipped[0],
            "{what}: 2^20 must overflow f16 at the first step"
        );
        let taken = self.skipped.iter().filter(|s| !**s).count();
        assert!(
            taken >= 8,
            "{what}: training recovers: {taken} of 16 steps taken"
        );
        for (w, skip) in self.scales.windows(2).zip(&self.skipped) {
            assert!(
                !skip || w[1] == w[0] / 2.0,
                "{what}: an overflow halves the scale: {} -> {}",
                w[0],
                w[1]
            );
        }
        assert!(self.finite, "{what}: the weights are finite");
        assert!(
            self.losses.iter().all(|l| l.is_finite()),
            "{what}: finite losses"
        );
        let first_taken = self.losses[self.skipped.iter().position(|s| !s).unwrap()];
        assert!(
            self.losses[15] < first_taken,
            "{what}: f16 training learns: {first_taken} -> {}",
            self.losses[15]
        );
    }
}
