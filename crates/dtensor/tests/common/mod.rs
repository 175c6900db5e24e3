//! Helpers shared by the integration tests.
#![allow(dead_code)]

use bonfire_comm::{ProcessGroup, ThreadWorld};
use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor, TensorData};
use std::time::Duration;

/// An autodiff CPU device (each rank thread makes its own leaves on it).
pub fn dev() -> Device {
    Device::flex().autodiff()
}

/// Runs `f` on `n` rank threads with a short timeout, panicking with every rank's failure.
pub fn world<R: Send>(n: usize, f: impl Fn(ProcessGroup) -> R + Sync) -> Vec<R> {
    ThreadWorld::new(n)
        .timeout(Duration::from_secs(20))
        .launch(f)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Small integer-valued data (exact in f32 under sums), different for each `seed`.
pub fn values(seed: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7 + seed * 13 + 3) % 11) as f32) - 5.0)
        .collect()
}

/// A tensor of integer-valued data for `seed`.
pub fn tensor<const D: usize>(seed: usize, shape: [usize; D], device: &Device) -> Tensor<D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(seed, n), shape), device)
}

/// A tracked leaf of integer-valued data for `seed`.
pub fn leaf<const D: usize>(seed: usize, shape: [usize; D]) -> Tensor<D> {
    tensor(seed, shape, &dev()).require_grad()
}

/// The tensor's values.
pub fn vec_of<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// Asserts two float slices agree within `1e-4·max(|a|, |b|) + 1e-4`.
pub fn assert_close(a: &[f32], b: &[f32], what: &str) {
    let tol = bonfire_comm::testing::Tolerance::new(1e-4, 1e-4);
    bonfire_comm::testing::assert_close(what, a, b, tol);
}

/// Asserts two float slices of the integer-valued data agree within `2e-7·max(|a|, |b|)`:
/// sums and copies of them are exact in f32, only averages round (the largest difference
/// measured: 6e-8, in the gradients of `all_reduce` avg).
pub fn assert_near_exact(a: &[f32], b: &[f32], what: &str) {
    let tol = bonfire_comm::testing::Tolerance::new(2e-7, 0.0);
    bonfire_comm::testing::assert_close(what, a, b, tol);
}

/// `module` with every parameter value-less (its values must come from a hook).
pub fn hollow<M: Module>(module: M) -> M {
    struct Hollow;
    impl burn::module::ModuleMapper for Hollow {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, shape, device) = (p.id, p.lazy_shape(), p.lazy_device());
            Param::uninitialized(id, |_, _| panic!("supplied"), device, true, shape)
        }
    }
    module.map(&mut Hollow)
}
