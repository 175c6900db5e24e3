//! The planner (`bonfire_plan`) on Bonfire's models and on this machine — its layouts are the
//! trainer's own [`ParallelDims`], nothing to translate: the GPT, the Llama and the Mixtral
//! as a [`ModelSpec`] ([`gpt_spec`], [`llama_spec`], [`mixtral_spec`]) and this machine as a
//! [`ClusterSpec`] ([`this_machine`]): one node of CPU rank threads whose matrix-product rate, communication
//! bandwidth and latency, and memory bandwidth are measured on the spot ([`calibrate`]),
//! and whose memory per rank is a budget or `/proc/meminfo`'s available bytes over the ranks.
//! [`measure_layout`] (any model of token batches) and [`predict_ranks`] hold one layout's
//! measured bytes (on the counting allocator) and the planner's, per rank, for
//! `tests/planner.rs` and `tests/planner_heldout.rs` (the GPT's rows and the Mixtral's).

use bonfire_comm::testing::rank_alloc;
use bonfire_comm::{ReduceOp, ThreadWorld};
use bonfire_layout::{Axis, MixedPrecision, ParallelDims};
use bonfire_models::data::TokenBatch;
use bonfire_models::gpt::config::GptConfig;
use bonfire_models::llama::LlamaConfig;
use bonfire_models::mixtral::MixtralConfig;
use bonfire_parallel::{DataSource, ParallelModel};
use bonfire_plan::{
    Arch, Attention, ClusterSpec, DeviceSpec, LinkSpec, MemoryParts, ModelSpec, Moe, PlannedLayout,
    Request, rank_memory, rank_shapes,
};
use bonfire_train::{Launcher, OptimizerKind, TrainError, Trainer};
use burn::tensor::{Device, Tensor, TensorData};
use std::time::{Duration, Instant};

/// Bonfire's Llama as the planner sees it: grouped-query attention, SwiGLU, RMSNorm, no
/// biases — and attention as the GPT computes it ([`Attention::Fused`]: no scores kept in
/// f32, kept in 16-bit types and under ring attention).
pub fn llama_spec(cfg: &LlamaConfig) -> ModelSpec {
    ModelSpec {
        name: "llama".into(),
        arch: Arch::Llama,
        attention: Attention::Fused,
        vocab_size: cfg.vocab_size,
        d_model: cfg.hidden_size,
        n_heads: cfg.num_attention_heads,
        n_kv_heads: cfg.num_key_value_heads,
        n_layers: cfg.num_hidden_layers,
        seq_len: cfg.max_position_embeddings,
        d_ff: cfg.intermediate_size,
    }
}

/// Bonfire's Mixtral as the planner sees it: the Llama's body ([`llama_spec`]) with each
/// MLP a sparse mixture of `num_local_experts` SwiGLU experts of width `intermediate_size`,
/// `num_experts_per_tok` of them per token.
pub fn mixtral_spec(cfg: &MixtralConfig) -> ModelSpec {
    ModelSpec {
        name: "mixtral".into(),
        arch: Arch::Mixtral(Moe {
            experts: cfg.num_local_experts,
            top_k: cfg.num_experts_per_tok,
        }),
        ..llama_spec(&cfg.base)
    }
}

/// The GPT as the planner sees it (its position table has `max_seq_len` rows; its
/// attention [`Attention::Fused`]).
pub fn gpt_spec(cfg: &GptConfig) -> ModelSpec {
    ModelSpec {
        attention: Attention::Fused,
        ..ModelSpec::gpt(
            "gpt",
            cfg.vocab_size,
            cfg.d_model,
            cfg.n_heads,
            cfg.n_layers,
            cfg.max_seq_len,
            cfg.d_ff,
        )
    }
}

/// This machine, measured: per-rank matrix-product FLOP/s with `ranks` threads computing at
/// once, the rank threads' all-reduce bandwidth and latency, memory bandwidth, and the fixed
/// seconds of one tensor operation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    /// Matrix-product FLOP/s of one rank while every rank computes (the ranks' mean).
    pub flops: f64,
    /// All-reduce bandwidth of the rank threads, bytes/s per rank (β, from a 1 M-value
    /// all-reduce beside a 1-value one); the `shm` preset's with one rank.
    pub bandwidth: f64,
    /// Seconds per ring step of an all-reduce (α, from the 1-value one); the `shm`
    /// preset's with one rank.
    pub latency: f64,
    /// Memory bandwidth, bytes/s (a sum over 64 MiB).
    pub mem_bw: f64,
    /// Seconds one tensor operation costs however little it computes (one-value additions).
    pub launch: f64,
}

