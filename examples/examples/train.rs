//! The training front door: one program for every model — the GPT, a Llama preset, or a
//! Hugging Face Llama or Mixtral directory — under any layout, on the generated corpus or on
//! your own text or token files, with distributed checkpoints, evaluation and a Hugging Face
//! export.
//!
//! ```sh
//! cargo run --release --example train -- --model llama-tiny --mesh dp=2,tp=2 --steps 50
//! # a Hugging Face directory (config.json; its weights if it has them, else a seeded init),
//! # your tokenizer and text, an eval loss every 50 steps, exported back at the end:
//! cargo run --release --example train -- --model path/to/llama --tokenizer tokenizer.json \
//!     --data corpus/ --eval-data valid.txt --eval-every 50 --mesh dp=2,pp=2 --zero 1 \
//!     --seq 128 --steps 500 --export target/trained
//! # a checkpoint exported as it is (bit for bit):
//! cargo run --release --example train -- --model llama-tiny --resume ckpt --steps 0 --export out
//! ```
//!
//! From the same `--seed` every layout trains on the same global batches from the same
//! initial model. `--data` takes UTF-8 text (a file or a directory of them, tokenized once
//! with `--tokenizer` and cached beside it) or a `*.bin` token file (nanoGPT's or llm.c's);
//! its sequences are read in a seeded per-epoch shuffle, step `s` being positions
//! `s · global batch ..` of that stream, each data-parallel replica reading only its own rows;
//! a `--resume`d run goes on with the stream where the checkpoint's step left it.
//!
//! A model directory's weights are read by every rank a slice at a time: only the
//! tensor-parallel shards, ZeRO slices and pipeline stages it holds (each rank prints
//! `weights rank=R read=N total=M`, in parameter values).

use bonfire_examples::cli::{
    CheckpointArgs, GptArgs, LayoutArgs, RunArgs, fail, init_logging, survivors,
};
use bonfire_examples::corpus::CharTokenizer;
use bonfire_examples::run::RunRecord;
use bonfire_examples::train_data::TrainData;
use bonfire_examples::{Gpt, GptConfig, harness};
use bonfire_layout::ParallelDims;
use bonfire_models::data::TokenBatch;
use bonfire_models::llama::{Llama, LlamaConfig};
use bonfire_models::mixtral::pretrained::MixtralWeights;
use bonfire_models::mixtral::{Mixtral, MixtralConfig};
use bonfire_models::pretrained;
use bonfire_module::params::{self, ParamValues};
use bonfire_parallel::ParameterSource;
use bonfire_parallel::{DataSource, ParallelModel};
use bonfire_train::checkpoint::{Checkpoint, Checkpointer, load_parameters, resume};
use bonfire_train::{Evaluation, Launcher, OptimizerKind, TrainError, Trainer, fit};
use burn::tensor::Device;
use clap::Parser;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Train the GPT, a Llama or a Mixtral under any layout, on generated text or your data"
)]
struct Cli {
    /// `gpt`, `llama-tiny`, `llama-bench`, or a Hugging Face Llama or Mixtral directory (its
    /// config.json, and its weights when it has them; without, the model starts from --seed).
    #[arg(long, default_value = "gpt")]
    model: String,
    /// The layout (`--mesh`, default `dp=2`, and its options).
    #[command(flatten)]
    layout: LayoutArgs,
    /// Distributed checkpoints and resuming.
    #[command(flatten)]
    ckpt: CheckpointArgs,
    /// The optimizer, steps, batch, seed, device, reporting and launcher.
    #[command(flatten)]
    run: RunArgs,
    /// The GPT's sizes (with --model gpt).
    #[command(flatten)]
    gpt: GptArgs,
    /// A Hugging Face `tokenizer.json` (read offline) for text data; the model's vocabulary
    /// must hold it (the GPT and the presets take its size, padded to a multiple of 8).
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Training data: UTF-8 text (a file or a directory) or a `*.bin` token file. Default:
    /// the generated corpus, character-tokenized.
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    /// Held-out data (the same kinds as --data) for an eval loss.
    #[arg(long, value_name = "PATH")]
    eval_data: Option<PathBuf>,
    /// Print the eval loss every this many steps (and always at the end; needs --eval-data).
    #[arg(long, value_name = "N", default_value_t = 0)]
    eval_every: usize,
    /// Global batches of --eval-data each evaluation averages over.
    #[arg(long, value_name = "N", default_value_t = 4)]
    eval_batches: usize,
    /// At the end, write the model as a Hugging Face directory (config.json and safetensors,
    /// sharded with an index past --max-shard-size). Llama and Mixtral models. With --resume,
    /// --steps 0 trains nothing and exports the checkpoint.
    #[arg(long, value_name = "DIR")]
    export: Option<PathBuf>,
    /// The largest weight file of --export (`5GiB`, `200MB`, bytes).
    #[arg(long, value_name = "BYTES", default_value = "5GiB", value_parser = bonfire_plan::parse_bytes)]
    max_shard_size: usize,
}

