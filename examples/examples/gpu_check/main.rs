//! The GPU kit's program: its checks, one per run, and the parity harness and the training
//! front door (`gpu_check parity …`, `gpu_check train …`: the `parity` and `train` examples,
//! compiled in, so that the kit carries Burn's CUDA backend once). `cargo xtask gpu-kit` builds
//! it with the `cuda` feature, in release, and the kit's `run` script runs each check it lists
//! in its own process with a timeout (docs/gpu.md). Without the `cuda` feature (the gate's
//! build) the checks refuse to run, saying so; `list` works in every build.
//!
//! ```sh
//! gpu_check list                 # name, GPUs needed, timeout (s), libraries, what it checks
//! gpu_check nccl                 # one check; exit 0 when it passed
//! gpu_check parity-llama --fixture fixtures/llama
//! gpu_check train --model llama-bench --device cuda --steps 50
//! ```

#[allow(dead_code)] // its `main`: this program runs `main_with`
#[path = "../parity.rs"]
mod parity_program;
#[allow(dead_code)]
#[path = "../train/main.rs"]
mod train_program;
// The checks a device other than Flex must pass (also run on wgpu by `tests/wgpu.rs`), and the
// benches' step timing they use.
#[allow(dead_code)]
mod checks;
// Where a step's time goes on a GPU (also run on wgpu by `tests/wgpu.rs`).
#[allow(dead_code)]
mod profile;
#[allow(dead_code)]
#[path = "../../benches/common/throughput.rs"]
mod throughput;

use bonfire_examples::cli::LayoutArgs;
use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

/// One check: its name, the GPUs it needs, its time limit, the libraries it loads.
struct Check {
    name: &'static str,
    min_gpus: usize,
    timeout_s: u64,
    /// Libraries beside libcuda, comma-separated: `nccl`, `nvrtc` (CubeCL compiles its kernels
    /// with NVRTC); `-` for none.
    needs: &'static str,
    what: &'static str,
    run: fn(&Cli) -> Result<Vec<String>, String>,
}

const CHECKS: &[Check] = &[
    Check {
        name: "nccl",
        min_gpus: 1,
        timeout_s: 90,
        needs: "nccl",
        what: "NCCL collectives on every visible GPU (one rank each) against their host results",
        run: gpu::nccl,
    },
    Check {
        name: "plane",
        min_gpus: 1,
        timeout_s: 90,
        needs: "nccl,nvrtc",
        what: "the data plane on CUDA tensors over NCCL: right values, 0 host bytes in the ledger",
        run: gpu::plane,
    },
    Check {
        name: "kernels",
        min_gpus: 1,
        timeout_s: 120,
        needs: "nvrtc",
        what: "the CubeCL kernels (pack, 16-bit casts with feedback, fused AdamW) vs their fallbacks",
        run: gpu::kernels,
    },
    Check {
        name: "parity-llama",
        min_gpus: 1,
        timeout_s: 150,
        needs: "nvrtc",
        what: "the parity harness on --device cuda, transformers' Llama checkpoint, dp=1 and \
               dp=2×tp=2 (ZeRO-3, SP, LP): within TF32's normwise 2e-3 of transformers' float64 run",
        run: gpu::parity_llama,
    },
    Check {
        name: "parity-layouts",
        min_gpus: 1,
        timeout_s: 240,
        needs: "nvrtc",
        what: "the GPT, SGD and AdamW: DDP, ZeRO-1/2/3, offload, tp=2, pp=2 on CUDA vs one CUDA \
               rank, and that vs Flex (TF32's normwise 2e-3)",
        run: gpu::parity_layouts,
    },
    Check {
        // Not `train`: `gpu_check train …` is the training program itself.
        name: "train-cuda",
        min_gpus: 1,
        timeout_s: 150,
        needs: "nvrtc",
        what: "the kit's `train --device cuda`: the GPT on generated text, 40 AdamW steps; the \
               loss falls",
        run: gpu::train,
    },
    Check {
        name: "bench",
        min_gpus: 1,
        timeout_s: 150,
        needs: "nvrtc",
        what: "tokens/s of the bench GPT (SGD) and the bench Llama (AdamW) on one GPU",
        run: gpu::bench,
    },
    Check {
        name: "gemm",
        min_gpus: 1,
        timeout_s: 150,
        needs: "nvrtc",
        what: "bf16 matrix products of the 1 B Llama's shapes: CubeCL's TFLOP/s, and cuBLAS's \
               through PyTorch on the same GPU when python3 has torch",
        run: gpu::gemm,
    },
    Check {
        name: "attention",
        min_gpus: 1,
        timeout_s: 150,
        needs: "nvrtc",
        what: "causal GQA attention in bf16 at the 1 B Llama's heads, T = 2,048 and 8,192: the \
               models' (forward, forward + backward), Burn's op (forward), PyTorch's SDPA",
        run: gpu::attention,
    },
    Check {
        name: "bench-1b",
        min_gpus: 1,
        timeout_s: 450,
        needs: "nvrtc",
        what: "the Llama at Llama-3.2-1B's shape, 2,048 tokens, bf16 with f32 masters, AdamW: \
               tokens/s, MFU, peak device bytes; PyTorch's (transformers, SDPA, fused AdamW)",
        run: gpu::bench_1b,
    },
    Check {
        name: "profile",
        min_gpus: 1,
        timeout_s: 300,
        needs: "nvrtc",
        what: "where a step of the 1 B Llama (bf16, 2,048 tokens) goes: matmul, attention, \
               element-wise, optimizer, communication, idle (ms and shares; docs/gpu.md)",
        run: gpu::profile,
    },
    Check {
        name: "offload",
        min_gpus: 1,
        timeout_s: 420,
        needs: "nvrtc",
        what: "ZeRO-Offload on one GPU: Llama-3.1-8B's shape in bf16 on the device, its f32 \
               masters and AdamW state on the host; tokens/s, peak device and host bytes \
               (run alone: `run --only offload`, it needs ~100 GB of host memory)",
        run: gpu::offload,
    },
];

