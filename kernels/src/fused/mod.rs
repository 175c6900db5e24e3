//! Fused differentiable ops for a transformer's element-wise hot spots: one autodiff node each,
//! with a hand-written backward, where Burn's autodiff decomposes the op into five to ten
//! element-wise ops (each a pass over the tensor and a graph node with its own backward).
//!
//! - [`causal_softmax`]: `softmax(scale · scores + causal mask)` over the last dim; forward
//!   is the backend's own softmax kernel (Flex's is fused), backward
//!   `scale · P ⊙ (dP − Σ dP ⊙ P)`; both in f32 for 16-bit inputs (as under autocast).
//! - [`cross_entropy`]: the mean over rows of `−log softmax(logits)[target]`; backward
//!   `(softmax − onehot) · g / N`.
//! - [`gelu`]: the exact (erf) GELU. On Flex, f32, one vectorizable pass each way (an erf
//!   with ≤ 1.5e-7 absolute error and an exp by range reduction, sharing `exp(−x²/2)`)
//!   instead of Flex's scalar `libm::erff`; elsewhere Burn's own `gelu` / `gelu_backward`.
//! - [`exp`]: `exp`, its backward from the output it keeps (Burn's keeps the input).
//!
//! The math of every op is backend-generic (Burn ops on the inner backend) and runs on Flex,
//! on a CubeCL device (features `wgpu`, `cuda`) and under `Autodiff` of either.

mod cross_entropy;
mod gelu;

/// The branch-free, vectorizable `e^x` of the GELU kernel (relative error below 3e-7 on
/// `[−87, 88]`, clamped outside), shared with the attention kernels.
pub(crate) use gelu::exp as fast_exp;
pub(crate) mod host;
mod norm;
mod rope;
mod softmax;
mod swiglu;
#[cfg(test)]
mod tests;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, Int, Tensor};
use cross_entropy::cross_entropy_forward;
pub use softmax::causal_mask;
pub(crate) use softmax::causal_mask_values;
use softmax::causal_softmax_forward;

/// Backends that run Bonfire's fused ops (see the module docs). Call them through
/// [`causal_softmax`], [`cross_entropy`], [`gelu`] and [`exp`].
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait FusedBackend: Backend {
    /// `softmax(scale · scores + mask)` over the last dim of `[.., Tq, Tk]`, the mask −∞
    /// where a key comes after its query.
    fn causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self>;
    /// The mean over the rows of `logits` `[N, V]` of `−log softmax(row)[target]`, `[1]`.
    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self>;
    /// `0.5 · x · (1 + erf(x / √2))`.
    fn gelu_erf(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `grad · GELU′(x)` (not differentiable itself).
    fn gelu_erf_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `exp(x)`, its backward `grad · exp(x)` from the output it keeps.
    fn exp_keeping_output(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Over the last dim: `(x − mean)/√(var + eps)` (biased variance) when `centered`
    /// (LayerNorm's core), else `x/√(mean(x²) + eps)` (RMSNorm's).
    fn norm_core(x: FloatTensor<Self>, eps: f64, centered: bool) -> FloatTensor<Self>;
    /// [`Self::norm_core`]'s output `x̂` and each row's `rstd = 1/√(… + eps)` `[.., 1]`
    /// (not differentiable).
    fn norm_core_stats(
        x: FloatTensor<Self>,
        eps: f64,
        centered: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// The input gradient of [`Self::norm_core`] from `x̂`, `rstd` and the output gradient
    /// (not differentiable).
    fn norm_core_backward(
        xhat: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        centered: bool,
    ) -> FloatTensor<Self>;
    /// `silu(gate) ⊙ up`.
    fn silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
    /// The gradients of `gate` and `up` in [`Self::silu_mul`] (not differentiable).
    fn silu_mul_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// `x·cos + rotate_half(x)·sin`, `x` `[B, h, T, hd]`, tables `[T, hd]`.
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// The input gradient of [`Self::rope`] (not differentiable).
    fn rope_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// [`Self::cross_entropy`]'s loss and each row's log-sum-exp `[N, 1]` (not
    /// differentiable).
    fn cross_entropy_lse(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// `(softmax(logits) − onehot(targets)) · grad / N` (not differentiable).
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// `softmax(scale · scores + causal mask)` over the last dim of `[B, h, Tq, Tk]` (a query
/// attends to the keys at or before it; with `Tk > Tq` the queries are the last `Tq`).
pub fn causal_softmax(scores: Tensor<4>, scale: f64) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::causal_softmax(
        scores.into_dispatch(),
        scale,
    ))
}

/// Mean cross-entropy of `logits` `[N, V]` against class ids `targets` `[N]`.
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::cross_entropy(
        logits.into_dispatch(),
        targets.into_dispatch(),
    ))
}

/// The exact (erf) GELU.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::gelu_erf(x.into_dispatch()))
}

