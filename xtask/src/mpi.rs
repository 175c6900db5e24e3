//! The MPI part of `cargo xtask test` and `cargo xtask bench comm --backend mpi`.
//!
//! MPI programs are launched through cargo with `mpirun` as the target *runner*
//! (`--config target.'cfg(all())'.runner=[...]`), so cargo builds the binary and runs it as
//! `mpirun -np N <binary> <args>`. When `mpirun` is not on PATH the test step is skipped with
//! a message saying how to enable it.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{self, Failure, Result};

/// How to enable the MPI step on a machine without MPI.
pub const HOW_TO_ENABLE: &str = "mpirun not found; install openmpi-bin libopenmpi-dev \
     libclang-dev (`cargo xtask test` does, in CI or as root) to enable";

/// Process counts the conformance suite runs at (oversubscribed on small machines).
const CONFORMANCE_RANKS: &[usize] = &[2, 4];

/// A failure scenario: the job must end non-zero within `FAILURE_DEADLINE` and print `expect`.
struct Scenario {
    mode: &'static str,
    ranks: usize,
    expect: &'static str,
    what: &'static str,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        mode: "fail-panic",
        ranks: 2,
        expect: "panicked; aborting the MPI job",
        what: "a rank that panics",
    },
    Scenario {
        mode: "fail-panic",
        ranks: 4,
        expect: "panicked; aborting the MPI job",
        what: "a rank that panics (4 ranks)",
    },
    Scenario {
        mode: "fail-exit",
        ranks: 2,
        expect: "shut down (world rank 1) without making this call",
        what: "a rank that exits early",
    },
    Scenario {
        mode: "fail-mismatch",
        ranks: 2,
        expect: "collective mismatch",
        what: "a mismatched collective",
    },
    Scenario {
        mode: "fail-timeout",
        ranks: 2,
        expect: "did not arrive",
        what: "a rank that never arrives (2 s timeout)",
    },
];

/// A failure must end the job this fast (the slowest scenario waits for a 2 s timeout plus
/// the 2 s abort grace period; the rest is process start-up on a loaded machine).
const FAILURE_DEADLINE: Duration = Duration::from_secs(10);

/// `mpirun` as the gate runs it: as root, over shared memory, oversubscribed, with a timeout.
pub(crate) fn mpirun(ranks: usize, timeout_s: u32) -> Command {
    let mut command = Command::new("mpirun");
    command
        .args([
            "--timeout",
            &timeout_s.to_string(),
            "-np",
            &ranks.to_string(),
            "--oversubscribe",
        ])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl", "self,vader");
    command
}

pub fn mpirun_available() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `cargo --config <runner> <subcommand>` that runs target binaries under `mpirun -np N`.
fn cargo_under_mpirun(ranks: usize, subcommand: &str) -> Command {
    let runner = format!(
        "target.'cfg(all())'.runner=['mpirun','--timeout','300','-np','{ranks}','--oversubscribe']"
    );
    let mut command = process::cargo();
    command
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // No network interfaces to probe in containers; shared memory is enough on one node.
        .env("OMPI_MCA_btl", "self,vader")
        .args(["--config", &runner, subcommand]);
    command
}

