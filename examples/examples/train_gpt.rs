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
//! # one rank per MPI process:
//! cargo build --release -p bonfire-examples --features mpi --example train_gpt
//! mpirun -np 4 target/release/examples/train_gpt --launcher env --mesh dp=2,tp=2
//! ```
//!
//! From the same `--seed` every layout trains on the same global batches from the same
//! initial model, so the loss curve is the same whatever the layout.
//!
//! Memory: the program allocates through `bonfire_examples::memory::RankAllocator`, which
//! charges every heap block to the rank thread that allocated it. At the end it prints each
//! rank's peak (`peak_bytes rank=R bytes=N`). `--memory-budget 300MiB` caps every rank's live
//! bytes: a rank that would go over aborts the run with one line such as `out of memory: rank
//! 1 asked for 25165824 bytes with 1073741824 live; its budget is 1100000000 bytes
//! (--memory-budget)` — a device out-of-memory error, on the CPU.

use bonfire_dtensor::params;
use bonfire_examples::cli::{LayoutArgs, fail, init_logging};
use bonfire_examples::corpus::{self, CharTokenizer};
use bonfire_examples::memory::{self, RankAllocator};
use bonfire_examples::parallel::TokenBatch;
use bonfire_examples::{Gpt, GptConfig, checkpoint, default_device, harness};
use bonfire_train::{
    Engine, FitConfig, Hooks, Launcher, OptimizerKind, ParallelDims, TrainError, Trainer, fit,
};
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
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
    /// Burn's optimizer: adamw (β1 0.9, β2 0.95, ε 1e-6, weight decay 0.1) or sgd.
    #[arg(long, default_value = "adamw")]
    optim: String,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per data-parallel replica per step (the global batch is dp times this).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 512)]
    d_ff: usize,
    /// Seed of the initial model and of the batches.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The Burn device every rank computes on: `flex` (CPU) or `wgpu` (a build with
    /// `--features wgpu`).
    #[arg(long, default_value = "flex")]
    device: String,
    /// Print the loss every this many steps.
    #[arg(long, default_value_t = 25)]
    log_every: usize,
    /// Write one JSON line per step (step, loss, tokens_per_s, step_ms) to this file.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Where to save the trained parameters (safetensors, PyTorch layout).
    #[arg(long, default_value = "target/train_gpt/gpt.safetensors")]
    checkpoint: PathBuf,
    /// Train only: no checkpoint (rank 0 gathers the whole model to save it), no sample.
    #[arg(long)]
    no_save: bool,
    /// `threads`: every rank a thread of this process; `env`: this process is one rank of a
    /// job started by a launcher (`mpirun`; build with `--features mpi`).
    #[arg(long, default_value = "threads")]
    launcher: String,
    /// Cap every rank's live heap bytes (`300MiB`, `1.5GiB`, `64M`, bytes): an allocation that
    /// would go over aborts the run with one `out of memory` line naming the rank, the bytes
    /// it asked for, its live bytes and the budget.
    #[arg(long, value_name = "BYTES", value_parser = memory::parse_bytes)]
    memory_budget: Option<usize>,
}

impl Cli {
    fn dims(&self) -> Result<ParallelDims, String> {
        let mut dims = self.layout.dims("dp=2")?;
        if dims.pp() > 1 && dims.pp.schedule.is_none() {
            dims = dims.with_schedule(bonfire_pipeline::ScheduleKind::OneFOneB);
        }
        Ok(dims)
    }

    /// The vocabulary is padded to a multiple of 8 (as Megatron pads it) so that tensor
    /// parallelism up to 8 can split the embedding and the head.
    fn config(&self) -> GptConfig {
        GptConfig {
            vocab_size: CharTokenizer.vocab_size().next_multiple_of(8),
            d_model: self.d_model,
            n_heads: self.heads,
            n_layers: self.layers,
            max_seq_len: self.seq,
            d_ff: self.d_ff,
        }
    }
}

