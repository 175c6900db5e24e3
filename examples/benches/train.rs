//! `cargo xtask bench train`: the bench GPT's (or, with `--model llama`, the bench Llama's,
//! with `--model mixtral`, the bench Mixtral's: `MixtralConfig::bench`) training throughput in
//! every layout, through the trainer's one loop, on rank threads — or as processes under
//! `mpirun` (`--backend mpi`, which runs this binary with `--launcher env`). The optimizer is
//! SGD (lr 0.01; `bonfire_kernels::FusedSgd`: Burn's SGD in one in-place pass per tensor) for the
//! GPT and the Mixtral, AdamW (`bonfire_kernels::FusedAdamW`: Burn's
//! AdamW in one pass per tensor; lr 1e-3, β 0.9/0.95, ε 1e-6, weight
//! decay 0.1) for the Llama; `--optimizer sgd|adamw` picks either. The xtask then runs
//! PyTorch's side in the same run where it is installed (`xtask/src/pytorch.rs`).
//!
//! The Mixtral runs `single`, `ddp`, `zero1`–`zero3`, `tp` and the expert-parallel `ddp-ep2`
//! (dp = ranks, ep = 2; `ddp-ep4` too where the ranks split by 4) by default (it refuses
//! `tp-sp`), then prints its routers' load imbalance step by step (`train/routing.rs`) and, for
//! each ep layout, the rows each ep rank receives (`routing_ep`). `zero1-epK`..`zero3-epK`
//! (ZeRO over every rank with ep = K) run when named. An ep row adds `ep=…
//! a2a_bytes=… a2a_ms=… a2a_calls=… a2a_share=…`: a rank's all-to-all bytes and time per step
//! (`train/experts.rs`; `a2a_share` = a2a_ms / step_ms).
//!
//! Prints one line per layout:
//! `bench train model=<gpt|llama|mixtral> layout=<single|ddp|zero1|zero2|zero3|tp|tp-sp|pp-1f1b|pp-zb-h1|pp-zb-v|ddp-epK|zeroN-epK>
//! ranks=N step_ms=… tokens_per_s=… best_step_ms=… best_tokens_per_s=… backend=…` — the median
//! over the timed steps (after warm-up) of the slowest rank's step, and the tokens of the
//! global batch per second of it; then the fastest of those steps (the one a shared VM's
//! neighbours slowed least) and its tokens per second.
//! Every multi-rank layout trains the same global batch (`batch` × `ranks` sequences), so
//! their step times compare directly; `single` trains `batch` sequences on one rank. Extra
//! fields: `ratio_vs_single` (ddp), `ratio_vs_ddp` (the other multi-rank layouts, when ddp ran
//! in the same run), each with its `best_` twin (the fastest steps' ratio), `fwd_ms` / `bwd_ms` / `wait_ms` (the median forward, backward and
//! after-backward spans the dp wrapper recorded: `wait_ms` is the gradient reduction left
//! after backward, the exposed communication; the rest of a step is the optimizer and the
//! data), `hidden` (ddp, zero2: the fraction of bucket communication time that ran
//! while backward was still computing, from the same timings, whose Chrome traces go to
//! `target/bench-train/`). Then, per layout, where the slowest rank's step went:
//! `bench profile split model=… layout=… ranks=N compute_ms=… comm_ms=… p2p_ms=…
//! optimizer_ms=… other_ms=… step_ms=…` — medians over the timed steps of the loop's
//! `StepPhases` (forward and backward less communication; blocked in collectives and waits;
//! blocked in point-to-point sends and receives, a pipeline's transfers and bubble; clipping
//! and the optimizer less communication; the rest: data and hooks). `cargo xtask bench
//! profile -- --layouts …` runs this bench for them.

mod common;
use bonfire_comm::{ReduceOp, World};
use bonfire_ddp::DdpConfig;
use bonfire_dtensor::timing::{StepTiming, chrome_trace};
use bonfire_examples::default_device;
use bonfire_kernels::{FusedAdamWConfig, FusedSgdConfig};
use bonfire_layout::ParallelDims;
use bonfire_models::data::{Batches, TokenBatch};
use bonfire_models::llama::{Llama, LlamaConfig};
use bonfire_models::mixtral::{Mixtral, MixtralConfig};
use bonfire_models::{Gpt, GptConfig};
use bonfire_parallel::ParallelModel;
use bonfire_train::Trainer;
use bonfire_zero::ZeroConfig;
use burn::tensor::Device;
use clap::Parser;
use common::layouts;
use common::throughput::{self, Hosts, RankRun, RunArgs, median};
use std::path::PathBuf;

