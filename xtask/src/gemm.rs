//! `cargo xtask bench gemm` (issue 49, point 1): the bench models' matrix products on one
//! thread — Bonfire's (`examples/benches/gemm.rs`: Burn's matmul on Flex, with the machine's
//! FMA peak measured by a micro-kernel) and PyTorch's (`examples/benches/pytorch/gemm.py`:
//! MKL / oneDNN) in the same run — then one comparison line per product:
//! `bench gemm compare shape=… dtype=… bonfire_gflops=… pytorch_gflops=… ratio=… of_peak=…`
//! (`ratio`: Bonfire's over PyTorch's; `of_peak`: Bonfire's over the measured f32 peak), and
//! where the bench timed Burn's own product too (bf16: Bonfire's is AMX's where the CPU has it)
//! `burn_gflops=… over_burn=…`. Where
//! the Python cannot import torch, one `… skipped=…` line says so and Bonfire's rows stand
//! alone. Bonfire's side builds in the bench profile (release): the dev profile's debug
//! assertions and overflow checks, which apply to the dependencies too, slow `gemm`'s kernels
//! 2.6× (measured: 107–113 → 41–43 GFLOP/s on the same shapes).

use crate::process::{self, Result};
use crate::pytorch::{field, run_echoed};
use std::process::Command;

/// A product line's `(shape, dtype)`.
fn key(line: &str) -> (Option<&str>, Option<&str>) {
    (field(line, "shape"), field(line, "dtype"))
}

/// Runs both sides and prints the comparison.
pub fn bench(extra_args: &[String]) -> Result {
    let mut command = process::cargo();
    command.args(["bench", "-p", "bonfire-examples", "--bench", "gemm"]);
    command.arg("--").args(extra_args);
    let ours = run_echoed(command)?;
    let python = match crate::python::with("import torch") {
        Ok(p) => p,
        Err(why) => {
            println!("bench gemm side=pytorch skipped={why}");
            return Ok(());
        }
    };
    let mut command = Command::new(python);
    command.arg(process::root().join("examples/benches/pytorch/gemm.py"));
    let theirs = run_echoed(command)?;
    let peak = ours
        .iter()
        .find_map(|l| field(l, "peak_gflops")?.parse::<f64>().ok())
        .unwrap_or(0.0);
    let gflops = |line: &str| field(line, "gflops")?.parse::<f64>().ok();
    for line in ours.iter().filter(|l| field(l, "side") == Some("bonfire")) {
        let Some(pytorch) = theirs
            .iter()
            .find(|t| key(t) == key(line))
            .and_then(|t| gflops(t))
        else {
            continue;
        };
        let Some(bonfire) = gflops(line) else {
            continue;
        };
        let (shape, dtype) = key(line);
        let burn = ours
            .iter()
            .filter(|l| field(l, "side") == Some("burn") && key(l) == key(line))
            .find_map(|l| gflops(l))
            .map(|b| format!(" burn_gflops={b:.1} over_burn={:.2}", bonfire / b))
            .unwrap_or_default();
        println!(
            "bench gemm compare shape={} dtype={} bonfire_gflops={bonfire:.1} \
             pytorch_gflops={pytorch:.1} ratio={:.2} of_peak={:.2}{burn}",
            shape.unwrap_or_default(),
            dtype.unwrap_or_default(),
            bonfire / pytorch,
            bonfire / peak,
        );
    }
    Ok(())
}
