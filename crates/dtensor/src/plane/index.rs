//! Integer tensors across the host boundary, counted like the float ones: the routed token
//! counts of expert parallelism (the sizes of its all-to-alls) read to the host, and the index
//! tensors built from them written back (reason `Routing`).

use super::is_host;
use super::ledger::{self, Direction, Reason};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// The non-negative counts of `tensor` (`[n]`, integers) on the host, for `reason`.
pub fn counts_to_host(tensor: Tensor<1, Int>, reason: Reason) -> Vec<usize> {
    let device = tensor.device();
    let data = tensor.into_data();
    if !is_host(&device) {
        ledger::record(Direction::DeviceToHost, reason, data.bytes().len());
    }
    data.convert::<i64>()
        .try_into_vec::<i64>()
        .expect("integer data")
        .into_iter()
        .map(|c| usize::try_from(c).expect("a count is not negative"))
        .collect()
}

/// An index tensor `[values.len()]` on `device` from host `values`, for `reason`.
pub fn indices_from_host(values: Vec<i64>, device: &Device, reason: Reason) -> Tensor<1, Int> {
    let len = values.len();
    let data = TensorData::new(values, [len]);
    if !is_host(device) {
        ledger::record(Direction::HostToDevice, reason, data.bytes().len());
    }
    Tensor::from_data(data, device)
}