/// The model a command line names.
enum Choice {
    Gpt(GptConfig),
    /// A Llama, with the directory of its weights when it starts from them.
    Llama(LlamaConfig, Option<PathBuf>),
    /// A Mixtral, with the directory of its weights when it starts from them.
    Mixtral(MixtralConfig, Option<PathBuf>),
}

impl Cli {
    /// The model of `--model`, its vocabulary sized for `tokenizer` where it is a preset.
    fn choice(&self, tokenizer: Option<usize>) -> Result<Choice, String> {
        let vocab = tokenizer
            .unwrap_or_else(|| CharTokenizer.vocab_size())
            .next_multiple_of(8);
        let preset = |cfg: LlamaConfig| LlamaConfig {
            vocab_size: if tokenizer.is_some() {
                vocab
            } else {
                cfg.vocab_size
            },
            max_position_embeddings: cfg.max_position_embeddings.max(self.run.seq),
            ..cfg
        };
        let choice = match self.model.as_str() {
            "gpt" => Choice::Gpt(self.gpt.config(vocab, self.run.seq)),
            "llama-tiny" => Choice::Llama(preset(LlamaConfig::tiny()), None),
            "llama-bench" => Choice::Llama(preset(LlamaConfig::bench()), None),
            dir => {
                let dir = Path::new(dir);
                if !dir.join(pretrained::CONFIG).is_file() {
                    return Err(format!(
                        "--model {}: not gpt, llama-tiny, llama-bench or a directory with a {}",
                        dir.display(),
                        pretrained::CONFIG
                    ));
                }
                let config = dir.join(pretrained::CONFIG);
                let has_weights = [pretrained::WEIGHTS, pretrained::INDEX]
                    .iter()
                    .any(|f| dir.join(f).exists());
                let weights = has_weights.then(|| dir.to_path_buf());
                match harness::HarnessConfig::load(&config)? {
                    harness::HarnessConfig::Mixtral(cfg) => Choice::Mixtral(cfg, weights),
                    _ => Choice::Llama(LlamaConfig::load(config)?, weights),
                }
            }
        };
        if self.export.is_some() && matches!(choice, Choice::Gpt(_)) {
            return Err(
                "--export writes a Hugging Face Llama or Mixtral directory: use one of those"
                    .into(),
            );
        }
        Ok(choice)
    }
}

impl Choice {
    fn vocab_size(&self) -> usize {
        match self {
            Choice::Gpt(c) => c.vocab_size,
            Choice::Llama(c, _) => c.vocab_size,
            Choice::Mixtral(c, _) => c.base.vocab_size,
        }
    }

    fn config_json(&self) -> serde_json::Value {
        match self {
            Choice::Gpt(c) => serde_json::to_value(c).expect("a config serializes"),
            Choice::Llama(c, _) => serde_json::from_str(&c.to_json()).expect("valid JSON"),
            Choice::Mixtral(c, _) => serde_json::from_str(&c.to_json()).expect("valid JSON"),
        }
    }