#[path = "train/experts.rs"]
mod experts;
#[path = "train/routing.rs"]
mod routing;

/// The Mixtral's default layouts: one rank, dp, ZeRO and tp (it refuses sequence
/// parallelism), then `ddp-epK` (DDP over every rank, expert parallelism K) for K = 2 and 4
/// where the ranks split by K.
const MIXTRAL_LAYOUTS: &[&str] = &["single", "ddp", "zero1", "zero2", "zero3", "tp"];
const EP_DEGREES: &[usize] = &[2, 4];

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: RunArgs,
    /// Comma-separated layouts to run (default: all of them, in the order above).
    #[arg(long, value_delimiter = ',')]
    layouts: Vec<String>,
    /// Micro-batches per step of the pipeline layouts.
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
    /// Cut the pipelines' stages evenly by piece count (default: balanced by the pieces'
    /// FLOPs, `ModelSpec::piece_costs`, as the `train` program does).
    #[arg(long)]
    even_split: bool,
    /// DDP's and ZeRO's gradient bucket size in MiB.
    #[arg(long, default_value_t = 4.0)]
    bucket_mb: f64,
    /// `threads` (ranks as threads of this process) or `env` (this process is one rank of a
    /// job `mpirun` started; `cargo xtask bench train --backend mpi` does that).
    #[arg(long, default_value = "threads")]
    launcher: String,
    /// Where the Chrome traces go (default: `bench-train` in the workspace's target dir).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// The model: `gpt` (vocab 4096, d 256, 8 heads, 4 layers, seq 128, d_ff 1024), `llama`
    /// (vocab 4096, hidden 256, 8 heads, 4 kv heads, 4 layers, intermediate 688, seq 128) or
    /// `mixtral` (the Llama's body, 8 experts of width 344 per layer, top 2, α = 0.02).
    #[arg(long, default_value = "gpt")]
    model: String,
    /// The optimizer: `sgd` (lr 0.01) or `adamw` (lr 1e-3, β 0.9/0.95, ε 1e-6, weight decay
    /// 0.1). Default: `adamw` for the Llama (the bench Llama), `sgd` otherwise.
    #[arg(long)]
    optimizer: Option<String>,
    /// Compute precision: `f32` (default) or `bf16` / `f16` (f32 masters and optimizer state,
    /// gradients reduced in f32). PyTorch's side stays f32.
    #[arg(long, default_value = "f32", value_name = "f32|bf16|f16")]
    precision: String,
    /// The model's head and loss as one node by blocks of ROWS positions
    /// (`with_fused_loss`, a pipeline's last stage included; the unfused head where the
    /// layout shards it). PyTorch's side stays unfused.
    #[arg(long, value_name = "ROWS")]
    fused_loss: Option<usize>,
    /// Ignored (passed by `cargo bench`).
    #[arg(long, hide = true)]
    bench: bool,
}

/// A layout's mesh and options, and its rank count (see [`layouts::layout`]).
fn layout(name: &str, args: &Args) -> Result<(ParallelDims, usize), String> {
    let precision = bonfire_layout::MixedPrecision::parse(&args.precision)
        .ok_or_else(|| format!("--precision {}: expected f32, bf16 or f16", args.precision))?;
    let (mut dims, ranks) = layouts::layout(name, args.run.ranks, args.microbatches)?;
    if dims.pp() > 1 && !args.even_split {
        dims = dims.with_piece_costs(model_spec(&args.model)?.piece_costs());
    }
    Ok((dims.with_precision(precision), ranks))
}

/// The bench model `name`'s planner description (its pipeline pieces' costs).
fn model_spec(name: &str) -> Result<bonfire_plan::ModelSpec, String> {
    Ok(match name {
        "gpt" => GptConfig::bench().spec(),
        "llama" => LlamaConfig::bench().spec(),
        "mixtral" => MixtralConfig::bench().spec(),
        other => return Err(format!("--model {other}: expected gpt, llama or mixtral")),
    })
}

