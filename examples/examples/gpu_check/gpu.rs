//! The kit's checks on CUDA (feature `cuda`): each one's run, as `main`'s `CHECKS` lists them;
//! a build without the feature has `main`'s refusing stand-ins.

use super::{Cli, llama_layouts};
use crate::checks as device_checks;
use bonfire_comm::nccl::launch_on_every_gpu;
use bonfire_comm::testing::conformance;
use burn::tensor::Device;
use std::time::Duration;

/// One thread per visible GPU, each a rank of one NCCL group; `each`'s lines, rank order.
fn on_every_gpu(
    each: impl Fn(&bonfire_comm::ProcessGroup, usize) -> Result<String, String> + Sync,
) -> Result<Vec<String>, String> {
    let timeout = Duration::from_secs(60);
    let (libs, lines) = launch_on_every_gpu("gpu-kit", timeout, |pg| each(pg, pg.rank()))
        .map_err(|e| e.to_string())?;
    let n = lines.len();
    let mut out = vec![format!("NCCL {} with {n} GPU(s)", libs.nccl_version)];
    for (rank, line) in lines.into_iter().enumerate() {
        out.push(format!("GPU {rank}/{n}: {}", line?));
    }
    Ok(out)
}

pub fn nccl(_: &Cli) -> Result<Vec<String>, String> {
    on_every_gpu(|pg, _| {
        conformance::run_all(pg).map(|checks| format!("{checks} conformance checks passed"))
    })
}

pub fn plane(_: &Cli) -> Result<Vec<String>, String> {
    on_every_gpu(|pg, rank| {
        let moved = bonfire_dtensor::plane::testing::collectives_on_device(pg, &Device::cuda(rank));
        match moved {
            0 => Ok(
                "all-reduce, broadcast, all-gather, reduce-scatter right; ledger host \
                     bytes 0"
                    .into(),
            ),
            b => Err(format!("{b} bytes staged through the host (want 0)")),
        }
    })
}

pub fn kernels(_: &Cli) -> Result<Vec<String>, String> {
    Ok(bonfire_kernels::testing::run_all(
        &bonfire_examples::harness::cuda_device()?,
    ))
}

pub fn parity_llama(cli: &Cli) -> Result<Vec<String>, String> {
    let out = std::env::temp_dir().join(format!("bonfire-gpu-kit-{}", std::process::id()));
    let mut lines = Vec::new();
    for layout in llama_layouts() {
        lines.push(device_checks::llama_against_transformers(
            &cli.fixture(),
            "cuda",
            layout,
            &out,
        )?);
    }
    std::fs::remove_dir_all(out).ok();
    Ok(lines)
}

pub fn parity_layouts(_: &Cli) -> Result<Vec<String>, String> {
    let (model, batches) = device_checks::gpt_fixture();
    let device = bonfire_examples::harness::cuda_device()?.autodiff();
    Ok(device_checks::parity_tf32(
        &model,
        &batches,
        &device,
        &device_checks::layouts(),
    ))
}

pub fn train(_: &Cli) -> Result<Vec<String>, String> {
    let args = [
        "--model", "gpt", "--device", "cuda", "--steps", "40", "--optim", "adamw",
    ];
    let (first, last, tokens_per_s) = super::train_program(&args)?;
    if last.is_nan() || last >= 0.8 * first {
        return Err(format!(
            "the loss went from {first:.4} to {last:.4} in 40 steps"
        ));
    }
    Ok(vec![format!(
        "train {}: loss {first:.4} → {last:.4}, {tokens_per_s:.0} tokens/s",
        args.join(" ")
    )])
}

pub fn bench(cli: &Cli) -> Result<Vec<String>, String> {
    let speeds = device_checks::tokens_per_second(
        &bonfire_examples::harness::cuda_device()?.autodiff(),
        cli.steps,
    )?;
    Ok(speeds
        .into_iter()
        .map(|s| {
            format!(
                "bench model={} device=cuda batch=8 step_ms={:.2} tokens_per_s={:.0}",
                s.model, s.step_ms, s.tokens_per_s
            )
        })
        .collect())
}

/// The 1 B Llama's matrix shapes at 4,096 tokens (`[tokens, in] × [in, out]`): q and o,
/// k and v, gate and up, down, the head.
const GEMMS: [(usize, usize, usize); 5] = [
    (4096, 2048, 2048),
    (4096, 2048, 512),
    (4096, 2048, 8192),
    (4096, 8192, 2048),
    (4096, 2048, 128_256),
];

