//! [`FusedBackend`]: the Burn backend extension every fused op is an operation of (its
//! implementations for Flex, CubeCL and Autodiff are in `impls.rs`).

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, backend_extension};

/// Backends that run Bonfire's fused ops (see the module docs). Call them through
/// [`causal_softmax`], [`cross_entropy`], [`gelu`], [`exp`] and the other
/// functions of [`crate::fused`].
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
    /// `x + bias` over the last dim: `x` `[.., N]`, `bias` `[N]` (a linear layer's bias).
    fn add_bias(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self>;
    /// The gradient of [`Self::add_bias`]'s `bias`: `grad` summed over every dim but the
    /// last, `[N]` (not differentiable).
    fn bias_grad(grad: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `(softmax(logits) − onehot(targets)) · grad / N` (not differentiable).
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        targets: IntTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}
