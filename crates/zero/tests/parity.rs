//! Stages 1, 2, 3 with and without offload, on 2 and 4 ranks, SGD, Adam and AdamW: parameters after
//! 3 steps equal DDP's and single-device training's within 1e-5 relative (absolute floor 1e-6
//! for SGD, 2e-5 = 2e-3·lr for Adam and AdamW; see `common::assert_trained`).

mod common;
use bonfire_zero::{DataParallel, Stage};
use common::*;

fn check(opt: Opt) {
    let model = initial();
    let reference = single(&model, opt);
    for n in [2, 4] {
        let d = ddp(&model, opt, n);
        assert_trained(&d, &reference, opt, &format!("ddp n={n} {opt:?}"));
        for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for offload in [false, true] {
                let all = zero(&model, opt, n, stage, offload);
                for (r, got) in all.iter().enumerate() {
                    let what = format!("{stage:?} offload={offload} n={n} rank={r} {opt:?}");
                    assert_trained(got, &reference, opt, &what);
                    assert_trained(got, &d, opt, &format!("{what} vs ddp"));
                }
            }
        }
    }
}

#[test]
fn small_model_sgd() {
    check(Opt::Sgd);
}

#[test]
fn small_model_adam() {
    check(Opt::Adam);
}

#[test]
fn small_model_adamw() {
    check(Opt::AdamW);
}

/// The step-0 gradient, gathered in full, is the same at every stage and on one rank.
#[test]
fn full_gradients_agree_across_stages() {
    use bonfire_comm::ThreadWorld;
    use burn::optim::SgdConfig;
    let model = initial();
    let grads = |n: usize, stage: Stage| {
        let device = device();
        ThreadWorld::new(n)
            .timeout(std::time::Duration::from_secs(60))
            .launch(|pg| {
                let config = bonfire_zero::ZeroConfig::new(stage).with_bucket_bytes(64);
                let mut z = build(
                    on_device(&model, &device),
                    SgdConfig::new().build(),
                    pg.clone(),
                    config,
                );
                let rows = BATCH / n;
                let (x, y) = batch(0, pg.rank() * rows..(pg.rank() + 1) * rows, &device);
                let loss = z.forward(|m: &Net| m.loss(x, y));
                z.backward(loss).unwrap();
                z.gradients().unwrap()
            })
            .unwrap()
            .remove(0)
    };
    let reference = grads(1, Stage::Zero0);
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for (got, want) in grads(2, stage).iter().zip(&reference) {
            assert_eq!(got.path, want.path);
            assert_close(
                &got.values,
                &want.values,
                &format!("{stage:?} grad {}", got.path),
            );
        }
    }
}

/// Offload keeps the optimizer state in the host store between steps (none on the device)
/// and moves it in and out for every step.
#[test]
fn offload_moves_state_through_the_host_store() {
    use bonfire_comm::ThreadWorld;
    use burn::optim::AdamConfig;
    let model = initial();
    let device = device();
    ThreadWorld::new(2)
        .timeout(std::time::Duration::from_secs(60))
        .launch(|pg| {
            for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
                let config = bonfire_zero::ZeroConfig::new(stage).with_offload(true);
                let mut z = build(
                    on_device(&model, &device),
                    AdamConfig::new().build(),
                    pg.clone(),
                    config,
                );
                for s in 0..2 {
                    let (x, y) = batch(s, pg.rank() * 4..(pg.rank() + 1) * 4, &device);
                    z.train_step(0.01, |m: &Net| m.loss(x, y)).unwrap();
                }
                let own = z.own_range().len();
                let optim = z.optimizer();
                assert_eq!(
                    optim.device_bytes(),
                    0,
                    "{stage:?}: no state on the device at rest"
                );
                assert_eq!(
                    optim.host_bytes(),
                    8 * own,
                    "{stage:?}: Adam's two moments per element"
                );
                let store = optim.host_store().unwrap();
                assert_eq!(
                    store.bytes_out,
                    2 * 8 * own as u64,
                    "{stage:?}: out after each step"
                );
                assert_eq!(
                    store.bytes_in,
                    8 * own as u64,
                    "{stage:?}: in before the second step"
                );
            }
        })
        .unwrap();
}
