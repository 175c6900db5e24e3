//! The one training loop: for each step, a batch from the [`DataSource`], forward and
//! backward, the optimizer step; the global loss, the step's time and tokens/s reported to
//! hooks, a progress bar and a `--metrics` JSON-lines file. Every layout, every binary
//! (`train`, the parity harness, the benches) trains through it.

use crate::checkpoint::Checkpointer;
use crate::engine::Engine;
use crate::error::TrainError;
use crate::scaler::{LossScaler, LossScaling};
use crate::schedule::LrSchedule;
use bonfire_dtensor::plane::ledger::Direction;
use bonfire_dtensor::plane::{TransferLedger, Transfers};
use bonfire_module::PrecisionDTypes;
use bonfire_parallel::{DataSource, Rows};
use burn::tensor::DType;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StepReport {
    /// The step's number (counted from the start of the run, resumed or not).
    pub step: usize,
    /// The global loss before the step's update.
    pub loss: f32,
    /// The learning rate the step's update used (its schedule's value at this step).
    pub lr: f64,
    /// The global L2 norm of the step's gradients before clipping (with clipping or
    /// [`FitConfig::grad_norm`]; not on a step skipped for an overflow).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Wall time of the step (data, forward, backward, optimizer), in milliseconds.
    pub step_ms: f64,
    /// Tokens of the global batch per second of this step (when the loop knows the tokens
    /// per step).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Bytes this rank's forward, backward and optimizer step moved device→host (the
    /// transfer ledger; zero on a host device such as Flex).
    pub d2h_bytes: u64,
    /// Bytes they moved host→device (the transfer ledger; zero on a host device).
    pub h2d_bytes: u64,
    /// Device→host reads they made: each one a host synchronization (the transfer ledger;
    /// zero on a host device).
    pub d2h_reads: u64,
    /// Bytes this rank's collectives carried in the step.
    pub payload_bytes: u64,
    /// The most bytes of host memory this process held resident during the step (Linux's
    /// high-water mark, reset at each step's start; rank 0's process, which holds every rank
    /// when ranks are threads; not a device's memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// With dynamic loss scaling: the scale this step's loss was multiplied by.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f32>,
    /// Whether the optimizer step was skipped (an infinite or NaN gradient under loss
    /// scaling).
    pub skipped: bool,
    /// Where this rank's step went.
    pub phases: StepPhases,
}

/// Where one rank's step went, in milliseconds, from the clock and the time its thread was
/// blocked in communication (`bonfire_comm::blocked`): the rest of the step is the data and
/// the hooks.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepPhases {
    /// Forward and backward, less the time blocked in communication inside them.
    pub compute_ms: f64,
    /// Blocked in collectives and in waits on asynchronous ones (DDP's exposed reduction,
    /// ZeRO's gathers, tp's and cp's exchanges), in the step's every phase.
    pub comm_ms: f64,
    /// Blocked in point-to-point sends and receives: a pipeline's transfers and its bubble.
    pub p2p_ms: f64,
    /// Clipping, the optimizer step and the state update, less their communication.
    pub optimizer_ms: f64,
}

impl StepPhases {
    /// `compute` and `optimizer` (wall times of the two phases) with the communication each
    /// was blocked in taken out.
    fn split(
        (compute, in_compute): (f64, bonfire_comm::blocked::Blocked),
        (optimizer, in_optimizer): (f64, bonfire_comm::blocked::Blocked),
    ) -> Self {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let all = |b: bonfire_comm::blocked::Blocked| ms(b.collective) + ms(b.p2p);
        Self {
            compute_ms: (compute - all(in_compute)).max(0.0),
            comm_ms: ms(in_compute.collective) + ms(in_optimizer.collective),
            p2p_ms: ms(in_compute.p2p) + ms(in_optimizer.p2p),
            optimizer_ms: (optimizer - all(in_optimizer)).max(0.0),
        }
    }
}