/// `exp(x)`, whose backward keeps the output rather than the input. Burn's `exp` keeps its
/// input and recomputes the exponential in backward; where the output is kept anyway — an
/// attention block's probabilities, which the product with the values saves — this keeps one
/// tensor instead of two.
pub fn exp<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::exp_keeping_output(
        x.into_dispatch(),
    ))
}

/// LayerNorm's core over the last dim: `(x − mean)/√(var + eps)`, biased variance (no
/// weight or bias).
pub fn layer_norm_core<const D: usize>(x: Tensor<D>, eps: f64) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::norm_core(
        x.into_dispatch(),
        eps,
        true,
    ))
}

/// RMSNorm's core over the last dim: `x/√(mean(x²) + eps)` (no weight).
pub fn rms_norm_core<const D: usize>(x: Tensor<D>, eps: f64) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::norm_core(
        x.into_dispatch(),
        eps,
        false,
    ))
}

/// `silu(gate) ⊙ up`, the SwiGLU activation, for two tensors of one shape.
pub fn silu_mul<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::silu_mul(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}

/// Rotary position embedding `x·cos + rotate_half(x)·sin`, `rotate_half(x) = [−x₂, x₁]`, on
/// `x` `[B, h, T, hd]` with tables `[T, hd]` (constants: they get no gradient).
pub fn rope(x: Tensor<4>, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::rope(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
    ))
}

/// `t` in f32 when it is a 16-bit type (softmax runs in f32 under autocast too), else as is.
pub(crate) fn widen<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    match t.dtype() {
        DType::F16 | DType::BF16 => B::float_cast(t, DType::F32.into()),
        _ => t,
    }
}

/// `t` in `dtype` (a no-op when it already is).
pub(crate) fn narrow_to<B: Backend>(t: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    match t.dtype() == dtype {
        true => t,
        false => B::float_cast(t, dtype.into()),
    }
}

// ---------------------------------------------------------------------------------------
// Concrete backends
// ---------------------------------------------------------------------------------------

impl FusedBackend for Flex {
    fn causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        causal_softmax_forward::<Self>(scores, scale)
    }
    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        Self::cross_entropy_lse(logits, targets).0
    }
    fn gelu_erf(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match x.dtype() {
            DType::F32 => gelu::gelu_flex(x),
            _ => <Self as burn::backend::ops::ActivationOps<Self>>::gelu(x),
        }
    }
    fn gelu_erf_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        match host::all_f32(&[&x, &grad]) {
            true => gelu::gelu_backward_flex(x, grad),
            false => <Self as burn::backend::ops::ActivationOps<Self>>::gelu_backward(x, grad),
        }
    }
    fn exp_keeping_output(x: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::backend::ops::FloatTensorOps<Self>>::float_exp(x)
    }
    fn norm_core(x: FloatTensor<Self>, eps: f64, centered: bool) -> FloatTensor<Self> {
        Self::norm_core_stats(x, eps, centered).0
    }
    fn norm_core_stats(
        x: FloatTensor<Self>,
        eps: f64,
        centered: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match host::all_f32(&[&x]) {
            true => norm::stats_flex(x, eps, centered),
            false => norm::stats_fallback::<Self>(x, eps, centered),
        }
    }
    fn norm_core_backward(
        xhat: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        centered: bool,
    ) -> FloatTensor<Self> {
        match host::all_f32(&[&xhat, &rstd, &grad]) {
            true => norm::backward_flex(xhat, rstd, grad, centered),
            false => norm::backward_fallback::<Self>(xhat, rstd, grad, centered),
        }
    }
    fn silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        match host::all_f32(&[&gate, &up]) {
            true => swiglu::forward_flex(gate, up),
            false => swiglu::forward_fallback::<Self>(gate, up),
        }
    }
    fn silu_mul_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match host::all_f32(&[&gate, &up, &grad]) {
            true => swiglu::backward_flex(gate, up, grad),
            false => swiglu::backward_fallback::<Self>(gate, up, grad),
        }
    }
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match rope::flex_covers(&x, &cos, &sin) {
            true => rope::flex(x, cos, sin, false),
            false => rope::fallback::<Self>(x, cos, sin, false),
        }
    }
    fn rope_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match rope::flex_covers(&grad, &cos, &sin) {
            true => rope::flex(grad, cos, sin, true),
            false => rope::fallback::<Self>(grad, cos, sin, true),
        }
    }
    fn cross_entropy_lse(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match cross_entropy::flex_covers(&logits, &targets) {
            true => cross_entropy::forward_flex(logits, targets),
            false => cross_entropy_forward::<Self>(logits, targets),
        }
    }
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match cross_entropy::flex_covers(&logits, &targets) && host::all_f32(&[&lse, &grad]) {
            true => cross_entropy::backward_flex(logits, lse, targets, grad),
            false => cross_entropy::cross_entropy_backward::<Self>(logits, lse, targets, grad),
        }
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl FusedBackend for burn::backend::Cube {
    fn causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        causal_softmax_forward::<Self>(scores, scale)
    }
    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        cross_entropy_forward::<Self>(logits, targets).0
    }
    fn gelu_erf(x: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::backend::ops::ActivationOps<Self>>::gelu(x)
    }
    fn gelu_erf_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::backend::ops::ActivationOps<Self>>::gelu_backward(x, grad)
    }
    fn exp_keeping_output(x: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::backend::ops::FloatTensorOps<Self>>::float_exp(x)
    }
    fn norm_core(x: FloatTensor<Self>, eps: f64, centered: bool) -> FloatTensor<Self> {
        norm::stats_fallback::<Self>(x, eps, centered).0
    }
    fn norm_core_stats(
        x: FloatTensor<Self>,
        eps: f64,
        centered: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        norm::stats_fallback::<Self>(x, eps, centered)
    }
    fn norm_core_backward(
        xhat: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        centered: bool,
    ) -> FloatTensor<Self> {
        norm::backward_fallback::<Self>(xhat, rstd, grad, centered)
    }
    fn silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu::forward_fallback::<Self>(gate, up)
    }
    fn silu_mul_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        swiglu::backward_fallback::<Self>(gate, up, grad)
    }
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope::fallback::<Self>(x, cos, sin, false)
    }
    fn rope_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope::fallback::<Self>(grad, cos, sin, true)
    }
    fn cross_entropy_lse(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cross_entropy_forward::<Self>(logits, targets)
    }
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        cross_entropy::cross_entropy_backward::<Self>(logits, lse, targets, grad)
    }
}