/// One layout's measurement.
struct Measured {
    step_ms: f64,
    tokens_per_s: f64,
    /// The fastest timed step ([`throughput::Steps::fastest`]), ms, and its tokens per second.
    best_step_ms: f64,
    best_tokens_per_s: f64,
    /// Every step's timings of this process's ranks (DDP, ZeRO-2), warm-up excluded.
    timings: Vec<StepTiming>,
    /// Under ep: a rank's all-to-all bytes, time (ms) and calls per step
    /// ([`experts::summary`]).
    a2a: Option<[f64; 3]>,
    /// Where the slowest rank's step went ([`throughput::Steps::split`]).
    split: [f64; 5],
}

fn measure<M: ParallelModel<Batch = TokenBatch> + Sync>(
    name: &str,
    model: &M,
    data: &Batches,
    args: &Args,
    world: Option<&World>,
    probed: Option<&experts::Probed>,
) -> Result<Measured, String> {
    let (dims, ranks) = layout(name, args)?;
    let steps = args.run.schedule();
    let bucket_bytes = (args.bucket_mb * (1 << 20) as f64) as usize;
    let adamw = optimizer(args)? == "adamw";
    let trainer = Trainer::new(dims.clone(), move || match adamw {
        // Burn's AdamW arithmetic, one pass per tensor on Flex (its state is Burn's).
        true => FusedAdamWConfig::new()
            .with_beta_1(0.9)
            .with_beta_2(0.95)
            .with_epsilon(1e-6)
            .with_weight_decay(0.1)
            .init(),
        // Burn's SGD arithmetic, one in-place pass per tensor on Flex.
        false => FusedSgdConfig::new().init(),
    })
    .with_ddp(
        DdpConfig::new()
            .with_bucket_mb(args.bucket_mb)
            .with_record_timings(true),
    )
    .with_zero(
        ZeroConfig::new(dims.zero)
            .with_bucket_bytes(bucket_bytes)
            .with_record_timings(true),
    );
    let rows_per_step = if ranks == 1 {
        args.run.batch
    } else {
        args.run.batch * ranks
    };
    let rows = |_: usize, s: usize, d: &Device| data.rows(s, 0, rows_per_step, d);
    let hosts = match world {
        None => Hosts::Threads { ranks },
        Some(w) if w.size() == ranks => Hosts::Group(w.group().clone()),
        Some(w) => {
            return Err(format!(
                "layout {name} needs {ranks} rank(s) but this job has {}",
                w.size()
            ));
        }
    };
    let failed = |e: bonfire_train::TrainError| format!("layout {name}: {e}");
    let (mut per_rank, mut a2a) = match (dims.ep(), probed) {
        (1, _) => (
            throughput::train_at(model, &trainer, hosts, steps, &rows, lr(args)?)
                .map_err(failed)?,
            Vec::new(),
        ),
        (_, Some(p)) => experts::train(p, &trainer, hosts, steps, &rows)
            .map_err(failed)?
            .into_iter()
            .unzip(),
        (_, None) => return Err(format!("layout {name}: ep needs --model mixtral")),
    };
    if let Some(w) = world {
        // The slowest rank of each step, across processes.
        for run in &mut per_rank {
            w.group()
                .all_reduce(&mut run.step_ms, ReduceOp::Max)
                .map_err(|e| e.to_string())?;
        }
        for steps in &mut a2a {
            experts::largest_across(w.group(), steps).map_err(|e| e.to_string())?;
        }
    }
    let step_ms = steps.slowest(&per_rank);
    let best_step_ms = steps.fastest(&per_rank);
    let split = steps.split(&per_rank);
    let tokens = (rows_per_step * data.seq) as f64;
    // Steps the dp wrapper timed (the pipeline's engine times none).
    let timings = per_rank
        .into_iter()
        .flat_map(|r: RankRun| r.report.timings.into_iter().skip(args.run.warmup))
        .filter(|t| t.backward.duration_us() > 0.0)
        .collect();
    Ok(Measured {
        step_ms,
        tokens_per_s: tokens / (step_ms / 1e3),
        best_step_ms,
        best_tokens_per_s: tokens / (best_step_ms / 1e3),
        timings,
        a2a: (!a2a.is_empty()).then(|| experts::summary(&a2a, steps)),
        split,
    })
}

/// The optimizer `args` name (`--optimizer`, else the model's default).
fn optimizer(args: &Args) -> Result<&str, String> {
    match (args.optimizer.as_deref(), args.model.as_str()) {
        (Some(o @ ("sgd" | "adamw")), _) => Ok(o),
        (Some(other), _) => Err(format!("--optimizer {other}: expected `sgd` or `adamw`")),
        (None, "llama") => Ok("adamw"),
        (None, _) => Ok("sgd"),
    }
}

