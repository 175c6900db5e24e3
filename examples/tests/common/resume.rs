//! A run checkpointed in one layout and resumed in another, against the same run on one
//! device: the legs of such a run and the comparison, shared by the model suites.

use bonfire_comm::testing::{Tolerance, assert_close};
use bonfire_examples::default_device;
use bonfire_layout::ParallelDims;
use bonfire_models::data::{Batches, TokenBatch};
use bonfire_parallel::ParallelModel;
use bonfire_train::checkpoint::{CheckpointConfig, Checkpointer, resume};
use bonfire_train::{
    FitConfig, Hooks, Launcher, LrSchedule, OptimizerKind, TrainError, Trainer, fit,
};
use std::ops::Range;
use std::path::Path;

/// One leg: `model` trained under `dims` with `optim` on steps `steps` of `batches` (`rows`
/// rows each) at the suites' rate with `recipe`'s schedule (over the run up to `steps.end`)
/// and bias update, resumed from the checkpoint in `from` and saving to `save` when given.
/// The losses of its steps and every parameter, then every state tensor (whole, flat) after
/// it.
#[allow(clippy::too_many_arguments)]
pub fn leg<M: ParallelModel<Batch = TokenBatch> + Clone + Send + Sync>(
    model: &M,
    batches: &Batches,
    rows: usize,
    dims: &ParallelDims,
    optim: OptimizerKind,
    steps: Range<usize>,
    from: Option<&Path>,
    save: Option<&Path>,
    recipe: &FitConfig,
) -> (Vec<f32>, Vec<f32>) {
    let trainer = Trainer::new(dims.clone(), move || optim.build());
    let data = |s: usize, d: &burn::tensor::Device| batches.rows(s, 0, rows, d);
    let first = data(0, &default_device());
    let config = FitConfig {
        start_step: steps.start,
        schedule: recipe.schedule,
        expert_bias_update: recipe.expert_bias_update,
        ..FitConfig::new(steps.end, super::gpt_lr(optim))
    };
    let out = Launcher::Threads {
        ranks: dims.world_size(),
    }
    .run("resume", |pg| -> Result<_, TrainError> {
        let mut engine = trainer.build(model.clone(), &pg, &first)?;
        if let Some(dir) = from {
            assert_eq!(resume(engine.as_mut(), dir)?.step, steps.start);
        }
        let mut hooks: Box<dyn Hooks<TokenBatch>> = match save {
            Some(dir) => Box::new(Checkpointer::new(CheckpointConfig::new(dir))),
            None => Box::new(()),
        };
        let reports = fit(engine.as_mut(), &data, &config, hooks.as_mut())?;
        let mut whole = engine.parameters()?;
        whole.extend(engine.buffers()?);
        let params: Vec<f32> = whole.into_iter().flat_map(|p| p.values).collect();
        Ok((reports.iter().map(|r| r.loss).collect::<Vec<f32>>(), params))
    })
    .unwrap();
    out.into_iter().next().unwrap().unwrap()
}

/// `steps` steps under `a`, saved after `saved_at`, resumed under `b`, equal the same steps
/// on one device (losses and every parameter within the suites' tolerances: SGD's, and
/// `adamw` for AdamW), with SGD and AdamW. Prints and returns the worst closeness.
#[allow(clippy::too_many_arguments)]
pub fn check_resume<M: ParallelModel<Batch = TokenBatch> + Clone + Send + Sync>(
    name: &str,
    model: &M,
    batches: &Batches,
    rows: usize,
    layouts: (&ParallelDims, &ParallelDims),
    steps: usize,
    saved_at: usize,
    adamw: Tolerance,
) {
    let at = (steps, saved_at);
    check_resume_scheduled(name, model, batches, rows, layouts, at, adamw, |_| {
        LrSchedule::default()
    });
}

/// [`check_resume`] with every leg's learning rate under `schedule(lr)` (`lr` the suites'
/// rate of each optimizer) over the whole run: the resumed legs continue it.
#[allow(clippy::too_many_arguments)]
pub fn check_resume_scheduled<M: ParallelModel<Batch = TokenBatch> + Clone + Send + Sync>(
    name: &str,
    model: &M,
    batches: &Batches,
    rows: usize,
    layouts: (&ParallelDims, &ParallelDims),
    at: (usize, usize),
    adamw: Tolerance,
    schedule: impl Fn(f64) -> LrSchedule,
) {
    let recipe = |lr| FitConfig {
        schedule: schedule(lr),
        ..FitConfig::new(0, lr)
    };
    let tols = (super::SGD, adamw);
    check_resume_recipe(name, model, batches, rows, layouts, at, tols, recipe);
}

/// [`check_resume`] with every leg's schedule and bias update those of `recipe(lr)` (`lr`
/// the suites' rate of each optimizer), SGD's and AdamW's tolerances `(sgd, adamw)`; the
/// state tensors compared with the parameters.
#[allow(clippy::too_many_arguments)]
pub fn check_resume_recipe<M: ParallelModel<Batch = TokenBatch> + Clone + Send + Sync>(
    name: &str,
    model: &M,
    batches: &Batches,
    rows: usize,
    (a, b): (&ParallelDims, &ParallelDims),
    (steps, saved_at): (usize, usize),
    (sgd, adamw): (Tolerance, Tolerance),
    recipe: impl Fn(f64) -> FitConfig,
) {
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        let schedule = &recipe(super::gpt_lr(optim));
        let dir = std::env::temp_dir().join(format!(
            "bonfire-{name}-resume-{}-{}",
            optim.name(),
            std::process::id()
        ));
        let one = ParallelDims::new();
        let (want_losses, want) = leg(
            model,
            batches,
            rows,
            &one,
            optim,
            0..steps,
            None,
            None,
            schedule,
        );
        let (mut losses, _) = leg(
            model,
            batches,
            rows,
            a,
            optim,
            0..saved_at,
            None,
            Some(&dir),
            schedule,
        );
        let (more, got) = leg(
            model,
            batches,
            rows,
            b,
            optim,
            saved_at..steps,
            Some(&dir),
            None,
            schedule,
        );
        std::fs::remove_dir_all(&dir).ok();
        losses.extend(more);
        let tol = match optim {
            OptimizerKind::Sgd => sgd,
            OptimizerKind::AdamW => adamw,
        };
        let what = format!("{name} {a} -> {b} {}", optim.name());
        let c = assert_close(&format!("{what} losses"), &losses, &want_losses, tol);
        assert_eq!(got.len(), want.len(), "{what}: parameters");
        let c = c.max(assert_close(
            &format!("{what} parameters"),
            &got,
            &want,
            tol,
        ));
        println!("resume {what}: {c}");
    }
}
