//! `cargo xtask gpu-kit`: every CUDA/NCCL path built here, on a machine with no GPU and no CUDA
//! toolkit, into `target/gpu-kit/` — a folder a GPU machine with nothing but a driver runs in
//! one command (`target/gpu-kit/run`, docs/gpu.md).
//!
//! The kit holds one program, `gpu_check` (the `cuda` feature of `bonfire-examples`: the checks,
//! and the parity harness and the training front door compiled in, so that Burn's CUDA backend
//! is carried once), stripped and gzipped (`bin/gpu_check.gz`: a 64 MiB program is 16 MiB
//! compressed; `run` unpacks it); `bin/parity` and `bin/train`, scripts running it as those
//! programs (`--device cuda`); the Llama fixture the harness checks against transformers'
//! float64 run; the `run` script, the list of checks (`CHECKS`) and what was built
//! (`VERSION`). At most [`LIMIT`] bytes in all.
//!
//! Burn's CUDA backend (CubeCL) links its LLVM code generator, whose build script downloads an
//! LLVM bundle; `DOCS_RS=1` makes that script (and `cubecl-llvm`'s) skip it, and the kit uses
//! CubeCL's C++ path instead (NVRTC at run time, `cubecl/cuda-cpp`). The LLVM functions the
//! skipped bundle would have provided are then undefined: [`llvm_stubs`] gives the linker a
//! definition of each that aborts, never called on the C++ path.
//!
//! `cargo xtask gpu-kit --smoke` (the gate's `gpu-kit` step) builds the same programs' code
//! without CUDA (the gate's build) and runs the kit's `run` script in a kit folder of its own,
//! which must take its SKIPPED path here.

mod llvm_stubs;

use crate::process::{self, Failure, Result};
use std::path::Path;
use std::process::Command;

/// The kit's size limit: a GPU node's upload, with room to spare.
pub const LIMIT: u64 = 60 << 20;

/// The run script, written to the kit as `run`.
const RUN_SCRIPT: &str = include_str!("run.sh");

/// The programs of the kit, examples of `bonfire-examples`.
const PROGRAMS: [&str; 1] = ["gpu_check"];

/// The programs `gpu_check` also is (`gpu_check <name> …`), each with a script in `bin/`.
const ALIASES: [&str; 2] = ["parity", "train"];

/// The Llama fixture's files the `parity-llama` check reads.
const FIXTURE: [&str; 4] = [
    "config.json",
    "model.safetensors",
    "batch.safetensors",
    "reference.safetensors",
];

fn fail(message: impl Into<String>) -> Failure {
    Failure {
        message: message.into(),
        exit_code: 1,
    }
}

pub fn run(smoke: bool) -> Result {
    if smoke {
        return self::smoke().map(|_| ());
    }
    let root = process::root();
    let build = root.join("target/gpu-kit-build");
    let stubs = llvm_stubs::prepare(&build)?;
    // One `cargo rustc` per program, so that only its link is given the stubs (RUSTFLAGS
    // would rebuild every dependency when they change).
    for program in PROGRAMS {
        let cargo = || {
            let mut command = process::cargo();
            command
                .current_dir(&root)
                .env("DOCS_RS", "1")
                .env("CARGO_TARGET_DIR", &build)
                .args(["rustc", "--release", "-p", "bonfire-examples"])
                .args(["--features", "cuda", "--example", program, "--"])
                .args(stubs.link_args());
            command
        };
        // A link naming LLVM functions the stubs lack fails: stub them, link again (the
        // linker names them all at once; a few rounds at most, in case it stops early).
        for round in 0.. {
            let mut output = String::new();
            let built = process::run_echoed(cargo(), |line| {
                output.push_str(line);
                output.push('\n');
            });
            match built {
                Ok(()) => break,
                Err(_) if round < 3 => {
                    let n = stubs.regenerate(&output)?;
                    println!(
                        "gpu-kit: {n} LLVM functions stubbed (never called on CubeCL's C++ path)"
                    );
                }
                Err(_) => return Err(fail(format!("gpu-kit: {program} does not link (above)"))),
            }
        }
    }
    let kit = root.join("target/gpu-kit");
    assemble(&kit, &build.join("release/examples"))?;
    let sizes = sizes(&kit)?;
    report(&kit, &sizes)
}