/// Called by the loop at fixed points of each step (collectives inside are fine: every rank
/// calls its hooks at the same points).
pub trait Hooks<B> {
    /// After backward, before clipping and the optimizer step (gradients are whole via
    /// [`Engine::gradients`]).
    fn after_backward(
        &mut self,
        step: usize,
        engine: &mut dyn Engine<B>,
    ) -> Result<(), TrainError> {
        let _ = (step, engine);
        Ok(())
    }
    /// After the optimizer step.
    fn after_step(
        &mut self,
        report: &StepReport,
        engine: &mut dyn Engine<B>,
    ) -> Result<(), TrainError> {
        let _ = (report, engine);
        Ok(())
    }
    /// A checkpoint is due: every `checkpoint_every` steps and after the last step.
    fn checkpoint(&mut self, step: usize, engine: &mut dyn Engine<B>) -> Result<(), TrainError> {
        let _ = (step, engine);
        Ok(())
    }
    /// After the last step (a background checkpoint finishes here).
    fn finish(&mut self, engine: &mut dyn Engine<B>) -> Result<(), TrainError> {
        let _ = engine;
        Ok(())
    }
}

/// No hooks.
impl<B> Hooks<B> for () {}

/// Hooks that may be absent.
impl<B, H: Hooks<B>> Hooks<B> for Option<H> {
    fn after_backward(
        &mut self,
        step: usize,
        engine: &mut dyn Engine<B>,
    ) -> Result<(), TrainError> {
        self.as_mut()
            .map_or(Ok(()), |h| h.after_backward(step, engine))
    }
    fn after_step(
        &mut self,
        report: &StepReport,
        engine: &mut dyn Engine<B>,
    ) -> Result<(), TrainError> {
        self.as_mut()
            .map_or(Ok(()), |h| h.after_step(report, engine))
    }
    fn checkpoint(&mut self, step: usize, engine: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.as_mut().map_or(Ok(()), |h| h.checkpoint(step, engine))
    }
    fn finish(&mut self, engine: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.as_mut().map_or(Ok(()), |h| h.finish(engine))
    }
}

/// Two sets of hooks, the first called first at every point.
impl<B, H1: Hooks<B>, H2: Hooks<B>> Hooks<B> for (H1, H2) {
    fn after_backward(
        &mut self,
        step: usize,
        engine: &mut dyn Engine<B>,
    ) -> Result<(), TrainError> {
        self.0.after_backward(step, engine)?;
        self.1.after_backward(step, engine)
    }
    fn after_step(
        &mut self,
        report: &StepReport,
        engine: &mut dyn Engine<B>,
    ) -> Result<(), TrainError> {
        self.0.after_step(report, engine)?;
        self.1.after_step(report, engine)
    }
    fn checkpoint(&mut self, step: usize, engine: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.0.checkpoint(step, engine)?;
        self.1.checkpoint(step, engine)
    }
    fn finish(&mut self, engine: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.0.finish(engine)?;
        self.1.finish(engine)
    }
}

/// The checkpoint hook: polls the pending save after every step, saves at checkpoint
/// steps, waits for the last save when the loop ends.
impl<B> Hooks<B> for Checkpointer {
    fn after_step(&mut self, _: &StepReport, engine: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.poll(engine.world())
    }
    fn checkpoint(&mut self, step: usize, engine: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.save(step, engine)
    }
    fn finish(&mut self, engine: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.wait(engine.world())
    }
}

/// The loop's options.
#[derive(Debug, Clone)]
pub struct FitConfig {
    /// The run's last step (exclusive): a resumed run goes on up to it.
    pub steps: usize,
    /// The first step (0, or where a resumed run starts).
    pub start_step: usize,
    /// The peak learning rate (the rate of every step without a schedule).
    pub lr: f64,
    /// The learning rate's schedule around `lr` over `steps` (default: constant).
    pub schedule: LrSchedule,
    /// Tokens in one global batch (for tokens/s).
    pub tokens_per_step: Option<usize>,
    /// Show a progress bar (rank 0, on a terminal).
    pub progress: bool,
    /// Print a line every this many steps (rank 0; 0: never).
    pub log_every: usize,
    /// Write one JSON line per step here (rank 0).
    pub metrics: Option<PathBuf>,
    /// Call [`Hooks::checkpoint`] every this many steps (and at the end).
    pub checkpoint_every: Option<usize>,
    /// Dynamic loss scaling (`None`: on with the defaults when the layout computes in f16,
    /// off otherwise).
    pub loss_scaling: Option<LossScaling>,
    /// Clip the gradients by their global L2 norm to this (`clip_grad_norm_`'s `max_norm`)
    /// after they are complete, before the optimizer.
    pub clip_grad_norm: Option<f64>,
    /// Measure and report the global gradient norm even without clipping.
    pub grad_norm: bool,
    /// Gradient accumulation: each replica's rows in this many equal parts, forward and
    /// backward one at a time, reduced once (1: none).
    pub grad_accum: usize,
    /// Auxiliary-loss-free balancing (DeepSeek-V3): after each optimizer step every
    /// balancing bias moves by this rate · sign(mean load − load), the loads of the step's
    /// whole global batch ([`Engine::update_buffers`]); refused for a model without one.
    pub expert_bias_update: Option<f64>,
}

