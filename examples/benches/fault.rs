//! `cargo xtask bench fault`: what fault-tolerant training costs on the bench GPT (AdamW,
//! `batch` sequences per rank), per dp layout, on rank threads.
//!
//! For each layout one run trains `warmup + steps` steps with `--fault-tolerant` and kills the
//! last rank at the start of the step after them; the survivors finish `steps` more steps.
//! Prints one line per layout:
//! `bench fault layout=<ddp|zero1|zero2|zero3> ranks=N step_ms=… commit_ms=… overhead_pct=…
//! export_ms=… exchange_ms=… bytes_sent_per_commit=… bytes_held=… state_bytes=…
//! recovery_ms=… pooled_bytes=… survivor_step_ms=…` where
//! - `step_ms`: the median step (fit's own report: data, forward, backward, optimizer) before
//!   the failure; `commit_ms`: rank 0's last commit with a buddy (export to the host +
//!   exchange with the buddy: a step's steady state), both from the same run; `overhead_pct`
//!   their ratio;
//! - `bytes_sent_per_commit`: what rank 0 hands its buddy at that commit; `bytes_held`: its own
//!   copy plus its buddy's, held between steps; `state_bytes`: the whole training state
//!   (parameters + AdamW's two moments, f32) for scale;
//! - `recovery_ms`: from the failed collective's error to the refilled engine (shrink, rebuild,
//!   pool, reshard, first commit), `pooled_bytes` what rank 0 received to refill, and
//!   `survivor_step_ms` the median step after it.

use bonfire_comm::ThreadWorld;
use bonfire_examples::default_device;
use bonfire_layout::ParallelDims;
use bonfire_layout::ZeroStage;
use bonfire_models::data::Batches;
use bonfire_models::{Gpt, GptConfig};
use bonfire_train::fault::{FaultTolerance, KillAt};
use bonfire_train::{FitConfig, OptimizerKind, Trainer, fit_fault_tolerant};
use burn::tensor::Device;
use clap::Parser;
use std::time::Duration;

#[derive(Parser, Debug)]
struct Args {
    /// Data-parallel ranks (one is killed).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Sequences per rank (the global batch is `batch × ranks`).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Timed steps before the failure, and after it.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Comma-separated layouts (default: ddp, zero1, zero2, zero3).
    #[arg(long, value_delimiter = ',')]
    layouts: Vec<String>,
    // `cargo bench` passes `--bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let args = Args::parse();
    let layouts = if args.layouts.is_empty() {
        vec!["ddp".into(), "zero1".into(), "zero2".into(), "zero3".into()]
    } else {
        args.layouts.clone()
    };
    let cfg = GptConfig::bench();
    let device = default_device();
    device.seed(0);
    let model = Gpt::new(&cfg, &device);
    let n = args.ranks;
    let rows = args.batch * n;
    let before = args.warmup + args.steps;
    let total = before + args.steps;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
        ((state >> 33) % cfg.vocab_size as u64) as i64
    };
    let len = total * rows * cfg.max_seq_len;
    let ids: Vec<i64> = (0..len).map(|_| next()).collect();
    let targets: Vec<i64> = (0..len).map(|_| next()).collect();
    let batches = Batches::new(ids, targets, [total, rows, cfg.max_seq_len]);
    let params = cfg.num_params() as u64;
    for layout in layouts {
        let stage = match layout.as_str() {
            "ddp" => ZeroStage::Zero0,
            "zero1" => ZeroStage::Zero1,
            "zero2" => ZeroStage::Zero2,
            "zero3" => ZeroStage::Zero3,
            other => panic!("unknown layout {other} (ddp, zero1, zero2, zero3)"),
        };
        let dims = ParallelDims::parse_mesh(&format!("dp={n}"))
            .unwrap()
            .with_zero(stage);
        let trainer = Trainer::new(dims, || OptimizerKind::AdamW.build());
        let data = |s: usize, device: &Device| batches.rows(s, 0, rows, device);
        let config = FitConfig::new(total, 1e-3);
        let outcomes = ThreadWorld::new(n)
            .timeout(Duration::from_secs(600))
            .launch_each(|pg| {
                let options = FaultTolerance {
                    kill: Some(KillAt {
                        rank: n - 1,
                        step: before,
                    }),
                    ..Default::default()
                };
                fit_fault_tolerant(&trainer, &model, &pg, &data, &config, &mut (), &options)
                    .map(|run| (run.steps, run.recoveries, run.buddy))
                    .map_err(|e| e.to_string())
            });
        let (steps, recoveries, buddy) = match &outcomes[0] {
            Ok(Ok(r)) => r.clone(),
            Ok(Err(e)) => panic!("{layout}: {e}"),
            Err(f) => panic!("{layout}: rank 0 died: {}", f.message),
        };
        let ms = |range: std::ops::Range<usize>| {
            median(steps[range].iter().map(|s| s.report.step_ms).collect())
        };
        let step_ms = ms(args.warmup..before);
        let last = buddy.last;
        let (export_ms, exchange_ms) = (last.export_s * 1e3, last.exchange_s * 1e3);
        let commit_ms = export_ms + exchange_ms;
        let r = &recoveries[0];
        println!(
            "bench fault layout={layout} ranks={n} step_ms={step_ms:.1} commit_ms={commit_ms:.2} \
             overhead_pct={:.2} export_ms={export_ms:.2} exchange_ms={exchange_ms:.2} \
             bytes_sent_per_commit={} bytes_held={} state_bytes={} recovery_ms={:.1} \
             pooled_bytes={} survivor_step_ms={:.1}",
            100.0 * commit_ms / step_ms,
            last.bytes_sent,
            last.bytes_held,
            params * 4 * 3,
            r.seconds * 1e3,
            r.pooled_bytes,
            ms(before..total)
        );
    }
}
