//! A dead rank under MPI, through the front door. A communicator cannot shrink here (that
//! needs ULFM), so the honest behaviour is checked instead: `train` under `mpirun -np 4`,
//! saving a checkpoint every 2 steps, with rank 2 killed at step 5 (`--kill-rank 2 --at-step
//! 5`) must end non-zero within a bound, naming rank 2 and the failure; every checkpoint left
//! visible must be complete (the latest at step 4: nothing half-written) and intact (every
//! block of every data file matches its CRC-32 in the index, every slice the index lists is
//! in its file); and `train --resume` under `mpirun -np 3` must continue from step 4 to
//! the end with, step by step, the losses of the same resume run as rank threads, and of the
//! same job never killed (`mpirun -np 4`, the same flags, all 8 steps).

use crate::checkpoint_verify::verify_checkpoint;
use crate::mpi::{counted, mpirun};
use crate::mpi_train::{fail, metrics_lines, tiny_gpt};
use crate::process::Result;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// With [`tiny_gpt`], a few steps of 3 sequences per replica on 4 ranks: a global batch of 12
/// rows, which 3 survivors split evenly.
const COMMON: &[&str] = &[
    "--steps", "8", "--batch", "3", "--zero", "2", "--sample", "0",
];

/// The killed job must end this fast (start-up of 4 processes on a loaded machine included).
const DEADLINE: Duration = Duration::from_secs(90);
/// The relative tolerance on each step's loss (processes vs threads, same arithmetic).
const REL: f64 = 1e-5;
/// The relative tolerance on each step's loss of the resumed run (3 replicas of 4 rows) against
/// the run never killed (4 replicas of 3 rows): the same global batch, gradients averaged in
/// another order. Measured 6.6e-8 (largest over steps 4..8); about 3× that.
const REL_UNINTERRUPTED: f64 = 2e-7;

