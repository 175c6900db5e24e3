//! The attention in plain Burn: the reference the fused op is tested against
//! ([`attention`], on tensors, differentiated by Burn's autodiff), and the same math on a
//! backend's primitives with the flash-style backward ([`forward`], [`backward`]), which the
//! extension runs where it has no kernel (a CubeCL device, a dtype other than f32 on Flex).

use super::Mask;
use crate::fused::{narrow_to, widen};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::activation::softmax;
use burn::tensor::{Int, Scalar, Shape, Tensor, TensorData};

/// `softmax(q kᵀ · scale + mask) v` with the kv heads repeated (query head `j` uses kv head
/// `j / (h / h_kv)`) by `select`; shapes and mask as in [`crate::attention::attention`].
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    mask: impl Into<Mask>,
) -> Tensor<4> {
    let (scores, v) = masked_scores(q, k, v, scale, mask.into());
    softmax(scores, 3).matmul(v)
}

/// The scaled, masked scores `[B, h, Tq, Tk]` of [`attention`] and its values with the kv
/// heads repeated to the query heads.
fn masked_scores(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    mask: Mask,
) -> (Tensor<4>, Tensor<4>) {
    let [_, h, tq, _] = q.dims();
    let tk = k.dims()[2];
    let (k, v) = repeat_kv_heads(k, v, h);
    let scores = q.matmul(k.swap_dims(2, 3)) * scale;
    if mask.is_full() {
        return (scores, v);
    }
    let bias = mask.bias(tq, tk, &scores.device());
    let bias = bias.cast(scores.dtype()).unsqueeze::<4>();
    (scores + bias, v)
}

/// [`attention`] and each query's log-sum-exp of its scaled, masked scores `[B, h, Tq]`, both
/// differentiable (the reference of [`crate::attention::attention_with_lse`]).
pub fn attention_with_lse(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    mask: impl Into<Mask>,
) -> (Tensor<4>, Tensor<3>) {
    let (scores, v) = masked_scores(q, k, v, scale, mask.into());
    // The shift by the row's max keeps exp finite and cancels: no gradient through it.
    let m = scores.clone().detach().max_dim(3);
    let lse = (scores.clone() - m.clone()).exp().sum_dim(3).log() + m;
    let out = softmax(scores, 3).matmul(v);
    (out, lse.squeeze_dim::<3>(3))
}

/// `k`, `v` `[B, h_kv, T, dh]` → `[B, h, T, dh]` by `select`: query head `j` gets kv head
/// `j / (h / h_kv)` (themselves when `h_kv = h`).
pub fn repeat_kv_heads(k: Tensor<4>, v: Tensor<4>, h: usize) -> (Tensor<4>, Tensor<4>) {
    let h_kv = k.dims()[1];
    if h == h_kv {
        return (k, v);
    }
    let heads: Vec<i64> = (0..h).map(|j| (j / (h / h_kv)) as i64).collect();
    let heads = Tensor::<1, Int>::from_data(TensorData::new(heads, [h]), &k.device());
    (k.select(1, heads.clone()), v.select(1, heads))
}

/// `[B, h_kv, T, dh]` → `[B, h, T, dh]`, each kv head repeated for its `h / h_kv` query heads.
fn repeat_heads<B: Backend>(x: FloatTensor<B>, h: usize) -> FloatTensor<B> {
    let s = x.shape();
    let (b, h_kv, t, dh) = (s[0], s[1], s[2], s[3]);
    if h == h_kv {
        return x;
    }
    let x = B::float_reshape(x, Shape::new([b, h_kv, 1, t, dh]));
    let x = B::float_expand(x, Shape::new([b, h_kv, h / h_kv, t, dh]));
    B::float_reshape(x, Shape::new([b, h, t, dh]))
}