/// The learning rate of `args`' optimizer: 0.01 for SGD, 1e-3 for AdamW.
fn lr(args: &Args) -> Result<f64, String> {
    Ok(match optimizer(args)? {
        "adamw" => 1e-3,
        _ => 0.01,
    })
}

/// The mean hidden fraction of the steps whose gradient buckets took time on the
/// communication thread (DDP, ZeRO-2 on more than one rank); `None` where none did.
fn hidden(timings: &[StepTiming]) -> Option<f64> {
    let comm = |t: &&StepTiming| t.buckets.iter().any(|b| b.duration_us() > 0.0);
    let reducing: Vec<&StepTiming> = timings.iter().filter(comm).collect();
    (!reducing.is_empty())
        .then(|| reducing.iter().map(|t| t.hidden_fraction()).sum::<f64>() / reducing.len() as f64)
}

/// The medians of the forward, backward and after-backward wait spans (ms) the wrapper
/// recorded.
fn phases(timings: &[StepTiming]) -> Option<[f64; 3]> {
    let ms = |f: fn(&StepTiming) -> f64| median(timings.iter().map(f).collect()) / 1e3;
    (!timings.is_empty()).then(|| {
        [
            ms(|t| t.forward.duration_us()),
            ms(|t| t.backward.duration_us()),
            ms(|t| t.wait.duration_us()),
        ]
    })
}

fn out_dir(args: &Args) -> PathBuf {
    // `cargo bench` runs in the package directory: default to the workspace's target dir.
    args.out_dir.clone().unwrap_or_else(|| {
        std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
            .join("bench-train")
    })
}

fn main() -> Result<(), String> {
    // As `train` runs (`bonfire_kernels::keep_freed_memory`).
    bonfire_kernels::keep_freed_memory();
    let args = Args::parse();
    let world = match args.launcher.as_str() {
        "threads" => None,
        "env" => Some(World::from_env().map_err(|e| e.to_string())?),
        other => return Err(format!("--launcher {other}: expected `threads` or `env`")),
    };
    let names: Vec<String> = if !args.layouts.is_empty() {
        args.layouts.clone()
    } else if args.model == "mixtral" {
        let ep = EP_DEGREES.iter().filter(|&&k| args.run.ranks % k == 0);
        let ep = ep.map(|k| format!("ddp-ep{k}"));
        MIXTRAL_LAYOUTS
            .iter()
            .map(|s| s.to_string())
            .chain(ep)
            .collect()
    } else {
        layouts::LAYOUTS.iter().map(|s| s.to_string()).collect()
    };
    for name in &names {
        layout(name, &args)?;
    }
    match args.model.as_str() {
        "gpt" => {
            let cfg = GptConfig::bench();
            let model = Gpt::new(&cfg, &default_device()).with_fused_loss(args.fused_loss);
            let what = format!(
                "GPT bench size: {} parameters, fused loss {:?}",
                cfg.num_params(),
                args.fused_loss
            );
            let data = args.run.batches(cfg.vocab_size, cfg.max_seq_len);
            run_all(&model, &data, &what, &names, &args, world.as_ref(), None)
        }
        "llama" => {
            let cfg = LlamaConfig::bench();
            let model = Llama::new(&cfg, &default_device()).with_fused_loss(args.fused_loss);
            let what = format!(
                "Llama bench size: {} parameters, fused loss {:?}",
                cfg.num_params(),
                args.fused_loss
            );
            let data = args
                .run
                .batches(cfg.vocab_size, cfg.max_position_embeddings);
            run_all(&model, &data, &what, &names, &args, world.as_ref(), None)
        }
        "mixtral" => {
            let cfg = MixtralConfig::bench();
            let model = Mixtral::new(&cfg, &default_device()).with_fused_loss(args.fused_loss);
            let b = &cfg.base;
            let what = format!(
                "Mixtral bench size: {} parameters, {} experts of width {} per layer, top {}",
                cfg.num_params(),
                cfg.num_local_experts,
                b.intermediate_size,
                cfg.num_experts_per_tok
            );
            let data = args.run.batches(b.vocab_size, b.max_position_embeddings);
            let probed = experts::Probed::new(model.clone());
            let world = world.as_ref();
            run_all(&model, &data, &what, &names, &args, world, Some(&probed))?;
            if world.is_none_or(|w| w.rank() == 0) {
                let rows = args.run.batch * args.run.ranks;
                let steps = args.run.schedule();
                let replayed = routing::replay(&model, &data, rows, steps.total());
                routing::summary(&replayed, steps.warmup);
                // One line per (dp, ep): the replay's routing is the same for every wrapper.
                let mut seen = Vec::new();
                for name in &names {
                    let dims = layout(name, &args)?.0;
                    if dims.ep() > 1 && !seen.contains(&(dims.dp(), dims.ep())) {
                        seen.push((dims.dp(), dims.ep()));
                        routing::ep_summary(&replayed, steps.warmup, name, dims.dp(), dims.ep());
                    }
                }
            }
            Ok(())
        }
        other => Err(format!(
            "--model {other}: expected `gpt`, `llama` or `mixtral`"
        )),
    }
}