/// Measures this machine for `ranks` rank threads (about a second): `[rows, k] × [k, n]`
/// products on Burn's CPU backend on every rank at once, ring all-reduces of 1 value and of
/// 1 M values on a [`ThreadWorld`] (α from the small one, β from the difference), a sum
/// over 64 MiB, and additions of one-value tensors (the fixed cost of an operation).
pub fn calibrate(ranks: usize, rows: usize, k: usize, n: usize) -> Calibration {
    let flops = matmul_rate(ranks, rows, k, n);
    let (bandwidth, latency) = if ranks > 1 {
        link_rate(ranks)
    } else {
        let shm = LinkSpec::preset("shm").expect("preset");
        (shm.bandwidth, shm.latency)
    };
    Calibration {
        flops,
        bandwidth,
        latency,
        mem_bw: memory_rate(),
        launch: op_overhead(),
    }
}

fn op_overhead() -> f64 {
    let device = Device::flex();
    let mut t = Tensor::<1>::from_data(TensorData::new(vec![1.0f32], [1]), &device);
    let reps = 2000;
    let start = Instant::now();
    for _ in 0..reps {
        t = t.add_scalar(1.0);
    }
    std::hint::black_box(t.into_data());
    start.elapsed().as_secs_f64() / reps as f64
}

fn matmul_rate(ranks: usize, rows: usize, k: usize, n: usize) -> f64 {
    let rates: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|_| {
                s.spawn(move || {
                    let device = Device::flex();
                    let a = Tensor::<2>::from_data(
                        TensorData::new(vec![0.5f32; rows * k], [rows, k]),
                        &device,
                    );
                    let b = Tensor::<2>::from_data(
                        TensorData::new(vec![0.25f32; k * n], [k, n]),
                        &device,
                    );
                    let _ = a.clone().matmul(b.clone()).into_data();
                    let (start, mut reps) = (Instant::now(), 0usize);
                    while start.elapsed() < Duration::from_millis(300) || reps < 2 {
                        let _ = a.clone().matmul(b.clone()).into_data();
                        reps += 1;
                    }
                    2.0 * (rows * k * n * reps) as f64 / start.elapsed().as_secs_f64()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("matmul thread"))
            .collect()
    });
    rates.iter().sum::<f64>() / rates.len() as f64
}

fn link_rate(ranks: usize) -> (f64, f64) {
    let times = ThreadWorld::new(ranks)
        .launch(|pg| {
            let time = |len: usize, reps: usize| {
                let mut v = vec![1.0f32; len];
                pg.all_reduce(&mut v, ReduceOp::Sum).expect("all-reduce");
                let start = Instant::now();
                for _ in 0..reps {
                    pg.all_reduce(&mut v, ReduceOp::Sum).expect("all-reduce");
                }
                start.elapsed().as_secs_f64() / reps as f64
            };
            (time(1, 50), time(1 << 20, 5))
        })
        .expect("calibration ranks");
    let (small, big) = times[0];
    let k = (ranks - 1) as f64;
    let latency = small / (2.0 * k);
    let bandwidth = 2.0 * k / ranks as f64 * (4 << 20) as f64 / (big - small).max(1e-9);
    (bandwidth, latency)
}

fn memory_rate() -> f64 {
    let v = vec![1.0f32; 16 << 20];
    let start = Instant::now();
    let mut total = 0.0f32;
    for _ in 0..4 {
        total += std::hint::black_box(&v).iter().sum::<f32>();
    }
    std::hint::black_box(total);
    (4 * v.len() * 4) as f64 / start.elapsed().as_secs_f64()
}

