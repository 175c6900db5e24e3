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
//! - [`add_bias`]: a linear layer's `y + b`, its bias's gradient summed in one pass.
//!
//! The math of every op is backend-generic (Burn ops on the inner backend) and runs on Flex,
//! on a CubeCL device (features `wgpu`, `cuda`) and under `Autodiff` of either.

mod backend;
mod bias;
mod cross_entropy;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
mod dtype;
mod gelu;

/// The branch-free, vectorizable `e^x` of the GELU kernel (relative error below 3e-7 on
/// `[−87, 88]`, clamped outside), shared with the attention kernels.
pub(crate) use gelu::exp as fast_exp;
pub(crate) mod host;
mod impls;
mod norm;
mod rope;
mod softmax;
mod swiglu;
#[cfg(test)]
mod tests;

pub use backend::FusedBackend;
use burn::backend::Dispatch;
use burn::tensor::{Int, Tensor};
pub(crate) use dtype::{narrow_to, widen};
pub use softmax::causal_mask;

/// Whether the fused ops take `x` as one node ([`crate::fuses`] of its device and dtype): the
/// models' switch between a fused op and Burn's ops.
pub fn takes<const D: usize>(x: &Tensor<D>) -> bool {
    crate::fuses(&x.device(), x.dtype())
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

/// Each row's log-sum-exp of `logits` `[N, V]`, `[N]`, without gradient: the fused
/// cross-entropy's forward pass (one pass on Flex in f32, a cube a row on CubeCL), on the
/// inner backend (the result carries no autodiff).
pub fn log_sum_exp(logits: Tensor<2>) -> Tensor<1> {
    let logits = logits.inner();
    let n = logits.dims()[0];
    let targets = Tensor::<1, Int>::zeros([n], &logits.device());
    let (_, lse) = <Dispatch as FusedBackend>::cross_entropy_lse(
        logits.into_dispatch(),
        targets.into_dispatch(),
    );
    Tensor::<2>::from_dispatch(lse).reshape([n])
}

/// The exact (erf) GELU.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::gelu_erf(x.into_dispatch()))
}

/// `x + bias` over `x`'s last dim (`bias` `[N]`): a linear layer's bias, one autodiff node
/// whose backward passes the gradient to `x` and sums its rows into `bias`'s. Burn's broadcast
/// add where the dtypes differ.
pub fn add_bias<const D: usize>(x: Tensor<D>, bias: Tensor<1>) -> Tensor<D> {
    if x.dtype() != bias.dtype() {
        return x + bias.unsqueeze();
    }
    Tensor::from_dispatch(<Dispatch as FusedBackend>::add_bias(
        x.into_dispatch(),
        bias.into_dispatch(),
    ))
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
