#![allow(dead_code)]
//! Shared pieces of the parity tests: a small model of our own, the data, reference runs.

use bonfire_comm::ThreadWorld;
use bonfire_layout::ZeroStage;
use bonfire_module::DataParallel;
use bonfire_module::params;
use bonfire_zero::{Zero, ZeroConfig};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use std::time::Duration;

pub const BATCH: usize = 8;
pub const STEPS: usize = 3;

/// Skewed parameter sizes: 6×40 + 40, 40×3 + 3, 3×1 + 1.
#[derive(Module, Debug)]
pub struct Net {
    pub a: Linear,
    pub b: Linear,
    pub c: Linear,
}

impl Net {
    pub fn new(device: &Device) -> Self {
        Self {
            a: LinearConfig::new(6, 40).init(device),
            b: LinearConfig::new(40, 3).init(device),
            c: LinearConfig::new(3, 1).init(device),
        }
    }
    pub fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        let h = self
            .c
            .forward(gelu(self.b.forward(gelu(self.a.forward(x)))));
        (h - y).powi_scalar(2).mean()
    }
}

pub fn device() -> Device {
    Device::flex().autodiff().gradient_checkpointing()
}

/// Step s's full batch (x [8, 6], y [8, 1]), deterministic.
pub fn batch(s: usize, rows: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let xs: Vec<f32> = (0..BATCH * 6)
        .map(|i| (((i * 7 + s * 13) % 17) as f32 - 8.0) / 5.0)
        .collect();
    let ys: Vec<f32> = (0..BATCH).map(|i| ((i + s) % 3) as f32 - 1.0).collect();
    let n = rows.len();
    let x = TensorData::new(xs[rows.start * 6..rows.end * 6].to_vec(), [n, 6]);
    let y = TensorData::new(ys[rows.clone()].to_vec(), [n, 1]);
    (Tensor::from_data(x, device), Tensor::from_data(y, device))
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Opt {
    Sgd,
    Adam,
    /// Adam with decoupled weight decay (Burn's default, 1e-4).
    AdamW,
}

impl Opt {
    pub fn module(self) -> burn::optim::ModuleOptimizer {
        match self {
            Opt::Sgd => SgdConfig::new().init(),
            Opt::Adam => AdamConfig::new().init(),
            Opt::AdamW => AdamWConfig::new().init(),
        }
    }
    pub fn lr(self) -> f64 {
        match self {
            Opt::Sgd => 0.1,
            Opt::Adam | Opt::AdamW => 0.01,
        }
    }
}

pub fn initial() -> Net {
    let device = Device::flex().autodiff();
    let _ = Distribution::Default;
    Net::new(&device)
}

/// Single device: the whole batch, Burn's module optimizer.
pub fn single(model: &Net, opt: Opt) -> Vec<f32> {
    single_steps(model, opt, STEPS)
}

pub fn single_steps(model: &Net, opt: Opt, steps: usize) -> Vec<f32> {
    let device = Device::flex().autodiff();
    let mut m = model.clone().fork(&device);
    let mut o = opt.module();
    for s in 0..steps {
        let (x, y) = batch(s, 0..BATCH, &device);
        let grads = m.loss(x, y).backward();
        let gp = burn::optim::GradientsParams::from_grads(grads, &m);
        m = o.step(opt.lr(), m, gp);
    }
    let infos = params::inventory(&m);
    params::flatten_values(&m, &infos)
}

/// DDP on `n` rank threads.
pub fn ddp(model: &Net, opt: Opt, n: usize) -> Vec<f32> {
    let device = Device::flex().autodiff();
    let out = ThreadWorld::new(n)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let mut d = bonfire_ddp::DistributedDataParallel::new(
                model.clone().fork(&device),
                opt.module(),
                pg.clone(),
                bonfire_ddp::DdpConfig::new(),
            )
            .unwrap();
            let rows = BATCH / n;
            for s in 0..STEPS {
                let (x, y) = batch(s, pg.rank() * rows..(pg.rank() + 1) * rows, &device);
                d.train_step(opt.lr(), |m: &Net| m.loss(x, y)).unwrap();
            }
            let infos = params::inventory(d.model());
            params::flatten_values(d.model(), &infos)
        })
        .unwrap();
    out.into_iter().next().unwrap()
}

