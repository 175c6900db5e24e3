//! Fault-tolerant data parallelism: training that outlives a dead replica (TorchFT's idea, on
//! Bonfire's threads backend).
//!
//! [`fit_fault_tolerant`] runs [`fit`] and commits every step to memory: each rank keeps a
//! copy of what it owns of the training state and hands one to its buddy, the previous rank
//! ([`BuddyCost`]: what that costs). When a rank dies mid-step (its thread panics or
//! returns), its peers' next collective fails at once (or after the timeout, for a rank that
//! hangs); the survivors then
//! 1. shrink the group ([`bonfire_comm::ProcessGroup::shrink`]): they agree on who is alive
//!    and continue on a fresh group, so nothing of the failed step leaks in;
//! 2. drop the failed step: every survivor goes back to the last committed step, whatever it
//!    had done of the failed one (no half-applied update);
//! 3. rebuild their engine for `dp = survivors` and fill it from the pooled copies — their own
//!    and the dead ranks' buddy copies, resharded for the new degree (the checkpoint's load
//!    into another layout, from memory: no restart, no disk);
//! 4. go on from the committed step, the global batch re-split over the survivors: the same
//!    global batch when the survivors divide its rows; otherwise its first
//!    `rows − rows mod survivors` rows (said in the log).
//!
//! Only a pure dp layout (DDP or ZeRO 1–3, cp = tp = pp = 1) can do this: a dead rank's
//! tensor-parallel shards or pipeline stage exist on no other rank, so such layouts are
//! refused before anything is built. MPI cannot shrink a communicator here: a dead rank ends
//! the job with an error naming it, and `--resume` continues from the last checkpoint on
//! fewer processes (docs/checkpoint.md).

mod buddy;
mod state;

pub use buddy::{BuddyCost, CommitCost};

use crate::engine::Engine;
use crate::error::TrainError;
use crate::fit::{FitConfig, Hooks, StepReport, fit};
use crate::trainer::Trainer;
use bonfire_comm::ProcessGroup;
use bonfire_layout::LayoutError;
use bonfire_layout::{Axis, ParallelDims};
use bonfire_parallel::{DataSource, ParallelModel, Rows};
use buddy::Snapshot;
use burn::tensor::Device;
use std::cell::Cell;
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::Path;
use std::time::Instant;

/// Options of fault-tolerant training.
#[derive(Debug, Clone, Default)]
pub struct FaultTolerance {
    /// Failure injection (tests, chaos runs): world rank `rank` panics at the start of step
    /// `step` (`train --kill-rank R --at-step S`).
    pub kill: Option<KillAt>,
    /// Stop with an error rather than continue on fewer ranks than this (0 or 1: any).
    pub min_ranks: usize,
    /// Start from this checkpoint (a `step-N` directory or a root: its latest), loaded into
    /// the first engine before the first commit; `FitConfig::start_step` must be its step.
    pub resume: Option<std::path::PathBuf>,
}

/// Kill world rank `rank` at the start of step `step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KillAt {
    /// The world rank that dies.
    pub rank: usize,
    /// The step at whose start it dies.
    pub step: usize,
}

impl KillAt {
    /// Panics when `world_rank` is the rank to kill and `step` its step: the injected failure
    /// (a rank thread that dies, or under `mpirun` a process that exits).
    pub fn strike(kill: Option<KillAt>, world_rank: usize, step: usize) {
        if kill
            == Some(KillAt {
                rank: world_rank,
                step,
            })
        {
            panic!("injected failure: rank {world_rank} killed at step {step} (--kill-rank)");
        }
    }
}

/// `data` with the failure `kill` injected on world rank `world_rank` (for runs that are not
/// fault-tolerant: the job ends with an error naming the dead rank).
pub fn inject<'a, B>(
    data: &'a dyn DataSource<B>,
    kill: Option<KillAt>,
    world_rank: usize,
) -> impl DataSource<B> + 'a {
    move |step: usize, device: &Device| {
        KillAt::strike(kill, world_rank, step);
        data.batch(step, device)
    }
}

/// One committed step and the world ranks that took part in it.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultStep {
    /// What the step did (the loop's report).
    pub report: StepReport,
    /// The world ranks that took part in it.
    pub ranks: Vec<usize>,
}

/// One recovery: the step the survivors went back to, who was lost, how long it took.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// The first step run again (the last committed one).
    pub step: usize,
    /// World ranks lost.
    pub lost: Vec<usize>,
    /// World ranks that continue.
    pub survivors: Vec<usize>,
    /// Wall time from the failed call's error to the rebuilt, refilled engine.
    pub seconds: f64,
    /// Bytes this rank received when the survivors pooled their copies.
    pub pooled_bytes: u64,
}

