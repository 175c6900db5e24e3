//! [`super::cross_entropy`]: the plain-Burn math (any backend, the reference), Flex's f32
//! host kernel and the autodiff node.

use super::backend::FusedBackend;
use super::gelu::exp;
use super::host::{self, FlexTensor};
use crate::simd::vectorized;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, TensorMetadata};
use burn::tensor::{DType, IndexingUpdateOp, Scalar, Shape};

/// The loss `[1]` and each row's log-sum-exp `[N, 1]`.
pub(super) fn cross_entropy_forward<B: Backend>(
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
pub(super) fn cross_entropy_backward<B: Backend>(
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
// Flex, f32
// ---------------------------------------------------------------------------------------

/// Vocabulary chunk of the online log-sum-exp: a chunk is read twice while it sits in L1.
const CHUNK: usize = 2048;

/// The targets as row indices, when they are a Flex int tensor of `n` ids.
fn target_ids(targets: &FlexTensor, n: usize) -> Option<Vec<usize>> {
    let t = host::contiguous(targets.clone());
    let ids: Vec<usize> = match t.dtype() {
        DType::I64 => t.as_slice::<i64>()?.iter().map(|&i| i as usize).collect(),
        DType::I32 => t.as_slice::<i32>()?.iter().map(|&i| i as usize).collect(),
        _ => return None,
    };
    (ids.len() == n).then_some(ids)
}

/// Whether the Flex kernel covers the op: f32 logits `[N, V]`, `N` int targets.
pub(super) fn flex_covers(logits: &FlexTensor, targets: &FlexTensor) -> bool {
    let s = logits.shape();
    host::all_f32(&[logits])
        && s.num_dims() == 2
        && matches!(targets.dtype(), DType::I64 | DType::I32)
        && targets.shape().num_elements() == s[0]
}

/// `log Σ exp(row)`, one pass over memory: per chunk its max, the running sum rescaled when
/// the max grows, then the chunk's `Σ exp(x − max)`. `row` starts at `all[at]`; each chunk
/// first asks for the next one ([`host::prefetch`], the next row's first past the end).
#[inline(always)]
fn row_lse(row: &[f32], all: &[f32], at: usize) -> f32 {
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    for (c, chunk) in row.chunks(CHUNK).enumerate() {
        host::prefetch(all, at + (c + 1) * CHUNK, CHUNK);
        let m = host::max_of(chunk);
        if m > max {
            sum *= exp(max - m);
            max = m;
        }
        sum += host::sum_map(chunk, |v| exp(v - max));
    }
    max + sum.ln()
}

vectorized! {
    /// Each row's [`row_lse`] (`v` values a row) into `lse`.
    fn rows_lse(logits: &[f32], v: usize, lse: &mut [f32]) {
        for (r, (row, l)) in logits.chunks_exact(v).zip(lse.iter_mut()).enumerate() {
            *l = row_lse(row, logits, r * v);
        }
    }
}

vectorized! {
    /// Each row of `buf` (`v` values) replaced by `(softmax(row) − onehot(target)) · scale`,
    /// from its log-sum-exp; by chunks, each asking for the next first.
    fn rows_grad(buf: &mut [f32], v: usize, lse: &[f32], ids: &[usize], scale: f32) {
        let all: *const [f32] = buf;
        for (r, ((row, &l), &t)) in buf.chunks_exact_mut(v).zip(lse).zip(ids).enumerate() {
            for (c, chunk) in row.chunks_mut(CHUNK).enumerate() {
                host::prefetch(all, r * v + (c + 1) * CHUNK, CHUNK);
                for x in chunk.iter_mut() {
                    *x = exp(*x - l) * scale;
                }
            }
            row[t] -= scale;
        }
    }
}

/// The loss `[1]` and each row's log-sum-exp `[N, 1]` on Flex (see [`flex_covers`]): one
/// pass over the logits, no exponentials kept (Burn's ops materialize `exp(logits − max)`).
pub(super) fn forward_flex(logits: FlexTensor, targets: FlexTensor) -> (FlexTensor, FlexTensor) {
    let (n, v) = (logits.shape()[0], logits.shape()[1]);
    let ids = target_ids(&targets, n).expect("checked by flex_covers");
    let logits = host::contiguous(logits);
    let mut lse = vec![0f32; n];
    rows_lse(host::values(&logits), v, &mut lse);
    let rows = host::values(&logits).chunks_exact(v);
    let total: f64 = rows
        .zip(&lse)
        .zip(&ids)
        .map(|((row, &l), &t)| (l - row[t]) as f64)
        .sum();
    let loss = host::from_vec(vec![(total / n as f64) as f32], vec![1]);
    (loss, host::from_vec(lse, vec![n, 1]))
}

/// `(softmax(logits) − onehot) · grad / N` on Flex, one pass, into the logits' buffer when it
/// can be reused.
pub(super) fn backward_flex(
    logits: FlexTensor,
    lse: FlexTensor,
    targets: FlexTensor,
    grad: FlexTensor,
) -> FlexTensor {
    let (n, v) = (logits.shape()[0], logits.shape()[1]);
    let ids = target_ids(&targets, n).expect("checked by flex_covers");
    let (lse, grad) = (host::contiguous(lse), host::contiguous(grad));
    let scale = host::values(&grad)[0] / n as f32;
    let mut out = host::writable(logits);
    let buf = host::owned(&mut out).expect("a writable buffer");
    rows_grad(buf, v, host::values(&lse), &ids, scale);
    out
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
            let g = B::cross_entropy_backward(logits, lse, targets, grad);
            grads.register::<B>(parent.id, g);
        }
    }
}

/// The autodiff node of [`FusedBackend::cross_entropy`]: it keeps the logits, their rows'
/// log-sum-exp and the targets.
pub(super) fn cross_entropy_autodiff<B: FusedBackend, C: CheckpointStrategy>(
    logits: FloatTensor<Autodiff<B, C>>,
    targets: IntTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    match CrossEntropyBackward
        .prepare::<C>([logits.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let logits = logits.into_primitive();
            let (loss, lse) = B::cross_entropy_lse(logits.clone(), targets.clone());
            prep.finish((logits, lse, targets), loss)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::cross_entropy(logits.into_primitive(), targets)),
    }
}
