//! A tensor placed in a device's autodiff context: what a module's parameter needs after it
//! is moved or rebuilt (forked onto a rank's device, gathered, received) so that its graph
//! uses the device's gradient-checkpointing strategy.

use burn::tensor::Tensor;

/// `tensor` with `device`'s autodiff context where `device` has one (autodiff with the
/// device's gradient-checkpointing strategy); unchanged on a plain device.
pub fn with_context_of<const D: usize>(
    tensor: Tensor<D>,
    device: &burn::tensor::Device,
) -> Tensor<D> {
    match device.gradient_checkpointing_strategy() {
        Some(strategy) => tensor
            .autodiff()
            .with_gradient_checkpointing_strategy(strategy),
        None => tensor,
    }
}
