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
    BenchTarget::new("train", "bonfire-examples", "train"),
    BenchTarget::new("profile", "bonfire-examples", "profile"),
    BenchTarget::new("tp", "bonfire-examples", "tp_memory"),
    BenchTarget::new("cp", "bonfire-examples", "context"),
    BenchTarget::new("memory", "bonfire-examples", "memory"),
    BenchTarget::new("pipeline", "bonfire-pipeline", "bubble"),
    // The same name again: its `workload=gpt` lines (the GPT's stages live in the examples).
    BenchTarget::new("pipeline", "bonfire-examples", "pipeline_gpt"),
    BenchTarget::new("ledger", "bonfire-examples", "ledger"),
    BenchTarget::new("fault", "bonfire-examples", "fault"),
    BenchTarget::new("head", "bonfire-examples", "head"),
    // Run by `crate::gemm` (both sides and the ratios); listed for the names.
    BenchTarget::new("gemm", "bonfire-examples", "gemm"),
];

/// Runs `cargo bench -p <package> --bench <bench> -- <extra_args>` for each target named
/// `target_name`.
///
/// `--backend mpi` (comm, train) runs the benchmark's ranks as processes under `mpirun`
/// instead; `--backend threads` is the default.
pub fn run(target_name: &str, extra_args: &[String]) -> Result {
    let (backend, extra_args) = crate::mpi::take_backend(extra_args);
    let extra_args = &bench_args(target_name, extra_args)[..];
    match (target_name, backend.as_deref()) {
        (_, None | Some("threads")) => {}
        ("comm", Some("mpi")) => return crate::mpi::bench(extra_args),
        ("train", Some("mpi")) => return crate::mpi_bench::bench_train(extra_args),
        (_, Some(other)) => {
            return Err(Failure::usage(format!(
                "unknown backend `{other}` for bench target `{target_name}` (known: threads; mpi for comm and train)"
            )));
        }
    }
    if target_name == "compare" {
        // Two revisions, built apart, measured interleaved (`compare.rs`).
        return crate::compare::run(extra_args);
    }
    if target_name == "profile" && extra_args.iter().any(|a| a.starts_with("--layouts")) {
        // The split per layout: the train bench's layouts, each step's phases.
        let train = BENCH_TARGETS.iter().find(|t| t.name == "train");
        return run_target(train.expect("the train bench"), extra_args);
    }
    if target_name == "train" {
        // Bonfire's rows, then PyTorch's in the same run where it is installed.
        return crate::pytorch::bench_train(extra_args);
    }
    if target_name == "gpu" {
        // The GPU kit's measuring checks, where this machine has a GPU.
        return crate::gpu_bench::bench(extra_args);
    }
    if target_name == "gemm" {
        // Bonfire's products and the measured peak, then PyTorch's, then the ratios.
        return crate::gemm::bench(extra_args);
    }
    if target_name == "zero" {
        return Err(Failure::usage(
            "`bench zero` was retired: its bytes per rank were computed from tensor shapes, not \
             measured. Run `cargo xtask bench memory`: bytes per rank from a counting allocator \
             for DDP, ZeRO 1-3 (+ offload), TP and PP, next to the ZeRO formula",
        ));
    }
    let targets: Vec<&BenchTarget> = BENCH_TARGETS
        .iter()
        .filter(|target| target.name == target_name)
        .collect();
    if targets.is_empty() {
        let mut known: Vec<&str> = BENCH_TARGETS.iter().map(|target| target.name).collect();
        known.dedup();
        return Err(Failure::usage(format!(
            "unknown bench target `{target_name}`; known targets: {}",
            known.join(", ")
        )));
    }
    // A name may cover several `[[bench]]` targets: they run in order, with the same args.
    for target in targets {
        run_target(target, extra_args)?;
    }
    Ok(())
}

/// `args` as the bench `target` takes them: a bare `--` dropped — after an option given
/// before it (`cargo xtask bench train --rounds 3 -- --model llama`) the command line's parser
/// keeps the separator, which a bench binary would refuse — except for `compare`, whose own
/// options end at it.
fn bench_args(target: &str, args: Vec<String>) -> Vec<String> {
    match target {
        "compare" => args,
        _ => args.into_iter().filter(|a| a != "--").collect(),
    }
}

/// The package and `[[bench]]` of the bench target `name` (its first, where it names several).
pub fn target(name: &str) -> Result<(&'static str, &'static str)> {
    BENCH_TARGETS
        .iter()
        .find(|t| t.name == name)
        .map(|t| (t.package, t.bench))
        .ok_or_else(|| Failure::usage(format!("unknown bench target `{name}`")))
}

/// Runs one `[[bench]]` target with `extra_args`.
fn run_target(target: &BenchTarget, extra_args: &[String]) -> Result {
    let mut command = process::cargo();
    command.args(["bench", "-p", target.package, "--bench", target.bench]);
    match target.name {
        "ledger" => ledger_options(&mut command),
        // Bytes from the allocator, not time: the dev profile (dependencies optimised).
        "memory" => {
            command.args(["--profile", "dev"]);
        }
        _ => {}
    }
    command.arg("--").args(extra_args);
    process::run(command)
}

/// The ledger counts bytes, not time: it runs in the dev profile (dependencies optimised),
/// sharing the gate's build with the wgpu features, with `--features wgpu` where Mesa's
/// lavapipe is installed (Flex only, said by the bench, elsewhere).
fn ledger_options(command: &mut std::process::Command) {
    command.args(["--profile", "dev"]);
    if crate::packages::lavapipe_present() {
        command.args(["--features", "wgpu"]);
        if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
            command.env("XDG_RUNTIME_DIR", std::env::temp_dir());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bench_args;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn a_benchs_arguments_lose_the_separator_but_compares_keep_it() {
        assert_eq!(
            bench_args("train", args("--rounds 3 -- --model llama")),
            args("--rounds 3 --model llama")
        );
        let compare = args("--rev a --rev b -- --model llama");
        assert_eq!(bench_args("compare", compare.clone()), compare);
    }
}
