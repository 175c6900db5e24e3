//! The data plane's CUDA path on real GPUs (feature `cuda`): Burn CUDA tensors on a
//! ProcessGroup over NCCL, one rank per visible GPU. Every collective and send/recv returns a
//! CUDA tensor with the right values, and the transfer ledger counts no byte between device
//! and host. `#[ignore]`d and named `gpu_*`: `cargo xtask test-multi-gpu` runs them.
#![cfg(feature = "cuda")]

use bonfire_comm::nccl::{NcclComm, UniqueId, probe};
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::plane::{self, TransferLedger};
use burn::tensor::{DType, Device, Tensor, TensorData};
use std::time::Duration;

fn host(t: Tensor<1>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// One rank's checks; returns the host↔device bytes the ledger counted.
fn rank(pg: &ProcessGroup, device: &Device) -> u64 {
    let (n, me) = (pg.size(), pg.rank());
    let ledger = TransferLedger::start();
    let t = Tensor::<1>::from_data(TensorData::new(vec![(me + 1) as f32; 256], [256]), device);
    let sum = plane::all_reduce(t.clone(), ReduceOp::Sum, pg).unwrap();
    let root = plane::broadcast(t.clone(), 0, pg).unwrap();
    let counts: Vec<usize> = (1..=n).collect();
    let piece = Tensor::<1>::from_data(TensorData::new(vec![me as f32; me + 1], [me + 1]), device);
    let all = plane::all_gather(Some(piece), &counts, DType::F32, pg, device).unwrap();
    let back = plane::reduce_scatter(all.clone(), &counts, ReduceOp::Sum, pg).unwrap();
    let moved = ledger.snapshot();
    let gathered: Vec<f32> = (0..n).flat_map(|r| vec![r as f32; r + 1]).collect();
    assert!(host(sum).iter().all(|&x| x == (n * (n + 1) / 2) as f32));
    assert!(host(root).iter().all(|&x| x == 1.0));
    assert_eq!(host(all), gathered);
    assert!(host(back.unwrap()).iter().all(|&x| x == (me * n) as f32));
    moved.total(plane::ledger::Direction::DeviceToHost)
        + moved.total(plane::ledger::Direction::HostToDevice)
}

#[test]
#[ignore = "needs NVIDIA GPUs: cargo xtask test-multi-gpu"]
fn gpu_plane_collectives_stay_on_the_device() {
    let n = probe().expect("CUDA and NCCL").devices;
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        for r in 0..n {
            s.spawn(move || {
                let pg = NcclComm::init(&id, r, n, r).unwrap().into_group("plane");
                pg.set_timeout(Duration::from_secs(60));
                let moved = rank(&pg, &Device::cuda(r));
                assert_eq!(moved, 0, "GPU rank {r}: nothing staged through the host");
            });
        }
    });
}