/// `[B, h, T, dh]` → `[B, h_kv, T, dh]`: the sum over each kv head's query heads.
fn sum_heads<B: Backend>(x: FloatTensor<B>, h_kv: usize) -> FloatTensor<B> {
    let s = x.shape();
    let (b, h, t, dh) = (s[0], s[1], s[2], s[3]);
    if h == h_kv {
        return x;
    }
    let x = B::float_reshape(x, Shape::new([b, h_kv, h / h_kv, t, dh]));
    B::float_reshape(B::float_sum_dim(x, 2), Shape::new([b, h_kv, t, dh]))
}

/// The scaled, masked scores `[B, h, Tq, Tk]` (kv heads already repeated).
fn scores<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    scale: f64,
    mask: Mask,
) -> FloatTensor<B> {
    let (tq, tk) = (q.shape()[2], k.shape()[2]);
    let device = q.device();
    let s = B::float_mul_scalar(
        B::float_matmul(q, B::float_swap_dims(k, 2, 3)),
        Scalar::Float(scale),
    );
    if mask.is_full() {
        return s;
    }
    let bias = B::float_from_data(mask.values(tq, tk).convert_dtype(s.dtype()), &device);
    B::float_add(s, B::float_reshape(bias, Shape::new([1, 1, tq, tk])))
}

/// The output `[B, h, Tq, dh]` and each query's log-sum-exp `[B, h, Tq]`, in the inputs'
/// dtype (computed in f32 for 16-bit inputs).
pub(crate) fn forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    scale: f64,
    mask: Mask,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = q.dtype();
    let (q, k, v) = (widen::<B>(q), widen::<B>(k), widen::<B>(v));
    let s = q.shape();
    let (b, h, tq) = (s[0], s[1], s[2]);
    let s = scores::<B>(q, repeat_heads::<B>(k, h), scale, mask);
    let m = B::float_max_dim(s.clone(), 3);
    let e = B::float_exp(B::float_sub(s, m.clone()));
    let l = B::float_sum_dim(e.clone(), 3);
    let p = B::float_div(e, l.clone());
    let out = B::float_matmul(p, repeat_heads::<B>(v, h));
    let lse = B::float_reshape(B::float_add(m, B::float_log(l)), Shape::new([b, h, tq]));
    (narrow_to::<B>(out, dtype), narrow_to::<B>(lse, dtype))
}

/// The gradients `(dq, dk, dv)` of the output's gradient `grad` and the log-sum-exp's `dlse`
/// (flash-attention-2 math on whole tensors: `P = exp(S − lse)`,
/// `dS = P ⊙ (dP − (rowsum(dO ⊙ O) − dlse))`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    dlse: FloatTensor<B>,
    scale: f64,
    mask: Mask,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let dtype = q.dtype();
    let [q, k, v, out, lse, grad, dlse] = [q, k, v, out, lse, grad, dlse].map(widen::<B>);
    let sh = q.shape();
    let (b, h, tq) = (sh[0], sh[1], sh[2]);
    let h_kv = k.shape()[1];
    let (k, v) = (repeat_heads::<B>(k, h), repeat_heads::<B>(v, h));
    let s = scores::<B>(q.clone(), k.clone(), scale, mask);
    let lse = B::float_reshape(lse, Shape::new([b, h, tq, 1]));
    let p = B::float_exp(B::float_sub(s, lse));
    let dv = B::float_matmul(B::float_swap_dims(p.clone(), 2, 3), grad.clone());
    let dp = B::float_matmul(grad.clone(), B::float_swap_dims(v, 2, 3));
    let dlse = B::float_reshape(dlse, Shape::new([b, h, tq, 1]));
    let d = B::float_sub(B::float_sum_dim(B::float_mul(grad, out), 3), dlse);
    let ds = B::float_mul_scalar(B::float_mul(p, B::float_sub(dp, d)), Scalar::Float(scale));
    let dq = B::float_matmul(ds.clone(), k);
    let dk = B::float_matmul(B::float_swap_dims(ds, 2, 3), q);
    let [dq, dk, dv] = [dq, sum_heads::<B>(dk, h_kv), sum_heads::<B>(dv, h_kv)];
    (
        narrow_to::<B>(dq, dtype),
        narrow_to::<B>(dk, dtype),
        narrow_to::<B>(dv, dtype),
    )
}
