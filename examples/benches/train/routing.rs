//! `bench train --model mixtral`'s routing lines: how unevenly the Mixtral's routers load
//! their experts, step by step, on the trajectory every multi-rank layout trains.
//!
//! The engines on the rank threads do not hand their model out, so the routing is read from a
//! one-device replay of the same training: the same initial model, SGD at the same learning
//! rate (0.01, `throughput::train`'s), the same global batch of every step (`batch × ranks`
//! rows) — the trajectory each multi-rank layout reproduces (dp, ZeRO, tp of the Mixtral equal
//! one device: `crates/models` tests). At each step the forward's routing
//! ([`Mixtral::forward_routed`]) gives every layer's tokens per expert (the top-k indicators
//! summed over the batch); a layer's imbalance is max over experts of its tokens / their mean
//! (N·k/E): 1 is perfect balance, E/k the worst possible.
//!
//! `bench train model=mixtral routing step=S layers=L experts=E top_k=K tokens=N
//! imbalance_mean=… imbalance_max=… max_layer=… loads=a/b/…` (the loads of the most
//! imbalanced layer), then a summary over the timed steps.
//!
//! For each expert-parallel layout of the run (dp replicas, ep groups of ep consecutive
//! replicas, ep rank r holding experts r·E/ep..(r+1)·E/ep), from the same replay cut into the
//! replicas' rows: `routing_ep` — per layer the rows each ep rank receives from its group
//! (what its experts run on), their imbalance (max over the dp ranks / their mean: the
//! busiest rank sets the exchange's and the experts' pace), and the fraction of routed rows
//! that leave their rank (the rest stay for its own experts).

use bonfire_dtensor::plane::{self, ledger::Reason};
use bonfire_models::cross_entropy;
use bonfire_models::data::{Batches, TokenBatch};
use bonfire_models::mixtral::{Mixtral, balance};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor};

/// The learning rate of `throughput::train` (and so of every layout's run).
const LR: f64 = 0.01;

/// One step's imbalance: the mean over layers, the max and the layer holding it, that
/// layer's tokens per expert.
pub struct StepRouting {
    pub mean: f64,
    pub max: f64,
    pub max_layer: usize,
    pub loads: Vec<f32>,
    /// Every layer's tokens per expert of each row (sequence) of the batch, `[L][B·E]`.
    pub rows: Vec<Vec<f32>>,
}

/// One forward of `model` on a batch: every layer's tokens per expert of each row `[L][B·E]`,
/// the balance term's value, and the loss (mean cross-entropy + α · balance, as
/// [`Mixtral::loss`]).
fn forward(model: &Mixtral, (ids, targets): TokenBatch) -> (Vec<Vec<f32>>, f64, Tensor<1>) {
    let (logits, routing) = model.forward_routed(ids);
    let per_layer = routing
        .iter()
        .map(|r| {
            let [b, _, e] = r.counts.dims();
            let summed = r.counts.clone().detach().sum_dim(1).reshape([b * e]);
            plane::to_host(summed, Reason::Report)
        })
        .collect();
    let aux = balance(&routing);
    let value = plane::to_host(aux.clone().detach(), Reason::Report)[0] as f64;
    let loss = cross_entropy(logits, targets) + aux.mul_scalar(model.aux_loss_coef());
    (per_layer, value, loss)
}

/// Tokens per expert `[E]` summed over the rows of `rows` (`[B·E]`).
fn loads(rows: &[f32], e: usize) -> Vec<f32> {
    (0..e)
        .map(|x| rows.iter().skip(x).step_by(e).sum())
        .collect()
}

/// The imbalance of one step's per-layer loads.
fn imbalance(per_layer: Vec<Vec<f32>>, rows: Vec<Vec<f32>>) -> StepRouting {
    let ratios: Vec<f64> = per_layer
        .iter()
        .map(|l| {
            let mean = l.iter().map(|&c| c as f64).sum::<f64>() / l.len() as f64;
            l.iter().copied().fold(0.0f32, f32::max) as f64 / mean
        })
        .collect();
    let max_layer = (0..ratios.len())
        .max_by(|&a, &b| ratios[a].total_cmp(&ratios[b]))
        .expect("a layer");
    StepRouting {
        mean: ratios.iter().sum::<f64>() / ratios.len() as f64,
        max: ratios[max_layer],
        max_layer,
        loads: per_layer[max_layer].clone(),
        rows,
    }
}

