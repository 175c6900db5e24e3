//! [`FusedBackend`] for each backend: Flex's host kernels, CubeCL's kernels (SwiGLU, RoPE, the
//! norms; Burn math for the rest), and the autodiff nodes over either.

use super::backend::FusedBackend;
use super::cross_entropy::{self, cross_entropy_forward};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::cube;
use super::softmax::{self, causal_softmax_forward};
use super::{bias, gelu, host, norm, rope, swiglu};
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Flex};
use burn::tensor::DType;

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
    fn add_bias(x: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        match bias::flex_covers(&x, &b) {
            true => bias::forward_flex(x, b),
            false => bias::forward_fallback::<Self>(x, b),
        }
    }
    fn bias_grad(grad: FloatTensor<Self>) -> FloatTensor<Self> {
        match host::all_f32(&[&grad]) {
            true => bias::grad_flex(grad),
            false => bias::grad_fallback::<Self>(grad),
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
        Self::cross_entropy_lse(logits, targets).0
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
        Self::norm_core_stats(x, eps, centered).0
    }
    fn norm_core_stats(
        x: FloatTensor<Self>,
        eps: f64,
        centered: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match cube::takes(x.dtype) {
            true => cube::norm_stats(x, eps, centered),
            false => norm::stats_fallback::<Self>(x, eps, centered),
        }
    }
    fn norm_core_backward(
        xhat: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        centered: bool,
    ) -> FloatTensor<Self> {
        match cube::takes(grad.dtype) {
            true => cube::norm_backward(xhat, rstd, grad, centered),
            false => norm::backward_fallback::<Self>(xhat, rstd, grad, centered),
        }
    }
    fn silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        match cube::takes(gate.dtype) {
            true => cube::silu_mul(gate, up),
            false => swiglu::forward_fallback::<Self>(gate, up),
        }
    }
    fn silu_mul_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match cube::takes(gate.dtype) {
            true => cube::silu_mul_backward(gate, up, grad),
            false => swiglu::backward_fallback::<Self>(gate, up, grad),
        }
    }
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match cube::takes(x.dtype) {
            true => cube::rope(x, cos, sin, false),
            false => rope::fallback::<Self>(x, cos, sin, false),
        }
    }
    fn rope_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match cube::takes(grad.dtype) {
            true => cube::rope(grad, cos, sin, true),
            false => rope::fallback::<Self>(grad, cos, sin, true),
        }
    }
    fn add_bias(x: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        bias::forward_fallback::<Self>(x, b)
    }
    fn bias_grad(grad: FloatTensor<Self>) -> FloatTensor<Self> {
        bias::grad_fallback::<Self>(grad)
    }
    fn cross_entropy_lse(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match cube::takes(logits.dtype) {
            true => cube::cross_entropy(logits, targets),
            false => cross_entropy_forward::<Self>(logits, targets),
        }
    }
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match cube::takes(logits.dtype) {
            true => cube::cross_entropy_backward(logits, lse, targets, grad),
            false => cross_entropy::cross_entropy_backward::<Self>(logits, lse, targets, grad),
        }
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
    fn add_bias(x: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        bias::add_bias_autodiff::<B, C>(x, b)
    }
    fn bias_grad(_grad: FloatTensor<Self>) -> FloatTensor<Self> {
        not_differentiable("bias_grad")
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
