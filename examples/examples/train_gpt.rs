//! The main job: train the reference GPT on a generated text corpus under any layout — data
//! (DDP or ZeRO 1–3), tensor (± sequence and loss parallelism) and pipeline parallelism on one
//! mesh — through the trainer's one loop, with a progress bar (step, loss, tokens/s), then
//! save a checkpoint and print a sample.
//!
//! ```sh
//! cargo run --release --example train_gpt                              # dp=2, 300 steps
//! cargo run --release --example train_gpt -- --mesh dp=2,tp=2,pp=2 --zero 1 --schedule 1f1b
//! cargo run --release --example train_gpt -- --mesh dp=4 --zero 3 --optim sgd --lr 0.5
//! cargo run --release --example train_gpt -- --steps 20 --metrics target/train_gpt/metrics.jsonl
//! # the planner chooses the layout for 4 rank threads under a per-rank budget (docs/planner.md):
//! cargo run --release --example train_gpt -- --mesh auto --ranks 4 --memory-budget 300MiB
//! # checkpoints of the whole training state, resumed on another layout:
//! cargo run --release --example train_gpt -- --mesh dp=4 --steps 100 --checkpoint-dir ckpt --checkpoint-every 50
//! cargo run --release --example train_gpt -- --mesh dp=2,tp=2 --zero 3 --steps 300 --resume ckpt
//! # one rank per MPI process:
//! cargo build --release -p bonfire-examples --features mpi --example train_gpt
//! mpirun -np 4 target/release/examples/train_gpt --launcher env --mesh dp=2,tp=2
//! ```
//!
//! From the same `--seed` every layout trains on the same global batches from the same
//! initial model, so the loss curve is the same whatever the layout.
//!
//! `--checkpoint-dir` saves the whole training state (parameters and optimizer state, each
//! rank its own slices) every `--checkpoint-every` steps and at the end; `--resume` continues
//! the run it holds under any `--mesh`: the global batch, seed, sequence length, optimizer,
//! learning rate and model come from the run (they must match the flags given), `--steps` is
//! the run's total, and `--metrics` lines go on with the true step numbers.
//!
//! Memory: the program allocates through `bonfire_comm::testing::rank_alloc::RankAllocator`, which
//! charges every heap block to the rank thread that allocated it. At the end it prints each
//! rank's peak (`peak_bytes rank=R bytes=N`). `--memory-budget 300MiB` caps every rank's live
//! bytes: a rank that would go over aborts the run with one line such as `out of memory: rank
//! 1 asked for 25165824 bytes with 1073741824 live; its budget is 1100000000 bytes
//! (--memory-budget)` — a device out-of-memory error, on the CPU.

use bonfire_comm::testing::rank_alloc::{self, RankAllocator};
use bonfire_examples::cli::{
    CheckpointArgs, FaultArgs, GptArgs, LayoutArgs, RunArgs, fail, init_logging, survivors,
};
use bonfire_examples::corpus::CharTokenizer;
use bonfire_examples::run::RunRecord;
use bonfire_examples::train_data::TrainData;
use bonfire_examples::{Gpt, GptConfig, default_device, harness};
use bonfire_layout::ParallelDims;
use bonfire_models::data::TokenBatch;
use bonfire_models::weights;
use bonfire_module::params;
use bonfire_parallel::DataSource;
use bonfire_train::checkpoint::{Checkpoint, Checkpointer, resume};
use bonfire_train::{
    Engine, Hooks, Launcher, OptimizerKind, StepReport, TrainError, Trainer, fault, fit,
    fit_fault_tolerant,
};
use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData};
use clap::Parser;
use std::path::PathBuf;

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

