//! `cargo xtask`: Bonfire's workspace automation.
//!
//! Everything CI and developers run lives here as plain Rust rather than in
//! shell scripts, so the same entry points work on every machine
//! (`.ci/run` is a thin wrapper around `cargo xtask test`). The alias is defined
//! in `.cargo/config.toml`.
//!
//! Each subcommand is table-driven: adding a test step, a benchmark target, a
//! GPU test suite or a GPU feature build is a one-line change in the matching
//! module.

#[cfg(test)]
mod architecture;
mod bench;
mod checkpoint_verify;
mod clients;
mod compare;
mod gemm;
mod gpu;
mod gpu_bench;
mod gpu_kit;
#[cfg(test)]
mod imports;
mod mpi;
mod mpi_bench;
mod mpi_fault;
mod mpi_train;
mod packages;
mod process;
mod python;
mod pytorch;
mod tally;
mod test;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::process::Failure;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "Bonfire workspace automation",
    version
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the CI gate: fmt check, clippy with -D warnings, then the whole test suite.
    Test {
        /// Skip the fmt and clippy steps and only run the tests (for quick local iterations).
        #[arg(long)]
        skip_lint: bool,
        /// Run the full sweeps of the slow suites (every loss-curve layout, every soak seed)
        /// instead of the gate's representative subset; sets `BONFIRE_FULL=1`.
        #[arg(long)]
        full: bool,
    },
    /// Run a benchmark suite, passing any extra arguments on to the bench binary.
    Bench {
        /// Which suite to run (see `bench::BENCH_TARGETS`; e.g. `comm`).
        target: String,
        /// Extra arguments forwarded after `--` to the benchmark binary.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        extra_args: Vec<String>,
    },
    /// Run the GPU test suites if an NVIDIA GPU is present; skip cleanly otherwise.
    TestMultiGpu,
    /// Type-check the GPU feature builds without needing a GPU or its toolkit.
    CheckGpu,
    /// Build the GPU kit into target/gpu-kit/: the CUDA/NCCL checks, `parity` and `train`
    /// with `--device cuda`, and a `run` script for a GPU machine with only a driver.
    GpuKit {
        /// Only the gate's part: this build's `gpu_check` in a kit of its own, whose `run`
        /// must take its SKIPPED path on a machine without a GPU.
        #[arg(long)]
        smoke: bool,
    },
    /// Install PyTorch and transformers (examples/python/requirements.txt) into target/python,
    /// the Python of the gate's `clients` step and of `bench train`'s PyTorch rows.
    Python,
    /// Only the MPI kill-and-resume scenario of the gate's MPI step (needs mpirun).
    #[command(hide = true)]
    MpiFault,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Test { skip_lint, full } => test::run(skip_lint, full),
        Command::Bench { target, extra_args } => bench::run(&target, &extra_args),
        Command::TestMultiGpu => gpu::test_multi_gpu(),
        Command::CheckGpu => gpu::check_gpu(),
        Command::GpuKit { smoke } => gpu_kit::run(smoke),
        Command::Python => python::install(),
        Command::MpiFault => mpi_fault::run_alone(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure { message, exit_code }) => {
            if !message.is_empty() {
                eprintln!("error: {message}");
            }
            ExitCode::from(exit_code)
        }
    }
}
