//! What the example programs' command lines share: the layout options of every trainer
//! front end (`train`, the parity harness), the checkpoint options, and how a program
//! starts and fails.

use bonfire_layout::ZeroStage;
use bonfire_layout::{MixedPrecision, ParallelDims, Recompute};
use bonfire_pipeline::ScheduleKind;
use bonfire_train::CheckpointConfig;
use std::path::PathBuf;

/// The layout options of a command line, as given (checked further when the run is built).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LayoutArgs {
    /// Axes and sizes, e.g. `dp=2`, `tp=4`, `dp=2,tp=2,pp=2`, `dp=2,cp=2`,
    /// `dp_replicate=2,dp=2` (omitted axes are 1; cp splits every sequence, which must cut into
    /// 2·cp equal chunks; dp_replicate replicates ZeRO's dp shards — HSDP — or, without ZeRO,
    /// is DDP over dp_replicate × dp).
    #[arg(long)]
    pub mesh: Option<String>,
    /// ZeRO stage on the dp axis: 0 is DDP; 1, 2, 3 shard the optimizer state, the
    /// gradients, the parameters.
    #[arg(long, default_value_t = 0)]
    pub zero: usize,
    /// Pipeline schedule with a pp axis (`ScheduleKind::NAMES`).
    #[arg(long, help = format!("Pipeline schedule with a pp axis: {}", ScheduleKind::NAMES))]
    pub schedule: Option<String>,
    /// Pipeline micro-batches (default: pp).
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Sequence parallelism on the tp axis.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Vocab-parallel cross-entropy on the tp axis.
    #[arg(long)]
    pub loss_parallel: bool,
    /// Keep ZeRO's optimizer state on the host between steps (needs --zero 1..3).
    #[arg(long)]
    pub offload: bool,
    /// Compute/parameter dtype: f32, bf16 or f16 (fp32 master weights and optimizer state,
    /// gradients reduced in fp32; f16 adds dynamic loss scaling).
    #[arg(long, value_name = "f32|bf16|f16")]
    pub precision: Option<String>,
    /// Reduce gradients in the compute dtype instead of fp32 (with --precision bf16|f16).
    #[arg(long)]
    pub reduce_in_half: bool,
    /// Recompute activations in backward: alone, every layer; `K`, every K-th layer.
    #[arg(long, num_args = 0..=1, default_missing_value = "1", value_name = "K")]
    pub recompute: Option<usize>,
}

impl LayoutArgs {
    /// `mesh` and no option.
    pub fn mesh(mesh: &str) -> Self {
        Self {
            mesh: Some(mesh.into()),
            ..Self::default()
        }
    }

    /// The layout of a training program: `dp=2` when no `--mesh` was given, 1F1B when a
    /// pipeline names no schedule.
    pub fn training_dims(&self) -> Result<ParallelDims, String> {
        let dims = self.dims("dp=2")?;
        Ok(match dims.pp() > 1 && dims.pp_options.schedule.is_none() {
            true => dims.with_schedule(ScheduleKind::OneFOneB),
            false => dims,
        })
    }

    /// The layout they describe, `default_mesh` when no `--mesh` was given.
    pub fn dims(&self, default_mesh: &str) -> Result<ParallelDims, String> {
        let mesh = self.mesh.as_deref().unwrap_or(default_mesh);
        let mut dims = ParallelDims::parse_mesh(mesh).map_err(|e| e.to_string())?;
        dims.zero = ZeroStage::from_index(self.zero)
            .ok_or_else(|| format!("--zero {}: must be 0, 1, 2 or 3", self.zero))?;
        if let Some(name) = &self.schedule {
            let kind = ScheduleKind::parse(name).ok_or_else(|| {
                format!(
                    "--schedule {name}: unknown (known: {})",
                    ScheduleKind::NAMES
                )
            })?;
            dims = dims.with_schedule(kind);
        }
        dims.pp_options.microbatches = self.microbatches;
        let name = self.precision.as_deref().unwrap_or("f32");
        let mut precision = MixedPrecision::parse(name)
            .ok_or_else(|| format!("--precision {name}: unknown (known: f32, bf16, f16)"))?;
        if self.reduce_in_half {
            if !precision.is_mixed() {
                return Err("--reduce-in-half needs --precision bf16 or f16".into());
            }
            precision = precision.reduced_in_param();
        }
        let ac = match self.recompute {
            None => Recompute::Off,
            Some(0) => return Err("--recompute K: K must be at least 1".into()),
            Some(k) => Recompute::Every(k),
        };
        Ok(dims
            .with_precision(precision)
            .with_recompute(ac)
            .with_sequence_parallel(self.sequence_parallel)
            .with_loss_parallel(self.loss_parallel)
            .with_offload(self.offload))
    }
}