pub fn gemm(_: &Cli) -> Result<Vec<String>, String> {
    let device = bonfire_examples::harness::cuda_device()?;
    let shapes: Vec<String> = GEMMS
        .iter()
        .map(|(m, k, n)| format!("{m}x{k}x{n}"))
        .collect();
    let torch = super::pytorch::run(&["gemm", "--reps", "20", "--shapes", &shapes.join(",")]);
    let mut lines = Vec::new();
    for (m, k, n) in GEMMS {
        let (ours, error) = device_checks::gemm_tflops(&device, (m, k, n), 20);
        let key = format!("gemm m={m} k={k} n={n}");
        let mut line = format!("{key} cubecl_tflops={ours:.1} cubecl_error={error:.1e}");
        if let Ok(theirs) = &torch {
            let cublas = super::pytorch::field(theirs, &key, "tflops")?;
            line += &format!(" cublas_tflops={cublas:.1} ratio={:.3}", ours / cublas);
        }
        eprintln!("{line}"); // as it is measured: a run cut short keeps it in the log
        lines.push(line);
        if error.is_nan() || error > 1e-2 {
            return Err(format!("CubeCL's product is wrong: {}", lines.join(" / ")));
        }
    }
    if let Err(why) = torch {
        lines.push(format!("cublas: not measured ({why})"));
    }
    Ok(lines)
}

/// Attention's shapes (`b × h × h_kv × T × dh`): the 1 B Llama's heads at 2,048 and 8,192.
const ATTENTION: [(usize, usize, usize, usize, usize); 2] =
    [(2, 32, 8, 2048, 64), (1, 32, 8, 8192, 64)];

pub fn attention(_: &Cli) -> Result<Vec<String>, String> {
    let name =
        |(b, h, k, t, d): (usize, usize, usize, usize, usize)| format!("{b}x{h}x{k}x{t}x{d}");
    let shapes: Vec<String> = ATTENTION.iter().map(|s| name(*s)).collect();
    let torch = super::pytorch::run(&["attention", "--shapes", &shapes.join(",")]);
    let device = bonfire_examples::harness::cuda_device()?.autodiff();
    let mut lines = Vec::new();
    for shape in ATTENTION {
        let key = format!("attention shape={}", name(shape));
        let mut line = key.clone();
        for (what, ms) in device_checks::attention_ms(&device, shape) {
            line += &format!(" {what}_ms={ms:.3}");
        }
        if let Ok(out) = &torch {
            for what in ["sdpa_fwd_ms", "sdpa_fwd_bwd_ms"] {
                let ms = super::pytorch::field(out, &key, what)?;
                line += &format!(" {what}={ms:.3}");
            }
        }
        eprintln!("{line}"); // as it is measured: a run cut short keeps it in the log
        lines.push(line);
    }
    if let Err(why) = torch {
        lines.push(format!("sdpa: not measured ({why})"));
    }
    Ok(lines)
}

pub fn bench_1b(cli: &Cli) -> Result<Vec<String>, String> {
    // PyTorch first, while this process holds no device memory (the meter reads the GPU).
    let torch = pytorch_1b(cli);
    let device = bonfire_examples::harness::cuda_device()?.autodiff();
    let peak = super::pytorch::PeakMemory::start();
    let (speed, params) =
        device_checks::bench_1b(&device, cli.batch, cli.steps.min(5), cli.fused_loss)?;
    let peak = peak.stop();
    let line = format!(
        "bench-1b engine=bonfire batch={} params={params} step_ms={:.1} tokens_per_s={:.0} \
         mfu={:.3} peak_device_bytes={peak} loss_first={:.3} loss_last={:.3} fused_loss_rows={}",
        cli.batch,
        speed.step_ms,
        speed.tokens_per_s,
        mfu(&device_checks::llama_1b(), params, speed.tokens_per_s),
        speed.losses.0,
        speed.losses.1,
        cli.fused_loss.map_or("none".to_string(), |r| r.to_string())
    );
    eprintln!("{line}");
    let mut lines = vec![line];
    for (mode, measured) in torch {
        match measured {
            Ok((line, theirs)) => {
                lines.push(line);
                lines.push(format!(
                    "bench compare model=llama-1b a=bonfire b=pytorch-{mode} \
                     a_tokens_per_s={:.0} b_tokens_per_s={theirs:.0} ratio={:.3}",
                    speed.tokens_per_s,
                    speed.tokens_per_s / theirs
                ));
            }
            Err(why) => lines.push(format!("pytorch-{mode}: not measured ({why})")),
        }
    }
    Ok(lines)
}

