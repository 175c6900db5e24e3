//! [`linear`]: a linear layer's `x · Wᵀ + b` as one compute-bound autodiff node — the
//! product ([`ProductBackend::product`]) with the bias added in place over its fresh output
//! ([`FusedBackend::add_bias`]), backward the product's two gradients and the bias's (the
//! gradient's column sums, [`FusedBackend::bias_grad`]).
//!
//! As two nodes (the product, then `add_bias`) the values are the same bit for bit, but under
//! Balanced checkpointing (ZeRO-3's) the product's output is a checkpoint: kept for the add's
//! recompute, so the add cannot reuse its buffer and writes a second one (on the bench GPT
//! under ZeRO-3, `perf`: the bias adds 4 × the samples of the in-place ones), and backward
//! runs the add again. As one node the output is the checkpoint, written once.

use super::{ProductBackend, ProductLayout, ProductNode};
use crate::fused::FusedBackend;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;

/// `lhs · rhs + bias` for `[m, k] × [k, n]` and `bias` `[n]` over the rows: one autodiff node
/// where [`super::matmul`] runs its own product (Flex in f32, or in bf16 with a
/// [`super::bf16_kernel`]) and the bias has the operands' dtype; otherwise
/// `add_bias(matmul(lhs, rhs), bias)`. The same values either way.
pub fn linear(lhs: Tensor<2>, rhs: Tensor<2>, bias: Tensor<1>) -> Tensor<2> {
    let dtype = lhs.dtype();
    let ours = [rhs.dtype(), bias.dtype()].iter().all(|d| *d == dtype)
        && super::is_ours(dtype)
        && crate::device::is_flex(&lhs.device());
    if !ours {
        return crate::fused::add_bias(super::matmul(lhs, rhs), bias);
    }
    Tensor::from_dispatch(<Dispatch as LinearBackend>::product_bias(
        lhs.into_dispatch(),
        rhs.into_dispatch(),
        bias.into_dispatch(),
    ))
}

/// Backends that run [`linear`]'s node.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait LinearBackend: Backend {
    /// `lhs · rhs + bias`, `[m, k] × [k, n]`, `bias` `[n]`.
    fn product_bias(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// A concrete backend's forward: its product, then its `add_bias` (in place over the fresh
/// output where the backend can).
macro_rules! product_then_bias {
    ($backend:ty) => {
        impl LinearBackend for $backend {
            fn product_bias(
                lhs: FloatTensor<Self>,
                rhs: FloatTensor<Self>,
                bias: FloatTensor<Self>,
            ) -> FloatTensor<Self> {
                Self::add_bias(Self::product(lhs, rhs), bias)
            }
        }
    };
}

product_then_bias!(Flex);
#[cfg(any(feature = "wgpu", feature = "cuda"))]
product_then_bias!(burn::backend::Cube);

impl<B, C> LinearBackend for Autodiff<B, C>
where
    B: LinearBackend + ProductBackend + ProductLayout + FusedBackend,
    C: CheckpointStrategy,
{
    fn product_bias(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
        let product = ProductNode {
            rhs_column_major: B::is_column_major(rhs.primitive()),
        };
        match LinearNode(product)
            .prepare::<C>([lhs.node(), rhs.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let lhs_kept = rhs_tracked.then(|| prep.checkpoint(&lhs));
                let rhs_kept = lhs_tracked.then(|| prep.checkpoint(&rhs));
                let (lhs, rhs, bias) = (lhs.into_primitive(), rhs.into_primitive(), bias);
                let out = B::product_bias(lhs, rhs, bias.into_primitive());
                prep.finish((lhs_kept, rhs_kept), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::product_bias(
                lhs.into_primitive(),
                rhs.into_primitive(),
                bias.into_primitive(),
            )),
        }
    }
}

/// The autodiff node of [`LinearBackend::product_bias`]: the product's, with the bias's gradient.
#[derive(Debug)]
struct LinearNode(ProductNode);

impl<B: ProductBackend + FusedBackend> Backward<B, 3> for LinearNode {
    /// The product's operands, kept as [`ProductNode`] keeps them.
    type State = (Option<NodeId>, Option<NodeId>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, ckpt: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [p_lhs, p_rhs, p_bias] = ops.parents;
        if let Some(p) = p_bias {
            grads.register::<B>(p.id, B::bias_grad(grad.clone()));
        }
        let parents = [p_lhs.map(|p| p.id), p_rhs.map(|p| p.id)];
        self.0
            .operand_grads::<B>(grad, ops.state, parents, grads, ckpt);
    }
}