/// What every training program's command line has besides the layout: the optimizer, the
/// run's length and batch, the seed, the device, the reporting and the launcher.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Burn's optimizer: adamw (β1 0.9, β2 0.95, ε 1e-6, weight decay 0.1) or sgd.
    #[arg(long, default_value = "adamw")]
    pub optim: String,
    /// Learning rate (the peak of a schedule).
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// The training recipe: warmup and decay, AdamW's settings, clipping, accumulation.
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Optimizer steps: the run's total (a resumed run goes on up to it).
    #[arg(long, default_value_t = 300)]
    pub steps: usize,
    /// Sequences per data-parallel replica per step (the global batch is dp times this).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    /// Seed of the initial model and of the batches.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The Burn device every rank computes on: `flex` (CPU), `wgpu` (a build with
    /// `--features wgpu`) or `cuda` (a build with `--features cuda`).
    #[arg(long, default_value = "flex")]
    pub device: String,
    /// Print the loss every this many steps.
    #[arg(long, default_value_t = 25)]
    pub log_every: usize,
    /// Write one JSON line per step (step, loss, lr, tokens_per_s, step_ms, …) to this file.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write TensorBoard event files here (loss, eval loss, lr, grad_norm, tokens/s, step
    /// time, peak resident bytes per step; rank 0): `tensorboard --logdir DIR`.
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// `threads`: every rank a thread of this process; `env`: this process is one rank of a
    /// job started by a launcher (`mpirun`; build with `--features mpi`).
    #[arg(long, default_value = "threads")]
    pub launcher: String,
}

impl RunArgs {
    /// The loop's configuration: from `start_step` up to the run's last step (`steps`, at
    /// least `start_step`), `rows` sequences a step, a progress bar, the log and metrics
    /// options, a checkpoint every `checkpoint_every` steps.
    pub fn fit_config(
        &self,
        start_step: usize,
        rows: usize,
        checkpoint_every: Option<usize>,
    ) -> bonfire_train::FitConfig {
        let config = bonfire_train::FitConfig {
            start_step,
            tokens_per_step: Some(rows * self.seq),
            progress: true,
            log_every: self.log_every,
            metrics: self.metrics.clone(),
            checkpoint_every,
            grad_norm: true,
            ..bonfire_train::FitConfig::new(self.steps.max(start_step), self.lr)
        };
        self.recipe.fit(config).unwrap_or_else(|e| fail(e))
    }
}

/// The training recipe on a command line (`train` and the parity harness), the contract's
/// "training recipe": the learning rate's schedule (`--lr-warmup`, `--lr-decay`,
/// `--lr-min`: [`bonfire_train::LrSchedule`]), AdamW's settings (`--adamw-betas`,
/// `--adamw-eps`, `--weight-decay`, `--no-decay-1d`), clipping by the global norm
/// (`--clip-grad-norm`) and gradient accumulation (`--grad-accum`).
#[derive(Debug, Clone, clap::Args)]
pub struct RecipeArgs {
    /// Steps of linear warmup: step s < W trains at lr·(s+1)/W.
    #[arg(long, default_value_t = 0)]
    pub lr_warmup: usize,
    /// After the warmup: constant, linear or cosine decay to --lr-min at the run's end.
    #[arg(long, default_value = "constant")]
    pub lr_decay: String,
    /// The rate a decay ends at.
    #[arg(long, default_value_t = 0.0)]
    pub lr_min: f64,
    /// AdamW's β1,β2.
    #[arg(long, default_value = "0.9,0.95", value_name = "B1,B2")]
    pub adamw_betas: String,
    /// AdamW's ε.
    #[arg(long, default_value_t = 1e-6)]
    pub adamw_eps: f32,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f32,
    /// Weight decay only on parameters of two or more dimensions (norm weights and biases
    /// undecayed: PyTorch's two parameter groups).
    #[arg(long)]
    pub no_decay_1d: bool,
    /// Clip the gradients by their global L2 norm to this before each optimizer step.
    #[arg(long, value_name = "C")]
    pub clip_grad_norm: Option<f64>,
    /// Gradient accumulation: each replica's rows of a step in K equal parts, forward and
    /// backward one at a time, gradients reduced once.
    #[arg(long, default_value_t = 1, value_name = "K")]
    pub grad_accum: usize,
    /// DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every
    /// `e_score_correction_bias` moves by RATE · sign(mean load − load), the loads of the
    /// step's whole global batch.
    #[arg(long, value_name = "RATE")]
    pub expert_bias_update: Option<f64>,
}

