//! `cargo xtask test`: the CI gate.
//!
//! The gate is an ordered list of [`Step`]s that fails fast: the first failing
//! step stops the run and is named in the error, so a red CI log points straight
//! at the cause. New steps are added to [`steps`]. Whatever happens, the last line is
//! the count of tests run, `N passed, N failed` ([`crate::tally`]).

use crate::process::{self, Failure, Result};

/// What a step reports when it did not fail.
enum Outcome {
    Passed,
    /// The step could not run in this environment (a tool is missing, ...).
    /// The reason should say how to enable it.
    Skipped {
        reason: String,
    },
}

/// One stage of the gate.
struct Step {
    /// Short name used in the banner (`==> fmt`) and in the summary.
    name: &'static str,
    /// Lint steps are left out by `--skip-lint`.
    is_lint: bool,
    run: fn() -> Result<Outcome>,
}

/// The gate, in the order it runs. Cheap checks first so they fail fast.
fn steps() -> Vec<Step> {
    vec![
        Step {
            name: "fmt",
            is_lint: true,
            run: fmt,
        },
        Step {
            name: "clippy",
            is_lint: true,
            run: clippy,
        },
        Step {
            name: "clippy-features",
            is_lint: true,
            run: clippy_features,
        },
        Step {
            name: "test",
            is_lint: false,
            run: test_suite,
        },
        Step {
            name: "wgpu",
            is_lint: false,
            run: wgpu,
        },
        Step {
            name: "mpi",
            is_lint: false,
            run: mpi,
        },
        Step {
            name: "nccl-cpu",
            is_lint: false,
            run: nccl_cpu,
        },
    ]
}

pub fn run(skip_lint: bool) -> Result {
    crate::packages::ensure_all();
    let steps: Vec<Step> = steps()
        .into_iter()
        .filter(|step| !(skip_lint && step.is_lint))
        .collect();

    let mut passed = Vec::new();
    let mut skipped = Vec::new();
    for step in &steps {
        match crate::process::free_bytes(std::path::Path::new(".")) {
            // A full disk kills the linker with a bus error; the banner says how close it is.
            Some(free) => println!("==> {} (disk free: {:.1} GB)", step.name, free as f64 / 1e9),
            None => println!("==> {}", step.name),
        }
        match (step.run)() {
            Ok(Outcome::Passed) => passed.push(step.name),
            Ok(Outcome::Skipped { reason }) => {
                println!("    skipped: {reason}");
                skipped.push(step.name);
            }
            Err(failure) => {
                println!(
                    "xtask test: FAILED at step `{}`: {}",
                    step.name, failure.message
                );
                // A failing step that reported no failed test (a lint, a build, a job) still
                // failed one check.
                if crate::tally::failed() == 0 {
                    crate::tally::add(0, 1);
                }
                println!("{}", crate::tally::total());
                return Err(Failure {
                    message: String::new(),
                    exit_code: failure.exit_code,
                });
            }
        }
    }

    let mut summary = format!("xtask test: OK — passed: {}", list(&passed));
    if !skipped.is_empty() {
        summary.push_str(&format!("; skipped: {}", list(&skipped)));
    }
    if skip_lint {
        summary.push_str(" (lint skipped by --skip-lint)");
    }
    println!("{summary}");
    println!("{}", crate::tally::total());
    Ok(())
}