/// What a fault-tolerant run leaves on a surviving rank.
pub struct FaultRun<B> {
    /// The engine it finished with (on the survivors' group: `engine.world()`).
    pub engine: Box<dyn Engine<B>>,
    /// Every committed step, in order.
    pub steps: Vec<FaultStep>,
    /// Every recovery from a lost rank, in order.
    pub recoveries: Vec<Recovery>,
    /// What the buddy copies cost this rank.
    pub buddy: BuddyCost,
}

/// Prints what a run survived and what its buddy copies cost, as `key=value` lines: one
/// `fault_recovery` line per recovery and one `fault_buddy` line (totals, and the last commit
/// made with a buddy).
pub fn print_summary<B>(run: &FaultRun<B>) {
    for r in &run.recoveries {
        println!(
            "fault_recovery step={} lost={:?} survivors={:?} recovery_ms={:.1} pooled_bytes={}",
            r.step,
            r.lost,
            r.survivors,
            r.seconds * 1e3,
            r.pooled_bytes
        );
    }
    let c = run.buddy;
    println!(
        "fault_buddy commits={} total_export_ms={:.1} total_exchange_ms={:.1} \
         total_bytes_sent={} last_export_ms={:.2} last_exchange_ms={:.2} last_bytes_sent={} \
         last_bytes_held={}",
        c.commits,
        c.export_s * 1e3,
        c.exchange_s * 1e3,
        c.bytes_sent,
        c.last.export_s * 1e3,
        c.last.exchange_s * 1e3,
        c.last.bytes_sent,
        c.last.bytes_held
    );
}

/// Refuses a layout fault tolerance cannot serve: anything but pure dp. dp_replicate is
/// refused too: the survivors re-form one dp group (`Trainer::with_dp`), and HSDP's two
/// groups (shards and replicas) would have to be re-cut around the dead rank.
pub fn check_layout(dims: &ParallelDims) -> Result<(), LayoutError> {
    if dims.dp_replicate() > 1 {
        return Err(LayoutError::axis(
            Axis::DpReplicate,
            dims.dp_replicate(),
            "fault tolerance re-forms one dp group from the survivors: use dp alone (e.g. \
             dp=4 instead of dp_replicate=2,dp=2)",
        ));
    }
    for axis in [Axis::Cp, Axis::Tp, Axis::Pp, Axis::Ep] {
        let degree = dims.degree(axis);
        if degree > 1 {
            return Err(LayoutError::Axis {
                axis,
                degree,
                reason: "fault tolerance needs a pure dp layout: a dead rank's chunks of the \
                         sequences, tensor-parallel shards, pipeline stage or experts exist on \
                         no other rank"
                    .into(),
            });
        }
    }
    Ok(())
}

/// The data a group of `dp` ranks trains on: the global batch, re-split (its first
/// `rows − rows mod dp` rows when `dp` does not divide them), with the injected failure.
struct Resplit<'a, B> {
    inner: &'a dyn DataSource<B>,
    dp: usize,
    kill: Option<KillAt>,
    /// This rank in the original world.
    world_rank: usize,
    /// Set just before the injected failure's panic (which must not be caught).
    killed: &'a Cell<bool>,
}

impl<B: Rows> DataSource<B> for Resplit<'_, B> {
    fn batch(&self, step: usize, device: &Device) -> B {
        if self
            .kill
            .is_some_and(|k| k.rank == self.world_rank && k.step == step)
        {
            self.killed.set(true);
        }
        KillAt::strike(self.kill, self.world_rank, step);
        let batch = self.inner.batch(step, device);
        let keep = batch.rows() - batch.rows() % self.dp;
        if keep == batch.rows() {
            batch
        } else {
            batch.narrow_rows(0, keep)
        }
    }
}

/// The loop's hooks plus the commit after every step and the metrics lines with the ranks.
struct Committing<'a, B> {
    inner: &'a mut dyn Hooks<B>,
    snapshot: &'a mut Snapshot,
    group: ProcessGroup,
    metrics: Option<&'a Path>,
    steps: &'a mut Vec<FaultStep>,
}

impl<B> Hooks<B> for Committing<'_, B> {
    fn after_backward(&mut self, step: usize, e: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.inner.after_backward(step, e)
    }
    fn after_step(&mut self, r: &StepReport, e: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.inner.after_step(r, e)?;
        *self.snapshot = Snapshot::take(e, &self.group, r.step + 1, self.snapshot.cost)?;
        let step = FaultStep {
            report: *r,
            ranks: self.group.world_ranks(),
        };
        if let Some(path) = self.metrics.filter(|_| self.group.rank() == 0) {
            append_metrics(path, &step)?;
        }
        self.steps.push(step);
        Ok(())
    }
    fn checkpoint(&mut self, step: usize, e: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.inner.checkpoint(step, e)
    }
    fn finish(&mut self, e: &mut dyn Engine<B>) -> Result<(), TrainError> {
        self.inner.finish(e)
    }
}

