//! Checkpoints: sharded with 4 ranks at stage 3, loaded with 2 ranks at stage 1 and on a
//! single device, training continues identically (Adam, whose state must travel); the
//! consolidated checkpoint loads into a plain model.

mod common;
use bonfire_comm::ThreadWorld;
use bonfire_zero::{DataParallel, Zero, ZeroConfig, ZeroStage};
use burn::optim::AdamConfig;
use burn_store::{ModuleSnapshot, SafetensorsStore};
use common::*;
use std::time::Duration;

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("bonfire-zero-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Loads the checkpoint in `dir` on `n` ranks at `stage` and trains steps 3..6.
fn resume(
    model: &Net,
    dir: &std::path::Path,
    n: usize,
    stage: ZeroStage,
    offload: bool,
) -> Vec<f32> {
    let device = device();
    let out = ThreadWorld::new(n)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            // Start from different values: everything must come from the checkpoint.
            let fresh = Net::new(&device);
            let _ = model;
            let config = ZeroConfig::new(stage).with_offload(offload);
            let mut z = Zero::new(fresh, AdamConfig::new().build(), pg.clone(), config).unwrap();
            z.load_sharded(dir).unwrap();
            train_steps(z, Opt::Adam, n, STEPS..2 * STEPS)
        })
        .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn sharded_4_ranks_stage3_resumes_on_2_ranks_stage1_and_on_one_device() {
    let model = initial();
    let reference = single_steps(&model, Opt::Adam, 2 * STEPS);
    let dir = tmp("sharded");
    let consolidated = tmp("full").join("model.safetensors");
    let device = device();
    let saved = ThreadWorld::new(4)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let config = ZeroConfig::new(ZeroStage::Zero3).with_offload(true);
            let replica = on_device(&model, &device);
            let mut z = Zero::new(replica, AdamConfig::new().build(), pg.clone(), config).unwrap();
            let rank = pg.rank();
            for s in 0..STEPS {
                let (x, y) = batch(s, rank * 2..(rank + 1) * 2, &device);
                z.train_step(Opt::Adam.lr(), |m: &Net| m.loss(x, y))
                    .unwrap();
            }
            z.save_sharded(&dir).unwrap();
            z.save_consolidated(&consolidated).unwrap();
            z.full_values().unwrap()
        })
        .unwrap();
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        4,
        "one file per rank"
    );

    // The consolidated file loads into a plain single-device model.
    let mut plain = Net::new(&burn::tensor::Device::flex().autodiff());
    let mut store = SafetensorsStore::from_file(&consolidated);
    let result = plain.load_from(&mut store).unwrap();
    assert!(
        result.missing.is_empty() && result.errors.is_empty(),
        "{result:?}"
    );
    let infos = bonfire_ddp::params::inventory(&plain);
    assert_eq!(
        bonfire_ddp::params::flatten_values(&plain, &infos),
        saved[0]
    );

    // Resumed training equals uninterrupted single-device training.
    let two = resume(&model, &dir, 2, ZeroStage::Zero1, false);
    assert_trained(
        &two,
        &reference,
        Opt::Adam,
        "4 ranks stage 3 -> 2 ranks stage 1",
    );
    let one = resume(&model, &dir, 1, ZeroStage::Zero0, false);
    assert_trained(&one, &reference, Opt::Adam, "4 ranks stage 3 -> 1 device");
    let back = resume(&model, &dir, 2, ZeroStage::Zero3, true);
    assert_trained(
        &back,
        &reference,
        Opt::Adam,
        "4 ranks stage 3 -> 2 ranks stage 3 offload",
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(consolidated.parent().unwrap());
}
