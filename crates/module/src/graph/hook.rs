//! The gradient hook: an identity op on a parameter whose backward hands the parameter's
//! finished gradient to a closure instead of storing it.
//!
//! Why two inputs: Burn runs backward deepest node first. A hook on a parameter alone is a
//! shallow node (depth 1) and would fire at the very end of backward, too late to overlap
//! anything. Giving the hook a second, *anchor* input — the layer's input activation — puts
//! it right below the layer in the graph, so it fires as soon as that layer's backward is done
//! while the earlier layers still compute. The anchor only positions the node: no gradient
//! flows to it through the hook.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Backend, BackendTensor, Dispatch, DispatchKindConversion, Flex, backend_extension,
};
use burn::tensor::{DispatchTensor, Shape, Tensor};
use std::sync::Arc;

/// The closure a [`GradHookBackend::grad_hook`] calls with the finished gradient, flattened to
/// one dimension, on the device it was computed on (no autodiff: a value, as in Burn's
/// `Gradients`).
#[derive(Clone)]
pub struct GradHook(pub Arc<dyn Fn(Tensor<1>) + Send + Sync>);

impl GradHook {
    /// A hook calling `f` with each gradient.
    pub fn new(f: impl Fn(Tensor<1>) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }
}

impl std::fmt::Debug for GradHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GradHook")
    }
}

/// Burn backends that support gradient hooks (`Flex`, `Autodiff<B>`, and `Cube` with the
/// `cuda` or `wgpu` feature).
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait GradHookBackend: Backend {
    /// Returns `weight` unchanged; in backward, passes its gradient to `hook` (and stores
    /// none). `anchor` places the node in the graph (see the module docs).
    fn grad_hook(
        weight: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        hook: GradHook,
    ) -> FloatTensor<Self>;
}

/// A concrete backend's forward: the weight itself (the hook only exists in backward).
macro_rules! forward_is_identity {
    ($backend:ty) => {
        impl GradHookBackend for $backend {
            fn grad_hook(
                weight: FloatTensor<Self>,
                _anchor: FloatTensor<Self>,
                _hook: GradHook,
            ) -> FloatTensor<Self> {
                weight
            }
        }
    };
}

forward_is_identity!(Flex);
#[cfg(any(feature = "cuda", feature = "wgpu"))]
forward_is_identity!(burn::backend::Cube);

#[derive(Debug)]
struct HookBackward {
    hook: GradHook,
}

impl<B: Backend> Backward<B, 2> for HookBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = ();

    fn backward(self, ops: Ops<(), 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let shape = burn::backend::TensorMetadata::shape(&grad);
        let n = shape.num_elements();
        let flat = match shape.num_dims() {
            // A weight's gradient may be a transposed view (see `bonfire_kernels::contiguous`).
            2 => {
                let dispatch = <DispatchTensor as DispatchKindConversion<B>>::from_backend(
                    BackendTensor::Float(grad),
                );
                bonfire_kernels::contiguous(Tensor::<2>::from_dispatch(dispatch)).reshape([n])
            }
            _ => {
                let flat = B::float_reshape(grad, Shape::new([n]));
                Tensor::from_dispatch(<DispatchTensor as DispatchKindConversion<B>>::from_backend(
                    BackendTensor::Float(flat),
                ))
            }
        };
        (self.hook.0)(flat);
    }
}

impl<B: GradHookBackend, C: CheckpointStrategy> GradHookBackend for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn grad_hook(
        weight: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        hook: GradHook,
    ) -> FloatTensor<Self> {
        let prep = HookBackward { hook }.prepare::<C>([weight.node(), anchor.node()]);
        drop(anchor);
        prep.compute_bound().stateless(weight.into_primitive())
    }
}

/// `weight`, with `hook` called on its gradient in backward right after the consumers of
/// `anchor` (see the module docs).
pub fn hooked<const D: usize, const A: usize>(
    weight: Tensor<D>,
    anchor: &Tensor<A>,
    hook: GradHook,
) -> Tensor<D> {
    Tensor::from_dispatch(hooked_dispatch(
        weight.into_dispatch(),
        anchor.clone().into_dispatch(),
        hook,
    ))
}

/// [`hooked`] on rank-erased tensors (what a [`crate::LayerHook`] sees).
pub fn hooked_dispatch(
    weight: DispatchTensor,
    anchor: DispatchTensor,
    hook: GradHook,
) -> DispatchTensor {
    <Dispatch as GradHookBackend>::grad_hook(weight, anchor, hook)
}