/// Bytes of memory available on this machine (`MemAvailable` of `/proc/meminfo`).
pub fn available_memory() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// This machine as one node of `ranks` CPU ranks: `memory` bytes each, the measured rates,
/// rank threads linked by shared memory inside and outside the "node" alike, and no overlap
/// of communication with compute (the ranks' threads share the cores).
pub fn this_machine(ranks: usize, memory: usize, c: &Calibration) -> ClusterSpec {
    let link = LinkSpec::measured("shm", c.bandwidth, c.latency);
    ClusterSpec {
        nodes: 1,
        gpus_per_node: ranks,
        device: DeviceSpec::cpu(c.flops, memory, c.mem_bw, c.launch),
        intra: link.clone(),
        inter: link,
        overlap: 0.0,
    }
}

/// `train_gpt --mesh auto`: the fastest layout the planner finds for `cfg` on `ranks` CPU
/// rank threads of this machine, `rows` sequences of `seq` tokens per step, in `precision`,
/// each rank holding at most `memory` bytes (`--memory-budget`; default: the available
/// memory over the ranks, 90 % of it). Returns the layout and the lines that say what was
/// chosen and why; `Err` when nothing fits (what does not fit where).
pub fn auto_layout(
    cfg: &GptConfig,
    ranks: usize,
    rows: usize,
    seq: usize,
    precision: &MixedPrecision,
    memory: Option<usize>,
) -> Result<(ParallelDims, Vec<String>), String> {
    let model = gpt_spec(cfg);
    let (capacity, fraction) = match memory {
        Some(m) => (m, 1.0),
        None => (available_memory().unwrap_or(1 << 30) / ranks.max(1), 0.9),
    };
    let calib = calibrate(ranks, (rows * seq / ranks).max(1), cfg.d_model, cfg.d_ff);
    let cluster = this_machine(ranks, capacity, &calib);
    let req = bonfire_plan::Request {
        global_batch: rows,
        seq,
        precisions: vec![*precision],
        memory_fraction: fraction,
    };
    let plan =
        bonfire_plan::plan(&model, &cluster, &req).map_err(|e| format!("--mesh auto: {e}"))?;
    let top = &plan.ranked[0];
    let dims = top.layout.clone();
    let mut lines = vec![
        format!(
            "auto: {ranks} CPU ranks measured at {:.2} GFLOP/s each (both busy), all-reduce {:.2} GB/s; {} per rank",
            calib.flops / 1e9,
            calib.bandwidth / 1e9,
            bonfire_plan::format_bytes(capacity as f64 * fraction),
        ),
        format!(
            "auto: plan rank=1 {} bytes_per_rank={:.0} step_ms={:.1} ({} feasible layouts)",
            top.layout.record(),
            top.bytes(),
            top.step_ms(),
            plan.ranked.len()
        ),
    ];
    lines.extend(plan.why.iter().map(|w| format!("auto: why: {w}")));
    Ok((dims, lines))
}

/// One rank's measurement of a layout ([`measure_layout`]), bytes over the rank's baseline.
#[derive(Debug, Clone, Copy, Default)]
pub struct RankRun {
    /// Live after the last forward+backward, before its optimizer step: parameters,
    /// gradients, optimizer state.
    pub held: usize,
    /// The most bytes live during those steps' forward+backward (the planner's moment "at a
    /// backward's start", and, in a pipeline, its gradient sums).
    pub backward_peak: usize,
    /// The most bytes live during those steps' optimizer step (the planner's gradient sum
    /// without a pipeline).
    pub step_peak: usize,
    /// The fastest step after the first (forward+backward and optimizer step), ms.
    pub step_ms: f64,
    /// The CPU backend's per-thread matrix-product workspace, allocated before the baseline
    /// and so in neither figure above ([`warm_matmul_workspace`]).
    pub workspace: usize,
}

impl RankRun {
    /// The most bytes live during the steps after the first (the larger of the two moments).
    pub fn steady_peak(&self) -> usize {
        self.backward_peak.max(self.step_peak)
    }
}

