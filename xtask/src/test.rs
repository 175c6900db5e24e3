//! `cargo xtask test`: the CI gate.
//!
//! The gate is an ordered list of [`Step`]s that fails fast: the first failing
//! step stops the run and is named in the error, so a red CI log points straight
//! at the cause. New steps are added to [`steps`]. Every step prints how long it took, and
//! the run ends with each step's time and, as its last line, the count of tests,
//! `N passed, N failed, N skipped` ([`crate::tally`]).
//!
//! A step that cannot run here (no `mpirun`, no software Vulkan) is skipped with its reason
//! on a developer's machine, but **fails the gate under `CI=true`**: CI is meant to run every
//! step, and a failed package install must not turn into a green run with suites missing.
//!
//! The gate runs each slow sweep on a representative subset; `cargo xtask test --full` (or
//! `BONFIRE_FULL=1` for a single `cargo test`) runs the full sweeps ([`FULL_ENV`]).

use crate::process::{self, Failure, Result};
use std::time::{Duration, Instant};

/// The environment variable the slow suites read to run their full sweep instead of the
/// gate's subset (every loss-curve layout, every soak seed, ...).
pub const FULL_ENV: &str = "BONFIRE_FULL";

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
            name: "parquet",
            is_lint: false,
            run: parquet,
        },
        Step {
            name: "clients",
            is_lint: false,
            run: clients,
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
        Step {
            name: "gpu-kit",
            is_lint: false,
            run: gpu_kit,
        },
    ]
}

