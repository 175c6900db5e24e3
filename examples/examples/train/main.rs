//! The training front door, the one program for every model — the GPT, a Llama preset, or a
//! Hugging Face Llama or Mixtral directory — under any layout (data, ZeRO 1–3, HSDP, tensor
//! ± sequence, context, expert and pipeline parallelism on one mesh), on the generated corpus
//! or your own text or token files, through the trainer's one loop, with a progress bar,
//! distributed checkpoints, evaluation, fault tolerance and an export.
//!
//! ```sh
//! cargo run --release --example train                      # the GPT on the corpus, dp=2, 300 steps
//! cargo run --release --example train -- --mesh dp=2,tp=2,pp=2 --zero 1 --schedule 1f1b
//! cargo run --release --example train -- --model llama-tiny --mesh dp=2,tp=2 --steps 50
//! # the planner chooses the layout for 4 rank threads under a per-rank budget (docs/planner.md):
//! cargo run --release --example train -- --mesh auto --ranks 4 --memory-budget 300MiB
//! # a Hugging Face directory (config.json; its weights if it has them, else a seeded init),
//! # your tokenizer and text, an eval loss every 50 steps, exported back at the end:
//! cargo run --release --example train -- --model path/to/llama --tokenizer tokenizer.json \
//!     --data corpus/ --eval-data valid.txt --eval-every 50 --mesh dp=2,pp=2 --zero 1 \
//!     --seq 128 --steps 500 --export target/trained
//! # checkpoints of the whole training state, resumed on another layout:
//! cargo run --release --example train -- --mesh dp=4 --steps 100 --checkpoint-dir ckpt --checkpoint-every 50
//! cargo run --release --example train -- --mesh dp=2,tp=2 --zero 3 --steps 300 --resume ckpt
//! # a checkpoint exported as it is (bit for bit):
//! cargo run --release --example train -- --model llama-tiny --resume ckpt --steps 0 --export out
//! # one rank per MPI process:
//! cargo build --release -p bonfire-examples --features mpi --example train
//! mpirun -np 4 target/release/examples/train --launcher env --mesh dp=2,tp=2
//! ```
//!
//! From the same `--seed` every layout trains on the same global batches from the same
//! initial model, so the loss curve is the same whatever the layout. `--data` takes UTF-8 text
//! (a file or a directory of them, tokenized once with `--tokenizer` and cached beside it) or
//! a `*.bin` token file (nanoGPT's or llm.c's); its sequences are read in a seeded per-epoch
//! shuffle, step `s` being positions `s · global batch ..` of that stream, each data-parallel
//! replica reading only its own rows; a `--resume`d run goes on with the stream where the
//! checkpoint's step left it, under any `--mesh` (the model, seed, sequence length,
//! optimizer, learning rate and data come from the run and must match the flags given;
//! `--steps` is the run's total).
//!
//! A model directory's weights are read by every rank a slice at a time: only the
//! tensor-parallel shards, ZeRO slices and pipeline stages it holds (each rank prints
//! `weights rank=R read=N total=M`, in parameter values). The GPT on the generated corpus
//! prints a greedy sample at the end.
//!
//! Memory: the program allocates through `bonfire_comm::testing::rank_alloc::RankAllocator`,
//! which charges every heap block to the rank thread that allocated it, and prints each
//! rank's peak at the end (`peak_bytes rank=R bytes=N`). `--memory-budget 300MiB` caps every
//! rank's live bytes: a rank that would go over aborts the run with one `out of memory` line
//! naming the rank, the bytes it asked for, its live bytes and the budget — a device
//! out-of-memory error, on the CPU.

use bonfire_comm::testing::rank_alloc::{self, RankAllocator};
use bonfire_data::generated::CharTokenizer;
use bonfire_examples::cli::{fail, init_logging, survivors};
use bonfire_examples::harness;
use bonfire_examples::run::RunRecord;
use bonfire_layout::ParallelDims;
use bonfire_models::data::{TokenBatch, TrainData};
use bonfire_models::mixtral::pretrained::MixtralWeights;
use bonfire_models::{Gpt, GptConfig, Llama, Mixtral, ModelConfig, pretrained};
use bonfire_module::params::{self, ParamValues};
use bonfire_parallel::{DataSource, ParallelModel, ParameterSource};
use bonfire_train::checkpoint::{Checkpoint, Checkpointer, load_parameters, resume};
use bonfire_train::{
    Engine, Evaluation, FaultTolerance, Launcher, OptimizerKind, OptimizerSpec, TensorBoard,
    TrainError, Trainer, fault, fit, fit_fault_tolerant,
};
use burn::tensor::{Device, Int, Tensor, TensorData};
use clap::Parser;
use std::path::Path;

