//! `cargo xtask bench gpu [-- --only NAME[,NAME]]`: the GPU kit's measuring checks on this
//! machine's GPU (issue 48, point 1: the 1 B bench "in `cargo xtask bench` where a GPU is
//! found"). Where a GPU is found (`crate::gpu::detect_gpus`) it builds the kit (`cargo xtask gpu-kit`) and runs
//! its `run` script with `bench-1b`, `gemm`, `attention` and `profile` (or the names given),
//! each printing its `key=value` lines beside PyTorch's on the same GPU. Without one it says so
//! and builds nothing: a bench, not a test, so that is no failure.

use crate::process::{self, Failure, Result};
use std::process::Command;

/// The checks that measure rather than judge.
const MEASURING: &str = "bench-1b,gemm,attention,profile";

/// The checks named by `--only NAME[,NAME]` in `args`, else [`MEASURING`].
fn checks(args: &[String]) -> Result<String> {
    match args.iter().position(|a| a == "--only") {
        None => Ok(MEASURING.into()),
        Some(i) => args.get(i + 1).cloned().ok_or_else(|| {
            Failure::usage("bench gpu: --only needs the checks' names (NAME[,NAME])")
        }),
    }
}

pub fn bench(args: &[String]) -> Result {
    let checks = checks(args)?;
    if crate::gpu::detect_gpus().is_none() {
        println!(
            "bench gpu: skipped — no NVIDIA GPU here (nvidia-smi lists none, no /dev/nvidia0); \
             the GPU kit runs `{checks}` on a GPU machine (docs/gpu.md)"
        );
        return Ok(());
    }
    crate::gpu_kit::run(false)?;
    let mut run = Command::new("bash");
    run.arg(process::root().join("target/gpu-kit/run"))
        .args(["--only", &checks]);
    process::run(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_the_measuring_checks_unless_told() {
        assert_eq!(checks(&[]).unwrap(), MEASURING);
        let only = ["--only".to_string(), "gemm".to_string()];
        assert_eq!(checks(&only).unwrap(), "gemm");
        assert!(checks(&["--only".to_string()]).is_err());
    }
}