/// Replays `steps` SGD steps of `model` on one device on the first `rows` sequences of each
/// step of `data`, printing every step's routing line; returns every step's imbalance.
pub fn replay(model: &Mixtral, data: &Batches, rows: usize, steps: usize) -> Vec<StepRouting> {
    let device: Device = bonfire_examples::default_device();
    let mut model = model.clone();
    let mut optim = SgdConfig::new().init();
    let mut out = Vec::with_capacity(steps);
    for s in 0..steps {
        let (per_row, aux, loss) = forward(&model, data.rows(s, 0, rows, &device));
        let e = model.model.layers[0].mlp.num_experts();
        let per_layer: Vec<Vec<f32>> = per_row.iter().map(|r| loads(r, e)).collect();
        let l = per_layer.len();
        let tokens: f64 = per_layer[0].iter().map(|&c| c as f64).sum::<f64>();
        let k = model.model.layers[0].mlp.top_k();
        let r = imbalance(per_layer, per_row);
        println!(
            "bench train model=mixtral routing step={s} layers={l} experts={e} top_k={k} \
             tokens={} imbalance_mean={:.3} imbalance_max={:.3} max_layer={} balance_term={aux:.4} \
             loads={}",
            tokens as usize / k,
            r.mean,
            r.max,
            r.max_layer,
            r.loads
                .iter()
                .map(|c| format!("{c:.0}"))
                .collect::<Vec<_>>()
                .join("/")
        );
        out.push(r);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    out
}

/// The summary line over the steps after `warmup` (the timed ones): the mean over steps of
/// each step's mean over layers, and the largest single layer's imbalance of any step.
pub fn summary(steps: &[StepRouting], warmup: usize) {
    let timed = &steps[warmup.min(steps.len())..];
    let n = timed.len().max(1) as f64;
    let mean = timed.iter().map(|r| r.mean).sum::<f64>() / n;
    let max = timed.iter().map(|r| r.max).fold(0.0, f64::max);
    println!(
        "bench train model=mixtral routing_summary steps={} imbalance_mean={mean:.3} \
         imbalance_max={max:.3} source=one-device-replay",
        timed.len()
    );
}

/// One layer's rows received by each of the `dp` ranks under `ep` (see the file's docs) and
/// the rows that leave their rank, from its tokens per expert of each row `rows` (`[B·E]`).
fn exchanged(rows: &[f32], e: usize, dp: usize, ep: usize) -> (Vec<f64>, f64) {
    let b = rows.len() / e;
    let (per_replica, local) = (b / dp, e / ep);
    let mut received = vec![0.0f64; dp];
    let mut remote = 0.0;
    for (row, counts) in rows.chunks(e).enumerate() {
        let replica = row / per_replica;
        let group = replica / ep;
        for (x, &c) in counts.iter().enumerate() {
            let holder = x / local;
            received[group * ep + holder] += c as f64;
            if holder != replica % ep {
                remote += c as f64;
            }
        }
    }
    (received, remote)
}

/// The `routing_ep` line of the layout `name` (`dp` ranks, `ep`) over the steps after
/// `warmup`: the mean over steps and layers of the received rows' imbalance, its largest,
/// and the fraction of the routed rows that left their rank.
pub fn ep_summary(steps: &[StepRouting], warmup: usize, name: &str, dp: usize, ep: usize) {
    let timed = &steps[warmup.min(steps.len())..];
    let (mut sum, mut max, mut n, mut remote, mut total) = (0.0, 0.0f64, 0, 0.0, 0.0);
    for step in timed {
        for rows in &step.rows {
            let e = step.loads.len();
            let (received, left) = exchanged(rows, e, dp, ep);
            let all: f64 = received.iter().sum();
            let ratio = received.iter().copied().fold(0.0, f64::max) / (all / dp as f64);
            (sum, max, n) = (sum + ratio, max.max(ratio), n + 1);
            (remote, total) = (remote + left, total + all);
        }
    }
    println!(
        "bench train model=mixtral routing_ep layout={name} dp={dp} ep={ep} steps={} \
         received_imbalance_mean={:.3} received_imbalance_max={max:.3} remote_fraction={:.3} \
         source=one-device-replay",
        timed.len(),
        sum / n.max(1) as f64,
        remote / total.max(1.0)
    );
}
