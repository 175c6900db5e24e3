//! The parity harness: a fixed GPT, a few SGD steps under a parallel layout, everything it
//! computed written to a safetensors file (see the contract in the repository's notes).
//!
//! ```sh
//! cargo run --release -p bonfire-examples --example parity -- \
//!     --config cfg.json --weights init.safetensors --data batch.safetensors \
//!     --mesh dp=2,tp=2 [--sequence-parallel] [--loss-parallel] \
//!     --steps 3 --lr 0.1 --out result.safetensors
//! ```

use bonfire_examples::harness::{self, HarnessArgs};
use bonfire_examples::mesh::{Layout, Mesh};
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
    /// Axes and sizes, e.g. `dp=2`, `tp=4`, `dp=2,tp=2`, `pp=2`, `dp=2,pp=2` (omitted axes
    /// are 1).
    #[arg(long, default_value = "dp=1")]
    mesh: String,
    /// ZeRO stage on the dp axis.
    #[arg(long, default_value_t = 0)]
    zero: u8,
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
    /// SGD steps.
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
        let args = HarnessArgs {
            config: cli.config,
            weights: cli.weights,
            data: cli.data,
            layout: Layout {
                mesh: Mesh::parse(&cli.mesh)?,
                zero: cli.zero,
                schedule: cli.schedule,
                microbatches: cli.microbatches,
                sequence_parallel: cli.sequence_parallel,
                loss_parallel: cli.loss_parallel,
            },
            steps: cli.steps,
            lr: cli.lr,
            out: cli.out,
        };
        let result = harness::run(&args)?;
        let losses: Vec<String> = result.losses.iter().map(|l| format!("{l:.6}")).collect();
        println!(
            "parity mesh={} steps={} loss=[{}] out={}",
            cli.mesh,
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
