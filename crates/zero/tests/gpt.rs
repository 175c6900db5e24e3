//! The reference GPT (tiny size) under stages 1, 2, 3 with and without offload, on 2 and 4
//! ranks, with SGD and Adam: parameters after 3 steps equal single-device training and DDP
//! within 1e-5 relative (absolute floor 1e-7 for SGD, 2e-5 = 2e-3·lr for Adam; see
//! `common::assert_trained`; the model drawn under a fixed seed, `seeded_gpt`). Saving and
//! resuming are the trainer's checkpoint's (`examples/tests/checkpoint_resume.rs`).

mod common;
use bonfire_comm::ThreadWorld;
use bonfire_ddp::{DdpConfig, DistributedDataParallel};
use bonfire_layout::ZeroStage;
use bonfire_models::data::Batches;
use bonfire_models::{Gpt, GptConfig};
use bonfire_module::DataParallel;
use bonfire_module::params;
use bonfire_zero::{Zero, ZeroConfig};
use burn::module::Module;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, SgdConfig};
use burn::tensor::Device;
use common::{Opt, STEPS, assert_trained, device};
use std::time::Duration;

const B: usize = 4;

fn batches(cfg: &GptConfig) -> Batches {
    let n = STEPS * B * cfg.max_seq_len;
    let ids: Vec<i64> = (0..n)
        .map(|i| ((i * 7 + 3) % cfg.vocab_size) as i64)
        .collect();
    let tg: Vec<i64> = (0..n)
        .map(|i| ((i * 11 + 5) % cfg.vocab_size) as i64)
        .collect();
    Batches::new(ids, tg, [STEPS, B, cfg.max_seq_len])
}

fn copy_to(model: &Gpt, cfg: &GptConfig, device: &Device) -> Gpt {
    let flat = params::flatten_values(model, &params::inventory(model));
    let fresh = Gpt::new(cfg, device);
    let infos = params::inventory(&fresh);
    params::assign_values(fresh, &infos, &flat)
}

fn single(model: &Gpt, data: &Batches, opt: Opt) -> Vec<f32> {
    let device = Device::flex().autodiff();
    let mut m = model.clone().fork(&device);
    let mut o = opt.module();
    for s in 0..STEPS {
        let (x, y) = data.rows(s, 0, B, &device);
        let gp = GradientsParams::from_grads(m.loss(x, y).backward(), &m);
        m = o.step(opt.lr(), m, gp);
    }
    params::flatten_values(&m, &params::inventory(&m))
}

fn ddp(model: &Gpt, data: &Batches, opt: Opt, n: usize) -> Vec<f32> {
    let device = Device::flex().autodiff();
    ThreadWorld::new(n)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let replica = model.clone().fork(&device);
            let mut d =
                DistributedDataParallel::new(replica, opt.module(), pg.clone(), DdpConfig::new())
                    .unwrap();
            let rows = B / n;
            for s in 0..STEPS {
                let (x, y) = data.rows(s, pg.rank() * rows, rows, &device);
                d.train_step(opt.lr(), |m: &Gpt| m.loss(x, y)).unwrap();
            }
            params::flatten_values(d.model(), &params::inventory(d.model()))
        })
        .unwrap()
        .remove(0)
}

fn run(mut z: Zero<Gpt>, data: &Batches, lr: f64, n: usize) -> Vec<f32> {
    let device = device();
    let rows = B / n;
    let rank = z.process_group().rank();
    for s in 0..STEPS {
        let (x, y) = data.rows(s, rank * rows, rows, &device);
        z.train_step(lr, |m: &Gpt| m.loss(x, y)).unwrap();
    }
    z.full_values().unwrap()
}

fn zero(
    model: &Gpt,
    cfg: &GptConfig,
    data: &Batches,
    opt: Opt,
    n: usize,
    config: ZeroConfig,
) -> Vec<Vec<f32>> {
    let device = device();
    ThreadWorld::new(n)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let replica = copy_to(model, cfg, &device);
            let config = config.clone();
            match opt {
                Opt::Sgd => run(
                    Zero::new(replica, SgdConfig::new().build(), pg.clone(), config).unwrap(),
                    data,
                    opt.lr(),
                    n,
                ),
                Opt::Adam => run(
                    Zero::new(replica, AdamConfig::new().build(), pg.clone(), config).unwrap(),
                    data,
                    opt.lr(),
                    n,
                ),
                Opt::AdamW => run(
                    Zero::new(replica, AdamWConfig::new().build(), pg.clone(), config).unwrap(),
                    data,
                    opt.lr(),
                    n,
                ),
            }
        })
        .unwrap()
}

/// The tiny GPT drawn under a fixed seed. With a fresh random draw each run, about 1 run in
/// 100 put one Adam-trained element just past the floor (measured 2026-11-27: 1 failure in 100
/// runs with Burn's decomposed attention, 1 in 100 with the fused one; the other 99 at
/// 0.02–0.99 of the tolerance, most under 0.1), which made `gpt_adam` flaky; the draw is fixed
/// so a run is repeatable.
fn seeded_gpt(cfg: &GptConfig) -> Gpt {
    params::seeded(7, &Device::flex().autodiff(), |d| Gpt::new(cfg, d))
}

fn check(opt: Opt) {
    let cfg = GptConfig::tiny();
    let model = seeded_gpt(&cfg);
    let data = batches(&cfg);
    let reference = single(&model, &data, opt);
    let initial = params::flatten_values(&model, &params::inventory(&model));
    common::assert_moved(&initial, &reference, opt);
    for n in [2, 4] {
        let d = ddp(&model, &data, opt, n);
        assert_trained(&d, &reference, opt, &format!("ddp n={n}"));
        for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
            for offload in [false, true] {
                let config = ZeroConfig::new(stage)
                    .with_offload(offload)
                    .with_bucket_bytes(4096);
                for (r, got) in zero(&model, &cfg, &data, opt, n, config).iter().enumerate() {
                    let what = format!("gpt {stage:?} offload={offload} n={n} rank={r} {opt:?}");
                    assert_trained(got, &reference, opt, &what);
                    assert_trained(got, &d, opt, &format!("{what} vs ddp"));
                }
            }
        }
    }
}

#[test]
fn gpt_sgd() {
    check(Opt::Sgd);
}

#[test]
fn gpt_adam() {
    check(Opt::Adam);
}