/// Where a step of the 1 B Llama goes ([`crate::profile`]): the step as `bench-1b` trains it,
/// then its pieces alone at its shapes in bf16.
pub fn profile(cli: &Cli) -> Result<Vec<String>, String> {
    let device = bonfire_examples::harness::cuda_device()?.autodiff();
    let cfg = device_checks::llama_1b();
    let (speed, _) = device_checks::bench_1b(&device, cli.batch, cli.steps.min(5), cli.fused_loss)?;
    let run = (burn::tensor::DType::BF16, device_checks::bench_adamw());
    let split = crate::profile::profile(&device, &cfg, run, (cli.batch, 5), speed.step_ms)?;
    let line = split.line("llama-1b");
    // A rate the chip cannot reach: the clock did not hold the work (the split is not used).
    if split.matmul_tflops() > super::pytorch::H200_BF16_FLOPS / 1e12 {
        return Err(format!(
            "{line}: the products ran faster than the H200's peak"
        ));
    }
    Ok(vec![line])
}

pub fn offload(cli: &Cli) -> Result<Vec<String>, String> {
    let device = bonfire_examples::harness::cuda_device()?.autodiff();
    let cfg = device_checks::llama_8b();
    let peak = super::pytorch::PeakMemory::start();
    let bf16 = bonfire_layout::MixedPrecision::bf16();
    let (batch, steps) = (cli.batch.min(2), cli.steps.min(3));
    let run = device_checks::offload_llama(&device, &cfg, bf16, (batch, steps));
    let device_peak = peak.stop();
    let (speed, params) = run?;
    Ok(vec![format!(
        "offload model=llama-8b params={params} batch={batch} step_ms={:.1} \
         tokens_per_s={:.0} mfu={:.3} peak_device_bytes={device_peak} peak_host_bytes={} \
         loss_first={:.3} loss_last={:.3}",
        speed.step_ms,
        speed.tokens_per_s,
        mfu(&cfg, params, speed.tokens_per_s),
        bonfire_train::peak_rss_bytes().unwrap_or(0),
        speed.losses.0,
        speed.losses.1
    )])
}

/// MFU of the Llama of `cfg` (`params` parameters) training at `tokens_per_s` over its
/// positions.
fn mfu(cfg: &bonfire_models::llama::LlamaConfig, params: usize, tokens_per_s: f64) -> f64 {
    let flops = device_checks::flops_per_token(cfg, params, cfg.max_position_embeddings);
    tokens_per_s * flops / super::pytorch::H200_BF16_FLOPS
}

/// One PyTorch run: its line and tokens/s, or why it was not measured.
type Measured = Result<(String, f64), String>;

/// PyTorch's 1 B Llama, eager (and compiled with `--torch-compile`): per mode, its line
/// (printed as measured) and tokens/s, or why it was not measured.
fn pytorch_1b(cli: &Cli) -> Vec<(&'static str, Measured)> {
    let batch = cli.batch.to_string();
    let steps = cli.steps.min(5).to_string();
    let modes: &[&'static str] = if cli.torch_compile {
        &["eager", "compile"]
    } else {
        &["eager"]
    };
    let one = |mode: &str| -> Measured {
        let args = [
            "bench-1b", "--batch", &batch, "--steps", &steps, "--mode", mode,
        ];
        let peak = super::pytorch::PeakMemory::start();
        let out = super::pytorch::run(&args);
        let peak = peak.stop();
        let out = out?;
        let key = format!("pytorch mode={mode}");
        let tokens = super::pytorch::field(&out, &key, "tokens_per_s")?;
        let params = super::pytorch::field(&out, &key, "params")?;
        let line = format!(
            "bench-1b engine=pytorch-{mode} {} mfu={:.3} peak_device_bytes={peak}",
            out.trim().trim_start_matches(&key).trim(),
            mfu(&device_checks::llama_1b(), params as usize, tokens)
        );
        eprintln!("{line}");
        Ok((line, tokens))
    };
    modes.iter().map(|&mode| (mode, one(mode))).collect()
}