    fn validate(&self, seq: usize) -> Result<(), String> {
        match self {
            Choice::Gpt(c) => c.validate(),
            Choice::Llama(c, _) if seq > c.max_position_embeddings => Err(format!(
                "--seq {seq}: the model's max_position_embeddings is {}",
                c.max_position_embeddings
            )),
            Choice::Llama(c, _) => c.validate(),
            Choice::Mixtral(c, _) => Choice::Llama(c.base, None)
                .validate(seq)
                .and_then(|()| c.validate()),
        }
    }
}

/// Everything a run needs besides its model.
struct Job {
    cli: Cli,
    dims: ParallelDims,
    optim: OptimizerKind,
    launcher: Launcher,
    data: TrainData,
    eval: Option<TrainData>,
    run: RunRecord,
    resumed: Option<Checkpoint>,
    /// The weights each rank loads its slices of (not when resuming: the checkpoint has them).
    weights: Option<Box<dyn ParameterSource>>,
    device: Device,
}

/// Writes the trained parameters somewhere (rank 0, after the run).
type Export<'a> = &'a (dyn Fn(Vec<ParamValues>) -> Result<(), String> + Sync);

fn main() {
    main_with(std::env::args_os());
}

/// The program on `args` (the program's name first): the GPU kit's `gpu_check train …` runs it
/// this way.
pub fn main_with(args: impl IntoIterator<Item = std::ffi::OsString>) {
    init_logging();
    let cli = Cli::parse_from(args);
    let dims = cli.layout.training_dims().unwrap_or_else(|e| fail(e));
    let optim = OptimizerKind::parse(&cli.run.optim).unwrap_or_else(|e| fail(e));
    let launcher =
        Launcher::parse(&cli.run.launcher, dims.world_size()).unwrap_or_else(|e| fail(e));
    let tokenizer = cli.tokenizer.as_ref().map(|p| {
        bonfire_data::Tokenizer::from_file(p).unwrap_or_else(|e| fail(format!("--tokenizer: {e}")))
    });
    let choice = cli
        .choice(tokenizer.as_ref().map(|t| t.vocab_size()))
        .unwrap_or_else(|e| fail(e));
    choice.validate(cli.run.seq).unwrap_or_else(|e| fail(e));
    let vocab = choice.vocab_size();
    let rows = cli.run.batch * dims.data_replicas();
    let open = |path: &Path, what: &str| {
        TrainData::packed(
            path,
            tokenizer.as_ref(),
            vocab,
            rows,
            cli.run.seq,
            cli.run.seed,
        )
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
        model: choice.config_json(),
        seed: cli.run.seed,
        seq: cli.run.seq,
        global_rows: rows,
        optim: optim.name().into(),
        lr: cli.run.lr,
        data: data.label(),
    };
    let export_only = cli.export.is_some();
    let resumed = cli.ckpt.resume.as_ref().map(|path| {
        let ckpt = Checkpoint::open(path).unwrap_or_else(|e| fail(e));
        run = run
            .resumed(&ckpt, dims.data_replicas(), cli.run.steps, export_only)
            .unwrap_or_else(|e| fail(e));
        ckpt
    });
    let data = data.with_rows(run.global_rows);
    let eval = eval.map(|e| e.with_rows(run.global_rows));
    let device = harness::device(&cli.run.device).unwrap_or_else(|e| fail(e));
    device.seed(cli.run.seed);
    let weights = match (&choice, &resumed) {
        (Choice::Llama(_, Some(dir)), None) => {
            let w = pretrained::Weights::open(dir).unwrap_or_else(|e| fail(e));
            Some(Box::new(w) as Box<dyn ParameterSource>)
        }
        (Choice::Mixtral(_, Some(dir)), None) => {
            let w = MixtralWeights::open(dir).unwrap_or_else(|e| fail(e));
            Some(Box::new(w) as Box<dyn ParameterSource>)
        }
        _ => None,
    };
    let job = Job {
        weights,
        dims,
        optim,
        launcher,
        data,
        eval,
        run,
        resumed,
        device,
        cli,
    };
    match choice {
        Choice::Gpt(cfg) => job.train(Gpt::new(&cfg, &job.device), None),
        Choice::Llama(cfg, _) => {
            let model = Llama::new(&cfg, &job.device);
            let export = |whole: Vec<ParamValues>| {
                let fresh = Llama::new(&cfg, &bonfire_examples::default_device());
                export_model(fresh, &cfg.to_json(), whole, &job.cli)
            };
            job.train(model, Some(&export));
        }
        Choice::Mixtral(cfg, _) => {
            let model = Mixtral::new(&cfg, &job.device);
            let export = |whole: Vec<ParamValues>| {
                let fresh = Mixtral::new(&cfg, &bonfire_examples::default_device());
                export_model(fresh, &cfg.to_json(), whole, &job.cli)
            };
            job.train(model, Some(&export));
        }
    }
}