/// Builds with `--features mpi` and runs: the MPI unit tests, the conformance suite on 2 and
/// 4 processes, and the cross-process failure scenarios.
pub fn test_step() -> Result<bool> {
    if !mpirun_available() {
        println!("MPI: SKIPPED — {HOW_TO_ENABLE}");
        return Ok(false);
    }
    let started = Instant::now();
    let mut unit = process::cargo();
    unit.args([
        "test",
        "-p",
        "bonfire-comm",
        "--features",
        "mpi",
        "--lib",
        "--",
        "mpi::",
        "wire::",
        "world::",
    ]);
    process::run_tests(unit)?;
    for &ranks in CONFORMANCE_RANKS {
        let mut command = cargo_under_mpirun(ranks, "test");
        command.args(CONFORMANCE_TEST);
        counted(process::run(command))?;
    }
    let mut args = vec!["test"];
    args.extend(CONFORMANCE_TEST);
    let binary = built_executable(&args, "mpi_conformance")?;
    for scenario in SCENARIOS {
        counted(run_scenario(&binary, scenario))?;
    }
    let mut ddp = process::cargo();
    let features = crate::test::examples_features("mpi");
    ddp.args([
        "test",
        "-p",
        "bonfire-examples",
        "--features",
        &features,
        "--test",
        "mpi_ddp",
    ]);
    counted(process::run(ddp))?;
    crate::mpi_train::compare_layouts()?;
    crate::mpi_fault::kill_then_resume()?;
    println!(
        "MPI: conformance on {CONFORMANCE_RANKS:?} processes, {} failure scenarios, DDP and \
         train across processes passed in {:.1}s",
        SCENARIOS.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(true)
}

/// Counts one check run outside the test harness.
pub(crate) fn counted(result: Result) -> Result {
    match &result {
        Ok(()) => crate::tally::add(1, 0),
        Err(_) => crate::tally::add(0, 1),
    }
    result
}

/// Cargo's selection of the MPI conformance test (run under mpirun, and located as a binary).
const CONFORMANCE_TEST: [&str; 6] = [
    "-p",
    "bonfire-comm",
    "--features",
    "mpi",
    "--test",
    "mpi_conformance",
];

/// Builds with `cargo <args>` (`test` builds without running) and returns the path of the
/// executable called `name`, from cargo's JSON messages.
pub(crate) fn built_executable(args: &[&str], name: &str) -> Result<String> {
    let mut command = process::cargo();
    command.args(args);
    if args.first() == Some(&"test") {
        command.arg("--no-run");
    }
    command.arg("--message-format=json");
    let output = command.output().map_err(|err| Failure {
        message: format!("could not start cargo: {err}"),
        exit_code: 1,
    })?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|msg| msg["target"]["name"] == name)
        .find_map(|msg| msg["executable"].as_str().map(str::to_string))
        .ok_or_else(|| Failure {
            message: format!("could not find the `{name}` binary in cargo's output"),
            exit_code: 1,
        })
}

/// Runs one failure scenario directly under `mpirun` (already built, so the time measured
/// is the job's own).
fn run_scenario(binary: &str, s: &Scenario) -> Result {
    let mut command = mpirun(s.ranks, 60);
    command
        .arg(binary)
        .arg(s.mode)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null());
    let started = Instant::now();
    let output = command.output().map_err(|err| Failure {
        message: format!("could not start mpirun for {}: {err}", s.mode),
        exit_code: 1,
    })?;
    let elapsed = started.elapsed();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let problem = if output.status.success() {
        Some("the job exited successfully".to_string())
    } else if elapsed > FAILURE_DEADLINE {
        Some(format!("the job took {elapsed:.1?} to end"))
    } else if !text.contains(s.expect) {
        Some(format!("the output does not contain `{}`", s.expect))
    } else {
        None
    };
    match problem {
        None => {
            println!(
                "    failure scenario `{}` on {} ranks ({}): job ended with {} after {:.1}s — OK",
                s.mode,
                s.ranks,
                s.what,
                output.status,
                elapsed.as_secs_f64()
            );
            if let Some(line) = text.lines().find(|line| line.contains(s.expect)) {
                let line: String = line.trim().chars().take(160).collect();
                println!("      {line}");
            }
            Ok(())
        }
        Some(problem) => {
            println!("{text}");
            Err(Failure {
                message: format!(
                    "MPI failure scenario `{}` on {} ranks ({}): {problem}",
                    s.mode, s.ranks, s.what
                ),
                exit_code: 1,
            })
        }
    }
}

/// `cargo xtask bench comm --backend mpi [--ranks N] [bench args...]`.
pub fn bench(extra_args: &[String]) -> Result {
    if !mpirun_available() {
        return Err(Failure {
            message: format!("cannot run the MPI benchmark: {HOW_TO_ENABLE}"),
            exit_code: 1,
        });
    }
    let mut ranks = 2usize;
    let mut rest = Vec::new();
    let mut it = extra_args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--ranks" | "--np" => {
                ranks = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| Failure::usage("--ranks needs a number"))?;
            }
            _ => rest.push(arg.clone()),
        }
    }
    let mut command = cargo_under_mpirun(ranks, "bench");
    command
        .args([
            "-p",
            "bonfire-comm",
            "--features",
            "mpi",
            "--bench",
            "mpi_collectives",
            "--",
        ])
        .args(rest);
    process::run(command)
}

/// Splits `--backend X` / `--backend=X` out of bench arguments.
pub fn take_backend(args: &[String]) -> (Option<String>, Vec<String>) {
    let mut backend = None;
    let mut rest = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        if arg == "--backend" {
            backend = it.next().cloned();
        } else if let Some(value) = arg.strip_prefix("--backend=") {
            backend = Some(value.to_string());
        } else {
            rest.push(arg.clone());
        }
    }
    (backend, rest)
}