impl FitConfig {
    /// `steps` steps at `lr`, quietly.
    pub fn new(steps: usize, lr: f64) -> Self {
        Self {
            steps,
            start_step: 0,
            lr,
            schedule: LrSchedule::default(),
            tokens_per_step: None,
            progress: false,
            log_every: 0,
            metrics: None,
            checkpoint_every: None,
            loss_scaling: None,
            clip_grad_norm: None,
            grad_norm: false,
            grad_accum: 1,
            expert_bias_update: None,
        }
    }

    /// Refuses a clipping norm that is not a positive number and zero accumulation parts,
    /// before anything runs.
    fn check_recipe(&self) -> Result<(), TrainError> {
        if let Some(c) = self.clip_grad_norm
            && !(c.is_finite() && c > 0.0)
        {
            return Err(TrainError::Recipe(format!(
                "--clip-grad-norm {c}: expected a positive number"
            )));
        }
        if self.grad_accum == 0 {
            return Err(TrainError::Recipe(
                "--grad-accum 0: expected at least 1 part".into(),
            ));
        }
        if let Some(r) = self.expert_bias_update
            && !(r.is_finite() && r >= 0.0)
        {
            return Err(TrainError::Recipe(format!(
                "--expert-bias-update {r}: expected a number ≥ 0"
            )));
        }
        Ok(())
    }

    /// Refuses the bias update for a model with no state tensor to move (a collective:
    /// every rank asks the engine for the model's state tensors).
    fn check_state(&self, engine: &mut dyn Engine<impl Sized>) -> Result<(), TrainError> {
        let Some(rate) = self.expert_bias_update else {
            return Ok(());
        };
        match engine.buffers()?.is_empty() {
            true => Err(TrainError::Recipe(format!(
                "--expert-bias-update {rate}: the model has no balancing bias (no \
                 e_score_correction_bias: DeepSeek-V3's routers have one)"
            ))),
            false => Ok(()),
        }
    }
}

/// Rank 0's reporting: progress bar, log lines, metrics file.
struct Reporter {
    bar: Option<ProgressBar>,
    metrics: Option<std::fs::File>,
    log_every: usize,
}

impl Reporter {
    fn new(config: &FitConfig, rank: usize) -> Result<Self, TrainError> {
        if rank != 0 {
            return Ok(Self {
                bar: None,
                metrics: None,
                log_every: 0,
            });
        }
        let bar = config.progress.then(|| {
            let bar = ProgressBar::new((config.steps - config.start_step.min(config.steps)) as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} step {pos:>5}/{len} [{bar:30}] {msg} ({elapsed}<{eta})",
                )
                .expect("template")
                .progress_chars("=> "),
            );
            bar
        });
        let metrics = match &config.metrics {
            None => None,
            Some(path) => {
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| TrainError::Io(format!("{}: {e}", dir.display())))?;
                }
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(config.start_step > 0)
                    .write(true)
                    .truncate(config.start_step == 0)
                    .open(path)
                    .map_err(|e| TrainError::Io(format!("{}: {e}", path.display())))?;
                Some(file)
            }
        };
        Ok(Self {
            bar,
            metrics,
            log_every: config.log_every,
        })
    }

    fn report(&mut self, r: &StepReport, last: bool) -> Result<(), TrainError> {
        if let Some(file) = &mut self.metrics {
            let line = serde_json::to_string(r).expect("a report serializes");
            writeln!(file, "{line}").map_err(|e| TrainError::Io(e.to_string()))?;
        }
        let tps = r
            .tokens_per_s
            .map(|t| format!("  {t:>7.0} tok/s"))
            .unwrap_or_default();
        let norm = r
            .grad_norm
            .map(|n| format!("  grad_norm {n:.3}"))
            .unwrap_or_default();
        if let Some(bar) = &self.bar {
            bar.set_message(format!("loss {:.4}{norm}{tps}", r.loss));
            bar.inc(1);
        }
        if self.log_every > 0 && (r.step.is_multiple_of(self.log_every) || last) {
            let line = format!(
                "step {:>5}  loss {:.4}  lr {:.3e}{norm}{tps}  {:.1} ms",
                r.step, r.loss, r.lr, r.step_ms
            );
            match &self.bar {
                Some(bar) if !bar.is_hidden() => bar.println(line),
                _ => println!("{line}"),
            }
        }
        Ok(())
    }

    fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish();
        }
    }
}

