//! `bench memory --model mixtral`: the bench Mixtral's (`MixtralConfig::bench`: the Llama
//! bench's body, 8 experts of width 344 per layer, top 2) bytes per rank from the counting
//! allocator: at ep = 1 (every rank holds every expert, ZeRO-3 shards them with the rest) and
//! under expert parallelism with DDP (dp = 2 at ep = 2; dp = 4 at ep = 1, 2 and 4: a rank
//! keeps E/ep experts).
//!
//! `bench memory model=mixtral layout=… ranks=N ep=P rank=R experts_held=… expert_bytes=…
//! params_bytes=… expert_fraction=… held_bytes=… steady_peak_bytes=… step_ms=…`, one line per rank:
//! - `expert_bytes`: what the allocator charged the rank's thread for the model's experts
//!   (every layer's `gate_up_proj` `[E, 2F, d]` and `down_proj` `[E, d, F]`, made on the
//!   rank's thread and dropped again before the build) — the experts a rank holds at ep = 1
//!   where they are replicated (dp, ZeRO-1/2, tp);
//! - `experts_held`: `whole` where the rank holds every expert (`expert_fraction` =
//!   expert_bytes / params_bytes is then the experts' share of its parameters), `sharded`
//!   under ZeRO-3 (the rank holds 1/dp of them; its `params_bytes`, as the GPT's ZeRO-3 rows,
//!   still include what the build leaves live until the first step), `1/ep` under expert
//!   parallelism;
//! - `params_bytes`: live after `Trainer::build` (the parameters as the layout holds them),
//!   over the rank's baseline, as the GPT rows;
//! - `held_bytes`: live after the last forward+backward (parameters, gradients, AdamW state);
//!   `steady_peak_bytes`: the most live over the steps after the first.
//!
//! Then one `ep_summary` line per rank of each ep > 1 layout whose ep = 1 layout (DDP, same
//! dp) also ran, from the held bytes (steady state: the `params_bytes` of a layout whose ep
//! group is all of dp still hold what the build made until the first step replaces it):
//! `expert_state_bytes_ep1` = 4 × the ep = 1 run's `expert_bytes` (the experts' values,
//! gradients and AdamW moments: DDP holds 16 bytes per parameter), `held_expert_state_bytes`
//! = its `held_bytes` − the ep = 1 run's dense part (its `held_bytes` −
//! expert_state_bytes_ep1), `ratio` = their quotient, `expected` = 1/ep; `held_ratio` = its
//! `held_bytes` / the ep = 1 run's.

use crate::common::measure::warm_matmul_workspace;
use bonfire_comm::testing::rank_alloc;
use bonfire_examples::default_device;
use bonfire_layout::ZeroStage;
use bonfire_models::mixtral::moe::Experts;
use bonfire_models::mixtral::{Mixtral, MixtralConfig};
use bonfire_parallel::DataSource;
use bonfire_train::{Launcher, OptimizerKind, TrainError, Trainer};
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

/// The layouts of the Mixtral rows: DDP, ZeRO 1–3 and TP 2 (f32), then DDP with expert
/// parallelism: dp = 2 at ep = 2, dp = 4 at ep = 1, 2, 4. No one-rank row: a one-rank engine
/// trains the caller's parameters in place, so the rank is charged none.
fn cases() -> Vec<super::Case> {
    let mut out = vec![super::case("ddp", "dp=2", |_| {})];
    for z in 1..=3 {
        out.push(super::case(&format!("zero{z}"), "dp=2", |a| a.zero = z));
    }
    out.push(super::case("tp2", "tp=2", |_| {}));
    out.push(super::case("ddp-ep2", "dp=2,ep=2", |_| {}));
    out.push(super::case("ddp4", "dp=4", |_| {}));
    for ep in [2, 4] {
        out.push(super::case(
            &format!("ddp4-ep{ep}"),
            &format!("dp=4,ep={ep}"),
            |_| {},
        ));
    }
    out
}