/// Writes the kit into `kit` from the programs in `bins`: the programs (stripped, gzipped),
/// the scripts of their aliases, the fixture, the checks' list, the version, the run script.
fn assemble(kit: &Path, bins: &Path) -> Result {
    let io = |what: &str, e: std::io::Error| fail(format!("gpu-kit: {what}: {e}"));
    if kit.exists() {
        std::fs::remove_dir_all(kit).map_err(|e| io("clearing the old kit", e))?;
    }
    std::fs::create_dir_all(kit.join("bin")).map_err(|e| io("bin/", e))?;
    let work = bins.join("gpu-kit-unpacked");
    std::fs::create_dir_all(&work).map_err(|e| io("gpu-kit-unpacked/", e))?;
    for program in PROGRAMS {
        let from = bins.join(program);
        let stripped = work.join(program);
        std::fs::copy(&from, &stripped).map_err(|e| io(&from.display().to_string(), e))?;
        strip(&stripped)?;
        gzip(&stripped, &kit.join("bin").join(format!("{program}.gz")), 9)?;
    }
    let fixture = kit.join("bin/fixtures/llama");
    std::fs::create_dir_all(&fixture).map_err(|e| io("fixtures/", e))?;
    for file in FIXTURE {
        let from = process::root().join("examples/fixtures/llama").join(file);
        std::fs::copy(&from, fixture.join(file)).map_err(|e| io(file, e))?;
    }
    // PyTorch's side of `gemm` and `bench-1b`, beside the fixtures (`gpu_check` finds it there).
    let bench = process::root().join("examples/python/gpu_bench.py");
    std::fs::copy(&bench, kit.join("bin/gpu_bench.py")).map_err(|e| io("gpu_bench.py", e))?;
    write_common(kit, &work.join("gpu_check"))
}

/// `program` compressed into `to` at `level` (gzip: every machine can unpack it).
fn gzip(program: &Path, to: &Path, level: u8) -> Result {
    let file = std::fs::File::create(to).map_err(|e| fail(format!("{}: {e}", to.display())))?;
    tool(
        Command::new("gzip")
            .arg(format!("-{level}"))
            .arg("-c")
            .arg(program)
            .stdout(file),
    )
}

/// Strips `program`'s symbols and debug information (binutils' `strip`).
fn strip(program: &Path) -> Result {
    tool(Command::new("strip").arg(program))
}