/// `cargo xtask mpi-fault`: [`kill_then_resume`] alone, timed.
pub fn run_alone() -> Result {
    if !crate::mpi::mpirun_available() {
        return Err(fail(crate::mpi::HOW_TO_ENABLE.to_string()));
    }
    let started = Instant::now();
    kill_then_resume()?;
    println!(
        "MPI kill and resume passed in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

pub fn kill_then_resume() -> Result {
    let binary = crate::mpi_train::train_binary()?;
    let dir = std::env::temp_dir().join(format!("bonfire-xtask-mpi-fault-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    let ckpt = dir.join("ckpt");
    counted(killed_job(&binary, &dir, &ckpt))?;
    counted(resumed_on_fewer(&binary, &dir, &ckpt))?;
    counted(as_if_never_killed(&binary, &dir))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The job that loses rank 2 at step 5: a clear error, only complete checkpoints left.
fn killed_job(binary: &str, dir: &Path, ckpt: &Path) -> Result {
    let mut job = four_ranks(binary, ckpt, &dir.join("killed.jsonl"));
    job.args(["--kill-rank", "2", "--at-step", "5"]);
    let started = Instant::now();
    let out = output(&mut job, "the killed job")?;
    let text = both(&out);
    if out.status.success() {
        return Err(fail(format!("train with rank 2 killed succeeded:\n{text}")));
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
    let (mut verified, mut blocks) = (0, 0);
    for e in std::fs::read_dir(ckpt).map_err(|e| fail(format!("{}: {e}", ckpt.display())))? {
        let path = e
            .map_err(|e| fail(format!("{}: {e}", ckpt.display())))?
            .path();
        if path.join("index.json").is_file() {
            blocks += verify_checkpoint(&path)?;
            verified += 1;
        }
    }
    if verified != steps.len() || blocks == 0 {
        return Err(fail(format!(
            "checkpoints {steps:?}: {verified} verified, {blocks} blocks"
        )));
    }
    println!(
        "    train under mpirun -np 4, rank 2 killed at step 5: the job ended in {:.1}s \
         naming rank 2; checkpoints {steps:?} complete, {blocks} blocks verified",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `train` on 4 processes (dp=4), checkpointing every 2 steps into `ckpt`, metrics to
/// `metrics`: the killed job, and without the kill the job it would have been.
fn four_ranks(binary: &str, ckpt: &Path, metrics: &Path) -> Command {
    let mut job = mpirun(4, DEADLINE.as_secs() as u32);
    job.arg(binary)
        .args(["--launcher", "env", "--mesh", "dp=4"])
        .args(tiny_gpt())
        .args(COMMON)
        .args(["--checkpoint-every", "2", "--sync-save"])
        .arg("--checkpoint-dir")
        .arg(ckpt)
        .arg("--metrics")
        .arg(metrics);
    job
}

/// The same job never killed: its steps 0..5 are the killed job's, its steps 4..8 the resumed
/// run's (another world size and order of summation: [`REL_UNINTERRUPTED`]), its final loss
/// among them.
fn as_if_never_killed(binary: &str, dir: &Path) -> Result {
    let full = dir.join("uninterrupted.jsonl");
    let mut job = four_ranks(binary, &dir.join("ckpt-uninterrupted"), &full);
    let out = output(&mut job, "the uninterrupted job")?;
    if !out.status.success() {
        return Err(fail(format!(
            "train on 4 processes, never killed, failed:\n{}",
            both(&out)
        )));
    }
    let full = metrics(&full)?;
    let steps: Vec<u64> = full.iter().map(|(s, _)| *s).collect();
    if steps != (0..8).collect::<Vec<u64>>() {
        return Err(fail(format!(
            "the uninterrupted run should train steps 0..8; its metrics say {steps:?}"
        )));
    }
    let killed = metrics(&dir.join("killed.jsonl"))?;
    let resumed = metrics(&dir.join("resumed.jsonl"))?;
    let before = compare_steps("killed job", &killed, &full, 0.0)?;
    let after = compare_steps("resumed on 3", &resumed, &full, REL_UNINTERRUPTED)?;
    let (Some(last), Some(want)) = (resumed.last(), full.last()) else {
        return Err(fail("no final loss to compare".into()));
    };
    println!(
        "    train never killed (mpirun -np 4): steps {:?} = the killed job's (largest \
         relative difference {before:.1e}); steps {:?} vs resumed on 3 processes: largest \
         relative difference {after:.1e}; final loss {:.6} resumed, {:.6} never killed",
        killed.iter().map(|(s, _)| s).collect::<Vec<_>>(),
        resumed.iter().map(|(s, _)| s).collect::<Vec<_>>(),
        last.1,
        want.1
    );
    Ok(())
}

/// Each of `run`'s steps against the same step of `full` (every one of `run`'s steps must be
/// there), within the relative tolerance `rel`; the largest relative difference.
fn compare_steps(what: &str, run: &[(u64, f64)], full: &[(u64, f64)], rel: f64) -> Result<f64> {
    if run.is_empty() {
        return Err(fail(format!("{what}: no metrics to compare")));
    }
    let mut worst = 0.0f64;
    for (step, loss) in run {
        let Some((_, want)) = full.iter().find(|(s, _)| s == step) else {
            return Err(fail(format!(
                "{what}: step {step} is not in the uninterrupted run's metrics {full:?}"
            )));
        };
        let diff = (loss - want).abs() / loss.abs().max(want.abs());
        if diff.is_nan() || diff > rel {
            return Err(fail(format!(
                "{what}: step {step} loss {loss} vs {want} never killed (relative difference \
                 {diff:e} > {rel:e}); {run:?} vs {full:?}"
            )));
        }
        worst = worst.max(diff);
    }
    Ok(worst)
}

/// `--resume` on 3 processes continues from step 4, as the same resume on threads does.
fn resumed_on_fewer(binary: &str, dir: &Path, ckpt: &Path) -> Result {
    let resumed = dir.join("resumed.jsonl");
    let mut job = mpirun(3, DEADLINE.as_secs() as u32);
    job.arg(binary)
        .args(["--launcher", "env", "--mesh", "dp=3"])
        .args(tiny_gpt())
        .args(COMMON)
        .arg("--resume")
        .arg(ckpt)
        .arg("--metrics")
        .arg(&resumed);
    let out = output(&mut job, "the resumed job")?;
    if !out.status.success() {
        return Err(fail(format!(
            "train --resume on 3 processes failed:\n{}",
            both(&out)
        )));
    }
    let threads = dir.join("threads.jsonl");
    let mut local = Command::new(binary);
    local
        .args(["--mesh", "dp=3"])
        .args(tiny_gpt())
        .args(COMMON)
        .arg("--resume")
        .arg(ckpt)
        .arg("--metrics")
        .arg(&threads);
    let out = output(&mut local, "the threads resume")?;
    if !out.status.success() {
        return Err(fail(format!(
            "train --resume on threads failed:\n{}",
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
        "    train --resume under mpirun -np 3 = on 3 threads: steps {steps:?}, largest \
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
