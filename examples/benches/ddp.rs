//! `cargo xtask bench ddp`: one GPT training step ("bench" size) on 2 rank threads, every
//! case through the trainer's one loop.
//!
//! Prints `bench ddp ranks=2 single_ms=… ddp_ms=… ddp_no_overlap_ms=… ratio=… hidden=…`:
//! (a) one rank alone with the per-rank batch, (b) DDP with bucket all-reduces overlapped
//! with backward, (c) DDP reducing after backward; ratio = (b)/(a); hidden = the fraction of
//! all-reduce time that ran while backward was still computing in (b). Writes a Chrome trace
//! (Perfetto-readable) per DDP run under `target/bench-ddp/`.
//!
//! Two extra fields follow: `contended_ms`, the same per-rank step run by `ranks` threads at
//! once with no communication at all, and `ratio_vs_contended` = (b) / that. On a machine
//! with fewer cores than ranks × Burn's worker threads, (a) has the cores to itself while the
//! DDP ranks share them, so (b)/(a) measures core sharing as much as communication;
//! (b)/contended isolates what DDP adds.

mod common;
use bonfire_ddp::DdpConfig;
use bonfire_dtensor::timing::{StepTiming, chrome_trace};
use bonfire_examples::default_device;
use bonfire_layout::{Axis, ParallelDims};
use bonfire_models::data::Batches;
use bonfire_models::{Gpt, GptConfig};
use bonfire_train::Trainer;
use burn::optim::SgdConfig;
use burn::tensor::Device;
use clap::Parser;
use common::throughput::{self, Hosts, RankRun, RunArgs};
use std::path::PathBuf;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    run: RunArgs,
    /// DDP bucket size in MiB (the model has ~21 MiB of gradients).
    #[arg(long, default_value_t = 4.0)]
    bucket_mb: f64,
    /// Where the Chrome traces go (default: `bench-ddp` in the workspace's target dir).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Ignored (passed by `cargo bench`).
    #[arg(long, hide = true)]
    bench: bool,
}

/// Trains `dims` with `ddp` on `hosts` through the trainer's loop (SGD).
fn run(
    model: &Gpt,
    dims: ParallelDims,
    hosts: Hosts,
    ddp: DdpConfig,
    args: &Args,
    rows: throughput::Rows<'_>,
) -> Vec<RankRun> {
    let trainer = Trainer::new(dims, || SgdConfig::new().init()).with_ddp(ddp);
    throughput::train(model, &trainer, hosts, args.run.schedule(), rows).expect("bench run")
}

/// (a): one rank alone, the per-rank batch.
fn single(model: &Gpt, data: &Batches, args: &Args) -> f64 {
    let rows = |_: usize, s: usize, d: &Device| data.rows(s, 0, args.run.batch, d);
    let hosts = Hosts::Threads { ranks: 1 };
    let runs = run(
        model,
        ParallelDims::new(),
        hosts,
        DdpConfig::new(),
        args,
        &rows,
    );
    args.run.schedule().slowest(&runs)
}

/// (a′): every rank runs the same one-rank steps on its rows at the same time, with no
/// communication; the median step time of the slowest rank.
fn contended(model: &Gpt, data: &Batches, args: &Args) -> f64 {
    let rows = |r: usize, s: usize, d: &Device| data.rows(s, r * args.run.batch, args.run.batch, d);
    let hosts = Hosts::Alone {
        copies: args.run.ranks,
    };
    let runs = run(
        model,
        ParallelDims::new(),
        hosts,
        DdpConfig::new(),
        args,
        &rows,
    );
    args.run.schedule().slowest(&runs)
}

/// (b)/(c): DDP; returns the median step time (slowest rank) and every step's timings.
fn ddp(model: &Gpt, data: &Batches, args: &Args, overlap: bool) -> (f64, Vec<StepTiming>) {
    let config = DdpConfig::new()
        .with_bucket_mb(args.bucket_mb)
        .with_overlap(overlap)
        .with_record_timings(true);
    let dims = ParallelDims::new().with_degree(Axis::Dp, args.run.ranks);
    let rows = |_: usize, s: usize, d: &Device| data.rows(s, 0, args.run.ranks * args.run.batch, d);
    let hosts = Hosts::Threads {
        ranks: args.run.ranks,
    };
    let per_rank = run(model, dims, hosts, config, args, &rows);
    let step_ms = args.run.schedule().slowest(&per_rank);
    let timings = per_rank
        .into_iter()
        .flat_map(|r| r.report.timings.into_iter().skip(args.run.warmup))
        .collect();
    (step_ms, timings)
}

fn main() {
    let args = Args::parse();
    let cfg = GptConfig::bench();
    let device = default_device();
    let model = Gpt::new(&cfg, &device);
    let data = args.run.batches(cfg.vocab_size, cfg.max_seq_len);
    eprintln!(
        "GPT bench size: {} parameters ({:.1} MiB of f32 gradients), batch {} x {} tokens per rank, buckets {} MiB",
        cfg.num_params(),
        cfg.num_params() as f64 * 4.0 / (1 << 20) as f64,
        args.run.batch,
        cfg.max_seq_len,
        args.bucket_mb
    );
    let single_ms = single(&model, &data, &args);
    let contended_ms = contended(&model, &data, &args);
    let (ddp_ms, overlap_timings) = ddp(&model, &data, &args, true);
    let (no_overlap_ms, plain_timings) = ddp(&model, &data, &args, false);
    let hidden = overlap_timings
        .iter()
        .map(StepTiming::hidden_fraction)
        .sum::<f64>()
        / overlap_timings.len() as f64;
    // `cargo bench` runs in the package directory: default to the workspace's target dir.
    let out_dir = args.out_dir.clone().unwrap_or_else(|| {
        std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
            .join("bench-ddp")
    });
    std::fs::create_dir_all(&out_dir).expect("trace directory");
    for (name, t) in [
        ("overlap", &overlap_timings),
        ("no_overlap", &plain_timings),
    ] {
        let path = out_dir.join(format!("trace-{name}.json"));
        std::fs::write(&path, chrome_trace(t)).expect("write trace");
        eprintln!("trace: {}", path.display());
    }
    println!(
        "bench ddp ranks={} single_ms={single_ms:.1} ddp_ms={ddp_ms:.1} ddp_no_overlap_ms={no_overlap_ms:.1} ratio={:.2} hidden={hidden:.2} contended_ms={contended_ms:.1} ratio_vs_contended={:.2}",
        args.run.ranks,
        ddp_ms / single_ms,
        ddp_ms / contended_ms
    );
}
