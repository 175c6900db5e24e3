//! `cargo xtask bench <target> [extra args...]`.
//!
//! Benchmark suites are registered in [`BENCH_TARGETS`]; each later crate
//! (ddp, tp, zero, pipeline) adds one line there.

use crate::process::{self, Failure, Result};

/// A named benchmark suite: one `[[bench]]` target of one package.
struct BenchTarget {
    /// The name used on the command line: `cargo xtask bench <name>`.
    name: &'static str,
    package: &'static str,
    bench: &'static str,
}

impl BenchTarget {
    const fn new(name: &'static str, package: &'static str, bench: &'static str) -> Self {
        Self {
            name,
            package,
            bench,
        }
    }
}

/// Known suites: (command-line name, package, `[[bench]]` name).
const BENCH_TARGETS: &[BenchTarget] = &[
    BenchTarget::new("comm", "bonfire-comm", "collectives"),
    BenchTarget::new("ddp", "bonfire-examples", "ddp"),
    BenchTarget::new("tp", "bonfire-examples", "tp_memory"),
    BenchTarget::new("zero", "bonfire-examples", "zero_memory"),
    BenchTarget::new("pipeline", "bonfire-pipeline", "bubble"),
];

/// Runs `cargo bench -p <package> --bench <bench> -- <extra_args>`.
///
/// `--backend mpi` (comm only) runs the MPI benchmark under `mpirun` instead; `--backend
/// threads` is the default.
pub fn run(target_name: &str, extra_args: &[String]) -> Result {
    let (backend, extra_args) = crate::mpi::take_backend(extra_args);
    let extra_args = &extra_args[..];
    match (target_name, backend.as_deref()) {
        (_, None | Some("threads")) => {}
        ("comm", Some("mpi")) => return crate::mpi::bench(extra_args),
        (_, Some(other)) => {
            return Err(Failure::usage(format!(
                "unknown backend `{other}` for bench target `{target_name}` (known: threads, mpi for comm)"
            )));
        }
    }
    let Some(target) = BENCH_TARGETS
        .iter()
        .find(|target| target.name == target_name)
    else {
        let known: Vec<&str> = BENCH_TARGETS.iter().map(|target| target.name).collect();
        return Err(Failure::usage(format!(
            "unknown bench target `{target_name}`; known targets: {}",
            known.join(", ")
        )));
    };

    let mut command = process::cargo();
    command
        .args(["bench", "-p", target.package, "--bench", target.bench, "--"])
        .args(extra_args);
    process::run(command)
}
