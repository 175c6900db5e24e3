//! Step times of a language model (the GPT, the Llama) under a layout, for the benches (`cargo xtask bench ddp`, `bench
//! train`): random token batches, training through the trainer's one loop ([`fit`]) with SGD
//! on rank threads, alone, or as this process's rank of a launcher's job, and the median over
//! the timed steps (after warm-up) of the slowest rank's step.

use bonfire_comm::ProcessGroup;
use bonfire_data::generated::Rng;
use bonfire_models::data::Batches;
use bonfire_models::data::TokenBatch;
use bonfire_parallel::ParallelModel;
use bonfire_train::{FitConfig, Launcher, StepPhases, TrainError, Trainer, WrapperReport, fit};
use burn::tensor::Device;

/// `steps` global batches of `rows` random sequences of `seq` tokens (ids and targets
/// uniform over a vocabulary of `vocab`), the same on every rank and every run of the same
/// `seed`.
pub fn random_batches(vocab: usize, seq: usize, rows: usize, steps: usize, seed: u64) -> Batches {
    let mut rng = Rng::new(seed);
    let n = steps * rows * seq;
    let mut draw = || (0..n).map(|_| rng.below(vocab) as i64).collect::<Vec<_>>();
    let ids = draw();
    let targets = draw();
    Batches::new(ids, targets, [steps, rows, seq])
}

/// The run options the training benches share (`bench train`, `bench ddp`).
#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Ranks (`bench train`: of every layout but `single`).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Sequences per rank (the global batch is `batch × ranks`).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Timed steps (after `warmup`).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Untimed steps run first.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
}

impl RunArgs {
    /// The steps run and timed.
    pub fn schedule(&self) -> Steps {
        Steps {
            warmup: self.warmup,
            timed: self.steps,
        }
    }

    /// Every step's global batch: `ranks × batch` random sequences of `seq` tokens over a
    /// vocabulary of `vocab` (seed 3).
    pub fn batches(&self, vocab: usize, seq: usize) -> Batches {
        random_batches(
            vocab,
            seq,
            self.ranks * self.batch,
            self.schedule().total(),
            3,
        )
    }
}

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// How many steps are run and how many of them are timed.
#[derive(Debug, Clone, Copy)]
pub struct Steps {
    /// Steps run first and not timed.
    pub warmup: usize,
    /// Timed steps.
    pub timed: usize,
}

impl Steps {
    /// Every step run: warm-up and timed.
    pub fn total(&self) -> usize {
        self.warmup + self.timed
    }

    /// The median over the timed steps of each phase of the slowest rank's step (ms):
    /// compute, communication, point-to-point, optimizer, and the rest (data, hooks).
    pub fn split(&self, per_rank: &[RankRun]) -> [f64; 5] {
        let at = |s: usize| {
            let r = per_rank
                .iter()
                .max_by(|a, b| a.step_ms[s].total_cmp(&b.step_ms[s]))
                .expect("a rank");
            let p = r.phases[s];
            let known = p.compute_ms + p.comm_ms + p.p2p_ms + p.optimizer_ms;
            [
                p.compute_ms,
                p.comm_ms,
                p.p2p_ms,
                p.optimizer_ms,
                r.step_ms[s] - known,
            ]
        };
        let steps: Vec<[f64; 5]> = (self.warmup..self.total()).map(at).collect();
        std::array::from_fn(|k| median(steps.iter().map(|s| s[k]).collect()))
    }

    /// The median over the timed steps of the slowest rank's step time (ms).
    pub fn slowest(&self, per_rank: &[RankRun]) -> f64 {
        median(self.slowest_each(per_rank))
    }

    /// The fastest of the timed steps by the slowest rank's time (ms): the step a shared
    /// machine's neighbours slowed least.
    pub fn fastest(&self, per_rank: &[RankRun]) -> f64 {
        self.slowest_each(per_rank)
            .into_iter()
            .fold(f64::INFINITY, f64::min)
    }

