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
    same_run(what, got, want, |_| tol)
}

/// [`assert_same_run`] within a *normwise* `bound`: each element within relative `bound`, or
/// `bound` times the largest magnitude of its kind in the reference run (the losses, the
/// parameters, the step-0 gradients) — the bound of products computed in a reduced precision
/// (TF32 tensor cores), whose error scales with the operands rather than with each result: a
/// gradient that cancels (the key bias's, 0 in exact arithmetic: 1.6e-12 on Flex, 3.9e-9 on
/// CUDA) carries the error of the terms that cancelled. Parameters also pass within
/// `param_floor` (`f32::INFINITY`: not compared but for NaN — after AdamW, whose normalised
/// step turns the rounding of a near-zero gradient into a whole step of either sign; the
/// gradients and losses stay normwise).
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
    same_run(what, got, want, |kind| {
        let scale = match kind {
            Kind::Loss => losses,
            Kind::Param => params,
            Kind::Grad => grads,
        };
        let tol = normwise(bound, scale);
        match kind {
            Kind::Param => Tolerance::new(bound, tol.abs.max(param_floor)),
            _ => tol,
        }
    })
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

/// The comparison of [`assert_same_run`], each tensor's tolerance from `tol` of its kind.
fn same_run(
    what: &str,
    got: &Outcome,
    want: &Outcome,
    tol: impl Fn(Kind) -> Tolerance,
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
        tol(Kind::Loss),
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
            tol(Kind::Param),
        ));
        let (gg, wg) = (&got.grad0[name], &want.grad0[name]);
        worst = worst.max(assert_close(
            &format!("{what} grad0.{name}"),
            gg,
            wg,
            tol(Kind::Grad),
        ));
    }
    worst
}