impl Default for RecipeArgs {
    fn default() -> Self {
        <Self as clap::FromArgMatches>::from_arg_matches(
            &<Self as clap::Args>::augment_args(clap::Command::new("recipe"))
                .get_matches_from(["recipe"]),
        )
        .expect("the defaults parse")
    }
}

impl RecipeArgs {
    /// The schedule these flags name (`Err` for an unknown decay).
    pub fn schedule(&self) -> Result<bonfire_train::LrSchedule, String> {
        Ok(bonfire_train::LrSchedule {
            warmup: self.lr_warmup,
            decay: bonfire_train::Decay::parse(&self.lr_decay)?,
            min_lr: self.lr_min,
        })
    }

    /// The optimizer `kind` with these settings (`Err` for settings AdamW refuses).
    pub fn optimizer(
        &self,
        kind: bonfire_train::OptimizerKind,
    ) -> Result<bonfire_train::OptimizerSpec, String> {
        let betas: Vec<f32> = self
            .adamw_betas
            .split(',')
            .map(|b| b.trim().parse::<f32>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("--adamw-betas {}: {e}", self.adamw_betas))?;
        let [b1, b2] = betas[..] else {
            return Err(format!(
                "--adamw-betas {}: expected two numbers, B1,B2",
                self.adamw_betas
            ));
        };
        let adamw = bonfire_train::AdamWSettings {
            betas: (b1, b2),
            epsilon: self.adamw_eps,
            weight_decay: self.weight_decay,
            no_decay_1d: self.no_decay_1d,
        };
        adamw.check()?;
        Ok(bonfire_train::OptimizerSpec { kind, adamw })
    }

    /// `config` with this recipe's schedule, clipping, accumulation and bias update.
    pub fn fit(
        &self,
        config: bonfire_train::FitConfig,
    ) -> Result<bonfire_train::FitConfig, String> {
        Ok(bonfire_train::FitConfig {
            schedule: self.schedule()?,
            clip_grad_norm: self.clip_grad_norm,
            grad_accum: self.grad_accum,
            expert_bias_update: self.expert_bias_update,
            ..config
        })
    }
}

/// The GPT's sizes on a command line.
#[derive(Debug, Clone, clap::Args)]
pub struct GptArgs {
    /// The GPT's width.
    #[arg(long, default_value_t = 128)]
    pub d_model: usize,
    /// The GPT's attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// The GPT's layers.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// The GPT's feed-forward width.
    #[arg(long, default_value_t = 512)]
    pub d_ff: usize,
}

impl GptArgs {
    /// The GPT of these sizes over `vocab_size` tokens and sequences of `seq`.
    pub fn config(&self, vocab_size: usize, seq: usize) -> bonfire_models::GptConfig {
        bonfire_models::GptConfig {
            vocab_size,
            d_model: self.d_model,
            n_heads: self.heads,
            n_layers: self.layers,
            max_seq_len: seq,
            d_ff: self.d_ff,
        }
    }
}

/// The checkpoint options of a training command line: distributed checkpoints of the whole
/// training state (`bonfire_train::checkpoint`) and resuming from one in any layout.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CheckpointArgs {
    /// Save the whole training state here (each rank its own slices, rank 0 the index; one
    /// `step-NNNNNNNN` directory per checkpoint): every --checkpoint-every steps and at the end.
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps (with --checkpoint-dir; always at the end).
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<usize>,
    /// Keep only the last K checkpoints in --checkpoint-dir.
    #[arg(long, value_name = "K")]
    pub keep: Option<usize>,
    /// Resume from a checkpoint — a `step-N` directory, or a --checkpoint-dir (its latest) —
    /// under this run's --mesh, which may differ from the one that saved it; --steps is the
    /// run's total.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Write checkpoints before training goes on, instead of in a background thread.
    #[arg(long)]
    pub sync_save: bool,
}