pub fn run(skip_lint: bool, full: bool) -> Result {
    if full {
        // SAFETY: set before xtask starts any thread; every child inherits it.
        unsafe { std::env::set_var(FULL_ENV, "1") };
    }
    crate::packages::ensure_all();
    let steps: Vec<Step> = steps()
        .into_iter()
        .filter(|step| !(skip_lint && step.is_lint))
        .collect();

    let gate = Instant::now();
    let mut times: Vec<(&str, Duration)> = Vec::new();
    let mut passed = Vec::new();
    let mut skipped = Vec::new();
    for step in &steps {
        println!("==> {}{}", step.name, disk_free());
        let started = Instant::now();
        let outcome = (step.run)().and_then(|outcome| must_run(step.name, outcome, in_ci()));
        times.push((step.name, started.elapsed()));
        println!("<== {} took {}", step.name, seconds(started.elapsed()));
        match outcome {
            Ok(Outcome::Passed) => passed.push(step.name),
            Ok(Outcome::Skipped { reason }) => {
                println!("    skipped: {reason}");
                crate::tally::skip(1);
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
                println!("{}{}", durations(&times, gate.elapsed()), disk_free());
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
    println!("{}{}", durations(&times, gate.elapsed()), disk_free());
    if gate.elapsed() > BUDGET {
        println!(
            "xtask test: WARNING — the gate took {}, over its {} budget: make the slowest \
             suites cheaper (a subset in the gate, the full sweep under --full)",
            seconds(gate.elapsed()),
            seconds(BUDGET)
        );
    }
    println!("{}", crate::tally::total());
    Ok(())
}

/// What the whole gate may take on the 2-core reference machine from a clean checkout; CI
/// stops at twice this.
const BUDGET: Duration = Duration::from_secs(45 * 60);

/// In CI (`in_ci`) a step that could not run is a failure naming why; elsewhere it stays a
/// skip with its reason.
fn must_run(name: &str, outcome: Outcome, in_ci: bool) -> Result<Outcome> {
    match outcome {
        Outcome::Skipped { reason } if in_ci => Err(Failure {
            message: format!("step `{name}` must run in CI but could not: {reason}"),
            exit_code: 1,
        }),
        outcome => Ok(outcome),
    }
}

/// ` (disk free: 12.3 GB)`, or nothing where `df` cannot tell. A full disk kills the linker
/// with a bus error (CI, stops 37 and 55); each banner and the last line say how close it is.
fn disk_free() -> String {
    crate::process::free_bytes(std::path::Path::new("."))
        .map(|free| format!(" (disk free: {:.1} GB)", free as f64 / 1e9))
        .unwrap_or_default()
}

/// Whether this run is CI's (`CI=true`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

fn seconds(d: Duration) -> String {
    format!("{:.0} s", d.as_secs_f64())
}

/// `xtask test: step times — fmt 3 s, clippy 250 s, …; total 1800 s`.
fn durations(times: &[(&str, Duration)], total: Duration) -> String {
    let each: Vec<String> = times
        .iter()
        .map(|(name, d)| format!("{name} {}", seconds(*d)))
        .collect();
    format!(
        "xtask test: step times — {}; total {}",
        each.join(", "),
        seconds(total)
    )
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

/// Clippy on the whole workspace, every target, with the features the test step builds:
/// where lavapipe is present the [`WGPU_PACKAGES`]' `wgpu` features, so that the wgpu code
/// paths are linted in the same pass (a second pass would check Burn and every crate again:
/// minutes on a 2-core machine). The code only built *without* `wgpu` — two `--device wgpu`
/// refusals and `runs_kernels`' fallback, a few lines — is then linted by a developer's
/// `cargo clippy` alone.
///
/// The same pass lints the CUDA code as the GPU kit builds it ([`crate::gpu::GPU_FEATURES`],
/// `DOCS_RS=1`: CubeCL's LLVM bundle is not fetched; checked, not linked, so no CUDA is
/// needed), for the same reason: one check of Burn, not two.
fn clippy() -> Result<Outcome> {
    let mut command = if crate::packages::lavapipe_present() {
        wgpu_cargo("clippy")
    } else {
        let mut command = process::cargo();
        command.arg("clippy");
        command
    };
    command.env("DOCS_RS", "1");
    command.args(["--features", crate::gpu::GPU_FEATURES]);
    command.args(["--workspace", "--all-targets", "--", "-D", "warnings"]);
    process::run(command)?;
    Ok(Outcome::Passed)
}

/// Whether the test step ran the wgpu suites (it does where lavapipe is present).
static WGPU_RAN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs every test, doc test included. `--no-fail-fast` so one run reports all
/// failing test binaries rather than only the first.
///
/// Where lavapipe is present the workspace is built once with the [`WGPU_PACKAGES`]' `wgpu`
/// features, so the wgpu suites (`tests/wgpu.rs`, compiled only with the feature) run here
/// and Burn is not built a second time for them: a build of Burn and its dependents is
/// minutes of the gate on a 2-core machine. The `wgpu` step then only reports on them.
fn test_suite() -> Result<Outcome> {
    let with_wgpu = crate::packages::lavapipe_present();
    let mut command = if with_wgpu {
        wgpu_cargo("test")
    } else {
        let mut command = process::cargo();
        command.arg("test");
        command
    };
    command.args(["--workspace", "--no-fail-fast"]);
    if with_wgpu {
        set_runtime_dir(&mut command)?;
    }
    let result = process::run_tests(command);
    println!("    slowest suites: {}", crate::tally::slowest(8));
    result?;
    WGPU_RAN.store(with_wgpu, std::sync::atomic::Ordering::SeqCst);
    Ok(Outcome::Passed)
}

/// `cargo test` as the test step runs it (with the `wgpu` features where lavapipe is present),
/// so that a later step reuses its build.
pub fn test_cargo() -> std::process::Command {
    if crate::packages::lavapipe_present() {
        let mut command = wgpu_cargo("test");
        let _ = set_runtime_dir(&mut command);
        command
    } else {
        let mut command = process::cargo();
        command.arg("test");
        command
    }
}

/// `bonfire-data` with its optional Parquet reader, linted and tested on its own: the
/// `parquet` crate turns on features of crates Burn shares (`num-traits`, `bytes`, `ahash`),
/// so in the workspace's build it would rebuild Burn, and every later step without it would
/// build Burn again. Alone, only bonfire-data's dependencies are built a second time.
fn parquet() -> Result<Outcome> {
    let mut lint = process::cargo();
    lint.args([
        "clippy",
        "-p",
        "bonfire-data",
        "--features",
        "parquet",
        "--all-targets",
    ])
    .args(["--", "-D", "warnings"]);
    process::run(lint)?;
    let mut test = process::cargo();
    // Only the test the feature adds: the others ran in the test step.
    test.args([
        "test",
        "-p",
        "bonfire-data",
        "--features",
        "parquet",
        "--test",
        "data",
    ])
    .args([
        "--",
        "--exact",
        "records::a_parquet_file_is_one_document_per_row",
    ]);
    process::run_tests(test)?;
    Ok(Outcome::Passed)
}

/// Hugging Face transformers as a real client of Bonfire's exports and fixtures
/// ([`crate::clients`]) where the Python has it; its checks counted as skipped where not (a
/// Python without transformers is a machine's setting, not a failure: the step passes).
fn clients() -> Result<Outcome> {
    match crate::clients::python() {
        Ok(python) => {
            let (ran, skipped) = crate::clients::run(&python)?;
            crate::tally::add(ran, 0);
            crate::tally::skip(skipped);
        }
        Err(why) => {
            println!(
                "    {} client checks skipped: {why}",
                crate::clients::CHECKS
            );
            crate::tally::skip(crate::clients::CHECKS);
        }
    }
    Ok(Outcome::Passed)
}

/// The packages whose `wgpu` feature the test step turns on, each with a `tests/wgpu.rs`.
const WGPU_PACKAGES: [&str; 3] = ["bonfire-kernels", "bonfire-dtensor", "bonfire-examples"];

/// `cargo <subcommand>` with the `wgpu` features of [`WGPU_PACKAGES`].
pub fn wgpu_cargo(subcommand: &str) -> std::process::Command {
    let features: Vec<String> = WGPU_PACKAGES.iter().map(|p| format!("{p}/wgpu")).collect();
    let mut command = process::cargo();
    command.arg(subcommand);
    command.args(["--features", &features.join(",")]);
    command
}

/// The features a gate step builds `bonfire-examples` with beside `extra`: the same `wgpu`
/// features as the test step where it used them, so that the MPI step's builds reuse the test
/// step's Burn instead of building it again without them.
pub fn examples_features(extra: &str) -> String {
    if crate::packages::lavapipe_present() {
        format!("{extra},wgpu")
    } else {
        extra.to_owned()
    }
}

/// wgpu's Vulkan loader wants a runtime directory; a fresh container has none.
fn set_runtime_dir(command: &mut std::process::Command) -> Result {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        let dir = std::env::temp_dir().join("bonfire-xdg-runtime");
        std::fs::create_dir_all(&dir).map_err(|e| Failure {
            message: format!("{}: {e}", dir.display()),
            exit_code: 1,
        })?;
        command.env("XDG_RUNTIME_DIR", dir);
    }
    Ok(())
}

/// The suites on Burn's wgpu backend over Mesa's software Vulkan (lavapipe): the kernels
/// against their fallbacks, the data plane, and every strategy against Flex with its transfer
/// ledger. They run inside the test step (one build); this step says whether they did, and is
/// skipped, saying how to enable it, where lavapipe is not installed.
fn wgpu() -> Result<Outcome> {
    if WGPU_RAN.load(std::sync::atomic::Ordering::SeqCst) {
        println!("    the wgpu suites ran in the test step (one build with the wgpu features)");
        return Ok(Outcome::Passed);
    }
    Ok(Outcome::Skipped {
        reason: crate::packages::how_to_enable(&crate::packages::VULKAN),
    })
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

/// Clippy on the comm backends behind features: `nccl` always (it builds without CUDA),
/// `mpi` when MPI is installed (the wgpu paths are linted by [`clippy`]).
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

/// The GPU kit cannot rot: its CUDA code is linted by the [`clippy`] step, and the kit's
/// `run` script, in a kit holding this build's `gpu_check` (no CUDA), must take its SKIPPED
/// path on this machine. The kit's checks count as skipped: they did not run. The whole kit is
/// built by `cargo xtask gpu-kit` (a release build of Burn's CUDA backend: minutes).
fn gpu_kit() -> Result<Outcome> {
    let checks = crate::gpu_kit::smoke()?;
    crate::tally::add(1, 0);
    crate::tally::skip(checks);
    Ok(Outcome::Passed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_that_cannot_run_fails_in_ci_and_is_skipped_elsewhere() {
        let skipped = || Outcome::Skipped {
            reason: "mpirun not found".into(),
        };
        let failure = must_run("mpi", skipped(), true)
            .err()
            .expect("CI must fail");
        assert_eq!(
            failure.message,
            "step `mpi` must run in CI but could not: mpirun not found"
        );
        assert!(matches!(
            must_run("mpi", skipped(), false),
            Ok(Outcome::Skipped { .. })
        ));
        assert!(matches!(
            must_run("mpi", Outcome::Passed, true),
            Ok(Outcome::Passed)
        ));
    }
}
