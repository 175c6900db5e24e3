//! A small model, single-device training and pipelined training, shared by the parity tests.
#![allow(dead_code)]

use bonfire_comm::testing::{Tolerance, assert_close as check_close, is_close as is_close_flat};
use bonfire_comm::{ProcessGroup, ReduceOp, ThreadWorld};
use bonfire_dtensor::DeviceMesh;
use bonfire_pipeline::{
    Block, BurnStage, LocalChunks, Schedule, chunks_for_rank, forward_chunk, microbatch_weights,
    run_schedule, split_balanced, split_batch,
};
use bonfire_tp::{ParallelKey, ParallelLinear as Linear};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData, activation::gelu};
use std::time::Duration;

pub const WIDTH: usize = 8;
pub const BLOCKS: usize = 8;
pub const ROWS: usize = 8;
pub const STEPS: usize = 3;
pub const LR: f64 = 0.5;

/// Linear + GELU (Bonfire's linear layer, whose weight gradient the zero-bubble schedules
/// defer to their "W" steps).
#[derive(Module, Debug)]
pub struct Mlp {
    pub linear: Linear,
}

impl Block<2> for Mlp {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        gelu(self.linear.forward(x))
    }
}

pub fn dev() -> Device {
    Device::flex().autodiff()
}

/// Deterministic pseudo-random values in [-scale, scale].
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The model: the same values on every call (each rank thread builds its own leaves).
pub fn model(device: &Device) -> Vec<Mlp> {
    let scale = 2.6 / (WIDTH as f32).sqrt();
    (0..BLOCKS)
        .map(|i| {
            let w = TensorData::new(values(100 + i as u64, WIDTH * WIDTH, scale), [WIDTH, WIDTH]);
            let b = TensorData::new(values(200 + i as u64, WIDTH, 0.1), [WIDTH]);
            Mlp {
                linear: Linear {
                    weight: Param::from_tensor(Tensor::from_data(w, device)),
                    bias: Some(Param::from_tensor(Tensor::from_data(b, device))),
                    key: ParallelKey::default(),
                },
            }
        })
        .collect()
}

/// Step `step`'s batch: input and target, `rows × WIDTH`.
pub fn batch(step: usize, rows: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let x = values(1000 + step as u64, rows * WIDTH, 1.0);
    let y = values(2000 + step as u64, rows * WIDTH, 0.5);
    (
        Tensor::from_data(TensorData::new(x, [rows, WIDTH]), device),
        Tensor::from_data(TensorData::new(y, [rows, WIDTH]), device),
    )
}

pub fn mse(out: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    (out - target).powi_scalar(2).mean()
}

/// A block's parameters as host vectors (weight, bias).
pub fn params_of(block: &Mlp) -> Vec<Vec<f32>> {
    let w = block
        .linear
        .weight
        .val()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let b = block.linear.bias.as_ref().unwrap().val();
    vec![w, b.into_data().try_to_vec::<f32>().unwrap()]
}

/// What a training run produced: the loss of each step, every block's final parameters.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub losses: Vec<f64>,
    pub params: Vec<Vec<Vec<f32>>>,
}

/// Single-device training on the full batch.
pub fn reference() -> Outcome {
    let device = dev();
    let mut blocks = model(&device);
    let mut optim = SgdConfig::new().init();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step, ROWS, &device);
        let loss = mse(forward_chunk(&blocks, x), y);
        losses.push(f64::from(loss.clone().into_scalar::<f32>()));
        let grads = GradientsParams::from_grads(loss.backward(), &blocks);
        blocks = optim.step(LR, blocks, grads);
    }
    Outcome {
        losses,
        params: blocks.iter().map(params_of).collect(),
    }
}