// ---------------------------------------------------------------------------------------
// Autodiff: one node per op (each op's module holds its node)
// ---------------------------------------------------------------------------------------

impl<B: FusedBackend, C: CheckpointStrategy> FusedBackend for Autodiff<B, C> {
    fn causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        softmax::causal_softmax_autodiff::<B, C>(scores, scale)
    }
    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        cross_entropy::cross_entropy_autodiff::<B, C>(logits, targets)
    }
    fn gelu_erf(x: FloatTensor<Self>) -> FloatTensor<Self> {
        gelu::gelu_autodiff::<B, C>(x)
    }
    fn gelu_erf_backward(_x: FloatTensor<Self>, _grad: FloatTensor<Self>) -> FloatTensor<Self> {
        panic!("bonfire-kernels: gelu_erf_backward is not differentiable");
    }
    fn exp_keeping_output(x: FloatTensor<Self>) -> FloatTensor<Self> {
        softmax::exp_autodiff::<B, C>(x)
    }
    fn norm_core(x: FloatTensor<Self>, eps: f64, centered: bool) -> FloatTensor<Self> {
        norm::norm_core_autodiff::<B, C>(x, eps, centered)
    }
    fn norm_core_stats(
        _x: FloatTensor<Self>,
        _eps: f64,
        _centered: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        not_differentiable("norm_core_stats")
    }
    fn norm_core_backward(
        _xhat: FloatTensor<Self>,
        _rstd: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _centered: bool,
    ) -> FloatTensor<Self> {
        not_differentiable("norm_core_backward")
    }
    fn silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu::silu_mul_autodiff::<B, C>(gate, up)
    }
    fn silu_mul_backward(
        _gate: FloatTensor<Self>,
        _up: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        not_differentiable("silu_mul_backward")
    }
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope::rope_autodiff::<B, C>(x, cos, sin)
    }
    fn rope_backward(
        _grad: FloatTensor<Self>,
        _cos: FloatTensor<Self>,
        _sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        not_differentiable("rope_backward")
    }
    fn cross_entropy_lse(
        _logits: FloatTensor<Self>,
        _targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        not_differentiable("cross_entropy_lse")
    }
    fn cross_entropy_backward(
        _logits: FloatTensor<Self>,
        _lse: FloatTensor<Self>,
        _targets: IntTensor<Self>,
        _grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        not_differentiable("cross_entropy_backward")
    }
}

/// The panic of a backend-level helper called on tracked tensors.
fn not_differentiable(op: &str) -> ! {
    panic!("bonfire-kernels: {op} is not differentiable")
}
