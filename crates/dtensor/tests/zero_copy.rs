//! In-place collectives hand the tensor's own allocation to the communicator: no copy.

mod common;
use bonfire_comm::ReduceOp;
use bonfire_dtensor::functional::{all_reduce, broadcast};
use burn::backend::Flex;
use burn::tensor::{Device, Tensor, TensorData};
use common::world;

/// The address of the tensor's buffer.
fn address(t: Tensor<1>) -> (Tensor<1>, usize) {
    let primitive = t.try_into_primitive::<Flex>().unwrap();
    let address = primitive.bytes().as_ptr() as usize;
    (Tensor::from_primitive::<Flex>(primitive), address)
}

#[test]
fn all_reduce_and_broadcast_reuse_the_tensor_buffer() {
    let out = world(2, |pg| {
        let data = TensorData::new(vec![pg.rank() as f32 + 1.0; 4096], [4096]);
        let (x, before) = address(Tensor::<1>::from_data(data, &Device::flex()));
        let (y, after_reduce) = address(all_reduce(x, &pg, ReduceOp::Sum));
        let (z, after_broadcast) = address(broadcast(y, &pg, 1).unwrap());
        let values = z.into_data().try_to_vec::<f32>().unwrap();
        (
            before == after_reduce && after_reduce == after_broadcast,
            values.iter().all(|&v| v == 3.0),
        )
    });
    assert!(out.iter().all(|&(same, right)| same && right), "{out:?}");
}
