//! Buckets really are reduced during backward: with anchored layers, every bucket but the
//! embeddings' is handed to the communication thread before backward returns.

mod common;

use bonfire_comm::ThreadWorld;
use bonfire_ddp::{DataParallel, DdpConfig, DistributedDataParallel};
use bonfire_examples::{Gpt, GptConfig, default_device};
use burn::module::Module;
use burn::optim::SgdConfig;
use std::time::Duration;

#[test]
fn first_bucket_starts_during_backward() {
    let cfg = GptConfig::tiny();
    let device = default_device();
    let model = Gpt::new(&cfg, &device);
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
    for rank in timings {
        let last = rank.last().unwrap();
        let n = last.launches.len();
        // The last two buckets hold the embeddings (not anchored: their input is token ids),
        // whose gradients come out of backward last.
        for (b, &at) in last.launches[..n - 2].iter().enumerate() {
            assert!(
                at > last.backward.start_us && at < last.backward.end_us,
                "bucket {b} launched at {at}, outside backward {:?}",
                last.backward
            );
        }
        assert!(last.buckets.iter().all(|s| s.end_us > s.start_us));
    }
}