mod cli;

use cli::Cli;

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

/// Everything a run needs besides its model.
struct Job {
    cli: Cli,
    dims: ParallelDims,
    optim: OptimizerSpec,
    launcher: Launcher,
    tolerance: Option<FaultTolerance>,
    data: TrainData,
    eval: Option<TrainData>,
    run: RunRecord,
    resumed: Option<Checkpoint>,
    /// The weights each rank loads its slices of (not when resuming: the checkpoint has them).
    weights: Option<Box<dyn ParameterSource>>,
    device: Device,
}

/// What rank 0 does with the whole trained parameters (the export, the sample).
type Finish<'a> = &'a (dyn Fn(Vec<ParamValues>) -> Result<(), String> + Sync);

fn main() {
    // Large freed buffers kept for the next step (`bonfire_kernels::keep_freed_memory`).
    bonfire_kernels::keep_freed_memory();
    main_with(std::env::args_os());
}

/// The program on `args` (the program's name first): the GPU kit's `gpu_check train …` runs it
/// this way.
pub fn main_with(args: impl IntoIterator<Item = std::ffi::OsString>) {
    init_logging();
    let mut cli = Cli::parse_from(args);
    let tokenizer = cli.tokenizer.as_ref().map(|p| {
        bonfire_data::Tokenizer::from_file(p).unwrap_or_else(|e| fail(format!("--tokenizer: {e}")))
    });
    let (model, weights_dir) = cli
        .choice(tokenizer.as_ref().map(|t| t.vocab_size()))
        .unwrap_or_else(|e| fail(e));
    model.validate(cli.run.seq).unwrap_or_else(|e| fail(e));
    let dims = cli.dims(&model).unwrap_or_else(|e| fail(e));
    let job = Job::new(
        cli,
        dims,
        &model,
        tokenizer.as_ref(),
        weights_dir.as_deref(),
    );
    rank_alloc::set_budget(job.cli.memory_budget);
    let device = job.device.clone();
    let fused = job.cli.fused_loss.map(|rows| rows as usize);
    match model {
        ModelConfig::Gpt(cfg) => {
            let finish = |whole: Vec<ParamValues>| finish_gpt(&cfg, whole, &job.cli, job.sample());
            job.train(Gpt::new(&cfg, &device).with_fused_loss(fused), &finish);
        }
        ModelConfig::Llama(cfg) => {
            let finish = |whole: Vec<ParamValues>| {
                let fresh = Llama::new(&cfg, &bonfire_examples::default_device());
                export_pretrained(fresh, &cfg.to_json(), whole, &job.cli)
            };
            job.train(Llama::new(&cfg, &device).with_fused_loss(fused), &finish);
        }
        ModelConfig::Mixtral(cfg) => {
            let finish = |whole: Vec<ParamValues>| {
                let fresh = Mixtral::new(&cfg, &bonfire_examples::default_device());
                export_pretrained(fresh, &cfg.to_json(), whole, &job.cli)
            };
            job.train(Mixtral::new(&cfg, &device).with_fused_loss(fused), &finish);
        }
    }
}

/// `whole` (every parameter and state tensor, by name) assigned to `model`, a fresh model of
/// the run's configuration.
fn with_values<M: burn::module::Module>(model: M, whole: Vec<ParamValues>) -> M {
    let infos = params::all_tensors(&model);
    let mut by_name: std::collections::HashMap<String, Vec<f32>> =
        whole.into_iter().map(|p| (p.path, p.values)).collect();
    let flat: Vec<f32> = infos
        .iter()
        .flat_map(|i| by_name.remove(&i.path).expect("every tensor of the model"))
        .collect();
    params::assign_values(model, &infos, &flat)
}

