//! HSDP (`Zero::with_replicas`): ZeRO stages 1–3 sharded over dp=2, two replicas of the shards
//! (dp_replicate=2) on 4 rank threads, each rank on its own 2 of the 8 rows, against DDP on
//! the same 4 ranks with AdamW. After every one of 4 steps each rank's shard equals the same
//! range of DDP's parameters (1e-5 relative, absolute floor 2e-5 = 2e-3·lr; see
//! `common::assert_trained`) and the two replicas of a shard are bit-equal.

mod common;
use bonfire_comm::ThreadWorld;
use bonfire_dtensor::DeviceMesh;
use bonfire_layout::ZeroStage;
use bonfire_module::DataParallel;
use bonfire_module::params;
use bonfire_zero::{Zero, ZeroConfig};
use burn::module::Module;
use burn::tensor::Device;
use common::{BATCH, Net, Opt, assert_trained, batch, device, initial, on_device};
use std::time::Duration;

const STEPS: usize = 4;
const RANKS: usize = 4;

/// DDP's whole parameters after each step (rank r trains on rows 2r..2r+2).
fn ddp_steps(model: &Net, opt: Opt) -> Vec<Vec<f32>> {
    let device = Device::flex().autodiff();
    let rows = BATCH / RANKS;
    ThreadWorld::new(RANKS)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let mut d = bonfire_ddp::DistributedDataParallel::new(
                model.clone().fork(&device),
                opt.module(),
                pg.clone(),
                bonfire_ddp::DdpConfig::new(),
            )
            .unwrap();
            (0..STEPS)
                .map(|s| {
                    let (x, y) = batch(s, pg.rank() * rows..(pg.rank() + 1) * rows, &device);
                    d.train_step(opt.lr(), |m: &Net| m.loss(x, y)).unwrap();
                    params::flatten_values(d.model(), &params::inventory(d.model()))
                })
                .collect()
        })
        .unwrap()
        .remove(0)
}

/// Each rank's (own range, its shard after each step) under HSDP: mesh
/// `[dp_replicate=2, dp=2]`, ZeRO on dp, the replicas' group dp_replicate. World rank r is
/// replica r / 2, shard r % 2, and trains on data replica r's rows (dp_replicate outside dp).
fn hsdp_steps(
    model: &Net,
    opt: Opt,
    stage: ZeroStage,
) -> Vec<(std::ops::Range<usize>, Vec<Vec<f32>>)> {
    let device = device();
    let rows = BATCH / RANKS;
    ThreadWorld::new(RANKS)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let mesh = DeviceMesh::new(&pg, &[2, 2], &["dp_replicate", "dp"]).unwrap();
            let config = ZeroConfig::new(stage).with_bucket_bytes(256);
            let mut z = Zero::on_mesh(on_device(model, &device), opt.module(), &mesh, "dp", config)
                .unwrap()
                .with_replicas(mesh.group("dp_replicate").unwrap().clone());
            let r = pg.rank();
            let shards = (0..STEPS)
                .map(|s| {
                    let (x, y) = batch(s, r * rows..(r + 1) * rows, &device);
                    z.train_step(opt.lr(), |m: &Net| m.loss(x, y)).unwrap();
                    z.own_values()
                })
                .collect();
            (z.own_range(), shards)
        })
        .unwrap()
}

#[test]
fn hsdp_shards_equal_ddp_after_every_adamw_step() {
    let model = initial();
    let want = ddp_steps(&model, Opt::AdamW);
    for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
        let got = hsdp_steps(&model, Opt::AdamW, stage);
        let mut worst = 0f32;
        for (rank, (range, shards)) in got.iter().enumerate() {
            for (s, shard) in shards.iter().enumerate() {
                let what = format!("stage {} rank {rank} step {s}", stage.index());
                let ddp = &want[s][range.clone()];
                assert_trained(shard, ddp, Opt::AdamW, &what);
                let diff = shard.iter().zip(ddp).map(|(a, b)| (a - b).abs());
                worst = worst.max(diff.fold(0.0, f32::max));
                // The same shard on the other replica (rank ± 2) is bit-equal.
                let peer = &got[(rank + 2) % RANKS];
                assert_eq!(&peer.0, range, "{what}: replicas own the same range");
                assert_eq!(&peer.1[s], shard, "{what}: replicas diverged");
            }
        }
        println!(
            "hsdp stage {}: largest |shard − DDP| {worst:.2e}",
            stage.index()
        );
    }
}
