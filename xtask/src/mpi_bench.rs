//! `cargo xtask bench train --backend mpi`: the training-throughput bench with ranks as MPI
//! processes. Builds the `train` bench with the `mpi` feature and runs it under `mpirun`
//! with `--launcher env`: `single` as one process, every other layout as `--ranks` processes
//! (one job for all of them: MPI initializes once per process).

use crate::mpi::{HOW_TO_ENABLE, built_executable, mpirun, mpirun_available};
use crate::process::{self, Failure, Result};

/// Every layout the bench knows, in its order (`--layouts` picks among them).
const ALL: &str = "single,ddp,zero1,zero2,zero3,tp,tp-sp,pp-1f1b,pp-zb-h1,pp-zb-v";

/// The job's time limit (s): building a step's graph is slow on a loaded 2-core machine.
const TIMEOUT_S: u32 = 1800;

pub fn bench_train(extra_args: &[String]) -> Result {
    if !mpirun_available() {
        return Err(Failure {
            message: format!("cannot run the MPI benchmark: {HOW_TO_ENABLE}"),
            exit_code: 1,
        });
    }
    let mut ranks = 2usize;
    let mut layouts = ALL.to_string();
    let mut rest = Vec::new();
    let mut it = extra_args.iter();
    while let Some(arg) = it.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) => (k, Some(v.to_string())),
            None => (arg.as_str(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| Failure::usage(format!("{key} needs a value")))
        };
        match key {
            "--ranks" => {
                ranks = value()?
                    .parse()
                    .map_err(|_| Failure::usage("--ranks needs a number"))?;
            }
            "--layouts" => layouts = value()?,
            _ => rest.push(arg.clone()),
        }
    }
    let (single, multi): (Vec<&str>, Vec<&str>) = layouts
        .split(',')
        .filter(|l| !l.is_empty())
        .partition(|l| *l == "single");
    let binary = built_executable(
        &[
            "bench",
            "-p",
            "bonfire-examples",
            "--features",
            "mpi",
            "--bench",
            "train",
            "--no-run",
        ],
        "train",
    )?;
    for (np, group) in [(1, single), (ranks, multi)] {
        if group.is_empty() {
            continue;
        }
        let mut command = mpirun(np, TIMEOUT_S);
        command
            .arg(&binary)
            .args(["--launcher", "env", "--ranks", &ranks.to_string()])
            .args(["--layouts", &group.join(",")])
            .args(&rest);
        process::run(command)?;
    }
    Ok(())
}