#[derive(Parser, Debug)]
#[command(
    about = "The GPU kit's checks (docs/gpu.md); `gpu_check train …` and `gpu_check parity …` \
             are the training front door and the parity harness"
)]
struct Cli {
    /// `list`, or the check to run.
    check: String,
    /// The Llama fixture (default: `$BONFIRE_GPU_KIT_FIXTURES/llama`, which the kit's `run`
    /// sets to its own `bin/fixtures`, else `fixtures/llama` beside this program).
    #[arg(long)]
    fixture: Option<PathBuf>,
    /// Timed steps of `bench` (`bench-1b` times at most 5).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Rows of 2,048 tokens a step of `bench-1b`.
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// `bench-1b` also times PyTorch under `torch.compile` (minutes of compiling).
    #[arg(long)]
    torch_compile: bool,
    /// `bench-1b` (and `profile`) with the head and its loss by blocks of this many rows
    /// (`Llama::with_fused_loss`: the `[rows, 128,256]` logits never whole); default: whole.
    #[arg(long)]
    fused_loss: Option<usize>,
}

impl Cli {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn fixture(&self) -> PathBuf {
        // `run` unpacks this program under $TMPDIR, away from the kit's fixtures: it names them.
        let kit = std::env::var_os("BONFIRE_GPU_KIT_FIXTURES").map(PathBuf::from);
        self.fixture.clone().unwrap_or_else(|| {
            let exe = std::env::current_exe().unwrap_or_default();
            kit.unwrap_or_else(|| exe.with_file_name("fixtures"))
                .join("llama")
        })
    }
}

fn main() -> ExitCode {
    // `gpu_check train …` and `gpu_check parity …` are those programs.
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match args.get(1).and_then(|a| a.to_str()) {
        Some("train") => {
            args.remove(1);
            train_program::main_with(args);
            return ExitCode::SUCCESS;
        }
        Some("parity") => {
            args.remove(1);
            return parity_program::main_with(args);
        }
        _ => {}
    }
    let cli = Cli::parse_from(args);
    if cli.check == "list" {
        for c in CHECKS {
            let (name, gpus, secs, needs) = (c.name, c.min_gpus, c.timeout_s, c.needs);
            println!("{name}\t{gpus}\t{secs}\t{needs}\t{}", c.what);
        }
        return ExitCode::SUCCESS;
    }
    let Some(check) = CHECKS.iter().find(|c| c.name == cli.check) else {
        let names: Vec<&str> = CHECKS.iter().map(|c| c.name).collect();
        eprintln!(
            "gpu_check: no check `{}` (checks: {})",
            cli.check,
            names.join(", ")
        );
        return ExitCode::from(2);
    };
    match (check.run)(&cli) {
        Ok(lines) if !lines.is_empty() => {
            for line in lines {
                println!("{}: {line}", check.name);
            }
            ExitCode::SUCCESS
        }
        Ok(_) => {
            eprintln!("{}: FAILED: the check reported nothing", check.name);
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{}: FAILED: {e}", check.name);
            ExitCode::FAILURE
        }
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// Runs the training front door (this program's `train`) in a process of its own with `args`
/// and a metrics file; the first and the last step's loss and the last step's tokens/s.
fn train_program(args: &[&str]) -> Result<(f64, f64, f64), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let metrics =
        std::env::temp_dir().join(format!("bonfire-gpu-kit-{}.jsonl", std::process::id()));
    let out = std::process::Command::new(&exe)
        .arg("train")
        .args(args)
        .arg("--metrics")
        .arg(&metrics)
        .output()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!(
            "train {}: {}\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = std::fs::read_to_string(&metrics).map_err(|e| e.to_string())?;
    std::fs::remove_file(&metrics).ok();
    let steps: Vec<serde_json::Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("metrics: {e}"))?;
    let field = |v: &serde_json::Value, k: &str| v[k].as_f64().ok_or(format!("metrics: no {k}"));
    let (first, last) = match (steps.first(), steps.last()) {
        (Some(f), Some(l)) if steps.len() > 1 => (f, l),
        _ => return Err(format!("{} metric lines, want every step's", steps.len())),
    };
    Ok((
        field(first, "loss")?,
        field(last, "loss")?,
        field(last, "tokens_per_s")?,
    ))
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// The Llama fixture's layouts: one rank, and dp=2 × tp=2 with ZeRO-3, SP and LP.
fn llama_layouts() -> Vec<LayoutArgs> {
    vec![
        LayoutArgs::mesh("dp=1"),
        LayoutArgs {
            zero: 3,
            sequence_parallel: true,
            loss_parallel: true,
            ..LayoutArgs::mesh("dp=2,tp=2")
        },
    ]
}

#[cfg(feature = "cuda")]
mod gpu;

#[cfg(feature = "cuda")]
mod pytorch;

/// A build without the `cuda` feature: every check refuses, saying how to build one with it.
#[cfg(not(feature = "cuda"))]
mod gpu {
    use super::Cli;

    macro_rules! refusing {
        ($($name:ident),*) => {$(
            pub fn $name(_: &Cli) -> Result<Vec<String>, String> {
                Err("this gpu_check was built without the `cuda` feature: build the kit with \
                     `cargo xtask gpu-kit`"
                    .into())
            }
        )*};
    }

    refusing!(
        nccl,
        plane,
        kernels,
        parity_llama,
        parity_layouts,
        train,
        bench,
        gemm,
        attention,
        bench_1b,
        profile,
        offload
    );
}