    /// Each timed step's slowest rank's time (ms), in step order.
    fn slowest_each(&self, per_rank: &[RankRun]) -> Vec<f64> {
        (self.warmup..self.total())
            .map(|s| per_rank.iter().map(|r| r.step_ms[s]).fold(0.0, f64::max))
            .collect()
    }
}

/// What one rank measured: every step's time (ms) and what its dp wrapper recorded.
pub struct RankRun {
    /// Every step's time in ms, warm-up steps included, in step order.
    pub step_ms: Vec<f64>,
    /// What the rank's data-parallel wrapper recorded over the run.
    pub report: WrapperReport,
    /// Every step's global loss, in step order.
    pub losses: Vec<f32>,
    /// Where every step went on this rank, in step order.
    pub phases: Vec<StepPhases>,
}

/// Where the ranks of a run live.
#[derive(Clone)]
pub enum Hosts {
    /// `ranks` threads of this process, one communicator.
    Threads {
        /// Number of rank threads.
        ranks: usize,
    },
    /// `copies` threads, each a world of one: the same work at the same time with no
    /// communication (what core sharing alone costs).
    Alone {
        /// Number of threads, each training alone.
        copies: usize,
    },
    /// This process's rank of a job a launcher started (its world's group, kept for every
    /// run of the process: MPI initializes once per process).
    Group(ProcessGroup),
}

/// What rank `rank` is given as the global batch of step `step` on `device`.
pub type Rows<'a> = &'a (dyn Fn(usize, usize, &Device) -> TokenBatch + Sync);

/// Trains `model` (the GPT, the Llama) with `trainer` for `steps` steps at learning
/// rate 0.01 through [`fit`] on `hosts`; every rank's step times and wrapper report, in rank
/// order (this process's ranks only).
pub fn train<M: ParallelModel<Batch = TokenBatch> + Sync>(
    model: &M,
    trainer: &Trainer,
    hosts: Hosts,
    steps: Steps,
    rows: Rows<'_>,
) -> Result<Vec<RankRun>, TrainError> {
    train_at(model, trainer, hosts, steps, rows, 0.01)
}

/// [`train`] at learning rate `lr` (the bench Llama's AdamW trains at 1e-3).
pub fn train_at<M: ParallelModel<Batch = TokenBatch> + Sync>(
    model: &M,
    trainer: &Trainer,
    hosts: Hosts,
    steps: Steps,
    rows: Rows<'_>,
    lr: f64,
) -> Result<Vec<RankRun>, TrainError> {
    let config = FitConfig::new(steps.total(), lr);
    let one = |pg: ProcessGroup, rank: usize| {
        let data = |s: usize, device: &Device| rows(rank, s, device);
        let mut engine = trainer.build(
            model.clone(),
            &pg,
            &data(0, &burn::tensor::Device::flex().autodiff()),
        )?;
        let reports = fit(engine.as_mut(), &data, &config, &mut ())?;
        Ok::<_, TrainError>(RankRun {
            step_ms: reports.iter().map(|r| r.step_ms).collect(),
            report: engine.wrapper_report(),
            losses: reports.iter().map(|r| r.loss).collect(),
            phases: reports.iter().map(|r| r.phases).collect(),
        })
    };
    let out = match hosts {
        Hosts::Threads { ranks } => {
            Launcher::Threads { ranks }.run("bench", |pg| one(pg.clone(), pg.rank()))?
        }
        Hosts::Group(pg) => vec![one(pg.clone(), pg.rank())],
        Hosts::Alone { copies } => std::thread::scope(|s| {
            let handles: Vec<_> = (0..copies)
                .map(|rank| {
                    s.spawn(move || {
                        Launcher::Threads { ranks: 1 }.run("bench-alone", |pg| one(pg, rank))
                    })
                })
                .collect();
            let mut all = Vec::new();
            for h in handles {
                all.extend(h.join().expect("a rank thread")?);
            }
            Ok::<_, TrainError>(all)
        })?,
    };
    out.into_iter().collect()
}
