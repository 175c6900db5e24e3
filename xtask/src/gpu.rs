//! GPU subcommands: `cargo xtask test-multi-gpu` and `cargo xtask check-gpu`.
//!
//! CI and dev machines are CPU-only, so both commands must succeed (and say
//! clearly what they did not do) without a GPU. GPU work is registered in the
//! two tables below as GPU crates arrive.

use std::path::Path;
use std::process::Command;

use crate::process::{self, Result};

/// A test suite that needs real GPUs. Its GPU tests are `#[ignore]`d with
/// names containing `gpu`, so the CPU-only `cargo xtask test` never runs them.
struct GpuTestSuite {
    package: &'static str,
    /// Cargo features that enable the GPU backend, comma-separated.
    features: &'static str,
    /// Suites needing more GPUs than the machine has are skipped, not failed.
    min_gpus: usize,
}

/// GPU test suites, run by `cargo xtask test-multi-gpu`.
const GPU_TEST_SUITES: &[GpuTestSuite] = &[
    // NCCL conformance on every visible GPU (one rank per GPU; 1 GPU = a 1-rank group).
    GpuTestSuite {
        package: "bonfire-comm",
        features: "nccl",
        min_gpus: 1,
    },
    // The data plane's CUDA path: Burn CUDA tensors through NCCL, nothing staged.
    GpuTestSuite {
        package: "bonfire-dtensor",
        features: "cuda",
        min_gpus: 1,
    },
];

/// GPU feature builds checked by `cargo xtask check-gpu`, as `package/feature`.
const GPU_FEATURE_BUILDS: &[&str] = &[
    "bonfire-comm/nccl",
    "bonfire-dtensor/cuda",
    "bonfire-kernels/cuda",
    "bonfire-examples/cuda",
];

/// The CUDA features of the crates with CUDA code, for the gate's lint of the GPU kit.
pub const GPU_FEATURES: &str = "bonfire-kernels/cuda,bonfire-dtensor/cuda,bonfire-examples/cuda";

pub fn test_multi_gpu() -> Result {
    let Some(gpu_count) = detect_gpus() else {
        println!(
            "test-multi-gpu: SKIPPED — no NVIDIA GPU detected \
             (nvidia-smi not found / lists no GPU); nothing was run"
        );
        return Ok(());
    };
    println!("test-multi-gpu: {gpu_count} NVIDIA GPU(s) detected");

    if GPU_TEST_SUITES.is_empty() {
        println!("test-multi-gpu: no GPU test suites are registered yet; nothing was run");
        return Ok(());
    }
    for suite in GPU_TEST_SUITES {
        println!("==> {} (features: {})", suite.package, suite.features);
        if gpu_count < suite.min_gpus {
            println!(
                "    skipped: needs {} GPUs, found {gpu_count}",
                suite.min_gpus
            );
            continue;
        }
        let mut command = process::cargo();
        command.args([
            "test",
            "-p",
            suite.package,
            "--features",
            suite.features,
            "--",
            "--ignored",
            "gpu",
        ]);
        process::run(command)?;
    }
    println!("test-multi-gpu: OK");
    Ok(())
}

/// Type-checks the GPU feature builds, tests included (the `#[ignore]`d GPU suites).
/// `DOCS_RS=1` tells GPU bindings' build
/// scripts not to look for the CUDA toolkit, so this works on CPU-only machines.
pub fn check_gpu() -> Result {
    if GPU_FEATURE_BUILDS.is_empty() {
        println!("check-gpu: no GPU feature builds are registered yet; nothing to check");
        return Ok(());
    }
    let mut command = process::cargo();
    command.env("DOCS_RS", "1").args([
        "check",
        "--workspace",
        "--all-targets",
        "--features",
        &GPU_FEATURE_BUILDS.join(","),
    ]);
    process::run(command)?;
    println!("check-gpu: OK");
    Ok(())
}

/// Number of NVIDIA GPUs on this machine, or `None` if there are none.
///
/// `nvidia-smi -L` is authoritative when present; device nodes are the fallback
/// for containers that expose GPUs without the driver's tools.
pub fn detect_gpus() -> Option<usize> {
    let listed = Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| {
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .filter(|line| line.starts_with("GPU "))
                .count()
        });
    let count = match listed {
        Some(count) => count,
        None => count_device_nodes(),
    };
    (count > 0).then_some(count)
}

/// Counts `/dev/nvidia0`, `/dev/nvidia1`, ... (not `nvidiactl`, `nvidia-uvm`).
fn count_device_nodes() -> usize {
    (0..)
        .take_while(|index| Path::new(&format!("/dev/nvidia{index}")).exists())
        .count()
}
