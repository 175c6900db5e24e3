//! Parity, the proof of every layout: a model trained a few steps in a layout, recorded
//! ([`record`]: parameters after the last step, step-0 gradients, losses — the parity
//! harness's contract — and what each rank ran), and two records compared within a tolerance
//! ([`assert_same_run`]; [`assert_same_run_normwise`] for products computed in a reduced
//! precision). The parity harness, the layout suites and the GPU kit all compare this way.

use crate::engine::Engine;
use crate::error::TrainError;
use crate::fit::{FitConfig, Hooks, fit};
use crate::launch::Launcher;
use crate::optim::{OptimizerKind, OptimizerSpec};
use crate::trainer::Trainer;
use bonfire_comm::testing::{Closeness, Tolerance, assert_close};
use bonfire_layout::ParallelDims;
use bonfire_module::params::ParamValues;
use bonfire_parallel::{DataSource, ParallelModel};
use burn::tensor::Device;
use std::collections::BTreeMap;

/// The tolerance of an f32 run against a float64 reference (transformers' fixtures): relative
/// 1e-5, absolute 1e-6 for elements that cancel.
pub const F64: Tolerance = Tolerance::new(1e-5, 1e-6);

/// What a run computed (rank 0's view; ranks agree): parameters after the last step, the
/// step-0 gradients, the losses.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Parameter name → (shape, values) after all steps.
    pub params: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// Parameter name → step-0 gradient of the global loss.
    pub grad0: BTreeMap<String, Vec<f32>>,
    /// Global loss at each step, before its update.
    pub losses: Vec<f32>,
    /// The global gradient norm of each step, before clipping (when the loop measured it:
    /// with clipping or `FitConfig::grad_norm`).
    pub grad_norms: Vec<f64>,
    /// State tensor name → (shape, values) after all steps (parameters without gradient:
    /// DeepSeek-V3's balancing biases; no `grad0`).
    pub state: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

impl Outcome {
    /// The contract's output tensors: parameters, `grad0.<name>`, `loss`, and the state
    /// tensors after the last step.
    pub fn tensors(&self) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
        let mut out = self.params.clone();
        out.extend(self.state.clone());
        for (name, g) in &self.grad0 {
            let shape = self.params[name].0.clone();
            out.insert(format!("grad0.{name}"), (shape, g.clone()));
        }
        out.insert(
            "loss".into(),
            (vec![self.losses.len()], self.losses.clone()),
        );
        out
    }
}

/// Keeps the whole gradients of step 0.
#[derive(Default)]
struct FirstGradients(Vec<ParamValues>);

impl<B> Hooks<B> for FirstGradients {
    fn after_backward(
        &mut self,
        step: usize,
        engine: &mut dyn Engine<B>,
    ) -> Result<(), TrainError> {
        if step == 0 {
            self.0 = engine.gradients()?;
        }
        Ok(())
    }
}

/// What one rank thread did during a [`record`] run, read on that thread (so that
/// runs beside it in the same process do not count): the dtypes its layers and reductions
/// ran in, the activation-checkpointed regions it recomputed in backward, the deferred
/// weight gradients it computed in "W" steps.
#[derive(Debug, Clone, Copy, Default)]
pub struct RankRecord {
    /// The dtypes its parameters, activations and gradient reductions were seen in.
    pub precision: bonfire_module::precision::observe::Observed,
    /// Number of activation-checkpointed regions recomputed in backward.
    pub recomputations: u64,
    /// Number of deferred weight gradients computed in "W" steps.
    pub weight_grads: u64,
}

impl RankRecord {
    /// This thread's counts so far.
    fn now() -> Self {
        Self {
            precision: bonfire_module::precision::observe::observed(),
            recomputations: bonfire_recompute::recomputations(),
            weight_grads: bonfire_module::weight_grad::applied(),
        }
    }

    /// What this thread did since `earlier`.
    fn since(earlier: &Self) -> Self {
        let now = Self::now();
        Self {
            precision: now.precision.since(&earlier.precision),
            recomputations: now.recomputations - earlier.recomputations,
            weight_grads: now.weight_grads - earlier.weight_grads,
        }
    }
}