/// The model's header line.
fn header(cfg: &MixtralConfig, steps: usize) {
    let b = &cfg.base;
    let expert_params =
        b.num_hidden_layers * cfg.num_local_experts * 3 * b.hidden_size * b.intermediate_size;
    println!(
        "bench memory model=mixtral vocab={} hidden={} heads={} kv_heads={} layers={} \
         experts={} top_k={} expert_width={} params={} expert_params={expert_params} \
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
}

/// One layout's rows, one per rank.
fn print_rows(case: &super::Case, ranks: &[Bytes]) {
    let (dims, ep) = (&case.dims, case.dims.ep());
    let held = match (dims.zero, ep) {
        (_, 2..) => "1/ep",
        (ZeroStage::Zero3, _) => "sharded",
        _ => "whole",
    };
    for (rank, m) in ranks.iter().enumerate() {
        println!(
            "bench memory model=mixtral layout={} ranks={} ep={ep} rank={rank} precision=f32 \
             experts_held={held} expert_bytes={} params_bytes={} expert_fraction={:.4} \
             held_bytes={} steady_peak_bytes={} step_ms={:.0}",
            case.name,
            dims.world_size(),
            m.experts,
            m.params,
            m.experts as f64 / m.params as f64,
            m.held,
            m.steady_peak,
            m.step_ms
        );
    }
}

/// The `ep_summary` lines of every ep > 1 layout whose ep = 1 layout (DDP, same dp) ran.
fn ep_summary(measured: &[(&super::Case, Vec<Bytes>)]) {
    let plain = |dp: usize| {
        measured.iter().find(|(c, _)| {
            c.dims.ep() == 1
                && c.dims.dp() == dp
                && c.dims.tp() == 1
                && c.dims.zero == ZeroStage::Zero0
        })
    };
    for (case, ranks) in measured.iter().filter(|(c, _)| c.dims.ep() > 1) {
        let (dp, ep) = (case.dims.dp(), case.dims.ep());
        let Some((_, base)) = plain(dp) else {
            println!(
                "bench memory model=mixtral ep_summary layout={} skipped=\"no ep=1 run at dp={dp}\"",
                case.name
            );
            continue;
        };
        for (rank, (m, b)) in ranks.iter().zip(base).enumerate() {
            // At ep = 1 the rank holds 16 bytes per parameter: the experts' values, gradients
            // and AdamW moments are 4 × expert_bytes, the rest is dense.
            let experts_ep1 = 4.0 * b.experts as f64;
            let dense = b.held as f64 - experts_ep1;
            let held_experts = m.held as f64 - dense;
            println!(
                "bench memory model=mixtral ep_summary layout={} dp={dp} ep={ep} rank={rank} \
                 expert_state_bytes_ep1={experts_ep1:.0} held_expert_state_bytes={held_experts:.0} \
                 ratio={:.4} expected={:.4} held_bytes={} held_bytes_ep1={} held_ratio={:.4} \
                 params_bytes={} params_bytes_ep1={}",
                case.name,
                held_experts / experts_ep1,
                1.0 / ep as f64,
                m.held,
                b.held,
                m.held as f64 / b.held as f64,
                m.params,
                b.params,
            );
        }
    }
}

/// `--model mixtral`: every layout's lines (see the file's docs).
pub fn rows(steps: usize, only: &[String]) {
    let cfg = MixtralConfig::bench();
    let model = Mixtral::new(&cfg, &default_device());
    header(&cfg, steps);
    let cases = cases();
    let mut measured = Vec::new();
    let mut first = 0;
    for case in &cases {
        if !only.is_empty() && !only.iter().any(|o| case.name.contains(o.as_str())) {
            continue;
        }
        let ranks = measure(case, &cfg, &model, steps, first);
        print_rows(case, &ranks);
        first += case.dims.world_size();
        measured.push((case, ranks));
    }
    ep_summary(&measured);
}
