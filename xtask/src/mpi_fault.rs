//! A dead rank under MPI, through the front door. A communicator cannot shrink here (that
//! needs ULFM), so the honest behaviour is checked instead: `train_gpt` under `mpirun -np 4`,
//! saving a checkpoint every 2 steps, with rank 2 killed at step 5 (`--kill-rank 2 --at-step
//! 5`) must end non-zero within a bound, naming rank 2 and the failure; every checkpoint left
//! visible must be complete (the latest at step 4: nothing half-written); and `train_gpt
//! --resume` under `mpirun -np 3` must continue from step 4 to the end with, step by step,
//! the losses of the same resume run as rank threads.

use crate::mpi::{counted, mpirun};
use crate::mpi_train::{TINY_GPT, fail, metrics_lines};
use crate::process::Result;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// With [`TINY_GPT`], a few steps of 3 sequences per replica on 4 ranks: a global batch of 12
/// rows, which 3 survivors split evenly.
const COMMON: &[&str] = &["--steps", "8", "--batch", "3", "--zero", "2", "--no-save"];

/// The killed job must end this fast (start-up of 4 processes on a loaded machine included).
const DEADLINE: Duration = Duration::from_secs(90);
/// The relative tolerance on each step's loss (processes vs threads, same arithmetic).
const REL: f64 = 1e-5;

pub fn kill_then_resume() -> Result {
    let binary = crate::mpi_train::train_gpt_binary()?;
    let dir = std::env::temp_dir().join(format!("bonfire-xtask-mpi-fault-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    let ckpt = dir.join("ckpt");
    counted(killed_job(&binary, &dir, &ckpt))?;
    counted(resumed_on_fewer(&binary, &dir, &ckpt))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The job that loses rank 2 at step 5: a clear error, only complete checkpoints left.
fn killed_job(binary: &str, dir: &Path, ckpt: &Path) -> Result {
    let mut job = mpirun(4, DEADLINE.as_secs() as u32);
    job.arg(binary)
        .args(["--launcher", "env", "--mesh", "dp=4"])
        .args(TINY_GPT)
        .args(COMMON)
        .args(["--checkpoint-every", "2", "--sync-save"])
        .args(["--kill-rank", "2", "--at-step", "5"])
        .arg("--checkpoint-dir")
        .arg(ckpt)
        .arg("--metrics")
        .arg(dir.join("killed.jsonl"));
    let started = Instant::now();
    let out = output(&mut job, "the killed job")?;
    let text = both(&out);
    if out.status.success() {
        return Err(fail(format!(
            "train_gpt with rank 2 killed succeeded:\n{text}"
        )));
    }
    if started.elapsed() > DEADLINE {
        return Err(fail(format!("the killed job took {:?}", started.elapsed())));
    }
    for expect in [
        "injected failure: rank 2 killed at step 5",
        "rank 2: panicked; aborting the MPI job",
    ] {
        if !text.contains(expect) {
            return Err(fail(format!(
                "the killed job did not say `{expect}`:\n{text}"
            )));
        }
    }
    let steps = complete_checkpoints(ckpt)?;
    if steps.last() != Some(&4) {
        return Err(fail(format!(
            "after rank 2 died at step 5 the latest complete checkpoint should be step 4; \
             found {steps:?}"
        )));
    }
    println!(
        "    train_gpt under mpirun -np 4, rank 2 killed at step 5: the job ended in {:.1}s \
         naming rank 2; checkpoints {steps:?} complete",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `--resume` on 3 processes continues from step 4, as the same resume on threads does.
fn resumed_on_fewer(binary: &str, dir: &Path, ckpt: &Path) -> Result {
    let resumed = dir.join("resumed.jsonl");
    let mut job = mpirun(3, DEADLINE.as_secs() as u32);
    job.arg(binary)
        .args(["--launcher", "env", "--mesh", "dp=3"])
        .args(TINY_GPT)
        .args(COMMON)
        .arg("--resume")
        .arg(ckpt)
        .arg("--metrics")
        .arg(&resumed);
    let out = output(&mut job, "the resumed job")?;
    if !out.status.success() {
        return Err(fail(format!(
            "train_gpt --resume on 3 processes failed:\n{}",
            both(&out)
        )));
    }
    let threads = dir.join("threads.jsonl");
    let mut local = Command::new(binary);
    local
        .args(["--mesh", "dp=3"])
        .args(TINY_GPT)
        .args(COMMON)
        .arg("--resume")
        .arg(ckpt)
        .arg("--metrics")
        .arg(&threads);
    let out = output(&mut local, "the threads resume")?;
    if !out.status.success() {
        return Err(fail(format!(
            "train_gpt --resume on threads failed:\n{}",
            both(&out)
        )));
    }
    let (a, b) = (metrics(&resumed)?, metrics(&threads)?);
    let steps: Vec<u64> = a.iter().map(|(s, _)| *s).collect();
    if steps != [4, 5, 6, 7] {
        return Err(fail(format!(
            "the resumed run should train steps 4..8 (no step lost beyond the checkpoint, none \
             repeated); its metrics say {steps:?}"
        )));
    }
    let worst = a
        .iter()
        .zip(&b)
        .map(|((_, x), (_, y))| (x - y).abs() / x.abs().max(y.abs()))
        .fold(0.0f64, f64::max);
    if a.len() != b.len() || worst > REL {
        return Err(fail(format!(
            "resumed on 3 processes {a:?} vs on 3 threads {b:?} (largest relative difference \
             {worst:e})"
        )));
    }
    println!(
        "    train_gpt --resume under mpirun -np 3 = on 3 threads: steps {steps:?}, largest \
         relative difference {worst:.1e}"
    );
    Ok(())
}

/// The steps of the complete checkpoints under `root` (each `step-N` directory with its
/// index); an error for a visible checkpoint without one.
fn complete_checkpoints(root: &Path) -> Result<Vec<u64>> {
    let entries = std::fs::read_dir(root).map_err(|e| fail(format!("{}: {e}", root.display())))?;
    let mut steps = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(step) = name
            .strip_prefix("step-")
            .filter(|n| !n.ends_with(".partial"))
        else {
            continue;
        };
        if !e.path().join("index.json").is_file() {
            return Err(fail(format!(
                "checkpoint {name} is visible without its index"
            )));
        }
        steps.push(
            step.parse()
                .map_err(|_| fail(format!("checkpoint directory {name}")))?,
        );
    }
    steps.sort_unstable();
    Ok(steps)
}

fn output(command: &mut Command, what: &str) -> Result<Output> {
    command
        .output()
        .map_err(|e| fail(format!("could not start {what}: {e}")))
}

fn both(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `(step, loss)` of every metrics line.
fn metrics(path: &Path) -> Result<Vec<(u64, f64)>> {
    metrics_lines(path)?
        .iter()
        .map(|v| match (v["step"].as_u64(), v["loss"].as_f64()) {
            (Some(s), Some(l)) => Ok((s, l)),
            _ => Err(fail(format!(
                "{}: a line without step and loss",
                path.display()
            ))),
        })
        .collect()
}