/// Measures every layout of `names` on `model` and prints its line.
fn run_all<M: ParallelModel<Batch = TokenBatch> + Sync>(
    model: &M,
    data: &Batches,
    what: &str,
    names: &[String],
    args: &Args,
    world: Option<&World>,
    probed: Option<&experts::Probed>,
) -> Result<(), String> {
    let backend = if world.is_some() { "mpi" } else { "threads" };
    let lead = world.is_none_or(|w| w.rank() == 0);
    if lead {
        eprintln!(
            "{what}, batch {} x {} tokens per rank, {} rank(s), {backend}, \
             {} warm-up + {} timed steps",
            args.run.batch, data.seq, args.run.ranks, args.run.warmup, args.run.steps
        );
    }
    let mut single_ms = None;
    let mut ddp_ms = None;
    for name in names {
        let m = measure(name, model, data, args, world, probed)?;
        let (dims, ranks) = layout(name, args)?;
        let model_name = &args.model;
        let mut line = format!(
            "bench train model={model_name} layout={name} ranks={ranks} step_ms={:.1} tokens_per_s={:.0} best_step_ms={:.1} best_tokens_per_s={:.0} backend={backend} optimizer={} precision={}",
            m.step_ms,
            m.tokens_per_s,
            m.best_step_ms,
            m.best_tokens_per_s,
            optimizer(args)?,
            args.precision
        );
        let steps = [m.step_ms, m.best_step_ms];
        let ratios = |to: [f64; 2], name: &str| {
            format!(
                " ratio_vs_{name}={:.2} best_ratio_vs_{name}={:.2}",
                steps[0] / to[0],
                steps[1] / to[1]
            )
        };
        match name.as_str() {
            "single" => single_ms = Some(steps),
            "ddp" => {
                ddp_ms = Some(steps);
                if let Some(s) = single_ms {
                    line += &ratios(s, "single");
                }
            }
            _ => {
                if let Some(d) = ddp_ms {
                    line += &ratios(d, "ddp");
                }
            }
        }
        if let Some([bytes, ms, calls]) = m.a2a {
            line += &format!(
                " ep={} a2a_bytes={bytes:.0} a2a_ms={ms:.1} a2a_calls={calls:.0} a2a_share={:.2}",
                dims.ep(),
                ms / m.step_ms
            );
        }
        if let Some([fwd, bwd, wait]) = phases(&m.timings) {
            line += &format!(" fwd_ms={fwd:.1} bwd_ms={bwd:.1} wait_ms={wait:.1}");
        }
        if let Some(h) = hidden(&m.timings) {
            line += &format!(" hidden={h:.2}");
            if lead {
                let dir = out_dir(args);
                std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
                let path = dir.join(format!("trace-{model_name}-{name}-{backend}.json"));
                std::fs::write(&path, chrome_trace(&m.timings)).map_err(|e| e.to_string())?;
                eprintln!("trace: {}", path.display());
            }
        }
        if lead {
            println!("{line}");
            let [compute, comm, p2p, optimizer, other] = m.split;
            println!(
                "bench profile split model={model_name} layout={name} ranks={} \
                 compute_ms={compute:.1} comm_ms={comm:.1} p2p_ms={p2p:.1} \
                 optimizer_ms={optimizer:.1} other_ms={other:.1} step_ms={:.1}",
                dims.world_size(),
                m.step_ms
            );
        }
    }
    Ok(())
}
