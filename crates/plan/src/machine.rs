//! This machine for the planner (feature `machine`): one node of CPU rank threads whose
//! matrix-product rate, communication bandwidth and latency, memory bandwidth and per-op cost
//! are measured on the spot on Burn's CPU backend ([`calibrate`]), its memory per rank a
//! budget or `/proc/meminfo`'s available bytes ([`this_machine`]); and `--mesh auto`
//! ([`auto_layout`]): the planner's fastest layout for a model on it. The rest of the crate
//! needs no Burn; this module measures what the engines will run on.

use crate::bytes::format_bytes;
use crate::cluster::{ClusterSpec, DeviceSpec, LinkSpec};
use crate::cost::Request;
use crate::layout::PlannedLayout;
use crate::model::ModelSpec;
use bonfire_comm::{ReduceOp, ThreadWorld};
use bonfire_layout::{MixedPrecision, ParallelDims};
use burn::tensor::{Device, Tensor, TensorData};
use std::time::{Duration, Instant};

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

/// `train --mesh auto`: the fastest layout the planner finds for `model` on `ranks` CPU
/// rank threads of this machine, `rows` sequences of `seq` tokens per step, in `precision`,
/// each rank holding at most `memory` bytes (`--memory-budget`; default: the available
/// memory over the ranks, 90 % of it). Returns the layout and the lines that say what was
/// chosen and why; `Err` when nothing fits (what does not fit where).
pub fn auto_layout(
    model: &ModelSpec,
    ranks: usize,
    rows: usize,
    seq: usize,
    precision: &MixedPrecision,
    memory: Option<usize>,
) -> Result<(ParallelDims, Vec<String>), String> {
    let (capacity, fraction) = match memory {
        Some(m) => (m, 1.0),
        None => (available_memory().unwrap_or(1 << 30) / ranks.max(1), 0.9),
    };
    let calib = calibrate(
        ranks,
        (rows * seq / ranks).max(1),
        model.d_model,
        model.d_ff,
    );
    let cluster = this_machine(ranks, capacity, &calib);
    let req = Request {
        global_batch: rows,
        seq,
        precisions: vec![*precision],
        memory_fraction: fraction,
    };
    let plan =
        crate::search::plan(model, &cluster, &req).map_err(|e| format!("--mesh auto: {e}"))?;
    let top = &plan.ranked[0];
    let dims = top.layout.clone();
    let mut lines = vec![
        format!(
            "auto: {ranks} CPU ranks measured at {:.2} GFLOP/s each (both busy), all-reduce {:.2} GB/s; {} per rank",
            calib.flops / 1e9,
            calib.bandwidth / 1e9,
            format_bytes(capacity as f64 * fraction),
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
