//! [`linear_cross_entropy`]: a language model's head and its loss as one autodiff node —
//! `mean(cross_entropy(hidden · Wᵀ, targets))` computed a block of rows at a time, each
//! block's logits made, reduced and turned into their gradient while they are in cache, then
//! dropped: the `[N, V]` logits never exist whole, and neither does their gradient.
//!
//! The loss ends the graph, so its gradient is one scalar `g` (1 for a plain `backward`,
//! `1/k` under gradient accumulation that scales the loss): forward computes the gradients
//! for `g = 1` as it goes — `dh = dlogits · W` for the block's rows, `dW += dlogitsᵀ · h` —
//! and keeps them (`N × d` and `V × d`, the size of the hidden and of the weight) instead of
//! the logits (`N × V`); backward multiplies them by `g`. Unfused, the head keeps its `N × V`
//! logits (f32 for the loss, and the compute dtype's too under mixed precision) from forward
//! to backward and writes an `N × V` gradient on top: with a Llama-3 vocabulary (128,256)
//! that is 0.5 GB of f32 a 1,024-token row block, several times the hidden and the weight.
//!
//! Each block runs the ops the unfused head runs — the product ([`ProductBackend::product`]),
//! the fused cross-entropy's forward and backward ([`FusedBackend::cross_entropy_lse`],
//! [`FusedBackend::cross_entropy_backward`]), in f32 whatever the compute dtype, as autocast
//! does — so with one block and `g = 1` the loss and both gradients are the unfused head's bit
//! for bit on Flex (tested); with several, the weight's gradient sums the blocks' products
//! (rounding differs in the last bits).

use crate::fused::FusedBackend;
use crate::matmul::ProductBackend;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, FloatDType, Int, Scalar, Shape, Slice, Tensor};

/// The mean over the rows of `hidden` `[N, d]` of `−log softmax(hidden · weightᵀ)[target]`,
/// `[1]`, for `weight` `[V, d]` (a head's, PyTorch's layout) and class ids `targets` `[N]`,
/// `chunk_rows` rows at a time (at least 1); one autodiff node (see the module docs). The
/// logits' softmax is taken in f32 whatever `hidden`'s dtype.
pub fn linear_cross_entropy(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    targets: Tensor<1, Int>,
    chunk_rows: usize,
) -> Tensor<1> {
    assert!(
        chunk_rows > 0,
        "linear_cross_entropy: chunk_rows must be at least 1"
    );
    let ([n, d], [_, dw]) = (hidden.dims(), weight.dims());
    assert_eq!(
        d, dw,
        "linear_cross_entropy: hidden [N, d] and weight [V, d] differ in d"
    );
    assert_eq!(
        targets.dims(),
        [n],
        "linear_cross_entropy: one target a row"
    );
    assert!(n > 0, "linear_cross_entropy: no rows");
    Tensor::from_dispatch(
        <Dispatch as LinearCrossEntropyBackend>::linear_cross_entropy(
            hidden.into_dispatch(),
            weight.into_dispatch(),
            targets.into_dispatch(),
            chunk_rows,
        ),
    )
}

/// The rows of a block of `chunk_rows` whose logits `[rows, V]` take about `bytes` in f32
/// (at least 1 row): a size for [`linear_cross_entropy`]'s `chunk_rows`.
pub fn rows_within(bytes: usize, vocab: usize) -> usize {
    (bytes / (4 * vocab.max(1))).max(1)
}

/// Backends that run [`linear_cross_entropy`]'s node.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait LinearCrossEntropyBackend: Backend {
    /// See [`linear_cross_entropy`].
    fn linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_rows: usize,
    ) -> FloatTensor<Self>;
}

/// A concrete backend's node: the loss by blocks, no gradient.
macro_rules! untracked {
    ($backend:ty) => {
        impl LinearCrossEntropyBackend for $backend {
            fn linear_cross_entropy(
                hidden: FloatTensor<Self>,
                weight: FloatTensor<Self>,
                targets: IntTensor<Self>,
                chunk_rows: usize,
            ) -> FloatTensor<Self> {
                by_blocks::<Self>(hidden, weight, targets, chunk_rows, false).0
            }
        }
    };
}

untracked!(Flex);
#[cfg(any(feature = "wgpu", feature = "cuda"))]
untracked!(burn::backend::Cube);

/// The gradients of `hidden` and of `weightᵀ` for an output gradient of 1.
type HeadGrads<B> = (FloatTensor<B>, FloatTensor<B>);

