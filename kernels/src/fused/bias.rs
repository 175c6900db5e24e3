//! [`super::add_bias`]: a linear layer's `y + b` (`b` `[N]` over `y`'s last dim) as one
//! autodiff node whose backward sums the gradient's rows into `b`'s gradient in one pass.
//! Burn's broadcast add reduces `[B, T, N]` one leading dim at a time (the first with a
//! `T × N` accumulator, its rows copied out, then the second); on Flex in f32 both ways here
//! are single passes over host slices: the add in place when `y`'s buffer can be reused (a
//! product's fresh output is), the sum four rows at a time into an `N`-value accumulator,
//! inputs prefetched. Elsewhere (CubeCL, 16-bit) Burn's ops on the flattened `[rows, N]`.

use super::backend::FusedBackend;
use super::host::{self, FlexTensor};
use crate::simd::vectorized;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata};
use burn::tensor::Shape;
use std::marker::PhantomData;

/// `x + bias` in Burn ops (any backend; the reference): `bias` reshaped `[1, .., 1, N]`.
pub(super) fn forward_fallback<B: Backend>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
) -> FloatTensor<B> {
    let mut dims = vec![1; x.shape().num_dims()];
    *dims.last_mut().expect("a tensor of rank ≥ 1") = bias.shape().num_elements();
    B::float_add(x, B::float_reshape(bias, Shape::from(dims)))
}

/// `grad` summed over every dim but the last, `[N]`, in Burn ops.
pub(super) fn grad_fallback<B: Backend>(grad: FloatTensor<B>) -> FloatTensor<B> {
    let n = *grad.shape().last().expect("a tensor of rank ≥ 1");
    let rows = grad.shape().num_elements() / n.max(1);
    let flat = B::float_reshape(grad, Shape::new([rows, n]));
    B::float_reshape(B::float_sum_dim(flat, 0), Shape::new([n]))
}

/// Whether the host kernels take `x` and `bias` (both f32; `bias` as long as `x`'s last dim).
pub(super) fn flex_covers(x: &FlexTensor, bias: &FlexTensor) -> bool {
    host::all_f32(&[x, bias]) && x.shape().last() == Some(&bias.shape().num_elements())
}

/// `x + bias` on Flex f32, into `x`'s buffer when it can be reused.
pub(super) fn forward_flex(x: FlexTensor, bias: FlexTensor) -> FlexTensor {
    let bias = host::contiguous(bias);
    host::zip_rows(x, host::values(&bias), |v, b| v + b)
}

/// Each column's sum of `grad` viewed `[rows, N]`, on Flex f32.
pub(super) fn grad_flex(grad: FlexTensor) -> FlexTensor {
    let n = *grad.shape().last().expect("a tensor of rank ≥ 1");
    let grad = host::contiguous(grad);
    let mut sums = vec![0f32; n];
    if n > 0 {
        column_sums(host::values(&grad), &mut sums);
    }
    host::from_vec(sums, vec![n])
}

vectorized! {
    /// `sums[j] = Σ_r m[r·N + j]` (`N = sums.len()`), four rows a step:
    /// `sums += (r₀ + r₁) + (r₂ + r₃)`, then the last rows one at a time.
    fn column_sums(m: &[f32], sums: &mut [f32]) {
        let n = sums.len();
        let mut quads = m.chunks_exact(4 * n);
        for (q, quad) in quads.by_ref().enumerate() {
            host::prefetch(m, (q + 2) * 4 * n, 4 * n);
            let (r0, rest) = quad.split_at(n);
            let (r1, rest) = rest.split_at(n);
            let (r2, r3) = rest.split_at(n);
            for ((((s, &a), &b), &c), &d) in sums.iter_mut().zip(r0).zip(r1).zip(r2).zip(r3) {
                *s += (a + b) + (c + d);
            }
        }
        for row in quads.remainder().chunks_exact(n) {
            for (s, &v) in sums.iter_mut().zip(row) {
                *s += v;
            }
        }
    }
}

#[derive(Debug)]
struct AddBiasBackward;

impl<B: FusedBackend> Backward<B, 2> for AddBiasBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [x, bias] = ops.parents;
        if let Some(bias) = bias {
            grads.register::<B>(bias.id, B::bias_grad(grad.clone()));
        }
        if let Some(x) = x {
            grads.register::<B>(x.id, grad);
        }
    }
}

/// The add run again from its inputs (Balanced checkpointing's recompute of an output).
struct RetroAddBias<B> {
    x: NodeId,
    bias: NodeId,
    _backend: PhantomData<fn() -> B>,
}

impl<B> std::fmt::Debug for RetroAddBias<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetroAddBias").field("x", &self.x).finish()
    }
}

impl<B: FusedBackend> RetroForward for RetroAddBias<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let x = states.get_state::<FloatTensor<B>>(&self.x);
        let bias = states.get_state::<FloatTensor<B>>(&self.bias);
        states.save(out_node, B::add_bias(x, bias))
    }
}

/// The autodiff node of [`FusedBackend::add_bias`]: memory-bound and stateless, as Burn's own
/// add is (under Balanced checkpointing backward recomputes the output from the inputs, which
/// the checkpointer keeps), so the layers' memory is what it was with Burn's add.
pub(super) fn add_bias_autodiff<B: FusedBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    bias: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let retro = RetroAddBias::<B> {
        x: x.id(),
        bias: bias.id(),
        _backend: PhantomData,
    };
    AddBiasBackward
        .prepare::<C>([x.node(), bias.node()])
        .memory_bound()
        .retro_forward(retro)
        .parents([&x, &bias])
        .stateless(B::add_bias(x.into_primitive(), bias.into_primitive()))
}
