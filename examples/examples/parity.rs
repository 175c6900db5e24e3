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

use bonfire_examples::harness::{self, HarnessArgs, LayoutArgs};
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
    /// Axes and sizes, e.g. `dp=2`, `tp=4`, `dp=2,tp=2,pp=2` (omitted axes are 1).
    #[arg(long, default_value = "dp=1")]
    mesh: String,
    /// ZeRO stage on the dp axis.
    #[arg(long, default_value_t = 0)]
    zero: usize,
    /// Pipeline schedule (gpipe, 1f1b, interleaved, zb, zb-v); required with a pp axis.
    #[arg(long)]
    schedule: Option<String>,
    /// Pipeline micro-batches (default: pp).
    #[arg(long)]
    microbatches: Option<usize>,
    /// Sequence parallelism on the tp axis.
    #[arg(long)]
    sequence_parallel: bool,
    /// Vocab-parallel cross-entropy on the tp axis.
    #[arg(long)]
    loss_parallel: bool,
    /// Burn's optimizer: sgd, or adamw (β1 0.9, β2 0.95, ε 1e-6, weight decay 0.1).
    #[arg(long, default_value = "sgd")]
    optim: String,
    /// The Burn device every rank computes on.
    #[arg(long, default_value = "flex")]
    device: String,
    /// Keep ZeRO's optimizer state on the host between steps (needs --zero 1..3).
    #[arg(long)]
    offload: bool,
    /// Optimizer steps.
    #[arg(long)]
    steps: usize,
    /// Learning rate.
    #[arg(long)]
    lr: f64,
    /// Where to write the result (parameters, grad0.<name>, loss).
    #[arg(long)]
    out: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let run = || -> Result<(), String> {
        let layout = LayoutArgs {
            mesh: cli.mesh.clone(),
            zero: cli.zero,
            schedule: cli.schedule.clone(),
            microbatches: cli.microbatches,
            sequence_parallel: cli.sequence_parallel,
            loss_parallel: cli.loss_parallel,
            offload: cli.offload,
        };
        let args = HarnessArgs {
            config: cli.config.clone(),
            weights: cli.weights.clone(),
            data: cli.data.clone(),
            dims: layout.dims()?,
            optim: OptimizerKind::parse(&cli.optim)?,
            device: cli.device.clone(),
            steps: cli.steps,
            lr: cli.lr,
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