/// The loss `[1]` and, `with_grads`, [`HeadGrads`], block by block (see the module docs).
fn by_blocks<B: ProductBackend + FusedBackend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    chunk_rows: usize,
    with_grads: bool,
) -> (FloatTensor<B>, Option<HeadGrads<B>>) {
    let n = hidden.shape()[0];
    let (dtype, device) = (hidden.dtype(), hidden.device());
    let weight_t = B::float_transpose(weight.clone());
    let mut loss: Option<FloatTensor<B>> = None;
    let (mut dh_blocks, mut dw_t) = (Vec::new(), None);
    for start in (0..n).step_by(chunk_rows) {
        let rows = chunk_rows.min(n - start);
        let range = Slice::new(start as isize, Some((start + rows) as isize), 1);
        let (h, t) = match rows == n {
            true => (hidden.clone(), targets.clone()),
            false => (
                B::float_slice(hidden.clone(), &[range, Slice::full()]),
                B::int_slice(targets.clone(), &[range]),
            ),
        };
        let logits = cast::<B>(B::product(h.clone(), weight_t.clone()), DType::F32);
        let (block_loss, lse) = B::cross_entropy_lse(logits.clone(), t.clone());
        // This block's share of the mean over all rows (the blocks' means weighted by rows).
        let share = rows as f64 / n as f64;
        let block_loss = match rows == n {
            true => block_loss,
            false => B::float_mul_scalar(block_loss, Scalar::Float(share)),
        };
        loss = Some(match loss {
            None => block_loss,
            Some(sum) => B::float_add(sum, block_loss),
        });
        if !with_grads {
            continue;
        }
        // `(softmax − onehot) · share / rows` = `… / n`: the gradient of the mean over all rows.
        let scale = B::float_full(
            Shape::new([1]),
            Scalar::Float(share),
            &device,
            FloatDType::F32,
        );
        let dlogits = B::cross_entropy_backward(logits, lse, t, scale);
        let dlogits = cast::<B>(dlogits, dtype);
        dh_blocks.push(B::product(dlogits.clone(), weight.clone()));
        // `Wᵀ`'s gradient `hᵀ · dlogits` `[d, V]`, summed over the blocks in place: the
        // orientation the unfused head's product takes for a weight wider than tall (`gemm`'s
        // workspace grows with the width of the rows it writes: see `ProductNode`).
        let h_t = B::float_transpose(h);
        dw_t = Some(match dw_t {
            None => B::product(h_t, dlogits),
            Some(sum) => B::product_add(sum, h_t, dlogits),
        });
    }
    let loss = loss.expect("at least one row (checked by linear_cross_entropy)");
    let grads = dw_t.map(|dw_t| {
        let dh = match dh_blocks.len() {
            1 => dh_blocks.pop().expect("one block"),
            _ => B::float_cat(dh_blocks, 0),
        };
        (dh, dw_t)
    });
    (loss, grads)
}

/// `t` in `dtype` (itself when it is).
fn cast<B: Backend>(t: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    match t.dtype() == dtype {
        true => t,
        false => B::float_cast(t, float_dtype(dtype)),
    }
}

/// A float `DType` as a [`FloatDType`] (f32 for any other).
fn float_dtype(dtype: DType) -> FloatDType {
    match dtype {
        DType::F64 => FloatDType::F64,
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        _ => FloatDType::F32,
    }
}

impl<B, C> LinearCrossEntropyBackend for Autodiff<B, C>
where
    B: LinearCrossEntropyBackend + ProductBackend + FusedBackend,
    C: CheckpointStrategy,
{
    fn linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_rows: usize,
    ) -> FloatTensor<Self> {
        match HeadLossNode
            .prepare::<C>([hidden.node(), weight.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (h, w) = (hidden.into_primitive(), weight.into_primitive());
                let (loss, grads) = by_blocks::<B>(h, w, targets, chunk_rows, true);
                prep.finish(grads.expect("computed with_grads"), loss)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::linear_cross_entropy(
                hidden.into_primitive(),
                weight.into_primitive(),
                targets,
                chunk_rows,
            )),
        }
    }
}

/// The autodiff node of [`LinearCrossEntropyBackend::linear_cross_entropy`]: it keeps the
/// gradients forward computed for an output gradient of 1.
#[derive(Debug)]
struct HeadLossNode;

impl<B: Backend> Backward<B, 2> for HeadLossNode {
    /// [`HeadGrads`] (`weightᵀ`'s `[d, V]` contiguous: scaled in place where the backend
    /// can).
    type State = HeadGrads<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let g = grads.consume::<B>(&ops.node);
        let (dh, dw_t) = ops.state;
        let [p_hidden, p_weight] = ops.parents;
        // `t · g`, `g` broadcast from `[1]` (in `t`'s dtype).
        let scaled = |t: FloatTensor<B>| {
            let g = cast::<B>(g.clone(), t.dtype());
            let g = B::float_expand(B::float_reshape(g, Shape::new([1, 1])), t.shape());
            B::float_mul(t, g)
        };
        if let Some(p) = p_hidden {
            grads.register::<B>(p.id, scaled(dh));
        }
        if let Some(p) = p_weight {
            grads.register::<B>(p.id, B::float_transpose(scaled(dw_t)));
        }
    }
}

#[cfg(test)]
mod tests;