/// One JSON line: the step's report and the world ranks that took part.
fn append_metrics(path: &Path, step: &FaultStep) -> Result<(), TrainError> {
    let mut line = serde_json::to_value(step.report).expect("a report serializes");
    line["ranks"] = serde_json::json!(step.ranks);
    let io = |e: std::io::Error| TrainError::Io(format!("{}: {e}", path.display()));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io)?;
    writeln!(file, "{line}").map_err(io)
}

/// Starts the metrics file (rank 0): a fresh one for a run from step 0.
fn start_metrics(path: &Path, start_step: usize) -> Result<(), TrainError> {
    let io = |e: std::io::Error| TrainError::Io(format!("{}: {e}", path.display()));
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    if start_step == 0 {
        std::fs::write(path, "").map_err(io)?;
    }
    Ok(())
}

/// The survivors' refilled engine, their first commit, the world ranks lost and the bytes
/// pooled.
struct Refilled<B> {
    engine: Box<dyn Engine<B>>,
    snapshot: Snapshot,
    lost: Vec<usize>,
    pooled: u64,
}

/// What every (re)build needs.
struct Setup<'a, M: ParallelModel> {
    trainer: &'a Trainer,
    model: &'a M,
    data: &'a dyn DataSource<M::Batch>,
    options: &'a FaultTolerance,
    world_rank: usize,
    device: Device,
    killed: Cell<bool>,
    /// The run's last step (the builds' batch is never past it).
    last_step: usize,
}

impl<M: ParallelModel> Setup<'_, M> {
    fn data(&self, dp: usize) -> Resplit<'_, M::Batch> {
        Resplit {
            inner: self.data,
            dp,
            kill: self.options.kill,
            world_rank: self.world_rank,
            killed: &self.killed,
        }
    }

    /// This rank's engine on `group` (dp = its size), built from the model as given.
    fn build(
        &self,
        group: &ProcessGroup,
        step: usize,
    ) -> Result<Box<dyn Engine<M::Batch>>, TrainError> {
        let first = self.data.batch(step.min(self.last_step), &self.device);
        let dp = group.size();
        if first.rows() < dp {
            return Err(TrainError::Model(format!(
                "fault tolerance: a global batch of {} rows cannot feed {dp} ranks",
                first.rows()
            )));
        }
        if first.rows() % dp != 0 && group.rank() == 0 {
            tracing::warn!(
                "fault tolerance: {dp} ranks do not divide the global batch of {} rows; \
                 each step now trains on its first {} rows",
                first.rows(),
                first.rows() - first.rows() % dp
            );
        }
        let keep = first.rows() - first.rows() % dp;
        let first = first.narrow_rows(0, keep);
        self.trainer
            .with_dp(dp)
            .build(self.model.clone(), group, &first)
    }

    /// Rebuilds on the survivors `group` from the committed copies (see the module docs).
    fn refill(
        &self,
        group: &ProcessGroup,
        snapshot: &Snapshot,
    ) -> Result<Refilled<M::Batch>, TrainError> {
        let min = self.options.min_ranks.max(1);
        if group.size() < min {
            return Err(TrainError::Model(format!(
                "fault tolerance: {} ranks survive, fewer than the minimum of {min}",
                group.size()
            )));
        }
        let lost = snapshot.check_recoverable(&group.world_ranks())?;
        let mut steps = vec![0i64; group.size()];
        group.all_gather(&[snapshot.step as i64], &mut steps)?;
        if steps.iter().any(|&s| s != snapshot.step as i64) {
            return Err(TrainError::Model(format!(
                "fault tolerance: the survivors committed different steps {steps:?}"
            )));
        }
        let mut engine = self.build(group, snapshot.step)?;
        let (pool, pooled) = snapshot.pool(group)?;
        let loaded = state::answer(&pool, &engine.state_wants())?;
        drop(pool);
        engine.load_state(loaded)?;
        let fresh = Snapshot::take(engine.as_mut(), group, snapshot.step, snapshot.cost)?;
        Ok(Refilled {
            engine,
            snapshot: fresh,
            lost,
            pooled,
        })
    }
}