/// `steps` steps of `model` under `dims` with Burn's `optim` at `lr`, on rank threads,
/// through the trainer, on the global batches of `data`: whole parameters after the last
/// step, whole step-0 gradients and the global losses (rank 0's; every rank computes the
/// same), and each rank's [`RankRecord`] of the run (in rank order).
pub fn record<M>(
    model: &M,
    data: &(dyn DataSource<M::Batch> + Sync),
    dims: &ParallelDims,
    optim: OptimizerKind,
    steps: usize,
    lr: f64,
) -> Result<(Outcome, Vec<RankRecord>), String>
where
    M: ParallelModel + Sync,
    M::Batch: Sync,
{
    record_with(model, data, dims, optim, &FitConfig::new(steps, lr))
}

/// [`record`] with the loop's whole configuration (its steps, peak rate and schedule).
pub fn record_with<M>(
    model: &M,
    data: &(dyn DataSource<M::Batch> + Sync),
    dims: &ParallelDims,
    optim: impl Into<OptimizerSpec>,
    config: &FitConfig,
) -> Result<(Outcome, Vec<RankRecord>), String>
where
    M: ParallelModel + Sync,
    M::Batch: Sync,
{
    let trainer = Trainer::with_optimizer(dims.clone(), optim);
    let first = data.batch(0, &Device::flex().autodiff());
    trainer
        .check(model, dims.world_size(), &first)
        .map_err(|e| e.to_string())?;
    let ranks = dims.world_size();
    let outcomes = Launcher::Threads { ranks }
        .run("parity", |pg| -> Result<_, TrainError> {
            let start = RankRecord::now();
            let mut engine = trainer.build(model.clone(), &pg, &first)?;
            let mut grads = FirstGradients::default();
            let reports = fit(engine.as_mut(), data, config, &mut grads)?;
            let params = engine.parameters()?;
            let state = engine.buffers()?;
            let result = Outcome {
                state: state
                    .into_iter()
                    .map(|p| (p.path, (p.shape, p.values)))
                    .collect(),
                params: params
                    .into_iter()
                    .map(|p| (p.path, (p.shape, p.values)))
                    .collect(),
                grad0: grads.0.into_iter().map(|p| (p.path, p.values)).collect(),
                losses: reports.iter().map(|r| r.loss).collect(),
                grad_norms: reports.iter().filter_map(|r| r.grad_norm).collect(),
            };
            Ok((result, RankRecord::since(&start)))
        })
        .map_err(|e| e.to_string())?;
    let mut result = None;
    let mut records = Vec::with_capacity(ranks);
    for outcome in outcomes {
        let (r, record) = outcome.map_err(|e| e.to_string())?;
        result.get_or_insert(r);
        records.push(record);
    }
    Ok((result.expect("rank 0"), records))
}

/// Asserts a run's outcome equals the reference — losses, every step-0 gradient and every
/// parameter, shapes included — within `tol`; says how close they came.
pub fn assert_same_run(what: &str, got: &Outcome, want: &Outcome, tol: Tolerance) -> Closeness {
    same_run(what, got, want, |_, _| tol)
}

/// The share of its kind's largest magnitude in the run below which a tensor's own scale is
/// not trusted by [`assert_same_run_normwise`]: a gradient that cancels (the key bias's, 0 in
/// exact arithmetic: 1.6e-12 on Flex, 3.9e-9 on CUDA) carries the error of the terms that
/// cancelled, which is set by the run's gradients, not by its own size.
pub const NORMWISE_FLOOR_SHARE: f32 = 1e-2;

