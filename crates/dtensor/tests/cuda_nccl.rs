//! The data plane's CUDA path on real GPUs (feature `cuda`): Burn CUDA tensors on a
//! ProcessGroup over NCCL, one rank per visible GPU. Every collective and send/recv returns a
//! CUDA tensor with the right values, and the transfer ledger counts no byte between device
//! and host. `#[ignore]`d and named `gpu_*`: `cargo xtask test-multi-gpu` runs them.
#![cfg(feature = "cuda")]

use bonfire_comm::nccl::launch_on_every_gpu;
use bonfire_dtensor::plane;
use burn::tensor::Device;
use std::time::Duration;

#[test]
#[ignore = "needs NVIDIA GPUs: cargo xtask test-multi-gpu"]
fn gpu_plane_collectives_stay_on_the_device() {
    let (_, moved) = launch_on_every_gpu("plane", Duration::from_secs(60), |pg| {
        plane::testing::collectives_on_device(pg, &Device::cuda(pg.rank()))
    })
    .expect("CUDA and NCCL");
    for (r, moved) in moved.into_iter().enumerate() {
        assert_eq!(moved, 0, "GPU rank {r}: nothing staged through the host");
    }
}