#[derive(Parser, Debug, Clone)]
#[command(about = "Train a small GPT on CPU ranks under any dp × ZeRO × tp × pp layout")]
struct Cli {
    /// The layout (`--mesh`, default `dp=2`, and its options).
    #[command(flatten)]
    layout: LayoutArgs,
    /// Distributed checkpoints and resuming.
    #[command(flatten)]
    ckpt: CheckpointArgs,
    /// Fault tolerance (`--fault-tolerant`) and failure injection (`--kill-rank R --at-step S`).
    #[command(flatten)]
    fault: FaultArgs,
    /// The optimizer, steps, batch, seed, device, reporting and launcher.
    #[command(flatten)]
    run: RunArgs,
    /// The GPT's sizes.
    #[command(flatten)]
    gpt: GptArgs,
    /// Ranks for `--mesh auto` (the planner chooses their layout; the global batch is
    /// `--batch` × `--ranks` sequences, split over the replicas the plan has).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Where to save the trained parameters (safetensors, PyTorch layout).
    #[arg(long, default_value = "target/train_gpt/gpt.safetensors")]
    checkpoint: PathBuf,
    /// Train only: no checkpoint (rank 0 gathers the whole model to save it), no sample.
    #[arg(long)]
    no_save: bool,
    /// Cap every rank's live heap bytes (`300MiB`, `1.5GiB`, `64M`, bytes): an allocation that
    /// would go over aborts the run with one `out of memory` line naming the rank, the bytes
    /// it asked for, its live bytes and the budget.
    #[arg(long, value_name = "BYTES", value_parser = bonfire_plan::parse_bytes)]
    memory_budget: Option<usize>,
}

impl Cli {
    fn dims(&mut self) -> Result<ParallelDims, String> {
        if self.layout.mesh.as_deref() == Some("auto") {
            return self.auto_dims();
        }
        self.layout.training_dims()
    }

    /// `--mesh auto`: the planner's fastest layout for `--ranks` CPU ranks of this machine
    /// under `--memory-budget` (or the available memory), printed with its reasons; the
    /// global batch stays `--batch` × `--ranks`, so `--batch` becomes the plan's per-replica
    /// share.
    fn auto_dims(&mut self) -> Result<ParallelDims, String> {
        let chosen = LayoutArgs {
            mesh: None,
            precision: None,
            reduce_in_half: false,
            ..self.layout.clone()
        };
        if format!("{chosen:?}") != format!("{:?}", LayoutArgs::default())
            || self.run.launcher != "threads"
        {
            return Err("--mesh auto chooses the layout for --ranks rank threads (--launcher threads): give no other layout option than --precision/--reduce-in-half".into());
        }
        let precision = LayoutArgs {
            mesh: Some("dp=1".into()),
            ..self.layout.clone()
        }
        .dims("dp=1")?
        .precision;
        let rows = self.run.batch * self.ranks;
        let (dims, lines) = bonfire_examples::planner::auto_layout(
            &self.config(),
            self.ranks,
            rows,
            self.run.seq,
            &precision,
            self.memory_budget,
        )?;
        for line in lines {
            println!("{line}");
        }
        self.run.batch = rows / dims.data_replicas();
        Ok(dims)
    }

    /// The vocabulary is padded to a multiple of 8 (as Megatron pads it) so that tensor
    /// parallelism up to 8 can split the embedding and the head.
    fn config(&self) -> GptConfig {
        let vocab = CharTokenizer.vocab_size().next_multiple_of(8);
        self.gpt.config(vocab, self.run.seq)
    }
}

/// Saves the whole model after the last step (rank 0 writes).
struct SaveAtEnd<'a> {
    cfg: GptConfig,
    /// `None`: `--no-save`.
    path: Option<&'a PathBuf>,
    /// The run's last step.
    last: usize,
    trained: Option<Gpt>,
}

impl SaveAtEnd<'_> {
    fn save(&mut self, engine: &mut dyn Engine<TokenBatch>) -> Result<(), TrainError> {
        let Some(path) = self.path else {
            return Ok(());
        };
        let whole = engine.parameters()?;
        if engine.world().rank() != 0 {
            return Ok(());
        }
        let model = Gpt::new(&self.cfg, &default_device());
        let infos = params::inventory(&model);
        let flat: Vec<f32> = whole.into_iter().flat_map(|p| p.values).collect();
        let model = params::assign_values(model, &infos, &flat);
        weights::save(&model, path).map_err(TrainError::Io)?;
        let cfg_path = path.with_extension("json");
        std::fs::write(&cfg_path, serde_json::to_string_pretty(&self.cfg).unwrap())
            .map_err(|e| TrainError::Io(e.to_string()))?;
        println!(
            "saved model to {} (config {})",
            path.display(),
            cfg_path.display()
        );
        self.trained = Some(model);
        Ok(())
    }
}

