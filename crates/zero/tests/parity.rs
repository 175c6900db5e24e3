//! Stages 1, 2, 3 with and without offload, on 2 and 4 ranks, SGD, Adam and AdamW: parameters after
//! 3 steps equal DDP's and single-device training's within 1e-5 relative (absolute floor 1e-7
//! for SGD, 2e-5 = 2e-3·lr for Adam and AdamW; see `common::assert_trained`).

mod common;
use bonfire_layout::ZeroStage;
use bonfire_module::DataParallel;
use common::*;

fn check(opt: Opt) {
    let model = initial();
    let reference = single(&model, opt);
    let infos = bonfire_module::params::inventory(&model);
    assert_moved(
        &bonfire_module::params::flatten_values(&model, &infos),
        &reference,
        opt,
    );
    for n in [2, 4] {
        let d = ddp(&model, opt, n);
        assert_trained(&d, &reference, opt, &format!("ddp n={n} {opt:?}"));
        for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
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
    let grads = |n: usize, stage: ZeroStage| {
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
    let reference = grads(1, ZeroStage::Zero0);
    let count = bonfire_module::params::inventory(&model).len();
    assert_eq!(
        reference.len(),
        count,
        "one gradient per parameter on one rank"
    );
    for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
        let got_all = grads(2, stage);
        assert_eq!(got_all.len(), reference.len(), "{stage:?}: gradient count");
        for (got, want) in got_all.iter().zip(&reference) {
            assert_eq!(got.path, want.path);
            assert_close(
                &got.values,
                &want.values,
                &format!("{stage:?} grad {}", got.path),
            );
        }
    }
}

/// Offload keeps the optimizer state and the update on a separate CPU device (Burn's plain
/// Flex device, while the model trains on the autodiff device): the shard of the state is
/// there, none of it on the model's device; parameters and gradients stay where the model is.
#[test]
fn offload_keeps_the_optimizer_state_on_its_own_device() {
    use bonfire_comm::ThreadWorld;
    use burn::optim::AdamConfig;
    let model = initial();
    let device = device();
    ThreadWorld::new(2)
        .timeout(std::time::Duration::from_secs(60))
        .launch(|pg| {
            for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
                let config = bonfire_zero::ZeroConfig::new(stage).with_offload(true);
                let mut z = build(
                    on_device(&model, &device),
                    AdamConfig::new().build(),
                    pg.clone(),
                    config.clone(),
                );
                for s in 0..2 {
                    let (x, y) = batch(s, pg.rank() * 4..(pg.rank() + 1) * 4, z.device());
                    let loss = z.forward(|m: &Net| m.loss(x, y));
                    z.backward(loss).unwrap();
                    if s == 1 {
                        let g = z.held_gradients().expect("gradients after backward");
                        assert_eq!(
                            g.device(),
                            z.device().clone().inner(),
                            "{stage:?}: gradients stay on the model's device"
                        );
                    }
                    z.step(0.01).unwrap();
                }
                let own = z.own_range().len();
                let optim = z.optimizer();
                // On this CPU build both are Flex (Burn's `Device` equality ignores autodiff):
                // the wgpu suite (`tests/wgpu.rs`) checks a model on wgpu with state on Flex.
                assert_eq!(optim.state_device(), &config.offload_device);
                assert!(!optim.state_device().is_autodiff());
                assert_eq!(
                    optim.device_bytes(),
                    0,
                    "{stage:?}: no state on the model's device"
                );
                assert_eq!(
                    optim.offload_bytes(),
                    12 * own,
                    "{stage:?}: Adam's two moments and the master value per element, on the \
                     offload device"
                );
                let shard = z.own_tensor().unwrap();
                assert!(
                    shard.is_autodiff(),
                    "{stage:?}: parameters on the model's device"
                );
            }
        })
        .unwrap();
}