/// Trains like [`fit`] on `world` with `trainer`'s pure-dp layout, surviving dead ranks (see
/// the module docs). Every rank calls it; the survivors return the run they finished, a rank
/// that dies does not (it panics, or, marked failed by an injected failure, gets an error
/// saying it is not among the survivors). Errors that are not a peer's death end the run as
/// [`fit`]'s do, on every rank.
pub fn fit_fault_tolerant<M: ParallelModel>(
    trainer: &Trainer,
    model: &M,
    world: &ProcessGroup,
    data: &dyn DataSource<M::Batch>,
    config: &FitConfig,
    hooks: &mut dyn Hooks<M::Batch>,
    options: &FaultTolerance,
) -> Result<FaultRun<M::Batch>, TrainError> {
    check_layout(trainer.dims())?;
    let device =
        bonfire_module::params::model_device(model).unwrap_or_else(|| Device::flex().autodiff());
    let setup = Setup {
        trainer,
        model,
        data,
        options,
        world_rank: world.rank(),
        device,
        killed: Cell::new(false),
        last_step: config.steps.saturating_sub(1),
    };
    let mut group = world.clone();
    // The first commit: the model as given; a rank lost before it is simply not built on.
    let (mut engine, mut snapshot) = loop {
        let start = config.start_step;
        let built = setup.build(&group, start).and_then(|mut e| {
            if let Some(dir) = &options.resume {
                crate::checkpoint::resume(e.as_mut(), dir)?;
            }
            let s = Snapshot::take(e.as_mut(), &group, start, BuddyCost::default())?;
            Ok((e, s))
        });
        match built {
            Ok(done) => break done,
            Err(cause) => regroup(&mut group, cause, start)?,
        }
    };
    if let Some(path) = config.metrics.as_deref().filter(|_| group.rank() == 0) {
        start_metrics(path, config.start_step)?;
    }
    let (mut steps, mut recoveries) = (Vec::new(), Vec::new());
    loop {
        let segment = FitConfig {
            start_step: snapshot.step,
            metrics: None,
            ..config.clone()
        };
        let data = setup.data(group.size());
        let mut committing = Committing {
            inner: &mut *hooks,
            snapshot: &mut snapshot,
            group: group.clone(),
            metrics: config.metrics.as_deref(),
            steps: &mut steps,
        };
        // A peer's death can surface as a panic where a collective cannot return an error
        // (inside a differentiable collective of the forward pass): caught, it is an error
        // like any other. The injected failure itself is this rank's death: not caught.
        let trained = catch_unwind(AssertUnwindSafe(|| {
            fit(engine.as_mut(), &data, &segment, &mut committing)
        }));
        let cause = match trained {
            Ok(Ok(_)) => break,
            Ok(Err(e)) => e,
            Err(panic) if setup.killed.get() => resume_unwind(panic),
            Err(panic) => TrainError::Model(format!(
                "rank {} panicked: {}",
                setup.world_rank,
                panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("a non-string panic")
            )),
        };
        let started = Instant::now();
        drop(engine);
        let Refilled {
            engine: rebuilt,
            snapshot: fresh,
            lost,
            pooled,
        } = recover(&setup, &mut group, &snapshot, cause)?;
        recoveries.push(Recovery {
            step: snapshot.step,
            lost,
            survivors: group.world_ranks(),
            seconds: started.elapsed().as_secs_f64(),
            pooled_bytes: pooled,
        });
        (engine, snapshot) = (rebuilt, fresh);
    }
    Ok(FaultRun {
        engine,
        steps,
        recoveries,
        buddy: snapshot.cost,
    })
}

/// After `cause`: shrinks `group` to the survivors and refills their engines, shrinking again
/// if another rank dies meanwhile. Returns `cause` itself when nobody died (it was not a
/// failure of a peer).
fn recover<M: ParallelModel>(
    setup: &Setup<'_, M>,
    group: &mut ProcessGroup,
    snapshot: &Snapshot,
    mut cause: TrainError,
) -> Result<Refilled<M::Batch>, TrainError> {
    loop {
        regroup(group, cause, snapshot.step)?;
        match setup.refill(group, snapshot) {
            Ok(done) => return Ok(done),
            Err(e) => cause = e,
        }
    }
}

/// Replaces `group` by its survivors after `cause`; `cause` itself when nobody died.
fn regroup(group: &mut ProcessGroup, cause: TrainError, step: usize) -> Result<(), TrainError> {
    let shrunk = group.shrink().map_err(|e| {
        TrainError::Io(format!(
            "fault tolerance: after `{cause}`, the survivors could not regroup: {e}"
        ))
    })?;
    if !shrunk.lost_any() {
        return Err(cause);
    }
    let before = group.world_ranks();
    *group = shrunk.group;
    if group.rank() == 0 {
        let alive = group.world_ranks();
        tracing::warn!(
            "fault tolerance: lost ranks {:?} ({cause}); continuing on world ranks {alive:?} \
             from step {step}",
            before
                .iter()
                .filter(|r| !alive.contains(r))
                .collect::<Vec<_>>(),
        );
    }
    Ok(())
}