fn world<R: Send>(n: usize, f: impl Fn(ProcessGroup) -> R + Sync) -> Vec<R> {
    ThreadWorld::new(n)
        .timeout(Duration::from_secs(60))
        .launch(f)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// One rank's result: losses (on the last stage's rank), (stage, params) for its chunks.
type RankOut = (Vec<Option<f64>>, Vec<(usize, Vec<Vec<Vec<f32>>>)>);

/// Averages the gradients of every parameter of `module` over `group` (parameters without a
/// gradient contribute zeros). What DDP does, done by hand: this crate sits below it.
fn average_grads<M: Module>(
    group: &ProcessGroup,
    module: &M,
    grads: GradientsParams,
) -> GradientsParams {
    struct Avg<'a>(&'a ProcessGroup, GradientsParams);
    impl ModuleVisitor for Avg<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            let g = self
                .1
                .remove::<D>(param.id)
                .unwrap_or_else(|| value.zeros_like());
            let (shape, device) = (g.dims(), g.device());
            let mut data = g.into_data().try_into_vec::<f32>().unwrap();
            self.0.all_reduce(&mut data, ReduceOp::Avg).unwrap();
            self.1.register::<D>(
                param.id,
                Tensor::from_data(TensorData::new(data, shape), &device),
            );
        }
    }
    let mut avg = Avg(group, grads);
    module.visit(&mut avg);
    avg.1
}

fn train_rank(
    mesh: &DeviceMesh,
    dp: Option<&ProcessGroup>,
    schedule: &Schedule,
    rows: std::ops::Range<usize>,
    uniform_weights: bool,
) -> RankOut {
    let device = dev();
    let rank = mesh.coord("pp").unwrap();
    let stages = split_balanced(model(&device), schedule.stages()).unwrap();
    let mut chunks = chunks_for_rank(&stages, schedule, rank).unwrap();
    drop(stages);
    let m = schedule.microbatches;
    let n = rows.len();
    let mut optim = SgdConfig::new().init();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step, ROWS, &device);
        let (x, y) = (x.narrow(0, rows.start, n), y.narrow(0, rows.start, n));
        let targets = split_batch(y, m);
        let weights = if uniform_weights {
            vec![1.0 / m as f32; m]
        } else {
            microbatch_weights(n, m)
        };
        let held = LocalChunks::new(chunks);
        let mut stage = BurnStage::new(held, schedule, rank, device.clone(), weights)
            .with_inputs(split_batch(x, m))
            .with_loss(move |mb, out| mse(out, targets[mb].clone()));
        run_schedule(mesh, "pp", schedule, &mut stage)
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let (held, mut loss) = stage.finish();
        let (c, mut grads) = held.into_parts();
        if let Some(dp) = dp {
            grads = average_grads(dp, &c, grads);
            if let Some(l) = loss.as_mut() {
                let mut buf = [*l];
                dp.all_reduce(&mut buf, ReduceOp::Avg).unwrap();
                *l = buf[0];
            }
        }
        losses.push(loss);
        chunks = optim.step(LR, c, grads);
    }
    let params = chunks
        .iter()
        .enumerate()
        .map(|(c, blocks)| {
            (
                schedule.stage_map.stage(rank, c),
                blocks.iter().map(params_of).collect(),
            )
        })
        .collect();
    (losses, params)
}

fn collect(results: Vec<RankOut>, blocks_per_stage: usize) -> Outcome {
    let mut losses = vec![None; STEPS];
    let mut params = vec![Vec::new(); BLOCKS];
    for (rank_losses, stages) in results {
        for (i, l) in rank_losses.into_iter().enumerate() {
            if let Some(l) = l {
                losses[i] = Some(l);
            }
        }
        for (stage, blocks) in stages {
            for (j, p) in blocks.into_iter().enumerate() {
                params[stage * blocks_per_stage + j] = p;
            }
        }
    }
    Outcome {
        losses: losses
            .into_iter()
            .map(|l| l.expect("no loss reported"))
            .collect(),
        params,
    }
}

