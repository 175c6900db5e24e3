//! Ranks as processes through the front door: `train` under `mpirun -np 4` (one rank per
//! process, `--launcher env`) must give, step by step, the losses of the same command run as
//! rank threads — for dp=2,tp=2 and for dp=2,pp=2 with ZeRO-3.

use crate::mpi::{built_executable, counted, mpirun};
use crate::process::{Failure, Result};
use std::path::Path;
use std::process::Command;

/// The small GPT of the MPI steps (`train` flags): the comparison, not the training, is
/// the point. One list, `examples/tiny_gpt.args`, which `examples/tests/fault_tolerance.rs`
/// reads too.
pub(crate) fn tiny_gpt() -> Vec<&'static str> {
    include_str!("../../examples/tiny_gpt.args")
        .split_whitespace()
        .collect()
}

/// A few steps of 4 sequences per replica.
const COMMON: &[&str] = &["--steps", "6", "--batch", "4"];

/// The layouts compared (4 ranks each).
const LAYOUTS: &[(&str, &[&str])] = &[
    ("dp2-tp2", &["--mesh", "dp=2,tp=2"]),
    (
        "dp2-pp2-zero3",
        &["--mesh", "dp=2,pp=2", "--zero", "3", "--schedule", "1f1b"],
    ),
];

/// The relative tolerance on each step's loss.
const REL: f64 = 1e-5;

/// `train` built with the `mpi` feature (its path).
pub(crate) fn train_binary() -> Result<String> {
    let features = crate::test::examples_features("mpi");
    built_executable(
        &[
            "build",
            "-p",
            "bonfire-examples",
            "--features",
            &features,
            "--example",
            "train",
        ],
        "train",
    )
}

pub fn compare_layouts() -> Result {
    let binary = train_binary()?;
    let dir = std::env::temp_dir().join(format!("bonfire-xtask-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    for (name, layout) in LAYOUTS {
        counted(compare(&binary, &dir, name, layout))?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn compare(binary: &str, dir: &Path, name: &str, layout: &[&str]) -> Result {
    let threads = dir.join(format!("{name}-threads.jsonl"));
    let processes = dir.join(format!("{name}-mpi.jsonl"));
    let mut local = Command::new(binary);
    run(
        local.args(tiny_gpt()).args(COMMON).args(layout),
        &threads,
        name,
    )?;
    let mut mpi = mpirun(4, 180);
    mpi.arg(binary).args(["--launcher", "env"]);
    run(
        mpi.args(tiny_gpt()).args(COMMON).args(layout),
        &processes,
        name,
    )?;
    let (a, b) = (losses(&threads)?, losses(&processes)?);
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()))
        .fold(0.0f64, f64::max);
    if a.len() != b.len() || a.is_empty() || worst > REL {
        return Err(fail(format!(
            "train {name}: threads {a:?} vs mpirun -np 4 {b:?} (largest relative difference {worst:e})"
        )));
    }
    println!(
        "    train {} as 4 MPI processes = as 4 threads: {} losses, largest relative difference {worst:.1e}",
        layout.join(" "),
        a.len()
    );
    Ok(())
}

fn run(command: &mut Command, metrics: &Path, name: &str) -> Result {
    command
        .arg("--metrics")
        .arg(metrics)
        .args(["--sample", "0"]);
    let output = command
        .output()
        .map_err(|e| fail(format!("train {name}: {e}")))?;
    if output.status.success() {
        return Ok(());
    }
    Err(fail(format!(
        "train {name} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )))
}

fn losses(path: &Path) -> Result<Vec<f64>> {
    metrics_lines(path)?
        .iter()
        .map(|v| {
            v["loss"]
                .as_f64()
                .ok_or_else(|| fail(format!("{}: a line without a loss", path.display())))
        })
        .collect()
}

/// Every line of a `train --metrics` file, parsed.
pub(crate) fn metrics_lines(path: &Path) -> Result<Vec<serde_json::Value>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
    text.lines()
        .map(|line| {
            serde_json::from_str(line).map_err(|e| fail(format!("{}: {e}", path.display())))
        })
        .collect()
}

pub(crate) fn fail(message: String) -> Failure {
    Failure {
        message,
        exit_code: 1,
    }
}