/// The run's hooks: distributed checkpoints (`--checkpoint-dir`) and the model at the end.
struct RunHooks<'a> {
    checkpoints: Option<Checkpointer>,
    model: SaveAtEnd<'a>,
}

impl Hooks<TokenBatch> for RunHooks<'_> {
    fn after_step(
        &mut self,
        report: &StepReport,
        engine: &mut dyn Engine<TokenBatch>,
    ) -> Result<(), TrainError> {
        match &mut self.checkpoints {
            Some(c) => c.after_step(report, engine),
            None => Ok(()),
        }
    }

    fn checkpoint(
        &mut self,
        step: usize,
        engine: &mut dyn Engine<TokenBatch>,
    ) -> Result<(), TrainError> {
        if let Some(c) = &mut self.checkpoints {
            Hooks::<TokenBatch>::checkpoint(c, step, engine)?;
        }
        if step == self.model.last {
            self.model.save(engine)?;
        }
        Ok(())
    }

    fn finish(&mut self, engine: &mut dyn Engine<TokenBatch>) -> Result<(), TrainError> {
        if let Some(c) = &mut self.checkpoints {
            Hooks::<TokenBatch>::finish(c, engine)?;
            if engine.world().rank() == 0
                && let Some(dir) = c.last()
            {
                println!("saved checkpoint {}", dir.display());
            }
        }
        Ok(())
    }
}