/// A copy of `model` with its own parameters on `device` (e.g. with Balanced checkpointing).
pub fn on_device(model: &Net, device: &Device) -> Net {
    let infos = params::inventory(model);
    let flat = params::flatten_values(model, &infos);
    let fresh = Net::new(device);
    let fresh_infos = params::inventory(&fresh);
    params::assign_values(fresh, &fresh_infos, &flat)
}

pub fn build(
    model: Net,
    o: impl Into<burn::optim::ModuleOptimizer>,
    pg: bonfire_comm::ProcessGroup,
    config: ZeroConfig,
) -> Zero<Net> {
    Zero::new(model, o, pg, config).unwrap()
}

/// ZeRO on `n` rank threads; every rank's full parameters after the steps.
pub fn zero(model: &Net, opt: Opt, n: usize, stage: ZeroStage, offload: bool) -> Vec<Vec<f32>> {
    let device = device();
    ThreadWorld::new(n)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let config = ZeroConfig::new(stage)
                .with_offload(offload)
                .with_bucket_bytes(256);
            let replica = on_device(model, &device);
            // The optimizer a run-time choice: Burn's module optimizer, as DDP takes it.
            train(build(replica, opt.module(), pg.clone(), config), opt, n)
        })
        .unwrap()
}

pub fn train(z: Zero<Net>, opt: Opt, n: usize) -> Vec<f32> {
    train_steps(z, opt, n, 0..STEPS)
}

pub fn train_steps(
    mut z: Zero<Net>,
    opt: Opt,
    n: usize,
    steps: std::ops::Range<usize>,
) -> Vec<f32> {
    let device = device();
    let rows = BATCH / n;
    let rank = z.process_group().rank();
    for s in steps {
        let (x, y) = batch(s, rank * rows..(rank + 1) * rows, &device);
        z.train_step(opt.lr(), |m: &Net| m.loss(x, y)).unwrap();
    }
    z.full_values().unwrap()
}

/// |a − b| ≤ 1e-5·max(|a|, |b|) + 1e-6, element-wise (the floor covers f32 summation-order
/// noise).
pub fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_within(a, b, 1e-6, what);
}

/// The tolerance after training with `opt`: 1e-5 relative, with an absolute floor of 1e-7 for
/// SGD (the largest difference measured: 3e-8) and 2e-5 (= 2e-3·lr) for Adam. Adam divides each gradient element by its running RMS,
/// so an element whose gradient is a cancellation (≈ 0, e.g. of a LayerNorm bias) turns f32
/// summation-order noise into a visible move; DDP itself differs from single-device training
/// by up to ~1.1e-5 there (observed), nondeterministically.
pub fn assert_trained(a: &[f32], b: &[f32], opt: Opt, what: &str) {
    let floor = match opt {
        Opt::Sgd => 1e-7,
        Opt::Adam | Opt::AdamW => 2e-5,
    };
    assert_within(a, b, floor, what);
}

/// Asserts training moved most of `trained` away from `initial` by more than 100× the
/// tolerance's floor after `opt`: a comparison of barely trained values would pass trivially.
pub fn assert_moved(initial: &[f32], trained: &[f32], opt: Opt) {
    let floor = match opt {
        Opt::Sgd => 1e-7,
        Opt::Adam | Opt::AdamW => 2e-5,
    };
    assert_eq!(initial.len(), trained.len(), "{opt:?}: parameter count");
    let moved = initial
        .iter()
        .zip(trained)
        .filter(|(a, b)| (*a - *b).abs() > 100.0 * floor)
        .count();
    assert!(
        moved > initial.len() / 2,
        "{opt:?}: only {moved} of {} values moved",
        initial.len()
    );
}

fn assert_within(a: &[f32], b: &[f32], floor: f32, what: &str) {
    let tol = bonfire_comm::testing::Tolerance::new(1e-5, floor);
    let closeness = bonfire_comm::testing::assert_close(what, a, b, tol);
    println!("parity {what}: {closeness}");
}