/// [`assert_same_run`] within a *normwise* `bound`, tensor by tensor: each element within
/// relative `bound`, or `bound` times its tensor's largest magnitude in the reference run —
/// but no less than [`NORMWISE_FLOOR_SHARE`] of the largest of its kind (the losses, the
/// parameters, the step-0 gradients): the bound of products computed in a reduced precision
/// (TF32 tensor cores), whose error scales with the operands rather than with each result. Per
/// tensor, so that 0.02-sized weights are held to 2e-3 of 0.02, not of the norm weights' 1.
/// Parameters also pass within `param_floor` (`f32::INFINITY`: not compared but for NaN —
/// after AdamW, whose normalised step turns the rounding of a near-zero gradient into a whole
/// step of either sign: [`assert_updates_agree`] compares them; the gradients and losses stay
/// normwise).
pub fn assert_same_run_normwise(
    what: &str,
    got: &Outcome,
    want: &Outcome,
    bound: f32,
    param_floor: f32,
) -> Closeness {
    let params = largest_magnitude(want.params.values().flat_map(|(_, v)| v));
    let grads = largest_magnitude(want.grad0.values().flatten());
    let losses = largest_magnitude(&want.losses);
    same_run(what, got, want, |kind, reference| {
        let kind_scale = match kind {
            Kind::Loss => losses,
            Kind::Param => params,
            Kind::Grad => grads,
        };
        let scale = largest_magnitude(reference).max(NORMWISE_FLOOR_SHARE * kind_scale);
        let tol = normwise(bound, scale);
        match kind {
            Kind::Param => Tolerance::new(bound, tol.abs.max(param_floor)),
            _ => tol,
        }
    })
}

/// A tensor's step-0 gradient below this share of the run's largest, or got's and want's
/// further apart than a tenth of want's (2-norm): rounding noise — a sum that cancels, such as
/// the key bias's, 0 in exact arithmetic (1.6e-12 on Flex, 3.9e-9 on CUDA against gradients of
/// ~0.1) — and so is its AdamW update, whose later steps' noise differs again
/// ([`assert_updates_agree`]; measured on lavapipe, ZeRO-3 against one rank: the key bias's
/// step-0 gradients within a tenth, its updates 0.28 apart). The small but real gradients stay
/// compared (a GPT's q/k weights at initialisation, below 1e-3 of the largest on lavapipe).
pub const NOISE_GRADIENT_SHARE: f64 = 1e-6;

/// The 2-norm of `a − b` over the 2-norm of `b`: 0 when both are 0, ∞ when only `b` is.
fn relative_distance(a: &[f32], b: &[f32]) -> f64 {
    let (mut diff, mut size) = (0.0f64, 0.0f64);
    for (&a, &b) in a.iter().zip(b) {
        diff += f64::from(a - b).powi(2);
        size += f64::from(b).powi(2);
    }
    match (diff, size) {
        (0.0, _) => 0.0,
        (_, 0.0) => f64::INFINITY,
        _ => (diff / size).sqrt(),
    }
}

/// How two runs' updates compare ([`assert_updates_agree`]).
#[derive(Debug, Clone, Default)]
pub struct UpdateAgreement {
    /// The largest `‖Δgot − Δwant‖ / ‖Δwant‖` over the compared tensors.
    pub worst: f64,
    /// The tensors whose step-0 gradient is rounding noise ([`NOISE_GRADIENT_SHARE`]), their
    /// updates not compared.
    pub noise: Vec<String>,
}

impl std::fmt::Display for UpdateAgreement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "updates {:.2e} apart", self.worst)?;
        match self.noise.len() {
            0 => Ok(()),
            n => write!(f, " ({n} with a noise gradient: {})", self.noise.join(", ")),
        }
    }
}

