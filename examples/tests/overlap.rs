//! Buckets really are reduced during backward: with anchored layers, every bucket but the
//! embeddings' is handed to the communication thread before backward returns — DDP's
//! all-reduces and ZeRO-2's reduce-scatters alike.

mod common;

use bonfire_comm::ThreadWorld;
use bonfire_ddp::{DdpConfig, DistributedDataParallel};
use bonfire_dtensor::timing::StepTiming;
use bonfire_examples::default_device;
use bonfire_layout::ZeroStage;
use bonfire_models::{Gpt, GptConfig};
use bonfire_module::DataParallel;
use bonfire_zero::{Zero, ZeroConfig};
use burn::module::Module;
use burn::optim::SgdConfig;
use std::time::Duration;

#[test]
fn first_bucket_starts_during_backward() {
    let cfg = GptConfig::tiny();
    let device = default_device();
    let model = bonfire_module::params::seeded(43, &device, |d| Gpt::new(&cfg, d));
    let batches = common::random_batches(&cfg, 3, 4, 7);
    let timings = ThreadWorld::new(2)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let config = DdpConfig::new()
                .with_bucket_bytes(1024)
                .with_record_timings(true);
            let replica = model.clone().fork(&device);
            let mut ddp =
                DistributedDataParallel::new(replica, SgdConfig::new().init(), pg.clone(), config)
                    .unwrap();
            for s in 0..3 {
                let (ids, targets) = batches.rows(s, pg.rank() * 2, 2, &device);
                ddp.train_step(0.1, |m| m.loss(ids, targets)).unwrap();
            }
            assert!(ddp.num_buckets() > 4);
            ddp.timings().to_vec()
        })
        .unwrap();
    launched_during_backward(timings, 2);
}

#[test]
fn zero2_buckets_start_during_backward() {
    let cfg = GptConfig::tiny();
    let device = default_device();
    let model = bonfire_module::params::seeded(43, &device, |d| Gpt::new(&cfg, d));
    let batches = common::random_batches(&cfg, 3, 4, 7);
    let timings = ThreadWorld::new(2)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let config = ZeroConfig::new(ZeroStage::Zero2)
                .with_bucket_bytes(1024)
                .with_record_timings(true);
            let replica = model.clone().fork(&device);
            let mut zero = Zero::new(replica, SgdConfig::new().init(), pg.clone(), config).unwrap();
            for s in 0..3 {
                let (ids, targets) = batches.rows(s, pg.rank() * 2, 2, &device);
                zero.train_step(0.1, |m| m.loss(ids, targets)).unwrap();
            }
            zero.timings().to_vec()
        })
        .unwrap();
    // Buckets of 256 values cut from the end of the flat vector; the embeddings are its
    // first values, in the last buckets.
    let embeddings = (cfg.vocab_size + cfg.max_seq_len) * cfg.d_model;
    let total = cfg.num_params();
    let trailing = (0..total.div_ceil(256))
        .filter(|k| total.saturating_sub((k + 1) * 256) < embeddings)
        .count();
    assert!(timings[0].last().unwrap().launches.len() > trailing + 2);
    launched_during_backward(timings, trailing);
}

/// In each rank's last step, every bucket but the last `trailing` (the embeddings': not
/// anchored, their input is token ids, so their gradients come out of backward last) was
/// launched while backward ran, and every bucket's collective took time on the
/// communication thread.
fn launched_during_backward(timings: Vec<Vec<StepTiming>>, trailing: usize) {
    for rank in timings {
        let last = rank.last().unwrap();
        let n = last.launches.len();
        assert_eq!(n, last.buckets.len());
        assert!(
            n > trailing,
            "{n} buckets, {trailing} trailing: none to check"
        );
        for (b, &at) in last.launches[..n - trailing].iter().enumerate() {
            assert!(
                at > last.backward.start_us && at < last.backward.end_us,
                "bucket {b} launched at {at}, outside backward {:?}",
                last.backward
            );
        }
        assert!(last.buckets.iter().all(|s| s.end_us > s.start_us));
    }
}