/// Saves the whole model when the loop says a checkpoint is due (rank 0 writes).
struct SaveAtEnd<'a> {
    cfg: GptConfig,
    /// `None`: `--no-save`.
    path: Option<&'a PathBuf>,
    trained: Option<Gpt>,
}

impl Hooks<TokenBatch> for SaveAtEnd<'_> {
    fn checkpoint(
        &mut self,
        _step: usize,
        engine: &mut dyn Engine<TokenBatch>,
    ) -> Result<(), TrainError> {
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
        checkpoint::save(&model, path).map_err(TrainError::Io)?;
        let cfg_path = path.with_extension("json");
        std::fs::write(&cfg_path, serde_json::to_string_pretty(&self.cfg).unwrap())
            .map_err(|e| TrainError::Io(e.to_string()))?;
        println!(
            "saved checkpoint to {} (config {})",
            path.display(),
            cfg_path.display()
        );
        self.trained = Some(model);
        Ok(())
    }
}

fn main() {
    init_logging();
    let cli = Cli::parse();
    let dims = cli.dims().unwrap_or_else(|e| fail(e));
    let optim = OptimizerKind::parse(&cli.optim).unwrap_or_else(|e| fail(e));
    let cfg = cli.config();
    cfg.validate().unwrap_or_else(|e| fail(e));
    let launcher = Launcher::parse(&cli.launcher, dims.world_size()).unwrap_or_else(|e| fail(e));
    let text = corpus::generate(400_000, cli.seed);
    let tokens = CharTokenizer.encode(&text);
    let device = harness::device(&cli.device).unwrap_or_else(|e| fail(e));
    device.seed(cli.seed);
    let model = Gpt::new(&cfg, &device);
    let rows = cli.batch * dims.dp();
    let data = |step: usize, device: &Device| {
        corpus::global_batch(&tokens, rows, cli.seq, cli.seed, step, device)
    };
    let trainer = Trainer::new(dims.clone(), move || optim.build());
    trainer
        .check(&model, dims.world_size(), &data(0, &device))
        .unwrap_or_else(|e| fail(e));
    println!(
        "train_gpt: {} parameters, layout {dims}, {} x {} tokens per step, {} {} steps at lr {}, corpus {} chars",
        cfg.num_params(),
        rows,
        cli.seq,
        optim.name(),
        cli.steps,
        cli.lr,
        text.len()
    );
    let config = FitConfig {
        tokens_per_step: Some(rows * cli.seq),
        progress: true,
        log_every: cli.log_every,
        metrics: cli.metrics.clone(),
        ..FitConfig::new(cli.steps, cli.lr)
    };
    memory::set_budget(cli.memory_budget);
    let trained = launcher
        .run(
            "train_gpt",
            |pg| -> Result<(Option<Gpt>, usize), TrainError> {
                let rank = pg.rank();
                let _counted = memory::enter_rank(rank);
                let first = data(0, &device);
                let mut engine = trainer.build(model.clone(), &pg, &first)?;
                let mut save = SaveAtEnd {
                    cfg,
                    path: (!cli.no_save).then_some(&cli.checkpoint),
                    trained: None,
                };
                fit(engine.as_mut(), &data, &config, &mut save)?;
                Ok((save.trained, rank))
            },
        )
        .unwrap_or_else(|e| fail(e));
    let ranks: Vec<(Option<Gpt>, usize)> = trained
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| fail(e)))
        .collect();
    // Each rank's most live heap bytes over the run (build, steps, checkpoint), measured.
    for (_, rank) in &ranks {
        println!("peak_bytes rank={rank} bytes={}", memory::peak(*rank));
    }
    let trained = ranks.into_iter().next().and_then(|(model, _)| model);
    if let Some(model) = trained {
        println!("sample: {:?}", sample(&model.valid(), "the ", 120, cli.seq));
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
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as i64)
            .unwrap_or(0);
        ids.push(next);
    }
    CharTokenizer.decode(&ids)
}
