//! The data plane's device check: every collective and its values on one rank's device, and
//! the bytes it staged through the host. `tests/cuda_nccl.rs` and the GPU kit (`cargo xtask
//! gpu-kit`, docs/gpu.md) run it on CUDA tensors over NCCL, where nothing may be staged.

use super::ledger::Direction;
use super::{TransferLedger, all_gather, all_reduce, broadcast, reduce_scatter};
use bonfire_comm::{ProcessGroup, ReduceOp};
use burn::tensor::{DType, Device, Tensor, TensorData};

fn host(t: Tensor<1>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// This rank's part of the check: all-reduce, broadcast, an uneven all-gather and the
/// reduce-scatter back, each result checked on the host afterwards. Every rank of `pg` must
/// call it. Returns the host↔device bytes the collectives moved (the ledger's count, taken
/// before the results are read back); panics on a wrong value.
pub fn collectives_on_device(pg: &ProcessGroup, device: &Device) -> u64 {
    let (n, me) = (pg.size(), pg.rank());
    let ledger = TransferLedger::start();
    let t = Tensor::<1>::from_data(TensorData::new(vec![(me + 1) as f32; 256], [256]), device);
    let sum = all_reduce(t.clone(), ReduceOp::Sum, pg).unwrap();
    let root = broadcast(t.clone(), 0, pg).unwrap();
    let counts: Vec<usize> = (1..=n).collect();
    let piece = Tensor::<1>::from_data(TensorData::new(vec![me as f32; me + 1], [me + 1]), device);
    let all = all_gather(Some(piece), &counts, DType::F32, pg, device).unwrap();
    let back = reduce_scatter(all.clone(), &counts, ReduceOp::Sum, pg).unwrap();
    let moved = ledger.snapshot();
    let gathered: Vec<f32> = (0..n).flat_map(|r| vec![r as f32; r + 1]).collect();
    assert!(
        host(sum).iter().all(|&x| x == (n * (n + 1) / 2) as f32),
        "all-reduce"
    );
    assert!(host(root).iter().all(|&x| x == 1.0), "broadcast");
    assert_eq!(host(all), gathered, "all-gather");
    let back = back.expect("every rank holds a piece");
    assert!(
        host(back).iter().all(|&x| x == (me * n) as f32),
        "reduce-scatter"
    );
    moved.total(Direction::DeviceToHost) + moved.total(Direction::HostToDevice)
}