impl CheckpointArgs {
    /// The checkpoint configuration (`None` without --checkpoint-dir); fails on options that
    /// need --checkpoint-dir without it.
    pub fn config(&self) -> Result<Option<CheckpointConfig>, String> {
        let Some(dir) = &self.checkpoint_dir else {
            if self.checkpoint_every.is_some() || self.keep.is_some() {
                return Err("--checkpoint-every and --keep need --checkpoint-dir".into());
            }
            return Ok(None);
        };
        if self.checkpoint_every == Some(0) {
            return Err("--checkpoint-every N: N must be at least 1".into());
        }
        Ok(Some(
            CheckpointConfig::new(dir)
                .with_keep(self.keep)
                .with_background(!self.sync_save),
        ))
    }
}

/// Fault tolerance and failure injection on a training command line.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct FaultArgs {
    /// Keep training when a data-parallel rank dies: the survivors shrink the group, drop the
    /// failed step and go on from their in-memory state (pure dp layouts, threads launcher).
    #[arg(long)]
    pub fault_tolerant: bool,
    /// Inject a failure: rank R panics at the start of step --at-step S (tests, chaos runs).
    #[arg(long, value_name = "R", requires = "at_step")]
    pub kill_rank: Option<usize>,
    /// The step --kill-rank strikes at.
    #[arg(long, value_name = "S", requires = "kill_rank")]
    pub at_step: Option<usize>,
}

impl FaultArgs {
    /// The injected failure, if any.
    pub fn kill(&self) -> Option<bonfire_train::KillAt> {
        Some(bonfire_train::KillAt {
            rank: self.kill_rank?,
            step: self.at_step?,
        })
    }

    /// The fault-tolerance options (`None` without --fault-tolerant), checked against the
    /// layout and the launcher.
    pub fn options(
        &self,
        dims: &ParallelDims,
        launcher: bonfire_train::Launcher,
    ) -> Result<Option<bonfire_train::FaultTolerance>, String> {
        if let Some(r) = self.kill_rank.filter(|&r| r >= dims.world_size()) {
            return Err(format!(
                "--kill-rank {r}: the layout has {} ranks",
                dims.world_size()
            ));
        }
        if !self.fault_tolerant {
            return Ok(None);
        }
        bonfire_train::fault::check_layout(dims).map_err(|e| format!("--fault-tolerant: {e}"))?;
        if launcher == bonfire_train::Launcher::Env {
            return Err(
                "--fault-tolerant needs the threads launcher: under mpirun a \
                        communicator cannot shrink, so a dead rank ends the job; save with \
                        --checkpoint-dir and --resume on fewer processes instead"
                    .into(),
            );
        }
        Ok(Some(bonfire_train::FaultTolerance {
            kill: self.kill(),
            ..Default::default()
        }))
    }
}

/// Every rank's outcome of a run: the results of those that finished. A rank that died is an
/// error naming it, unless the run is fault-tolerant (`tolerant`): then it is reported on
/// stderr and the survivors' results are returned.
pub fn survivors<R>(
    outcomes: Vec<Result<Result<R, bonfire_train::TrainError>, bonfire_comm::RankFailure>>,
    tolerant: bool,
) -> Result<Vec<R>, String> {
    let world_size = outcomes.len();
    let (mut done, mut errors, mut failures) = (Vec::new(), Vec::new(), Vec::new());
    for outcome in outcomes {
        match outcome {
            Ok(Ok(r)) => done.push(r),
            Ok(Err(e)) => errors.push(e.to_string()),
            Err(f) => failures.push(f),
        }
    }
    if failures.is_empty() || (tolerant && !errors.is_empty()) {
        return match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(done),
        };
    }
    // The dead ranks are the root cause: name them first (their peers' errors follow them).
    if !tolerant || done.is_empty() {
        return Err(bonfire_comm::LaunchError {
            world_size,
            failures,
        }
        .to_string());
    }
    for f in &failures {
        eprintln!("rank {} died: {}", f.rank, f.message);
    }
    Ok(done)
}

/// Logs (Bonfire's notices) to stderr, without timestamps.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_target(false)
        .without_time()
        .with_writer(std::io::stderr)
        .init();
}

/// Prints `error: {message}` and exits with status 2.
pub fn fail(message: impl std::fmt::Display) -> ! {
    eprintln!("error: {message}");
    std::process::exit(2)
}