/// Runs a build tool (`gzip`, `strip`, `cc`, `ar`) to completion; its error output on failure.
fn tool(command: &mut Command) -> Result {
    let out = command
        .output()
        .map_err(|e| fail(format!("gpu-kit: {command:?}: {e}")))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(fail(format!(
            "gpu-kit: {command:?}: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))),
    }
}

/// The files every kit has: `CHECKS` (what `gpu_check list` prints), `VERSION`, `run`, and
/// the scripts of `gpu_check`'s aliases.
fn write_common(kit: &Path, gpu_check: &Path) -> Result {
    let io = |what: &str, e: std::io::Error| fail(format!("gpu-kit: {what}: {e}"));
    let listed = Command::new(gpu_check)
        .arg("list")
        .output()
        .map_err(|e| io("gpu_check list", e))?;
    let checks = String::from_utf8_lossy(&listed.stdout).to_string();
    if !listed.status.success() || checks.lines().count() == 0 {
        return Err(fail(format!(
            "gpu-kit: `gpu_check list` listed no check ({})",
            listed.status
        )));
    }
    // `gpu_check <alias>` is that program: a check of the same name could never run.
    let names: Vec<&str> = checks
        .lines()
        .filter_map(|l| l.split('\t').next())
        .collect();
    if let Some(clash) = ALIASES.iter().find(|a| names.contains(a)) {
        return Err(fail(format!(
            "gpu-kit: a check is named `{clash}`, which `gpu_check` runs as a program"
        )));
    }
    std::fs::write(kit.join("CHECKS"), &checks).map_err(|e| io("CHECKS", e))?;
    std::fs::write(kit.join("VERSION"), version() + "\n").map_err(|e| io("VERSION", e))?;
    write_script(&kit.join("run"), RUN_SCRIPT)?;
    for alias in ALIASES {
        let script = format!(
            "#!/bin/sh\n# `gpu_check {alias}`: the kit's {alias} program (docs/gpu.md).\n\
             bin=$(\"$(dirname \"$0\")/../run\" --unpack) || exit 1\n\
             exec \"$bin\" {alias} \"$@\"\n"
        );
        write_script(&kit.join("bin").join(alias), &script)?;
    }
    Ok(())
}

/// Writes an executable script.
fn write_script(path: &Path, text: &str) -> Result {
    use std::os::unix::fs::PermissionsExt;
    let io = |e: std::io::Error| fail(format!("gpu-kit: {}: {e}", path.display()));
    std::fs::write(path, text).map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).map_err(io)
}

/// `bonfire <commit> built <date> with <rustc>`.
fn version() -> String {
    let out = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .current_dir(process::root())
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    format!(
        "bonfire {} built {} with {}",
        out("git", &["describe", "--always", "--dirty"]),
        out("date", &["-u", "+%Y-%m-%dT%H:%MZ"]),
        out("rustc", &["--version"]),
    )
}

/// Every file of `kit` (relative path) and its size, largest first.
fn sizes(kit: &Path) -> Result<Vec<(String, u64)>> {
    let mut out = Vec::new();
    let mut stack = vec![kit.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries =
            std::fs::read_dir(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
        for entry in entries {
            let entry = entry.map_err(|e| fail(e.to_string()))?;
            let meta = entry.metadata().map_err(|e| fail(e.to_string()))?;
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                let name = entry
                    .path()
                    .strip_prefix(kit)
                    .unwrap()
                    .display()
                    .to_string();
                out.push((name, meta.len()));
            }
        }
    }
    out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    Ok(out)
}

/// Prints every file's size and the total; fails over [`LIMIT`].
fn report(kit: &Path, sizes: &[(String, u64)]) -> Result {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    for (name, bytes) in sizes {
        println!("gpu-kit: {name} {:.2} MiB", mib(*bytes));
    }
    let total: u64 = sizes.iter().map(|(_, b)| b).sum();
    println!(
        "gpu-kit: {} — {} files, {:.1} MiB in all (limit {:.0} MiB)",
        kit.display(),
        sizes.len(),
        mib(total),
        mib(LIMIT)
    );
    if total > LIMIT {
        return Err(fail(format!(
            "gpu-kit: {:.1} MiB is over the kit's {:.0} MiB",
            mib(total),
            mib(LIMIT)
        )));
    }
    println!("gpu-kit: copy the folder to a GPU machine and run `./run` in it (docs/gpu.md)");
    Ok(())
}

/// The gate's part: the `gpu_check` of this build (no CUDA) in a kit folder with the `run`
/// script, which must print SKIPPED and exit 0 on this machine (no GPU). Returns the number of
/// checks the kit lists (all skipped here).
pub fn smoke() -> Result<usize> {
    let root = process::root();
    // The test step's features, so that its build is reused.
    let mut command = if crate::packages::lavapipe_present() {
        crate::test::wgpu_cargo("build")
    } else {
        let mut command = process::cargo();
        command.arg("build");
        command
    };
    command
        .current_dir(&root)
        .args(["--workspace", "--example", "gpu_check"]);
    process::run(command)?;
    let kit = root.join("target/gpu-kit-smoke");
    let _ = std::fs::remove_dir_all(&kit);
    std::fs::create_dir_all(kit.join("bin")).map_err(|e| fail(e.to_string()))?;
    // Packed as the kit packs it (gzip, fastest level: a debug build is large).
    let bin = root.join("target/debug/examples/gpu_check");
    gzip(&bin, &kit.join("bin/gpu_check.gz"), 1)?;
    write_common(&kit, &bin)?;
    // The aliases' scripts unpack the program and run it as `parity` and `train`.
    for alias in ALIASES {
        let out = Command::new(kit.join("bin").join(alias))
            .arg("--help")
            .output()
            .map_err(|e| fail(format!("bin/{alias}: {e}")))?;
        let usage = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() || !usage.contains("Usage:") {
            return Err(fail(format!(
                "gpu-kit: bin/{alias} --help: {} ({})",
                String::from_utf8_lossy(&out.stderr),
                out.status
            )));
        }
        println!(
            "gpu-kit: bin/{alias} --help: {}",
            usage.lines().next().unwrap_or_default()
        );
    }
    let checks = std::fs::read_to_string(kit.join("CHECKS"))
        .map_err(|e| fail(e.to_string()))?
        .lines()
        .count();
    if let Some(gpus) = crate::gpu::detect_gpus() {
        println!(
            "gpu-kit: {gpus} GPU(s) here: the SKIPPED path cannot be checked; `cargo xtask gpu-kit` builds the kit to run on them"
        );
        return Ok(checks);
    }
    let out = Command::new(kit.join("run"))
        .output()
        .map_err(|e| fail(format!("run: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    print!("{text}");
    let last = text.lines().last().unwrap_or_default();
    let want = format!("0 passed, 0 failed, {checks} skipped");
    let skipped = text.lines().any(|l| l.starts_with("SKIPPED: "));
    if !out.status.success() || !skipped || last != want {
        return Err(fail(format!(
            "gpu-kit: the kit's run script on a machine without a GPU should print SKIPPED, \
             end with `{want}` and exit 0; it ended with `{last}` ({})",
            out.status
        )));
    }
    Ok(checks)
}

#[cfg(test)]
mod tests {
    use super::RUN_SCRIPT;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;
    use std::process::Command;

    /// A kit whose `gpu_check` is a shell script: `pass` passes, `fail` fails, `slow` sleeps
    /// past its 1 s limit; `needs-nccl` needs a library the test does not provide and
    /// `two-gpus` two GPUs. With `gpu`, a fake `nvidia-smi` lists one GPU and fake libcuda and
    /// libnvrtc files stand in a directory on `LD_LIBRARY_PATH`; with `headers`, `CUDA_PATH`
    /// has an `include/cuda_fp16.h`. Returns the run's output and
    /// whether it exited 0.
    fn run_fake_kit(tag: &str, gpu: bool, headers: bool) -> (String, bool) {
        let dir = std::env::temp_dir().join(format!("bonfire-kit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let write = |path: &Path, text: &str, exec: bool| {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
            if exec {
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
        };
        let kit = dir.join("kit");
        write(&kit.join("run"), RUN_SCRIPT, true);
        let checks = "pass\t1\t5\t-\tpasses\nfail\t1\t5\tnvrtc\tfails\nslow\t1\t1\t-\tsleeps\n\
                      needs-nccl\t1\t5\tnccl\tneeds NCCL\ntwo-gpus\t2\t5\t-\tneeds two GPUs\n";
        write(&kit.join("CHECKS"), checks, false);
        let program = "#!/bin/sh\ncase \"$1\" in\n list) cat \"$(dirname \"$0\")/../CHECKS\" ;;\n \
                       pass) echo \"fixtures=$BONFIRE_GPU_KIT_FIXTURES\" ;;\n fail) echo broken >&2; exit 3 ;;\n slow) sleep 30 ;;\n \
                       *) exit 9 ;;\nesac\n";
        write(&kit.join("bin/gpu_check"), program, true);
        let fake_bin = dir.join("fakebin");
        std::fs::create_dir_all(&fake_bin).unwrap();
        let libs = dir.join("libs");
        if gpu {
            write(
                &fake_bin.join("nvidia-smi"),
                "#!/bin/sh\n[ \"$1\" = -L ] && echo 'GPU 0: Fake (UUID: GPU-0)'\nexit 0\n",
                true,
            );
            write(&libs.join("libcuda.so.1"), "", false);
            write(&libs.join("libnvrtc.so.12"), "", false);
        }
        let cuda = dir.join("cuda");
        if headers {
            write(&cuda.join("include/cuda_fp16.h"), "", false);
        }
        let out = Command::new(kit.join("run"))
            .env("CUDA_PATH", &cuda)
            .env("PATH", format!("{}:/usr/bin:/bin", fake_bin.display()))
            .env("LD_LIBRARY_PATH", &libs)
            .env("HOME", &dir)
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        (
            String::from_utf8_lossy(&out.stdout).to_string(),
            out.status.success(),
        )
    }

    #[test]
    fn the_run_script_counts_passed_failed_timed_out_and_skipped_checks() {
        let (text, ok) = run_fake_kit("gpu", true, true);
        println!("{text}");
        assert!(!ok, "a failed check fails the run");
        for line in [
            "gpu-kit: 1 GPU(s)",
            "PASSED pass",
            "FAILED fail: exit 3",
            "FAILED slow: over its 1 s limit",
            "SKIPPED needs-nccl: missing libnccl",
            "SKIPPED two-gpus: needs 2 GPUs, found 1",
            "gpu-kit: libnccl: MISSING — NCCL: apt install libnccl2",
            "gpu-kit: CUDA headers: ",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(line)),
                "no line `{line}`"
            );
        }
        assert_eq!(text.lines().last(), Some("1 passed, 2 failed, 2 skipped"));
        // The program runs unpacked elsewhere: `run` names the kit's fixtures for it.
        assert!(
            text.lines()
                .any(|l| l.starts_with("    fixtures=/") && l.ends_with("/kit/bin/fixtures")),
            "the checks are not told where the kit's fixtures are"
        );
    }

    #[test]
    fn without_cuda_headers_the_nvrtc_checks_are_skipped() {
        let (text, ok) = run_fake_kit("noheaders", true, false);
        println!("{text}");
        assert!(!ok, "the slow check still fails");
        assert!(
            text.lines()
                .any(|l| l.starts_with("gpu-kit: CUDA headers: MISSING"))
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("SKIPPED fail: missing libnvrtc cuda-headers"))
        );
        assert_eq!(text.lines().last(), Some("1 passed, 1 failed, 3 skipped"));
    }

    #[test]
    fn without_a_gpu_the_run_script_skips_everything_and_succeeds() {
        if crate::gpu::detect_gpus().is_some() {
            return; // a GPU machine: the SKIPPED path cannot be taken here
        }
        let (text, ok) = run_fake_kit("nogpu", false, false);
        println!("{text}");
        assert!(ok, "no GPU is not a failure");
        assert!(
            text.lines()
                .any(|l| l.starts_with("SKIPPED: no NVIDIA GPU"))
        );
        assert_eq!(text.lines().last(), Some("0 passed, 0 failed, 5 skipped"));
    }
}