/// Writes `whole` (every parameter of `model`, a fresh model of the run's config
/// `config_json`) to `--export` as a Hugging Face directory.
fn export_pretrained<M: burn::module::Module>(
    model: M,
    config_json: &str,
    whole: Vec<ParamValues>,
    cli: &Cli,
) -> Result<(), String> {
    let Some(dir) = &cli.export else {
        return Ok(());
    };
    let model = with_values(model, whole);
    let files = pretrained::save_pretrained(&model, config_json, dir, cli.max_shard_size)?;
    println!("exported {} ({} weight files)", dir.display(), files.len());
    Ok(())
}

/// The trained GPT: `--export`ed as `model.safetensors` and `cfg.json`, and a greedy sample
/// of `sample` characters printed.
fn finish_gpt(
    cfg: &GptConfig,
    whole: Vec<ParamValues>,
    cli: &Cli,
    sample: usize,
) -> Result<(), String> {
    let model = with_values(Gpt::new(cfg, &bonfire_examples::default_device()), whole);
    if let Some(dir) = &cli.export {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        bonfire_models::weights::save(&model, dir.join("model.safetensors"))?;
        let json = serde_json::to_string_pretty(cfg).expect("a config serializes");
        std::fs::write(dir.join("cfg.json"), json).map_err(|e| e.to_string())?;
        println!("exported {} (model.safetensors, cfg.json)", dir.display());
    }
    if sample > 0 {
        let text = greedy_sample(
            &burn::module::Module::valid(&model),
            "the ",
            sample,
            cfg.max_seq_len,
        );
        println!("sample: {text:?}");
    }
    Ok(())
}