/// Writes `whole` (every parameter of `model`, a fresh model of the run's config
/// `config_json`) to `--export` as a Hugging Face directory.
fn export_model<M: burn::module::Module>(
    model: M,
    config_json: &str,
    whole: Vec<ParamValues>,
    cli: &Cli,
) -> Result<(), String> {
    let Some(dir) = &cli.export else {
        return Ok(());
    };
    let infos = params::inventory(&model);
    let flat: Vec<f32> = whole.into_iter().flat_map(|p| p.values).collect();
    let model = params::assign_values(model, &infos, &flat);
    let files = pretrained::save_pretrained(&model, config_json, dir, cli.max_shard_size)?;
    println!("exported {} ({} weight files)", dir.display(), files.len());
    Ok(())
}

impl Job {
    /// Trains `model` on every rank of the layout; `export` writes the result at the end.
    fn train<M>(&self, model: M, export: Option<Export>)
    where
        M: ParallelModel<Batch = TokenBatch> + Sync,
    {
        let (cli, dims) = (&self.cli, &self.dims);
        let optim = self.optim;
        let trainer = Trainer::new(dims.clone(), move || optim.build());
        let first = self.data.batch(0, &self.device);
        trainer
            .check(&model, dims.world_size(), &first)
            .unwrap_or_else(|e| fail(e));
        let start_step = self.resumed.as_ref().map_or(0, Checkpoint::step);
        self.announce(&model, start_step);
        let checkpoints = cli.ckpt.config().unwrap_or_else(|e| fail(e)).map(|c| {
            c.with_optimizer(optim.describe())
                .with_rng(serde_json::json!({ "seed": cli.run.seed, "note": "the model is initialized from the seed; batch s is positions s·global_rows.. of the data's seeded stream" }))
                .with_extra(serde_json::json!({ "run": self.run }))
        });
        let config =
            cli.run
                .fit_config(start_step, self.run.global_rows, cli.ckpt.checkpoint_every);
        let end = config.steps;
        let outcomes = self
            .launcher
            .run_each("train", |pg| -> Result<(), TrainError> {
                let mut engine = trainer.build(model.clone(), &pg, &first)?;
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
                let eval = self.eval.as_ref().map(|d| {
                    Evaluation::new(
                        d as &dyn DataSource<TokenBatch>,
                        cli.eval_batches,
                        cli.eval_every,
                    )
                });
                let mut hooks = (checkpoints.clone().map(Checkpointer::new), eval);
                fit(engine.as_mut(), &self.data, &config, &mut hooks)?;
                let (checkpointer, eval) = hooks;
                if let Some(mut e) = eval.filter(|e| e.last().map(|l| l.0) != Some(end)) {
                    e.run(end, engine.as_mut())?;
                }
                if let (Some(dir), 0) = (checkpointer.as_ref().and_then(|c| c.last()), pg.rank()) {
                    println!("saved checkpoint {}", dir.display());
                }
                if let Some(export) = export.filter(|_| cli.export.is_some()) {
                    let whole = engine.parameters()?;
                    if pg.rank() == 0 {
                        export(whole).map_err(TrainError::Io)?;
                    }
                }
                Ok(())
            })
            .unwrap_or_else(|e| fail(e));
        survivors(outcomes, false).unwrap_or_else(|e| fail(e));
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
            self.optim.name(),
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
