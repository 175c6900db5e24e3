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

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, IndexingUpdateOp, Int, Scalar, Shape, Tensor, TensorData};

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

// ---------------------------------------------------------------------------------------
// The math, on any backend
// ---------------------------------------------------------------------------------------

/// `t` in f32 when it is a 16-bit type (softmax runs in f32 under autocast too), else as is.
fn widen<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    match t.dtype() {
        DType::F16 | DType::BF16 => B::float_cast(t, DType::F32.into()),
        _ => t,
    }
}

/// `t` in `dtype` (a no-op when it already is).
fn narrow_to<B: Backend>(t: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    match t.dtype() == dtype {
        true => t,
        false => B::float_cast(t, dtype.into()),
    }
}

fn causal_softmax_forward<B: Backend>(scores: FloatTensor<B>, scale: f64) -> FloatTensor<B> {
    let dtype = scores.dtype();
    narrow_to::<B>(causal_softmax_f32::<B>(widen::<B>(scores), scale), dtype)
}

fn causal_softmax_f32<B: Backend>(scores: FloatTensor<B>, scale: f64) -> FloatTensor<B> {
    let shape = scores.shape();
    let r = shape.num_dims();
    let (tq, tk) = (shape[r - 2], shape[r - 1]);
    let offset = tk.saturating_sub(tq);
    let values: Vec<f32> = (0..tq * tk)
        .map(|i| match i % tk > i / tk + offset {
            true => f32::NEG_INFINITY,
            false => 0.0,
        })
        .collect();
    let data = TensorData::new(values, [tq, tk]).convert_dtype(scores.dtype());
    let mask = B::float_from_data(data, &scores.device());
    let mut dims = vec![1; r];
    dims[r - 2] = tq;
    dims[r - 1] = tk;
    let mask = B::float_reshape(mask, Shape::from(dims));
    let scaled = B::float_mul_scalar(scores, Scalar::Float(scale));
    B::softmax(B::float_add(scaled, mask), r - 1)
}

/// `scale · P ⊙ (dP − Σ_last dP ⊙ P)`, in f32 for 16-bit types.
fn softmax_backward<B: Backend>(
    p: FloatTensor<B>,
    grad: FloatTensor<B>,
    scale: f64,
) -> FloatTensor<B> {
    let dtype = grad.dtype();
    let (p, grad) = (widen::<B>(p), widen::<B>(grad));
    let last = p.shape().num_dims() - 1;
    let gp = B::float_mul(grad, p.clone());
    let rows = B::float_sum_dim(gp.clone(), last);
    let d = B::float_sub(gp, B::float_mul(p, rows));
    narrow_to::<B>(B::float_mul_scalar(d, Scalar::Float(scale)), dtype)
}

/// The loss `[1]` and each row's log-sum-exp `[N, 1]`.
fn cross_entropy_forward<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let n = logits.shape()[0];
    let max = B::float_max_dim(logits.clone(), 1);
    let exp = B::float_exp(B::float_sub(logits.clone(), max.clone()));
    let lse = B::float_add(B::float_log(B::float_sum_dim(exp, 1)), max);
    let picked = B::float_gather(1, logits, B::int_reshape(targets, Shape::new([n, 1])));
    let loss = B::float_mean(B::float_sub(lse.clone(), picked));
    (loss, lse)
}

/// `(softmax(logits) − onehot(targets)) · grad / N`.
fn cross_entropy_backward<B: Backend>(
    logits: FloatTensor<B>,
    lse: FloatTensor<B>,
    targets: IntTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let n = logits.shape()[0];
    let per_row = B::float_reshape(
        B::float_div_scalar(grad, Scalar::Float(n as f64)),
        Shape::new([1, 1]),
    );
    let p = B::float_exp(B::float_sub(logits, lse));
    let d = B::float_mul(p, per_row.clone());
    let minus = B::float_expand(B::float_neg(per_row), Shape::new([n, 1]));
    let idx = B::int_reshape(targets, Shape::new([n, 1]));
    B::float_scatter(1, d, idx, minus, IndexingUpdateOp::Add)
}

// ---------------------------------------------------------------------------------------
// Concrete backends
// ---------------------------------------------------------------------------------------

impl FusedBackend for Flex {
    fn causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        causal_softmax_forward::<Self>(scores, scale)
    }
    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        cross_entropy_forward::<Self>(logits, targets).0
    }
    fn gelu_erf(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match x.dtype() {
            DType::F32 => crate::gelu::map_f32::<Self>(x, crate::gelu::gelu),
            _ => <Self as burn::backend::ops::ActivationOps<Self>>::gelu(x),
        }
    }
    fn gelu_erf_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        match (x.dtype(), grad.dtype()) {
            (DType::F32, DType::F32) => crate::gelu::gelu_backward_f32::<Self>(x, grad),
            _ => <Self as burn::backend::ops::ActivationOps<Self>>::gelu_backward(x, grad),
        }
    }
    fn exp_keeping_output(x: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::backend::ops::FloatTensorOps<Self>>::float_exp(x)
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
}

// ---------------------------------------------------------------------------------------
// Autodiff: one node per op
// ---------------------------------------------------------------------------------------

#[derive(Debug)]
struct CausalSoftmaxBackward {
    scale: f64,
}

