//! Shared helpers of the parity tests: random batches, single-device reference training,
//! DDP training, tolerant comparison.

#![allow(dead_code)]

use bonfire_comm::{ReduceOp, ThreadWorld};
use bonfire_ddp::{DdpConfig, DistributedDataParallel, params};
use bonfire_examples::data::Batches;
use bonfire_examples::{Gpt, GptConfig, default_device};
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use std::time::Duration;

/// Relative tolerance of every parity comparison, and the absolute floor below which values
/// count as zero: `|a − b| ≤ REL · max(|a|, |b|) + ABS`.
pub const REL: f32 = 1e-5;
pub const ABS: f32 = 1e-7;

pub fn random_batches(cfg: &GptConfig, steps: usize, batch: usize, seed: u64) -> Batches {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % cfg.vocab_size as u64) as i64
    };
    let n = steps * batch * cfg.max_seq_len;
    let ids: Vec<i64> = (0..n).map(|_| next()).collect();
    let targets: Vec<i64> = (0..n).map(|_| next()).collect();
    Batches::new(ids, targets, [steps, batch, cfg.max_seq_len])
}

/// Losses and final parameters (flat, module order) of a run.
#[derive(Debug, Clone)]
pub struct Run {
    pub losses: Vec<f32>,
    pub params: Vec<f32>,
}

/// Plain Burn training on one device with the whole global batch: the reference.
pub fn single_device(
    model: &Gpt,
    batches: &Batches,
    steps: usize,
    lr: f64,
    mut optim: ModuleOptimizer,
) -> Run {
    let device = default_device();
    let mut model = model.clone().fork(&device);
    let infos = params::inventory(&model);
    let mut losses = Vec::new();
    for s in 0..steps {
        let (ids, targets) = batches.rows(s, 0, batches.batch, &device);
        let loss = model.loss(ids, targets);
        losses.push(params::to_host(loss.clone().detach())[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
    }
    Run {
        losses,
        params: params::flatten_values(&model, &infos),
    }
}

/// DDP on `n` rank threads, each taking its rows of every global batch. Returns every
/// rank's run (losses are global: averaged over ranks).
pub fn ddp(
    model: &Gpt,
    batches: &Batches,
    n: usize,
    steps: usize,
    lr: f64,
    optim: impl Fn() -> ModuleOptimizer + Sync,
    config: DdpConfig,
) -> Vec<Run> {
    let device = default_device();
    let rows = batches.batch / n;
    ThreadWorld::new(n)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let replica = model.clone().fork(&device);
            let mut ddp =
                DistributedDataParallel::new(replica, optim(), pg.clone(), config.clone()).unwrap();
            let mut losses = Vec::new();
            for s in 0..steps {
                let (ids, targets) = batches.rows(s, pg.rank() * rows, rows, &device);
                let local = ddp.train_step(lr, |m| m.loss(ids, targets)).unwrap();
                let mut global = [local];
                pg.all_reduce(&mut global, ReduceOp::Avg).unwrap();
                losses.push(global[0]);
            }
            let infos = params::inventory(ddp.model());
            Run {
                losses,
                params: params::flatten_values(ddp.model(), &infos),
            }
        })
        .unwrap()
}

/// Asserts `a` and `b` agree within `rel` (relative) and `abs` (absolute floor).
pub fn assert_close(what: &str, a: &[f32], b: &[f32], rel: f32, abs: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let mut worst = (0.0f32, 0usize);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let err = (x - y).abs();
        let allowed = rel * x.abs().max(y.abs()) + abs;
        assert!(
            err <= allowed,
            "{what}[{i}]: {x} vs {y} (|diff| {err:e} > {allowed:e})"
        );
        if err > worst.0 {
            worst = (err, i);
        }
    }
}
