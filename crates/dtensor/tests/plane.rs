//! The data plane: collectives on Burn tensors return tensors on the same device, work on the
//! tensor's own buffer on a host device (no transfer counted, the buffer reused), carry
//! half-precision tensors as half precision, and record their payload (by kind of call too).

mod common;
use bonfire_comm::{OpKind, ReduceOp};
use bonfire_dtensor::plane::{self, TransferLedger, ledger::Direction};
use burn::backend::Flex;
use burn::tensor::{DType, Device, Tensor, TensorData};
use common::world;

/// The address of the tensor's buffer.
fn address(t: Tensor<1>) -> (Tensor<1>, usize) {
    let primitive = t.try_into_primitive::<Flex>().unwrap();
    let address = primitive.bytes().as_ptr() as usize;
    (Tensor::from_primitive::<Flex>(primitive), address)
}

fn values(t: Tensor<1>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

#[test]
fn all_reduce_and_broadcast_on_the_host_reuse_the_buffer_and_move_nothing() {
    let out = world(2, |pg| {
        let ledger = TransferLedger::start();
        let data = TensorData::new(vec![pg.rank() as f32 + 1.0; 4096], [4096]);
        let (x, before) = address(Tensor::<1>::from_data(data, &Device::flex()));
        let (y, after_reduce) = address(plane::all_reduce(x, ReduceOp::Sum, &pg).unwrap());
        let (z, after_broadcast) = address(plane::broadcast(y, 1, &pg).unwrap());
        let t = ledger.snapshot();
        (
            before == after_reduce && after_reduce == after_broadcast,
            values(z).iter().all(|&v| v == 3.0),
            t.total(Direction::DeviceToHost) + t.total(Direction::HostToDevice),
            t.payload,
            [OpKind::AllReduce, OpKind::Broadcast, OpKind::AllGather].map(|op| t.carried(op)),
        )
    });
    for (same, right, moved, payload, by_op) in out {
        assert!(same && right);
        assert_eq!(moved, 0, "a host device moves nothing");
        assert_eq!(payload, 2 * 4096 * 4, "two collectives of 16 KiB");
        assert_eq!(
            by_op,
            [4096 * 4, 4096 * 4, 0],
            "the payload by kind of call"
        );
    }
}

#[test]
fn reduce_scatter_and_all_gather_uneven() {
    let counts = [3usize, 0, 2];
    let out = world(3, |pg| {
        let device = Device::flex().autodiff();
        let r = pg.rank() as f32;
        let x = Tensor::<1>::from_floats([r, r + 1.0, r + 2.0, r + 3.0, r + 4.0], &device);
        let mine = plane::reduce_scatter(x, &counts, ReduceOp::Sum, &pg).unwrap();
        let piece = mine.clone();
        let whole = plane::all_gather(piece, &counts, DType::F32, &pg, &device).unwrap();
        (mine.map(values), values(whole), whole_device_is(&device))
    });
    // Sums over ranks 0, 1, 2 of [r, r+1, r+2, r+3, r+4]: [3, 6, 9, 12, 15].
    assert_eq!(out[0].0, Some(vec![3.0, 6.0, 9.0]));
    assert_eq!(out[1].0, None, "rank 1 owns nothing");
    assert_eq!(out[2].0, Some(vec![12.0, 15.0]));
    for (_, whole, _) in &out {
        assert_eq!(whole, &vec![3.0, 6.0, 9.0, 12.0, 15.0]);
    }
}

/// The asynchronous reduce-scatter returns what the synchronous one does (a rank owning
/// nothing gets `None`), with when the communication thread ran it; two in flight at once
/// come back in launch order.
#[test]
fn async_reduce_scatter_matches_the_synchronous_one() {
    let counts = [3usize, 0, 2];
    let out = world(3, |pg| {
        let device = Device::flex().autodiff();
        let r = pg.rank() as f32;
        let x = Tensor::<1>::from_floats([r, r + 1.0, r + 2.0, r + 3.0, r + 4.0], &device);
        let first = plane::reduce_scatter_async(x.clone(), &counts, ReduceOp::Sum, &pg).unwrap();
        let second = plane::reduce_scatter_async(x * 2.0, &counts, ReduceOp::Avg, &pg).unwrap();
        let (a, ran) = first.wait_timed().unwrap();
        assert!(ran.end >= ran.start);
        let b = second.wait().unwrap();
        (a.map(values), b.map(values))
    });
    assert_eq!(out[0].0, Some(vec![3.0, 6.0, 9.0]));
    assert_eq!(out[0].1, Some(vec![2.0, 4.0, 6.0]));
    assert_eq!(out[1], (None, None), "rank 1 owns nothing");
    assert_eq!(out[2].0, Some(vec![12.0, 15.0]));
    assert_eq!(out[2].1, Some(vec![8.0, 10.0]));
}

fn whole_device_is(device: &Device) -> bool {
    plane::is_host(device)
}

#[test]
fn half_precision_travels_as_half_precision() {
    let out = world(2, |pg| {
        let ledger = TransferLedger::start();
        let x = Tensor::<1>::from_floats([1.5, -2.0, 0.25, 8.0], &Device::flex()).cast(DType::BF16);
        let y = plane::all_reduce(x, ReduceOp::Sum, &pg).unwrap();
        (y.dtype(), values(y), ledger.snapshot().payload)
    });
    for (dtype, v, payload) in out {
        assert_eq!(dtype, DType::BF16);
        assert_eq!(v, vec![3.0, -4.0, 0.5, 16.0]);
        assert_eq!(payload, 4 * 2, "bf16: two bytes per element");
    }
}

#[test]
fn async_all_reduce_and_send_recv() {
    let out = world(2, |pg| {
        let device = Device::flex();
        let x = Tensor::<1>::from_floats([pg.rank() as f32, 1.0], &device);
        let pending = plane::all_reduce_async(x, ReduceOp::Avg, &pg);
        let avg = values(pending.wait().unwrap());
        let received = if pg.rank() == 0 {
            let t = Tensor::<2>::from_floats([[1.0, 2.0], [3.0, 4.0]], &device);
            plane::send(t, 1, 7, &pg).unwrap();
            None
        } else {
            let t: Tensor<2> = plane::recv([2, 2], DType::F32, 0, 7, &pg, &device).unwrap();
            Some(t.into_data().try_into_vec::<f32>().unwrap())
        };
        (avg, received)
    });
    assert_eq!(out[0].0, vec![0.5, 1.0]);
    assert_eq!(out[1].1, Some(vec![1.0, 2.0, 3.0, 4.0]));
}

/// The device check the GPU kit runs on CUDA over NCCL (`plane::testing`), here on Flex over
/// 1 and 3 rank threads: right values, and nothing staged on a host device.
#[test]
fn the_device_check_passes_on_flex() {
    for n in [1, 3] {
        let moved = world(n, |pg| {
            plane::testing::collectives_on_device(&pg, &Device::flex())
        });
        assert_eq!(moved, vec![0; n], "{n} ranks");
    }
}
