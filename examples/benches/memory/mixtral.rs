//! `bench memory --model mixtral`: the bench Mixtral's (`MixtralConfig::bench`: the Llama
//! bench's body, 8 experts of width 344 per layer, top 2) bytes per rank from the counting
//! allocator, with no expert parallelism (ep = 1: every rank holds every expert, ZeRO-3
//! shards them with the rest).
//!
//! `bench memory model=mixtral layout=… ranks=N rank=R experts_held=… expert_bytes=…
//! params_bytes=… expert_fraction=… held_bytes=… steady_peak_bytes=… step_ms=…`, one line per rank:
//! - `expert_bytes`: what the allocator charged the rank's thread for the model's experts
//!   (every layer's `gate_up_proj` `[E, 2F, d]` and `down_proj` `[E, d, F]`, made on the
//!   rank's thread and dropped again before the build) — the experts a rank holds at ep = 1
//!   where they are replicated (dp, ZeRO-1/2, tp);
//! - `experts_held`: `whole` where the rank holds every expert (`expert_fraction` =
//!   expert_bytes / params_bytes is then the experts' share of its parameters), `sharded`
//!   under ZeRO-3 (the rank holds 1/dp of them; its `params_bytes`, as the GPT's ZeRO-3 rows,
//!   still include what the build leaves live until the first step);
//! - `params_bytes`: live after `Trainer::build` (the parameters as the layout holds them),
//!   over the rank's baseline, as the GPT rows;
//! - `held_bytes`: live after the last forward+backward (parameters, gradients, AdamW state);
//!   `steady_peak_bytes`: the most live over the steps after the first.

use bonfire_comm::testing::rank_alloc;
use bonfire_examples::default_device;
use bonfire_examples::planner::warm_matmul_workspace;
use bonfire_models::mixtral::moe::Experts;
use bonfire_models::mixtral::{Mixtral, MixtralConfig};
use bonfire_train::{DataSource, Launcher, OptimizerKind, TrainError, Trainer};
use bonfire_zero::ZeroStage;
use burn::tensor::Device;
use std::time::Instant;

/// Sequences per step (global batch) and tokens per sequence: the GPT rows'.
const ROWS: usize = super::ROWS;
const SEQ: usize = super::SEQ;

/// One rank's bytes over its baseline.
#[derive(Debug, Default, Clone, Copy)]
struct Bytes {
    experts: usize,
    params: usize,
    held: usize,
    steady_peak: usize,
    step_ms: f64,
}

/// The experts of every layer of `cfg` made on this thread: the bytes the allocator charged
/// rank `r` for them while they were live.
fn expert_bytes(cfg: &MixtralConfig, r: usize, device: &Device) -> usize {
    let b = &cfg.base;
    let before = rank_alloc::live(r);
    let experts: Vec<Experts> = (0..b.num_hidden_layers)
        .map(|_| {
            Experts::new(
                cfg.num_local_experts,
                b.hidden_size,
                b.intermediate_size,
                device,
            )
        })
        .collect();
    let bytes = rank_alloc::live(r) - before;
    drop(experts);
    bytes
}

/// Every rank's bytes of `model` trained `steps` AdamW steps under `case`, charged to
/// allocator ranks `first..`.
fn measure(
    case: &super::Case,
    cfg: &MixtralConfig,
    model: &Mixtral,
    steps: usize,
    first: usize,
) -> Vec<Bytes> {
    let trainer = Trainer::new(case.dims.clone(), || OptimizerKind::AdamW.build());
    let vocab = cfg.base.vocab_size;
    let batch =
        |step, device: &Device| bonfire_models::data::pattern_batch(vocab, ROWS, SEQ, step, device);
    Launcher::Threads {
        ranks: case.dims.world_size(),
    }
    .run("bench-memory-mixtral", |pg| {
        let r = first + pg.rank();
        let _rank = rank_alloc::enter_rank(r);
        warm_matmul_workspace();
        let device = default_device();
        let mut m = Bytes {
            experts: expert_bytes(cfg, r, &device),
            ..Bytes::default()
        };
        let b0 = batch(0, &device);
        let base = rank_alloc::live(r);
        let mut engine = trainer.build(model.clone(), &pg, &b0)?;
        drop(b0);
        m.params = rank_alloc::live(r) - base;
        let start = Instant::now();
        for step in 0..steps {
            let b = batch.replica_batch(step, engine.replica(), engine.device());
            rank_alloc::reset_peak(r);
            engine.forward_backward(&b)?;
            drop(b);
            m.held = rank_alloc::live(r) - base;
            engine.step(super::LR)?;
            if step > 0 {
                m.steady_peak = m.steady_peak.max(rank_alloc::peak(r) - base);
            }
        }
        m.step_ms = start.elapsed().as_secs_f64() * 1e3 / steps as f64;
        Ok::<Bytes, TrainError>(m)
    })
    .expect("bench run")
    .into_iter()
    .map(|r| r.expect("bench rank"))
    .collect()
}

/// The layouts of the Mixtral rows: DDP, ZeRO 1–3 and TP 2 (f32). No one-rank row: a
/// one-rank engine trains the caller's parameters in place, so the rank is charged none.
fn cases() -> Vec<super::Case> {
    let mut out = vec![super::case("ddp", "dp=2", |_| {})];
    for z in 1..=3 {
        out.push(super::case(&format!("zero{z}"), "dp=2", |a| a.zero = z));
    }
    out.push(super::case("tp2", "tp=2", |_| {}));
    out
}

/// `--model mixtral`: every layout's lines (see the file's docs).
pub fn rows(steps: usize, only: &[String]) {
    let cfg = MixtralConfig::bench();
    let b = &cfg.base;
    let model = Mixtral::new(&cfg, &default_device());
    let expert_params =
        b.num_hidden_layers * cfg.num_local_experts * 3 * b.hidden_size * b.intermediate_size;
    println!(
        "bench memory model=mixtral vocab={} hidden={} heads={} kv_heads={} layers={} \
         experts={} top_k={} expert_width={} params={} expert_params={expert_params} ep=1 \
         rows={ROWS} tokens_per_row={SEQ} optimizer=adamw steps={steps} backend=flex \
         machine=cpu-threads",
        b.vocab_size,
        b.hidden_size,
        b.num_attention_heads,
        b.num_key_value_heads,
        b.num_hidden_layers,
        cfg.num_local_experts,
        cfg.num_experts_per_tok,
        b.intermediate_size,
        cfg.num_params()
    );
    let mut first = 0;
    for case in cases() {
        if !only.is_empty() && !only.iter().any(|o| case.name.contains(o.as_str())) {
            continue;
        }
        let ranks = case.dims.world_size();
        let held = match case.dims.zero {
            ZeroStage::Zero3 => "sharded",
            _ => "whole",
        };
        for (rank, m) in measure(&case, &cfg, &model, steps, first)
            .iter()
            .enumerate()
        {
            println!(
                "bench memory model=mixtral layout={} ranks={ranks} rank={rank} precision=f32 \
                 experts_held={held} expert_bytes={} params_bytes={} expert_fraction={:.4} \
                 held_bytes={} \
                 steady_peak_bytes={} step_ms={:.0}",
                case.name,
                m.experts,
                m.params,
                m.experts as f64 / m.params as f64,
                m.held,
                m.steady_peak,
                m.step_ms
            );
        }
        first += ranks;
    }
}