/// Trains `engine` from `config.start_step` up to `config.steps` on `data`, calling `hooks`;
/// returns every step's report (the same on every rank but for the timings).
pub fn fit<B: Rows>(
    engine: &mut dyn Engine<B>,
    data: &dyn DataSource<B>,
    config: &FitConfig,
    hooks: &mut dyn Hooks<B>,
) -> Result<Vec<StepReport>, TrainError> {
    config
        .schedule
        .check(config.lr, config.steps)
        .map_err(TrainError::Recipe)?;
    config.check_recipe()?;
    config.check_state(engine)?;
    engine.set_grad_accum(config.grad_accum);
    let mut reporter = Reporter::new(config, engine.world().rank())?;
    let mut reports = Vec::with_capacity(config.steps.saturating_sub(config.start_step));
    let f16 = engine.dims().precision.param_dtype() == DType::F16;
    let mut scaler = config
        .loss_scaling
        .or_else(|| f16.then(LossScaling::default))
        .map(LossScaler::new);
    let rank0 = engine.world().rank() == 0;
    for step in config.start_step..config.steps {
        let start = Instant::now();
        if rank0 {
            crate::rss::reset_peak();
        }
        // What evaluation forwards recorded since the last step is no statistic of this one.
        bonfire_module::state::clear();
        let batch = data.replica_batch(step, engine.replica(), engine.device());
        let (ledger, mut moved) = (TransferLedger::start(), Transfers::default());
        let loss_scale = scaler.as_ref().map(LossScaler::scale);
        engine.set_loss_scale(loss_scale.unwrap_or(1.0));
        let computing = (Instant::now(), bonfire_comm::blocked::take());
        let loss = engine.forward_backward(&batch)?;
        drop(batch);
        let finite = match (&mut scaler, loss_scale) {
            (Some(s), Some(scale)) => {
                let finite = engine.unscale(scale)?;
                s.update(finite);
                finite
            }
            _ => true,
        };
        let computed = (ms_since(computing.0), bonfire_comm::blocked::take());
        moved.add(&ledger.snapshot());
        drop(ledger);
        hooks.after_backward(step, engine)?;
        let ledger = TransferLedger::start();
        let stepping = (Instant::now(), bonfire_comm::blocked::take());
        let measure = config.clip_grad_norm.is_some() || config.grad_norm;
        let grad_norm = match finite && measure {
            true => Some(engine.clip_gradients(config.clip_grad_norm)?),
            false => None,
        };
        let lr = config.schedule.lr_at(step, config.lr, config.steps);
        if finite {
            engine.step(lr)?;
            if let Some(rate) = config.expert_bias_update {
                engine.update_buffers(rate)?;
            }
        } else if engine.world().rank() == 0 {
            tracing::info!(
                "step {step}: a gradient overflowed at loss scale {}; step skipped, scale now {}",
                loss_scale.unwrap_or(1.0),
                scaler.as_ref().map_or(1.0, LossScaler::scale)
            );
        }
        let stepped = (ms_since(stepping.0), bonfire_comm::blocked::take());
        moved.add(&ledger.snapshot());
        drop(ledger);
        let seconds = start.elapsed().as_secs_f64();
        let report = StepReport {
            step,
            loss,
            lr,
            grad_norm,
            step_ms: seconds * 1e3,
            tokens_per_s: config.tokens_per_step.map(|t| t as f64 / seconds),
            d2h_bytes: moved.total(Direction::DeviceToHost),
            h2d_bytes: moved.total(Direction::HostToDevice),
            d2h_reads: moved.reads_total(),
            payload_bytes: moved.payload,
            peak_rss_bytes: rank0.then(crate::rss::peak_bytes).flatten(),
            loss_scale,
            skipped: !finite,
            phases: StepPhases::split(computed, stepped),
        };
        reporter.report(&report, step + 1 == config.steps)?;
        hooks.after_step(&report, engine)?;
        let last = step + 1 == config.steps;
        if last
            || config
                .checkpoint_every
                .is_some_and(|k| k > 0 && (step + 1) % k == 0)
        {
            hooks.checkpoint(step + 1, engine)?;
        }
        reports.push(report);
    }
    hooks.finish(engine)?;
    reporter.finish();
    Ok(reports)
}

/// Milliseconds since `start`.
fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}