/// Asserts each parameter tensor moved as the reference's did: `‖(got − initial) − (want −
/// initial)‖₂ ≤ share · ‖want − initial‖₂`, the difference of the two updates against the
/// reference's update, per tensor. The parameter comparison that survives AdamW under reduced
/// precision: a rounding that flips the sign of a near-zero gradient moves that element a whole
/// step the other way (per element no bound holds), but only a few elements of a tensor; a
/// wrong gradient moves the whole tensor wrong (the ratio near 1 or above). A tensor whose
/// step-0 gradient is rounding noise ([`NOISE_GRADIENT_SHARE`]; Adam steps its sign whole, so
/// no update agrees) is listed instead; the gradients themselves are
/// [`assert_same_run_normwise`]'s to compare. Panics naming the
/// tensor above `share`, or where every tensor's gradient is noise.
pub fn assert_updates_agree(
    what: &str,
    got: &Outcome,
    want: &Outcome,
    initial: &BTreeMap<String, Vec<f32>>,
    share: f64,
) -> UpdateAgreement {
    assert!(!want.params.is_empty(), "{what}: empty reference");
    assert_eq!(
        got.params.len(),
        want.params.len(),
        "{what}: parameter count"
    );
    let largest = f64::from(largest_magnitude(want.grad0.values().flatten()));
    let noise = |name: &str| {
        let own = f64::from(largest_magnitude(&want.grad0[name]));
        own < NOISE_GRADIENT_SHARE * largest
            || relative_distance(&got.grad0[name], &want.grad0[name]) > 0.1
    };
    let mut agreement = UpdateAgreement::default();
    for (name, (_, w)) in &want.params {
        let (g, w0) = (&got.params[name].1, &initial[name]);
        assert!(
            g.len() == w.len() && w0.len() == w.len(),
            "{what} {name}: sizes"
        );
        if noise(name) {
            agreement.noise.push(name.clone());
            continue;
        }
        let moved = |p: &[f32]| -> Vec<f32> { p.iter().zip(w0).map(|(a, b)| a - b).collect() };
        let ratio = relative_distance(&moved(g), &moved(w));
        assert!(
            ratio <= share,
            "{what} {name}: its update is {ratio:.3e} of the reference's apart (bound {share})"
        );
        agreement.worst = agreement.worst.max(ratio);
    }
    assert!(
        agreement.noise.len() < want.params.len(),
        "{what}: every gradient is noise, no update compared"
    );
    agreement
}

/// The normwise tolerance `bound` for values whose scale (largest magnitude) is `scale`:
/// relative `bound`, or `bound · scale` absolute.
pub fn normwise(bound: f32, scale: f32) -> Tolerance {
    Tolerance::new(bound, bound * scale)
}

/// The largest magnitude of `values` (0 for none).
pub fn largest_magnitude<'a>(values: impl IntoIterator<Item = &'a f32>) -> f32 {
    values.into_iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// What a compared tensor of an outcome is.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Loss,
    Param,
    Grad,
}

