//! `bench train --model mixtral`'s expert-parallel rows (`ddp-ep2`, `ddp-ep4`): the Mixtral
//! trained as every other row (the trainer's `fit`, SGD at 0.01, the same global batches), with
//! each rank's all-to-all traffic per step.
//!
//! - `a2a_bytes`: what the rank's all-to-alls carried in the step, from the transfer ledger
//!   (`Transfers::carried(OpKind::AllToAll)`: each call's whole buffer, the larger of what it
//!   sends and what it receives, the rows it keeps for its own experts included): every MoE
//!   layer's dispatch and combine and their duals in backward. The E routed counts exchanged
//!   before each dispatch go on the group directly and are not in it (8 × 8 bytes a layer).
//! - `a2a_ms`: the time the rank spent inside the ep group's all-to-all calls in the step
//!   (counts and rows, forward and backward), from the group's flight recorder
//!   (`ProcessGroup::flight_recorder`: every call's start and duration) — moving the rows and
//!   waiting for the peers to reach the call. The trainer does not hand its ep group out: the
//!   [`Probed`] wrapper reads it from the `ExpertScope` its loss runs in.
//!
//! Both are the largest over ranks of each step, then the median over the timed steps, as
//! `step_ms`; `a2a_calls` is the calls a rank made on the ep group in one step.

use crate::common::throughput::{Hosts, RankRun, Rows, Steps};
use bonfire_comm::{OpKind, ProcessGroup, RECORDER_CAPACITY};
use bonfire_cp::ContextSplit;
use bonfire_dtensor::plane::TransferLedger;
use bonfire_ep::ExpertScope;
use bonfire_examples::default_device;
use bonfire_layout::{LayoutError, ParallelDims};
use bonfire_models::data::TokenBatch;
use bonfire_models::mixtral::Mixtral;
use bonfire_parallel::ParallelModel;
use bonfire_train::{Engine, FitConfig, Hooks, Launcher, StepReport, TrainError, Trainer, fit};
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use std::cell::RefCell;
use std::time::Instant;

/// The Mixtral, noting on its rank's thread the ep group its experts exchange over (the
/// trainer's, from the [`ExpertScope`] its loss runs in). Its module paths are the Mixtral's
/// under `inner.`; it has no tensor-parallel plan and no pipeline (the ep rows need neither).
#[derive(Module, Debug)]
pub struct Probed {
    inner: Mixtral,
}

impl Probed {
    pub fn new(inner: Mixtral) -> Self {
        Self { inner }
    }
}

thread_local! {
    /// The ep group the last loss on this thread ran in.
    static EP_GROUP: RefCell<Option<ProcessGroup>> = const { RefCell::new(None) };
}

fn prefixed(paths: Vec<String>) -> Vec<String> {
    paths.into_iter().map(|p| format!("inner.{p}")).collect()
}

impl ParallelModel for Probed {
    type Batch = TokenBatch;

    fn loss(&self, batch: TokenBatch) -> Tensor<1> {
        if let Some(scope) = ExpertScope::current() {
            EP_GROUP.with(|g| *g.borrow_mut() = Some(scope.group));
        }
        ParallelModel::loss(&self.inner, batch)
    }
    fn check_layout(&self, dims: &ParallelDims) -> Result<(), LayoutError> {
        self.inner.check_layout(dims)
    }
    fn check_batch(&self, dims: &ParallelDims, batch: &TokenBatch) -> Result<(), LayoutError> {
        self.inner.check_batch(dims, batch)
    }
    fn experts(&self) -> Vec<String> {
        prefixed(self.inner.experts())
    }
    fn layers(&self) -> Vec<String> {
        prefixed(self.inner.layers())
    }
    fn sequence_length(batch: &TokenBatch) -> Option<usize> {
        Mixtral::sequence_length(batch)
    }
    fn context_batch(batch: &TokenBatch, split: &ContextSplit, rank: usize) -> TokenBatch {
        Mixtral::context_batch(batch, split, rank)
    }
}

/// One rank's all-to-all traffic in one step.
#[derive(Debug, Clone, Copy, Default)]
pub struct A2aStep {
    pub bytes: f64,
    pub ms: f64,
    pub calls: usize,
}

/// Reads the ledger and the ep group's flight recorder after every step.
struct Probe {
    ledger: TransferLedger,
    carried: u64,
    since: Instant,
    steps: Vec<A2aStep>,
}

