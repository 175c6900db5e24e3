//! The training front door's flags (`Cli`): the model, the layout (`--mesh` or `auto`, the
//! planner's choice), checkpoints, fault tolerance, data, evaluation and export; and the two
//! answers they give before a run starts — which model, and which layout.

use bonfire_data::generated::CharTokenizer;
use bonfire_examples::cli::{CheckpointArgs, FaultArgs, GptArgs, LayoutArgs, RunArgs};
use bonfire_layout::ParallelDims;
use bonfire_models::{LlamaConfig, ModelConfig, pretrained};
use clap::Parser;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Train the GPT, a Llama or a Mixtral under any layout, on generated text or your data"
)]
pub(crate) struct Cli {
    /// `gpt`, `llama-tiny`, `llama-bench`, or a Hugging Face Llama or Mixtral directory (its
    /// config.json, and its weights when it has them; without, the model starts from --seed).
    #[arg(long, default_value = "gpt")]
    pub(crate) model: String,
    /// The layout (`--mesh`, default `dp=2`, or `auto`, and its options).
    #[command(flatten)]
    pub(crate) layout: LayoutArgs,
    /// Distributed checkpoints and resuming.
    #[command(flatten)]
    pub(crate) ckpt: CheckpointArgs,
    /// Fault tolerance (`--fault-tolerant`) and failure injection (`--kill-rank R --at-step S`).
    #[command(flatten)]
    pub(crate) fault: FaultArgs,
    /// The optimizer, steps, batch, seed, device, reporting and launcher.
    #[command(flatten)]
    pub(crate) run: RunArgs,
    /// The GPT's sizes (with --model gpt).
    #[command(flatten)]
    pub(crate) gpt: GptArgs,
    /// Ranks for `--mesh auto` (the planner chooses their layout; the global batch is
    /// `--batch` × `--ranks` sequences, split over the replicas the plan has).
    #[arg(long, default_value_t = 2)]
    pub(crate) ranks: usize,
    /// Cap every rank's live heap bytes (`300MiB`, `1.5GiB`, `64M`, bytes): an allocation that
    /// would go over aborts the run with one `out of memory` line naming the rank.
    #[arg(long, value_name = "BYTES", value_parser = bonfire_plan::parse_bytes)]
    pub(crate) memory_budget: Option<usize>,
    /// The head and its loss as one node by blocks of ROWS positions (every model;
    /// `bonfire_kernels::linear_cross_entropy`): a rank never holds its `[tokens, V]` logits
    /// whole, nor their gradient (a pipeline's last stage included). Where the head is
    /// sharded (tp), it runs unfused.
    #[arg(long, value_name = "ROWS", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) fused_loss: Option<u64>,
    /// A Hugging Face `tokenizer.json` (read offline) for text data; the model's vocabulary
    /// must hold it (the GPT and the presets take its size, padded to a multiple of 8).
    #[arg(long, value_name = "FILE")]
    pub(crate) tokenizer: Option<PathBuf>,
    /// Training data: UTF-8 text (a file or a directory) or a `*.bin` token file. Default:
    /// the generated corpus, character-tokenized.
    #[arg(long, value_name = "PATH")]
    pub(crate) data: Option<PathBuf>,
    /// Held-out data (the same kinds as --data) for an eval loss.
    #[arg(long, value_name = "PATH")]
    pub(crate) eval_data: Option<PathBuf>,
    /// Print the eval loss every this many steps (and always at the end; needs --eval-data).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) eval_every: usize,
    /// Global batches of --eval-data each evaluation averages over.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub(crate) eval_batches: usize,
    /// At the end, write the model to this directory: a Llama or a Mixtral as a Hugging Face
    /// directory (config.json and safetensors, sharded with an index past --max-shard-size),
    /// the GPT as `model.safetensors` and `cfg.json`. With --resume, --steps 0 trains nothing
    /// and exports the checkpoint.
    #[arg(long, value_name = "DIR")]
    pub(crate) export: Option<PathBuf>,
    /// Characters of greedy sample the GPT prints at the end when it trained on the generated
    /// corpus (0: none).
    #[arg(long, value_name = "CHARS", default_value_t = 120)]
    pub(crate) sample: usize,
    /// The largest weight file of --export (`5GiB`, `200MB`, bytes).
    #[arg(long, value_name = "BYTES", default_value = "5GiB", value_parser = bonfire_plan::parse_bytes)]
    pub(crate) max_shard_size: usize,
}

impl Cli {
    /// The model of `--model`, its vocabulary sized for `tokenizer` where it is a preset, with
    /// the directory of its weights when it starts from them.
    pub(crate) fn choice(
        &self,
        tokenizer: Option<usize>,
    ) -> Result<(ModelConfig, Option<PathBuf>), String> {
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
        Ok(match self.model.as_str() {
            "gpt" => (ModelConfig::Gpt(self.gpt.config(vocab, self.run.seq)), None),
            "llama-tiny" => (ModelConfig::Llama(preset(LlamaConfig::tiny())), None),
            "llama-bench" => (ModelConfig::Llama(preset(LlamaConfig::bench())), None),
            dir => {
                let dir = Path::new(dir);
                let config = dir.join(pretrained::CONFIG);
                if !config.is_file() {
                    return Err(format!(
                        "--model {}: not gpt, llama-tiny, llama-bench or a directory with a {}",
                        dir.display(),
                        pretrained::CONFIG
                    ));
                }
                let has_weights = [pretrained::WEIGHTS, pretrained::INDEX]
                    .iter()
                    .any(|f| dir.join(f).exists());
                let cfg = ModelConfig::load(&config)?;
                if matches!(cfg, ModelConfig::Gpt(_)) {
                    return Err(format!(
                        "--model {}: its config.json names no model_type (llama, mixtral)",
                        dir.display()
                    ));
                }
                (cfg, has_weights.then(|| dir.to_path_buf()))
            }
        })
    }

    /// The layout: `--mesh auto` asks the planner for the fastest on `--ranks` CPU ranks of
    /// this machine (printed with its reasons; `--batch` becomes the plan's per-replica share
    /// of `--batch` × `--ranks`), else the flags' layout.
    pub(crate) fn dims(&mut self, model: &ModelConfig) -> Result<ParallelDims, String> {
        if self.layout.mesh.as_deref() != Some("auto") {
            // A pipeline's stages balanced by its pieces' FLOPs (the head and its loss weigh
            // more than a block, the embedding almost nothing).
            let dims = self.layout.training_dims()?;
            return Ok(match dims.pp() > 1 {
                true => dims.with_piece_costs(model.spec().piece_costs()),
                false => dims,
            });
        }
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
        let layout = LayoutArgs {
            mesh: Some("dp=1".into()),
            ..self.layout.clone()
        };
        let precision = layout.dims("dp=1")?.precision;
        let rows = self.run.batch * self.ranks;
        let spec = model
            .spec()
            .with_fused_loss(self.fused_loss.map(|r| r as usize));
        let (dims, lines) = bonfire_plan::machine::auto_layout(
            &spec,
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
}