/// The comparison of [`assert_same_run`], each tensor's tolerance from `tol` of its kind and
/// its reference values.
fn same_run(
    what: &str,
    got: &Outcome,
    want: &Outcome,
    tol: impl Fn(Kind, &[f32]) -> Tolerance,
) -> Closeness {
    // An empty reference would make every comparison below pass.
    assert!(
        !want.losses.is_empty() && !want.params.is_empty(),
        "{what}: empty reference"
    );
    assert_eq!(
        want.grad0.len(),
        want.params.len(),
        "{what}: reference grad0"
    );
    assert_eq!(got.grad0.len(), want.grad0.len(), "{what}: grad0 count");
    let mut worst = assert_close(
        &format!("{what} loss"),
        &got.losses,
        &want.losses,
        tol(Kind::Loss, &want.losses),
    );
    assert_eq!(
        got.params.len(),
        want.params.len(),
        "{what}: parameter count"
    );
    for (name, (shape, w)) in &want.params {
        let (gshape, g) = &got.params[name];
        assert_eq!(gshape, shape, "{what} {name} shape");
        worst = worst.max(assert_close(
            &format!("{what} {name}"),
            g,
            w,
            tol(Kind::Param, w),
        ));
        let (gg, wg) = (&got.grad0[name], &want.grad0[name]);
        worst = worst.max(assert_close(
            &format!("{what} grad0.{name}"),
            gg,
            wg,
            tol(Kind::Grad, wg),
        ));
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An outcome of one parameter `w` (100 values), its gradient and two losses.
    fn outcome(w: Vec<f32>) -> Outcome {
        let mut out = Outcome {
            losses: vec![2.0, 1.5],
            ..Default::default()
        };
        out.grad0.insert("w".into(), vec![0.5; w.len()]);
        out.params.insert("w".into(), (vec![w.len()], w));
        out
    }

    fn initial() -> BTreeMap<String, Vec<f32>> {
        BTreeMap::from([("w".to_string(), vec![0.02; 100])])
    }

    /// AdamW's update: every element a step of 1e-3 down.
    fn stepped() -> Vec<f32> {
        vec![0.02 - 1e-3; 100]
    }

    #[test]
    fn updates_agree_when_a_few_elements_flip() {
        let want = outcome(stepped());
        let same = assert_updates_agree("same", &want, &want, &initial(), 0.25);
        assert_eq!(same.worst, 0.0);
        // One element of 100 stepped the other way: 2e-3 of a 1e-2 update, 0.2.
        let mut w = stepped();
        w[7] = 0.02 + 1e-3;
        let ratio = assert_updates_agree("one flip", &outcome(w), &want, &initial(), 0.25).worst;
        assert!((ratio - 0.2).abs() < 1e-3, "{ratio}");
    }

    #[test]
    #[should_panic(expected = "of the reference's apart")]
    fn a_tensor_moved_the_wrong_way_fails() {
        let want = outcome(stepped());
        let got = outcome(vec![0.02 + 1e-3; 100]);
        assert_updates_agree("negated", &got, &want, &initial(), 0.25);
    }

    /// A tensor whose gradient is rounding noise (its step-0 gradients apart by their own
    /// size) is listed, not compared; where every tensor's is, nothing was compared: a failure.
    #[test]
    fn a_noise_gradient_is_listed_not_compared() {
        let mut want = outcome(stepped());
        want.params
            .insert("k.bias".into(), (vec![2], vec![1e-3, -1e-3]));
        want.grad0.insert("k.bias".into(), vec![1e-12, -1e-12]);
        let mut got = want.clone();
        got.params
            .insert("k.bias".into(), (vec![2], vec![-1e-3, 1e-3]));
        got.grad0.insert("k.bias".into(), vec![-1e-12, 1e-12]);
        let mut initial = initial();
        initial.insert("k.bias".into(), vec![0.0, 0.0]);
        let agreement = assert_updates_agree("noise", &got, &want, &initial, 0.25);
        assert_eq!(agreement.noise, ["k.bias"]);
        assert_eq!(agreement.worst, 0.0);
        want.params.remove("w");
        got.params.remove("w");
        let all_noise =
            std::panic::catch_unwind(|| assert_updates_agree("all", &got, &want, &initial, 0.25));
        assert!(all_noise.is_err());
    }

    #[test]
    #[should_panic(expected = "of the reference's apart")]
    fn a_tensor_that_should_not_move_but_did_fails() {
        let want = outcome(vec![0.02; 100]);
        assert_updates_agree("moved", &outcome(stepped()), &want, &initial(), 0.25);
    }

    /// Per tensor: a tensor of 0.02-sized values 1e-4 off fails 2e-3 normwise (it passed when
    /// the scale was the run's largest magnitude, 1); a cancelling tensor is held to the floor.
    #[test]
    fn normwise_is_per_tensor_with_a_floor() {
        let mut want = outcome(vec![0.02; 100]);
        want.params.insert("norm".into(), (vec![2], vec![1.0, 1.0]));
        want.grad0.insert("norm".into(), vec![1e-9, -1e-9]);
        let mut got = want.clone();
        got.grad0.insert("norm".into(), vec![4e-9, -4e-9]);
        assert_same_run_normwise("cancelling", &got, &want, 2e-3, 0.0);
        got.params
            .insert("w".into(), (vec![100], vec![0.02 + 1e-4; 100]));
        let caught = std::panic::catch_unwind(|| {
            assert_same_run_normwise("small weights", &got, &want, 2e-3, 0.0)
        });
        assert!(caught.is_err(), "1e-4 on 0.02-sized weights passed");
    }
}