/// Pipelined training with `schedule` on its ranks.
pub fn pipelined(schedule: &Schedule) -> Outcome {
    pipelined_counting_w(schedule).0
}

/// [`pipelined`], with how many deferred weight gradients its ranks computed in "W" steps
/// (`bonfire_module::weight_grad::applied`, read on each rank's thread around its own work
/// and summed: tests running beside it cannot add to it).
pub fn pipelined_counting_w(schedule: &Schedule) -> (Outcome, u64) {
    let results = world(schedule.ranks(), |pg| {
        let before = bonfire_module::weight_grad::applied();
        let out = train_rank(
            &DeviceMesh::one_d(&pg, "pp").unwrap(),
            None,
            schedule,
            0..ROWS,
            false,
        );
        (out, bonfire_module::weight_grad::applied() - before)
    });
    let applied = results.iter().map(|(_, n)| n).sum();
    let outs = results.into_iter().map(|(out, _)| out).collect();
    (collect(outs, BLOCKS / schedule.stages()), applied)
}

/// Like [`pipelined`], but weighting every micro-batch's mean loss by `1/m` even when the
/// micro-batches are uneven (wrong on purpose: a negative control for the tolerance).
pub fn pipelined_uniform_weights(schedule: &Schedule) -> Outcome {
    let results = world(schedule.ranks(), |pg| {
        train_rank(
            &DeviceMesh::one_d(&pg, "pp").unwrap(),
            None,
            schedule,
            0..ROWS,
            true,
        )
    });
    collect(results, BLOCKS / schedule.stages())
}

/// `dp` replicas of the pipeline on a `pp × dp` mesh; replica `d` trains on its rows.
pub fn pipelined_dp(schedule: &Schedule, dp: usize) -> Outcome {
    let pp = schedule.ranks();
    let results = world(dp * pp, |world| {
        let mesh = DeviceMesh::new(&world, &[pp, dp], &["pp", "dp"]).unwrap();
        let per = ROWS / dp;
        let d = mesh.coord("dp").unwrap();
        let rows = d * per..(d + 1) * per;
        let out = train_rank(
            &mesh,
            Some(mesh.group("dp").unwrap()),
            schedule,
            rows,
            false,
        );
        (d, out)
    });
    // Replicas must agree; keep replica 0's view after checking.
    let (zero, others): (Vec<_>, Vec<_>) = results.into_iter().partition(|(d, _)| *d == 0);
    let a = collect(
        zero.into_iter().map(|(_, o)| o).collect(),
        BLOCKS / schedule.stages(),
    );
    let b = collect(
        others
            .into_iter()
            .filter(|(d, _)| *d == 1)
            .map(|(_, o)| o)
            .collect(),
        BLOCKS / schedule.stages(),
    );
    assert_close(&a, &b, "replica 0 vs replica 1");
    a
}

/// The tolerance of every comparison: `|a − b| ≤ 1e-5·max(|a|, |b|) + 1e-7`, the parity
/// suites' rule after SGD (the largest difference measured: 6e-8).
const TOL: Tolerance = Tolerance::new(1e-5, 1e-7);

/// Every loss and parameter, flattened in order.
fn flat(o: &Outcome) -> Vec<f32> {
    let losses = o.losses.iter().map(|&l| l as f32);
    let params = o.params.iter().flatten().flatten().copied();
    losses.chain(params).collect()
}

/// Whether every loss and parameter agrees within the tolerance.
pub fn is_close(got: &Outcome, want: &Outcome) -> bool {
    got.params.len() == want.params.len() && is_close_flat(&flat(got), &flat(want), TOL)
}

/// Asserts every loss and parameter agrees within the tolerance.
pub fn assert_close(got: &Outcome, want: &Outcome, what: &str) {
    assert_eq!(got.params.len(), want.params.len(), "{what}: blocks");
    let c = check_close(what, &flat(got), &flat(want), TOL);
    println!("parity {what}: {c}");
}
