//! [`super::causal_softmax`] and [`super::exp`]: the math on any backend and their autodiff
//! nodes.

use super::backend::FusedBackend;
use super::dtype::{narrow_to, widen};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata};
use burn::tensor::{Scalar, Shape, TensorData};

pub(super) fn causal_softmax_forward<B: Backend>(
    scores: FloatTensor<B>,
    scale: f64,
) -> FloatTensor<B> {
    let dtype = scores.dtype();
    narrow_to::<B>(causal_softmax_f32::<B>(widen::<B>(scores), scale), dtype)
}

/// The causal mask as a tensor on `device`: `[Tq, Tk]` f32, the values of
/// [`causal_mask_values`], to add to attention scores before a softmax (the path of dtypes the
/// fused softmax does not take). Built on the device (index arithmetic: measured on an H200 at
/// T = 8,192, the host-built mask cost 336 ms a call, longer than the attention).
pub fn causal_mask(tq: usize, tk: usize, device: &burn::tensor::Device) -> burn::tensor::Tensor<2> {
    use burn::tensor::{Bool, Tensor};
    let hidden = Tensor::<2, Bool>::tril_mask([tq, tk], tk.saturating_sub(tq) as i64, device);
    Tensor::<2>::zeros([tq, tk], device).mask_fill(hidden, f32::NEG_INFINITY)
}

/// `[Tq, Tk]` f32: 0 where query `i` sees key `t` (`t ≤ i + Tk − Tq`: with `Tk > Tq` the
/// queries are the last `Tq`), −∞ elsewhere.
pub(crate) fn causal_mask_values(tq: usize, tk: usize) -> TensorData {
    let offset = tk.saturating_sub(tq);
    let values: Vec<f32> = (0..tq * tk)
        .map(|i| match i % tk > i / tk + offset {
            true => f32::NEG_INFINITY,
            false => 0.0,
        })
        .collect();
    TensorData::new(values, [tq, tk])
}

fn causal_softmax_f32<B: Backend>(scores: FloatTensor<B>, scale: f64) -> FloatTensor<B> {
    let shape = scores.shape();
    let r = shape.num_dims();
    let (tq, tk) = (shape[r - 2], shape[r - 1]);
    let data = causal_mask_values(tq, tk).convert_dtype(scores.dtype());
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

/// The autodiff node of [`FusedBackend::causal_softmax`]: it keeps the output.
pub(super) fn causal_softmax_autodiff<B: FusedBackend, C: CheckpointStrategy>(
    scores: FloatTensor<Autodiff<B, C>>,
    scale: f64,
) -> FloatTensor<Autodiff<B, C>> {
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
        OpsKind::UnTracked(prep) => prep.finish(B::causal_softmax(scores.into_primitive(), scale)),
    }
}

/// The autodiff node of [`FusedBackend::exp_keeping_output`].
pub(super) fn exp_autodiff<B: FusedBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
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
