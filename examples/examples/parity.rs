//! The parity harness: a fixed GPT, a few SGD or AdamW steps under a parallel layout, through
//! the trainer's one loop, everything it computed written to a safetensors file (see the
//! contract in the repository's notes).
//!
//! ```sh
//! cargo run --release -p bonfire-examples --example parity -- \
//!     --config cfg.json --weights init.safetensors --data batch.safetensors \
//!     --mesh dp=2,tp=2,pp=2 --zero 3 --schedule 1f1b --microbatches 2 \
//!     --optim adamw --steps 3 --lr 0.01 --out result.safetensors
//! ```

use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::harness::{self, HarnessArgs};
use bonfire_train::OptimizerKind;
use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(about = "Bonfire parity harness: train a fixed GPT under a parallel layout")]
struct Cli {
    /// cfg.json with vocab_size, d_model, n_heads, n_layers, max_seq_len, d_ff.
    #[arg(long)]
    config: PathBuf,
    /// Initial parameters (safetensors, PyTorch names and layout).
    #[arg(long)]
    weights: PathBuf,
    /// Batches: int64 `input_ids` and `targets` of shape [S, B, T'].
    #[arg(long)]
    data: PathBuf,
    /// The layout (`--mesh`, default `dp=1`, and its options).
    #[command(flatten)]
    layout: LayoutArgs,
    /// Burn's optimizer: sgd, or adamw (β1 0.9, β2 0.95, ε 1e-6, weight decay 0.1).
    #[arg(long, default_value = "sgd")]
    optim: String,
    /// The Burn device every rank computes on.
    #[arg(long, default_value = "flex")]
    device: String,
    /// Optimizer steps.
    #[arg(long)]
    steps: usize,
    /// Learning rate (the peak of a schedule).
    #[arg(long)]
    lr: f64,
    /// The training recipe: warmup and decay, AdamW's settings, clipping by the global norm,
    /// gradient accumulation (the contract's "training recipe").
    #[command(flatten)]
    recipe: bonfire_examples::cli::RecipeArgs,
    /// Where to write the result (parameters, grad0.<name>, loss).
    #[arg(long)]
    out: PathBuf,
}

fn main() -> ExitCode {
    main_with(std::env::args_os())
}

/// The program on `args` (the program's name first): the GPU kit's `gpu_check parity …` runs
/// it this way.
pub fn main_with(args: impl IntoIterator<Item = std::ffi::OsString>) -> ExitCode {
    let cli = Cli::parse_from(args);
    let run = || -> Result<(), String> {
        let args = HarnessArgs {
            config: cli.config.clone(),
            weights: cli.weights.clone(),
            data: cli.data.clone(),
            dims: cli.layout.dims("dp=1")?,
            optim: OptimizerKind::parse(&cli.optim)?,
            device: cli.device.clone(),
            steps: cli.steps,
            lr: cli.lr,
            recipe: cli.recipe.clone(),
            out: cli.out.clone(),
        };
        let result = harness::run(&args)?;
        let losses: Vec<String> = result.losses.iter().map(|l| format!("{l:.6}")).collect();
        println!(
            "parity layout={} optim={} steps={} loss=[{}] out={}",
            args.dims,
            cli.optim,
            args.steps,
            losses.join(", "),
            args.out.display()
        );
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