fn main() {
    init_logging();
    let mut cli = Cli::parse();
    let dims = cli.dims().unwrap_or_else(|e| fail(e));
    let optim = OptimizerKind::parse(&cli.run.optim).unwrap_or_else(|e| fail(e));
    let cfg = cli.config();
    cfg.validate().unwrap_or_else(|e| fail(e));
    let launcher =
        Launcher::parse(&cli.run.launcher, dims.world_size()).unwrap_or_else(|e| fail(e));
    let mut tolerance = cli
        .fault
        .options(&dims, launcher)
        .unwrap_or_else(|e| fail(e));
    let device = harness::device(&cli.run.device).unwrap_or_else(|e| fail(e));
    device.seed(cli.run.seed);
    let model = Gpt::new(&cfg, &device);
    let mut run = RunRecord {
        model: serde_json::to_value(cfg).expect("a config serializes"),
        seed: cli.run.seed,
        seq: cli.run.seq,
        global_rows: cli.run.batch * dims.data_replicas(),
        optim: optim.name().into(),
        lr: cli.run.lr,
        data: "generated".into(),
    };
    let resumed = cli.ckpt.resume.as_ref().map(|path| {
        let ckpt = Checkpoint::open(path).unwrap_or_else(|e| fail(e));
        run = run
            .resumed(&ckpt, dims.data_replicas(), cli.run.steps, false)
            .unwrap_or_else(|e| fail(e));
        ckpt
    });
    let rows = run.global_rows;
    let data = TrainData::generated(rows, cli.run.seq, cli.run.seed);
    let trainer = Trainer::new(dims.clone(), move || optim.build());
    trainer
        .check(&model, dims.world_size(), &data.batch(0, &device))
        .unwrap_or_else(|e| fail(e));
    let start_step = resumed.as_ref().map_or(0, Checkpoint::step);
    announce(&cli, &dims, &run, optim, data.tokens(), resumed.as_ref());
    let checkpoints = cli.ckpt.config().unwrap_or_else(|e| fail(e)).map(|c| {
        c.with_optimizer(optim.describe())
            .with_rng(serde_json::json!({ "seed": cli.run.seed, "note": "batches are drawn from (seed, step); nothing else is random after initialization" }))
            .with_extra(serde_json::json!({ "run": run }))
    });
    let config = cli
        .run
        .fit_config(start_step, rows, cli.ckpt.checkpoint_every);
    rank_alloc::set_budget(cli.memory_budget);
    if let Some(t) = &mut tolerance {
        t.resume = resumed.as_ref().map(|c| c.dir.clone());
    }
    let kill = cli.fault.kill();
    let trained = launcher
        .run_each(
            "train_gpt",
            |pg| -> Result<(Option<Gpt>, usize), TrainError> {
                let rank = pg.rank();
                let _counted = rank_alloc::enter_rank(rank);
                let mut hooks = RunHooks {
                    checkpoints: checkpoints.clone().map(Checkpointer::new),
                    model: SaveAtEnd {
                        cfg,
                        path: (!cli.no_save).then_some(&cli.checkpoint),
                        last: cli.run.steps,
                        trained: None,
                    },
                };
                if let Some(t) = &tolerance {
                    let run =
                        fit_fault_tolerant(&trainer, &model, &pg, &data, &config, &mut hooks, t)?;
                    if run.engine.world().rank() == 0 {
                        fault::print_summary(&run);
                    }
                    return Ok((hooks.model.trained, rank));
                }
                let first = data.batch(0, &device);
                let mut engine = trainer.build(model.clone(), &pg, &first)?;
                if let Some(ckpt) = &resumed {
                    resume(engine.as_mut(), &ckpt.dir)?;
                }
                let data = fault::inject(&data, kill, rank);
                fit(engine.as_mut(), &data, &config, &mut hooks)?;
                Ok((hooks.model.trained, rank))
            },
        )
        .unwrap_or_else(|e| fail(e));
    let ranks: Vec<(Option<Gpt>, usize)> =
        survivors(trained, tolerance.is_some()).unwrap_or_else(|e| fail(e));
    // Each rank's most live heap bytes over the run (build, steps, checkpoint), measured.
    for (_, rank) in &ranks {
        println!("peak_bytes rank={rank} bytes={}", rank_alloc::peak(*rank));
    }
    let trained = ranks.into_iter().next().and_then(|(model, _)| model);
    if let Some(model) = trained {
        println!(
            "sample: {:?}",
            sample(&model.valid(), "the ", 120, cli.run.seq)
        );
    }
}

/// What the run trains, and where a resumed run starts.
fn announce(
    cli: &Cli,
    dims: &ParallelDims,
    run: &RunRecord,
    optim: OptimizerKind,
    corpus_chars: usize,
    resumed: Option<&Checkpoint>,
) {
    println!(
        "train_gpt: {} parameters, layout {dims}, {} x {} tokens per step, {} {} steps at lr {}, corpus {} chars",
        cli.config().num_params(),
        run.global_rows,
        cli.run.seq,
        optim.name(),
        cli.run.steps,
        cli.run.lr,
        corpus_chars
    );
    if let Some(ckpt) = resumed {
        println!(
            "resuming from {} at step {} (saved under {} on {} ranks)",
            ckpt.dir.display(),
            ckpt.step(),
            ckpt.index.layout.dims,
            ckpt.index.layout.world
        );
    }
}

/// Greedy continuation of `prompt`.
fn sample(model: &Gpt, prompt: &str, n: usize, seq: usize) -> String {
    let device = model.tok_emb.weight.val().device();
    let mut ids = CharTokenizer.encode(prompt);
    for _ in 0..n {
        let window = &ids[ids.len().saturating_sub(seq)..];
        let t = window.len();
        let input = Tensor::<2, Int>::from_data(TensorData::new(window.to_vec(), [1, t]), &device);
        let logits = params::to_host(model.forward(input).narrow(1, t - 1, 1));
        // Only the tokenizer's ids: the vocabulary is padded (to a multiple of tp), and an
        // untrained padding row may win.
        let next = logits
            .iter()
            .take(CharTokenizer.vocab_size())
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as i64)
            .unwrap_or(0);
        ids.push(next);
    }
    CharTokenizer.decode(&ids)
}