impl Probe {
    /// The ep group's all-to-all calls that started in `since..now`: their time (ms) and
    /// count. Warns where the recorder's ring may have dropped some.
    fn recorded(group: &ProcessGroup, since: Instant, now: Instant) -> (f64, usize) {
        let records = group.flight_recorder().records();
        if records.len() == RECORDER_CAPACITY && records[0].started >= since {
            eprintln!("bench train: more ep calls in a step than the flight recorder keeps");
        }
        let mine = records
            .iter()
            .filter(|r| r.fingerprint.op == OpKind::AllToAll)
            .filter(|r| r.started >= since && r.started < now);
        mine.fold((0.0, 0), |(ms, n), r| {
            let d = r.duration.map_or(0.0, |d| d.as_secs_f64() * 1e3);
            (ms + d, n + 1)
        })
    }
}

impl<B> Hooks<B> for Probe {
    fn after_step(&mut self, _: &StepReport, _: &mut dyn Engine<B>) -> Result<(), TrainError> {
        let now = Instant::now();
        let carried = self.ledger.snapshot().carried(OpKind::AllToAll);
        let group = EP_GROUP.with(|g| g.borrow().clone());
        let (ms, calls) = group.map_or((0.0, 0), |g| Self::recorded(&g, self.since, now));
        self.steps.push(A2aStep {
            bytes: (carried - self.carried) as f64,
            ms,
            calls,
        });
        (self.carried, self.since) = (carried, now);
        Ok(())
    }
}

/// [`crate::common::throughput::train`] for [`Probed`] (threads or this process's rank):
/// every rank's step times and wrapper report, and its all-to-all traffic per step.
pub fn train(
    model: &Probed,
    trainer: &Trainer,
    hosts: Hosts,
    steps: Steps,
    rows: Rows<'_>,
) -> Result<Vec<(RankRun, Vec<A2aStep>)>, TrainError> {
    let config = FitConfig::new(steps.total(), 0.01);
    let one = |pg: ProcessGroup, rank: usize| {
        let data = |s: usize, device: &Device| rows(rank, s, device);
        let mut engine = trainer.build(model.clone(), &pg, &data(0, &default_device()))?;
        let mut probe = Probe {
            ledger: TransferLedger::start(),
            carried: 0,
            since: Instant::now(),
            steps: Vec::new(),
        };
        let reports = fit(engine.as_mut(), &data, &config, &mut probe)?;
        let run = RankRun {
            step_ms: reports.iter().map(|r| r.step_ms).collect(),
            report: engine.wrapper_report(),
            losses: reports.iter().map(|r| r.loss).collect(),
            phases: reports.iter().map(|r| r.phases).collect(),
        };
        Ok::<_, TrainError>((run, probe.steps))
    };
    let out = match hosts {
        Hosts::Threads { ranks } => {
            Launcher::Threads { ranks }.run("bench-ep", |pg| one(pg.clone(), pg.rank()))?
        }
        Hosts::Group(pg) => vec![one(pg.clone(), pg.rank())],
        Hosts::Alone { .. } => unreachable!("the ep rows run on one communicator"),
    };
    out.into_iter().collect()
}

/// The timed steps' medians of the largest rank's all-to-all bytes and time, and the calls
/// a rank makes per step: `[bytes, ms, calls]`.
pub fn summary(per_rank: &[Vec<A2aStep>], steps: Steps) -> [f64; 3] {
    let most =
        |s: usize, f: fn(&A2aStep) -> f64| per_rank.iter().map(|r| f(&r[s])).fold(0.0, f64::max);
    let median = |f: fn(&A2aStep) -> f64| {
        let timed = (steps.warmup..steps.total()).map(|s| most(s, f)).collect();
        crate::common::throughput::median(timed)
    };
    [
        median(|a| a.bytes),
        median(|a| a.ms),
        median(|a| a.calls as f64),
    ]
}

/// Each step's bytes and time the largest over the processes of a job (one rank each).
pub fn largest_across(group: &ProcessGroup, steps: &mut [A2aStep]) -> bonfire_comm::Result<()> {
    let mut v: Vec<f64> = steps.iter().flat_map(|s| [s.bytes, s.ms]).collect();
    group.all_reduce(&mut v, bonfire_comm::ReduceOp::Max)?;
    for (s, pair) in steps.iter_mut().zip(v.chunks(2)) {
        (s.bytes, s.ms) = (pair[0], pair[1]);
    }
    Ok(())
}
