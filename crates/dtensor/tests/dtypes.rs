//! The collectives move f64, f16 and bf16 tensors as well as f32.

mod common;
use bonfire_comm::ReduceOp;
use bonfire_dtensor::functional::{all_gather, all_reduce};
use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};
use common::world;

fn run(dtype: FloatDType, expected: DType) {
    let out = world(2, |pg| {
        let r = pg.rank() as f32;
        let x = Tensor::<1>::from_data(
            TensorData::new(vec![r + 1.0, r + 2.0], [2]),
            &Device::flex(),
        )
        .cast(dtype);
        assert_eq!(x.dtype(), expected);
        let sum = all_reduce(x.clone(), &pg, ReduceOp::Sum);
        let gathered = all_gather(x, &pg, 0).unwrap();
        assert_eq!(sum.dtype(), expected);
        (
            sum.into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap(),
            gathered
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap(),
        )
    });
    for (sum, gathered) in out {
        assert_eq!(sum, vec![3.0, 5.0]);
        assert_eq!(gathered, vec![1.0, 2.0, 2.0, 3.0]);
    }
}

#[test]
fn f64_f16_bf16() {
    run(FloatDType::F64, DType::F64);
    run(FloatDType::F16, DType::F16);
    run(FloatDType::BF16, DType::BF16);
}
