//! [`super::silu_mul`]: `silu(gate) ⊙ up`, the SwiGLU MLP's activation, as one autodiff
//! node (Burn's autodiff keeps `gate`, `sigmoid(gate)`, `silu(gate)` and `up` over three
//! nodes). Backward: `d_up = g ⊙ silu(gate)`, `d_gate = g ⊙ up ⊙ σ(gate)·(1 + gate·(1 − σ(gate)))`.
//! On Flex in f32 each way is one pass over host slices with the vectorizable `exp` of
//! [`super::gelu`].

use super::backend::FusedBackend;
use super::gelu::exp;
use super::host::{self, FlexTensor};
use crate::simd::vectorized;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata};
use burn::tensor::Scalar;

/// `silu(gate) ⊙ up` in Burn ops (any backend; the reference).
pub(super) fn forward_fallback<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
) -> FloatTensor<B> {
    let s = B::sigmoid(gate.clone());
    B::float_mul(B::float_mul(gate, s), up)
}

/// `(d_gate, d_up)` in Burn ops.
pub(super) fn backward_fallback<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let s = B::sigmoid(gate.clone());
    let silu = B::float_mul(gate.clone(), s.clone());
    let d_up = B::float_mul(grad.clone(), silu);
    // σ·(1 + gate·(1 − σ)) = σ + silu − silu·σ.
    let one_minus = B::float_add_scalar(B::float_neg(s.clone()), Scalar::Float(1.0));
    let dsilu = B::float_mul(
        s.clone(),
        B::float_add_scalar(B::float_mul(gate, one_minus), Scalar::Float(1.0)),
    );
    (B::float_mul(B::float_mul(grad, up), dsilu), d_up)
}

/// `σ(x)`, with the clamped vectorizable `exp`.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `silu(gate) ⊙ up` on Flex f32, into `gate`'s buffer when it can be reused.
pub(super) fn forward_flex(gate: FlexTensor, up: FlexTensor) -> FlexTensor {
    host::zip(gate, up, |g, u| g * sigmoid(g) * u)
}

/// `(d_gate, d_up)` on Flex f32, one pass.
pub(super) fn backward_flex(
    gate: FlexTensor,
    up: FlexTensor,
    grad: FlexTensor,
) -> (FlexTensor, FlexTensor) {
    assert!(gate.shape() == up.shape() && up.shape() == grad.shape());
    let shape = gate.shape().to_vec();
    let (gate, up) = (host::contiguous(gate), host::contiguous(up));
    let mut d_gate = host::writable(grad);
    let n = shape.iter().product::<usize>();
    let mut d_up = vec![0f32; n];
    let dg = host::owned(&mut d_gate).expect("a writable buffer");
    silu_mul_grads(dg, &mut d_up, host::values(&gate), host::values(&up));
    (d_gate, host::from_vec(d_up, shape))
}

vectorized! {
    /// `d_up = g · x · σ(x)` and `d_gate = g · u · σ(x) · (1 + x (1 − σ(x)))` with `g` read
    /// from (and `d_gate` written over) `dg`; all four slices one length.
    fn silu_mul_grads(dg: &mut [f32], d_up: &mut [f32], gate: &[f32], up: &[f32]) {
        let n = dg.len();
        let (d_up, gate, up) = (&mut d_up[..n], &gate[..n], &up[..n]);
        for i in 0..n {
            let (x, u, g) = (gate[i], up[i], dg[i]);
            let s = sigmoid(x);
            d_up[i] = g * x * s;
            dg[i] = g * u * s * (1.0 + x * (1.0 - s));
        }
    }
}

#[derive(Debug)]
struct SiluMulBackward;

impl<B: FusedBackend> Backward<B, 2> for SiluMulBackward {
    /// `gate` and `up`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (d_gate, d_up) = B::silu_mul_backward(gate, up, grad);
        let [pg, pu] = ops.parents;
        if let Some(p) = pg {
            grads.register::<B>(p.id, d_gate);
        }
        if let Some(p) = pu {
            grads.register::<B>(p.id, d_up);
        }
    }
}

/// The autodiff node of [`FusedBackend::silu_mul`]: it keeps both inputs.
pub(super) fn silu_mul_autodiff<B: FusedBackend, C: CheckpointStrategy>(
    gate: FloatTensor<Autodiff<B, C>>,
    up: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    match SiluMulBackward
        .prepare::<C>([gate.node(), up.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (gate, up) = (gate.into_primitive(), up.into_primitive());
            prep.finish((gate.clone(), up.clone()), B::silu_mul(gate, up))
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(B::silu_mul(gate.into_primitive(), up.into_primitive()))
        }
    }
}
