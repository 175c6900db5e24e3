//! What the host collectives and the ring shift share: a communicator's outcome turned into the
//! panic a Burn operation raises ([`check`]), and a tensor's host buffer as a slice.

use bonfire_comm::CommError;
use burn::tensor::{Element as BurnElement, TensorData};

/// Panics with `what`'s failure (a Burn operation is infallible; see the crate's docs).
pub(super) fn check(result: Result<(), CommError>, what: &str) {
    if let Err(e) = result {
        panic!("bonfire-dtensor: {what} failed: {e}");
    }
}

/// `data`'s elements.
pub(super) fn slice<T: BurnElement>(data: &TensorData) -> &[T] {
    data.as_slice::<T>()
        .expect("bonfire-dtensor: tensor data is not host-readable")
}

/// `data`'s elements, writable.
pub(super) fn slice_mut<T: BurnElement>(data: &mut TensorData) -> &mut [T] {
    data.as_mut_slice::<T>()
        .expect("bonfire-dtensor: tensor data is not host-writable")
}