impl<B: FusedBackend> Backward<B, 1> for CausalSoftmaxBackward {
    /// The output `P`.
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            let g = softmax_backward::<B>(ops.state, grad, self.scale);
            grads.register::<B>(parent.id, g);
        }
    }
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: FusedBackend> Backward<B, 1> for CrossEntropyBackward {
    /// The logits, their rows' log-sum-exp and the targets.
    type State = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            let (logits, lse, targets) = ops.state;
            let g = cross_entropy_backward::<B>(logits, lse, targets, grad);
            grads.register::<B>(parent.id, g);
        }
    }
}

#[derive(Debug)]
struct GeluBackward;

impl<B: FusedBackend> Backward<B, 1> for GeluBackward {
    /// The input `x`.
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, B::gelu_erf_backward(ops.state, grad));
        }
    }
}

#[derive(Debug)]
struct ExpBackward;

impl<B: FusedBackend> Backward<B, 1> for ExpBackward {
    /// The output `exp(x)`.
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, B::float_mul(grad, ops.state));
        }
    }
}

impl<B: FusedBackend, C: CheckpointStrategy> FusedBackend for Autodiff<B, C> {
    fn causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        let step = CausalSoftmaxBackward { scale };
        match step
            .prepare::<C>([scores.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let p = B::causal_softmax(scores.into_primitive(), scale);
                prep.finish(p.clone(), p)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::causal_softmax(scores.into_primitive(), scale))
            }
        }
    }

    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        let step = CrossEntropyBackward;
        match step
            .prepare::<C>([logits.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let logits = logits.into_primitive();
                let (loss, lse) = cross_entropy_forward::<B>(logits.clone(), targets.clone());
                prep.finish((logits, lse, targets), loss)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::cross_entropy(logits.into_primitive(), targets))
            }
        }
    }

    fn gelu_erf(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match GeluBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let x = x.into_primitive();
                prep.finish(x.clone(), B::gelu_erf(x))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gelu_erf(x.into_primitive())),
        }
    }

    fn gelu_erf_backward(_x: FloatTensor<Self>, _grad: FloatTensor<Self>) -> FloatTensor<Self> {
        panic!("bonfire-kernels: gelu_erf_backward is not differentiable");
    }

    fn exp_keeping_output(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match ExpBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::exp_keeping_output(x.into_primitive());
                prep.finish(y.clone(), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::exp_keeping_output(x.into_primitive())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::activation::{gelu as burn_gelu, log_softmax, softmax};
    use burn::tensor::{Device, Distribution};

    fn close<const D: usize>(what: &str, a: Tensor<D>, b: Tensor<D>, tol: f32) {
        let (a, b) = (
            a.into_data().try_to_vec::<f32>().unwrap(),
            b.into_data().try_to_vec::<f32>().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(worst <= tol, "{what}: largest difference {worst} > {tol}");
    }

    /// `f` and `reference` on the same tracked input: outputs and input gradients (of the
    /// output weighted by a fixed random tensor) agree.
    fn same_as<const D: usize, const E: usize>(
        input: Tensor<D>,
        f: impl Fn(Tensor<D>) -> Tensor<E>,
        reference: impl Fn(Tensor<D>) -> Tensor<E>,
        tol: f32,
    ) {
        let (a, b) = (input.clone().require_grad(), input.require_grad());
        let (ya, yb) = (f(a.clone()), reference(b.clone()));
        let w = Tensor::<E>::random(ya.shape(), Distribution::Normal(0.0, 1.0), &ya.device());
        close("forward", ya.clone(), yb.clone(), tol);
        let ga = (ya * w.clone()).sum().backward();
        let gb = (yb * w).sum().backward();
        close("gradient", a.grad(&ga).unwrap(), b.grad(&gb).unwrap(), tol);
    }

    fn device() -> Device {
        Device::flex().autodiff()
    }

    #[test]
    fn causal_softmax_is_masked_scaled_softmax() {
        let x = Tensor::<4>::random([2, 3, 5, 5], Distribution::Normal(0.0, 2.0), &device());
        let mask = |t: Tensor<4>| {
            let tri = Tensor::<2>::ones([5, 5], &t.device()).triu(1) * -1e30;
            t * 0.3 + tri.unsqueeze::<4>()
        };
        same_as(x, |t| causal_softmax(t, 0.3), |t| softmax(mask(t), 3), 1e-6);
    }

    #[test]
    fn cross_entropy_is_mean_negative_log_likelihood() {
        let x = Tensor::<2>::random([6, 11], Distribution::Normal(0.0, 3.0), &device());
        let targets = Tensor::<1, Int>::from_data([0, 10, 3, 3, 7, 1], &device());
        let t = targets.clone();
        let reference = move |x: Tensor<2>| {
            log_softmax(x, 1)
                .gather(1, t.clone().reshape([6, 1]))
                .mean()
                .neg()
        };
        same_as(x, |x| cross_entropy(x, targets.clone()), reference, 1e-6);
    }

    #[test]
    fn exp_is_burns_exp() {
        let x = Tensor::<3>::random([2, 7, 33], Distribution::Normal(0.0, 2.0), &device());
        same_as(x, exp, |x| x.exp(), 1e-5);
    }

    #[test]
    fn gelu_is_burns_gelu() {
        let x = Tensor::<3>::random([2, 7, 33], Distribution::Normal(0.0, 3.0), &device());
        same_as(x, gelu, burn_gelu, 1e-6);
    }
}