fn list(names: &[&str]) -> String {
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

fn fmt() -> Result<Outcome> {
    let mut command = process::cargo();
    command.args(["fmt", "--all", "--", "--check"]);
    process::run(command)?;
    Ok(Outcome::Passed)
}

fn clippy() -> Result<Outcome> {
    let mut command = process::cargo();
    command.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    process::run(command)?;
    Ok(Outcome::Passed)
}

/// Runs every test, doc test included. `--no-fail-fast` so one run reports all
/// failing test binaries rather than only the first.
fn test_suite() -> Result<Outcome> {
    let mut command = process::cargo();
    command.args(["test", "--workspace", "--no-fail-fast"]);
    process::run_tests(command)?;
    Ok(Outcome::Passed)
}

/// The packages whose `wgpu` feature the wgpu step turns on, each with a `tests/wgpu.rs`.
const WGPU_PACKAGES: [&str; 3] = ["bonfire-kernels", "bonfire-dtensor", "bonfire-examples"];

/// `cargo <subcommand>` on [`WGPU_PACKAGES`] with their `wgpu` features.
fn wgpu_cargo(subcommand: &str) -> std::process::Command {
    let features: Vec<String> = WGPU_PACKAGES.iter().map(|p| format!("{p}/wgpu")).collect();
    let mut command = process::cargo();
    command.arg(subcommand);
    for package in WGPU_PACKAGES {
        command.args(["-p", package]);
    }
    command.args(["--features", &features.join(",")]);
    command
}

/// The suites on Burn's wgpu backend over Mesa's software Vulkan (lavapipe): the kernels
/// against their fallbacks, the data plane, and every strategy against Flex with its transfer
/// ledger. One cargo invocation, so that burn is built with wgpu once. Skipped, saying how to
/// enable it, where lavapipe is not installed.
fn wgpu() -> Result<Outcome> {
    if !crate::packages::lavapipe_present() {
        return Ok(Outcome::Skipped {
            reason: crate::packages::how_to_enable(&crate::packages::VULKAN),
        });
    }
    let mut command = wgpu_cargo("test");
    command.args(["--test", "wgpu"]);
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // wgpu's Vulkan loader wants a runtime directory; a fresh container has none.
        let dir = std::env::temp_dir().join("bonfire-xdg-runtime");
        std::fs::create_dir_all(&dir).map_err(|e| Failure {
            message: format!("{}: {e}", dir.display()),
            exit_code: 1,
        })?;
        command.env("XDG_RUNTIME_DIR", dir);
    }
    process::run_tests(command)?;
    Ok(Outcome::Passed)
}

/// The MPI conformance suite (2 and 4 processes) and the cross-process failure scenarios,
/// when `mpirun` is available; skipped with instructions otherwise.
fn mpi() -> Result<Outcome> {
    if crate::mpi::test_step()? {
        Ok(Outcome::Passed)
    } else {
        Ok(Outcome::Skipped {
            reason: crate::mpi::HOW_TO_ENABLE.to_string(),
        })
    }
}

/// Clippy on the feature-gated code: the comm backends (`nccl` always — it builds without
/// CUDA —, `mpi` when MPI is installed) and the wgpu paths.
fn clippy_features() -> Result<Outcome> {
    let features = if crate::mpi::mpirun_available() {
        "nccl,mpi"
    } else {
        "nccl"
    };
    let mut command = process::cargo();
    command.args([
        "clippy",
        "-p",
        "bonfire-comm",
        "--all-targets",
        "--features",
        features,
        "--",
        "-D",
        "warnings",
    ]);
    process::run(command)?;
    // The wgpu code paths (kernels, the plane's wgpu tests, the examples' wgpu suite).
    let mut command = wgpu_cargo("clippy");
    command.args(["--all-targets", "--", "-D", "warnings"]);
    process::run(command)?;
    Ok(Outcome::Passed)
}

/// The NCCL backend's CPU-side tests (library probing without a GPU, unique-id sharing over
/// a process group and over the TCP rendezvous, argument checks). GPU tests are `#[ignore]`d
/// and run by `cargo xtask test-multi-gpu`.
fn nccl_cpu() -> Result<Outcome> {
    let mut command = process::cargo();
    command.args([
        "test",
        "-p",
        "bonfire-comm",
        "--features",
        "nccl",
        "--lib",
        "--tests",
        "--",
        "nccl",
    ]);
    process::run_tests(command)?;
    Ok(Outcome::Passed)
}