/// Greedy continuation of `prompt` by the GPT trained on the generated corpus.
fn greedy_sample(model: &Gpt, prompt: &str, n: usize, seq: usize) -> String {
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

/// Names the last checkpoint `checkpointer` committed (rank 0).
fn saved(checkpointer: Option<&Checkpointer>, rank: usize) {
    if let (Some(dir), 0) = (checkpointer.and_then(|c| c.last()), rank) {
        println!("saved checkpoint {}", dir.display());
    }
}

impl Job {
    /// The run of `cli` under `dims` for `model`: its data, the checkpoint it resumes, the
    /// weights it starts from, the device.
    fn new(
        cli: Cli,
        dims: ParallelDims,
        model: &ModelConfig,
        tokenizer: Option<&bonfire_data::Tokenizer>,
        weights_dir: Option<&Path>,
    ) -> Self {
        let optim = OptimizerKind::parse(&cli.run.optim)
            .and_then(|kind| cli.run.recipe.optimizer(kind))
            .unwrap_or_else(|e| fail(e));
        let launcher =
            Launcher::parse(&cli.run.launcher, dims.world_size()).unwrap_or_else(|e| fail(e));
        let tolerance = cli
            .fault
            .options(&dims, launcher)
            .unwrap_or_else(|e| fail(e));
        let vocab = model.vocab_size();
        let rows = cli.run.batch * dims.data_replicas();
        let open = |path: &Path, what: &str| {
            TrainData::packed(path, tokenizer, vocab, rows, cli.run.seq, cli.run.seed)
                .unwrap_or_else(|e| fail(format!("{what}: {e}")))
        };
        let data = match &cli.data {
            Some(path) => open(path, "--data"),
            None if vocab < CharTokenizer.vocab_size() => fail(format!(
                "the generated corpus has {} characters, the model's vocabulary {vocab}: give --data",
                CharTokenizer.vocab_size()
            )),
            None => TrainData::generated(rows, cli.run.seq, cli.run.seed),
        };
        if cli.eval_every > 0 && cli.eval_data.is_none() {
            fail("--eval-every needs --eval-data");
        }
        let eval = cli.eval_data.as_ref().map(|p| open(p, "--eval-data"));
        let mut run = RunRecord {
            model: model.to_json(),
            seed: cli.run.seed,
            seq: cli.run.seq,
            global_rows: rows,
            optim: optim.kind.name().into(),
            lr: cli.run.lr,
            schedule: cli.run.recipe.schedule().unwrap_or_else(|e| fail(e)),
            data: data.label(),
        };
        let resumed = cli.ckpt.resume.as_ref().map(|path| {
            let ckpt = Checkpoint::open(path).unwrap_or_else(|e| fail(e));
            let export_only = cli.export.is_some();
            run = run
                .resumed(&ckpt, dims.data_replicas(), cli.run.steps, export_only)
                .unwrap_or_else(|e| fail(e));
            ckpt
        });
        let device = harness::device(&cli.run.device).unwrap_or_else(|e| fail(e));
        device.seed(cli.run.seed);
        let weights = match (model, weights_dir, &resumed) {
            (ModelConfig::Mixtral(_), Some(dir), None) => {
                let w = MixtralWeights::open(dir).unwrap_or_else(|e| fail(e));
                Some(Box::new(w) as Box<dyn ParameterSource>)
            }
            (_, Some(dir), None) => {
                let w = pretrained::Weights::open(dir).unwrap_or_else(|e| fail(e));
                Some(Box::new(w) as Box<dyn ParameterSource>)
            }
            _ => None,
        };
        let mut tolerance = tolerance;
        if let Some(t) = &mut tolerance {
            t.resume = resumed.as_ref().map(|c| c.dir.clone());
        }
        Self {
            data: data.with_rows(run.global_rows),
            eval: eval.map(|e| e.with_rows(run.global_rows)),
            dims,
            optim,
            launcher,
            tolerance,
            run,
            resumed,
            weights,
            device,
            cli,
        }
    }

    /// Trains `model` on every rank of the layout; rank 0 hands the result to `finish`.
    fn train<M>(&self, model: M, finish: Finish)
    where
        M: ParallelModel<Batch = TokenBatch> + Sync,
    {
        let dims = &self.dims;
        let trainer = Trainer::with_optimizer(dims.clone(), self.optim);
        let first = self.data.batch(0, &self.device);
        trainer
            .check(&model, dims.world_size(), &first)
            .unwrap_or_else(|e| fail(e));
        let start_step = self.resumed.as_ref().map_or(0, Checkpoint::step);
        self.announce(&model, start_step);
        let outcomes = self
            .launcher
            .run_each("train", |pg| -> Result<usize, TrainError> {
                let rank = pg.rank();
                let _counted = rank_alloc::enter_rank(rank);
                let mut engine = match &self.tolerance {
                    Some(t) => {
                        let config = self.fit_config(start_step);
                        let mut hooks = (self.hooks(), self.board(rank)?);
                        let run = fit_fault_tolerant(
                            &trainer, &model, &pg, &self.data, &config, &mut hooks, t,
                        )?;
                        if run.engine.world().rank() == 0 {
                            fault::print_summary(&run);
                        }
                        saved(hooks.0.as_ref(), run.engine.world().rank());
                        run.engine
                    }
                    None => self.train_rank(&trainer, &model, &pg, &first)?,
                };
                self.finish(engine.as_mut(), finish)?;
                Ok(rank)
            });
        let outcomes = outcomes.unwrap_or_else(|e| fail(e));
        let ranks = survivors(outcomes, self.tolerance.is_some()).unwrap_or_else(|e| fail(e));
        // Each rank's most live heap bytes over the run (build, steps, checkpoints), measured.
        for rank in ranks {
            println!("peak_bytes rank={rank} bytes={}", rank_alloc::peak(rank));
        }
    }

    /// One rank's run without fault tolerance: build, resume or load, train, evaluate.
    fn train_rank<M>(
        &self,
        trainer: &Trainer,
        model: &M,
        pg: &bonfire_comm::ProcessGroup,
        first: &TokenBatch,
    ) -> Result<Box<dyn Engine<TokenBatch>>, TrainError>
    where
        M: ParallelModel<Batch = TokenBatch> + Sync,
    {
        let mut engine = trainer.build(model.clone(), pg, first)?;
        if let Some(ckpt) = &self.resumed {
            resume(engine.as_mut(), &ckpt.dir)?;
        }
        if let Some(weights) = &self.weights {
            let got = load_parameters(engine.as_mut(), weights.as_ref())?;
            println!(
                "weights rank={} read={} total={}",
                pg.rank(),
                got.read,
                got.total
            );
        }
        let start_step = self.resumed.as_ref().map_or(0, Checkpoint::step);
        let config = self.fit_config(start_step);
        let end = config.steps;
        let cli = &self.cli;
        let board = self.board(pg.rank())?;
        let eval = self.eval.as_ref().map(|d| {
            Evaluation::new(
                d as &dyn DataSource<TokenBatch>,
                cli.eval_batches,
                cli.eval_every,
            )
            .with_tensorboard(board.clone())
        });
        let mut hooks = ((self.hooks(), board), eval);
        let data = fault::inject(&self.data, cli.fault.kill(), pg.rank());
        fit(engine.as_mut(), &data, &config, &mut hooks)?;
        saved(hooks.0.0.as_ref(), pg.rank());
        if let Some(mut e) = hooks.1.filter(|e| e.last().map(|l| l.0) != Some(end)) {
            e.run(end, engine.as_mut())?;
        }
        Ok(engine)
    }

    /// The sample's characters: `--sample` for the GPT on the generated corpus, else none.
    fn sample(&self) -> usize {
        match self.data.is_generated() && self.cli.model == "gpt" {
            true => self.cli.sample,
            false => 0,
        }
    }

    /// The loop's configuration from `start_step`.
    fn fit_config(&self, start_step: usize) -> bonfire_train::FitConfig {
        let checkpoint_every = self.cli.ckpt.checkpoint_every;
        self.cli
            .run
            .fit_config(start_step, self.run.global_rows, checkpoint_every)
    }

    /// The checkpoint hook of `--checkpoint-dir` (none without it).
    /// Rank 0's TensorBoard event file, with `--tensorboard` (`None` elsewhere).
    fn board(&self, rank: usize) -> Result<Option<TensorBoard>, TrainError> {
        match (&self.cli.run.tensorboard, rank) {
            (Some(dir), 0) => TensorBoard::create(dir).map(Some),
            _ => Ok(None),
        }
    }

    fn hooks(&self) -> Option<Checkpointer> {
        let cli = &self.cli;
        let config = cli.ckpt.config().unwrap_or_else(|e| fail(e))?;
        let note = "the model is initialized from the seed; batch s is positions \
                    s·global_rows.. of the data's seeded stream";
        Some(Checkpointer::new(
            config
                .with_optimizer(self.optim.describe())
                .with_rng(serde_json::json!({ "seed": cli.run.seed, "note": note }))
                .with_extra(serde_json::json!({ "run": self.run })),
        ))
    }

    /// After training: the whole parameters, then the state tensors, handed to `finish` on
    /// rank 0 when there is anything to finish (an export, a sample).
    fn finish(
        &self,
        engine: &mut dyn Engine<TokenBatch>,
        finish: Finish,
    ) -> Result<(), TrainError> {
        if self.cli.export.is_none() && self.sample() == 0 {
            return Ok(());
        }
        let mut whole = engine.parameters()?;
        whole.extend(engine.buffers()?);
        if engine.world().rank() == 0 {
            finish(whole).map_err(TrainError::Io)?;
        }
        Ok(())
    }

    /// What the run trains, on what, and where a resumed run starts.
    fn announce<M: ParallelModel>(&self, model: &M, start_step: usize) {
        let (cli, run) = (&self.cli, &self.run);
        println!(
            "train: {} ({} parameters), layout {}, {} x {} tokens per step, {} {} steps at lr {}, data {}",
            cli.model,
            model.num_params(),
            self.dims,
            run.global_rows,
            cli.run.seq,
            self.optim.kind.name(),
            cli.run.steps,
            cli.run.lr,
            run.data
        );
        if let (Some(n), Some((epoch, position))) =
            (self.data.sequences(), self.data.position(start_step))
        {
            println!(
                "data: {n} sequences of {} tokens an epoch; step {start_step} starts at epoch {epoch}, position {position}",
                cli.run.seq
            );
        }
        if let Some(ckpt) = &self.resumed {
            println!(
                "resuming from {} at step {} (saved under {} on {} ranks)",
                ckpt.dir.display(),
                ckpt.step(),
                ckpt.index.layout.dims,
                ckpt.index.layout.world
            );
        }
    }
}