/// Has this thread's matrix-product workspace allocated (one small product) and returns the
/// bytes that took on this thread's rank: the `gemm` crate behind Burn's CPU backend keeps a
/// packing buffer per thread, sized to the core's L2 cache (`gemm_common::gemm::L2_SLAB`:
/// 2 MiB on this machine), allocated by the thread's first product and kept for the
/// thread's life. It is the backend's, not the layout's — the same on every
/// rank whatever the model, mesh or schedule, like a GPU's cuBLAS workspace, which the
/// planner does not model either — so [`measure_layout`] allocates it before a rank's
/// baseline and reports it beside the rank's bytes instead of inside them.
pub fn warm_matmul_workspace() -> usize {
    let before = rank_alloc::current_rank().map_or(0, rank_alloc::live);
    let device = crate::default_device();
    let a = Tensor::<2>::from_data(TensorData::new(vec![0.5f32; 64 * 64], [64, 64]), &device);
    std::hint::black_box(a.clone().matmul(a).into_data());
    rank_alloc::current_rank()
        .map_or(0, rank_alloc::live)
        .saturating_sub(before)
}

/// Trains `model` (of a vocabulary of `vocab`) `steps` AdamW steps (at least 2) under `dims`
/// on rank threads, `rows` sequences of `seq` tokens a step
/// ([`bonfire_models::data::pattern_batch`]), and reads every
/// rank's bytes from the counting allocator — which must be the binary's global allocator
/// ([`rank_alloc::RankAllocator`]) — charged to allocator ranks `first..first + world` (fresh
/// ones per run: blocks a run leaves alive do not disturb the next). Each rank's baseline is
/// taken after its thread's matrix-product workspace exists ([`warm_matmul_workspace`]).
pub fn measure_layout<M: ParallelModel<Batch = TokenBatch> + Sync>(
    vocab: usize,
    dims: &ParallelDims,
    model: &M,
    (rows, seq, steps): (usize, usize, usize),
    first: usize,
) -> Vec<RankRun> {
    assert!(steps >= 2, "the steady peak needs a step after the first");
    assert!(
        rank_alloc::installed(),
        "the counting allocator is not installed"
    );
    let trainer = Trainer::new(dims.clone(), || OptimizerKind::AdamW.build());
    Launcher::Threads {
        ranks: dims.world_size(),
    }
    .run("planner-measure", |pg| {
        let r = first + pg.rank();
        let _rank = rank_alloc::enter_rank(r);
        let workspace = warm_matmul_workspace();
        let batch = |step, device: &burn::tensor::Device| {
            bonfire_models::data::pattern_batch(vocab, rows, seq, step, device)
        };
        let b0 = batch(0, &crate::default_device());
        let base = rank_alloc::live(r);
        let mut engine = trainer.build(model.clone(), &pg, &b0)?;
        drop(b0);
        let mut run = RankRun {
            workspace,
            ..RankRun::default()
        };
        let mut timed = f64::MAX;
        for step in 0..steps {
            let b = batch.replica_batch(step, engine.replica(), engine.device());
            rank_alloc::reset_peak(r);
            let start = Instant::now();
            engine.forward_backward(&b)?;
            drop(b);
            run.held = rank_alloc::live(r) - base;
            let backward = rank_alloc::peak(r) - base;
            rank_alloc::reset_peak(r);
            engine.step(1e-4)?;
            if step > 0 {
                timed = f64::min(timed, start.elapsed().as_secs_f64());
                let optimizer = rank_alloc::peak(r) - base;
                run.backward_peak = run.backward_peak.max(backward);
                run.step_peak = run.step_peak.max(optimizer);
            }
        }
        run.step_ms = timed * 1e3;
        Ok::<RankRun, TrainError>(run)
    })
    .expect("launch")
    .into_iter()
    .map(|r| r.expect("rank"))
    .collect()
}

/// The planner's bytes for every world rank of `layout` ([`rank_memory`] of its pipeline
/// stage) training the model `spec` on `req`; `Err` for a layout the planner does not model
/// ([`PlannedLayout::check_model`]) or whose sequences do not cut
/// ([`PlannedLayout::check_sequence`]: `2·cp` chunks).
pub fn predict_ranks(
    spec: &ModelSpec,
    req: &Request,
    layout: &ParallelDims,
) -> Result<Vec<MemoryParts>, String> {
    layout.check_model(spec, req.global_batch)?;
    layout.check_sequence(req.seq)?;
    let shapes = rank_shapes(spec, layout, req.seq);
    Ok((0..layout.world_size())
        .map(|r| rank_memory(spec, req, layout, &shapes, layout.coordinate(r, Axis::Pp)))
        .collect())
}
