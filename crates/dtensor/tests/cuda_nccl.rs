//! The data plane's CUDA path on real GPUs (feature `cuda`): Burn CUDA tensors on a
//! ProcessGroup over NCCL, one rank per visible GPU. Every collective and send/recv returns a
//! CUDA tensor with the right values, and the transfer ledger counts no byte between device
//! and host. `#[ignore]`d and named `gpu_*`: `cargo xtask test-multi-gpu` runs them.
#![cfg(feature = "cuda")]

use bonfire_comm::nccl::{NcclComm, UniqueId, probe};
use bonfire_dtensor::plane;
use burn::tensor::Device;
use std::time::Duration;

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
                let moved = plane::testing::collectives_on_device(&pg, &Device::cuda(r));
                assert_eq!(moved, 0, "GPU rank {r}: nothing staged through the host");
            });
        }
    });
}
