//! What both kernel suites use: host copies, tensors from values, and a fixed spread of
//! values in [-3.5, 3.8).

#![allow(dead_code)]

use burn::tensor::{DType, Device, Tensor, TensorData};

/// `t`'s values as f32 on the host.
pub fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap()
}

/// A 1-d f32 tensor of `values` on `device`.
pub fn tensor(values: &[f32], device: &Device) -> Tensor<1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// `n` values from a multiplicative hash of the index, varied by `seed`.
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) % 1000)
        .map(|x| x as f32 / 137.0 - 3.5)
        .collect()
}
