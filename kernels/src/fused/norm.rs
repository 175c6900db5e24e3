//! The normalization core of LayerNorm and RMSNorm over the last dim, one autodiff node:
//! `x̂ = (x − mean)·rstd`, `rstd = 1/√(var + eps)` (biased variance; `centered`), or
//! `x̂ = x·rstd`, `rstd = 1/√(mean(x²) + eps)` (RMS). Forward keeps `x̂` and each row's
//! `rstd`; backward is the closed form `dx = rstd·(g − mean(g) − x̂·mean(g ⊙ x̂))` (RMS: no
//! `mean(g)` term). The weight and bias stay outside, as Burn ops, since the tensor-parallel
//! layers route them through their own bookkeeping.
//!
//! Under Burn's Balanced checkpointing (ZeRO-3's) the node is memory-bound with a retro
//! forward, as Burn's element-wise ops are: backward recomputes `x̂` from the input.
//!
//! On Flex in f32 both passes are host kernels over rows (slices, no libm): two reads and one
//! write forward, two reads and one write backward, in place where a buffer can be reused.

use super::backend::FusedBackend;
use super::host::{self, FlexTensor};
use crate::simd::vectorized;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata};
use burn::tensor::Scalar;
use std::any::TypeId;
use std::marker::PhantomData;
use std::mem::MaybeUninit;

// ---------------------------------------------------------------------------------------
// Plain Burn (any backend; the reference)
// ---------------------------------------------------------------------------------------

/// `x̂` and each row's `rstd` (`[.., 1]`), in Burn ops.
pub(super) fn stats_fallback<B: Backend>(
    x: FloatTensor<B>,
    eps: f64,
    centered: bool,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let last = x.shape().num_dims() - 1;
    let x = match centered {
        true => B::float_sub(x.clone(), B::float_mean_dim(x, last)),
        false => x,
    };
    let ms = B::float_mean_dim(B::float_mul(x.clone(), x.clone()), last);
    let rstd = B::float_recip(B::float_sqrt(B::float_add_scalar(ms, Scalar::Float(eps))));
    (B::float_mul(x, rstd.clone()), rstd)
}

/// `rstd·(g − mean(g) − x̂·mean(g ⊙ x̂))` (RMS: without `mean(g)`), in Burn ops.
pub(super) fn backward_fallback<B: Backend>(
    xhat: FloatTensor<B>,
    rstd: FloatTensor<B>,
    grad: FloatTensor<B>,
    centered: bool,
) -> FloatTensor<B> {
    let last = xhat.shape().num_dims() - 1;
    let mgx = B::float_mean_dim(B::float_mul(grad.clone(), xhat.clone()), last);
    let g = match centered {
        true => B::float_sub(grad.clone(), B::float_mean_dim(grad, last)),
        false => grad,
    };
    B::float_mul(B::float_sub(g, B::float_mul(xhat, mgx)), rstd)
}

// ---------------------------------------------------------------------------------------
// Flex, f32
// ---------------------------------------------------------------------------------------

/// One row's mean (0 unless `centered`) and `rstd`.
#[inline(always)]
fn row_stats(row: &[f32], eps: f32, centered: bool) -> (f32, f32) {
    let d = row.len() as f32;
    let mean = match centered {
        true => host::sum_map(row, |v| v) / d,
        false => 0.0,
    };
    let ms = host::sum_map(row, |v| (v - mean) * (v - mean)) / d;
    (mean, 1.0 / (ms + eps).sqrt())
}

vectorized! {
    /// Every row of `buf` (`d` values each) normalized in place, its `rstd` into `rstd`.
    fn normalize_rows(buf: &mut [f32], d: usize, eps: f32, centered: bool, rstd: &mut [f32]) {
        for (row, r) in buf.chunks_exact_mut(d).zip(rstd.iter_mut()) {
            let (mean, rs) = row_stats(row, eps, centered);
            for v in row.iter_mut() {
                *v = (*v - mean) * rs;
            }
            *r = rs;
        }
    }
}

vectorized! {
    /// [`normalize_rows`] from `src` into `out` (as long), writing each value once.
    fn normalize_rows_into(
        src: &[f32],
        out: &mut [MaybeUninit<f32>],
        d: usize,
        (eps, centered): (f32, bool),
        rstd: &mut [f32],
    ) {
        let rows = src.chunks_exact(d).zip(out.chunks_exact_mut(d)).zip(rstd.iter_mut());
        for ((row, o), r) in rows {
            let (mean, rs) = row_stats(row, eps, centered);
            for (o, &v) in o.iter_mut().zip(row) {
                o.write((v - mean) * rs);
            }
            *r = rs;
        }
    }
}

/// `x̂` and each row's `rstd` on Flex f32: in `x`'s buffer when it can be reused (or in the
/// contiguous copy a strided `x` needs), else written once into a new one — the residual
/// stream a norm reads is shared, and was copied first.
pub(super) fn stats_flex(x: FlexTensor, eps: f64, centered: bool) -> (FlexTensor, FlexTensor) {
    let shape = x.shape().to_vec();
    let mut x = host::contiguous(x);
    let d = *shape.last().expect("a norm needs a last dim");
    let mut rstd = vec![0f32; shape.iter().product::<usize>() / d.max(1)];
    let out = match host::owned(&mut x) {
        Some(buf) => {
            normalize_rows(buf, d, eps as f32, centered, &mut rstd);
            x
        }
        None => {
            let src = host::values(&x);
            let args = (eps as f32, centered);
            let v = host::filled(src.len(), |o| {
                normalize_rows_into(src, o, d, args, &mut rstd)
            });
            host::from_vec(v, shape.clone())
        }
    };
    let mut rshape = shape;
    *rshape.last_mut().expect("checked") = 1;
    (out, host::from_vec(rstd, rshape))
}

/// One row's `dx`, written over `g`.
#[inline(always)]
fn backward_row(g: &mut [f32], xhat: &[f32], rstd: f32, centered: bool) {
    let d = g.len() as f32;
    let mg = match centered {
        true => host::sum_map(g, |v| v) / d,
        false => 0.0,
    };
    let mgx = host::sum_zip(g, xhat, |a, b| a * b) / d;
    for (g, &x) in g.iter_mut().zip(xhat) {
        *g = rstd * (*g - mg - x * mgx);
    }
}

vectorized! {
    /// Every row's `dx` (`d` values each) written over `g`.
    fn backward_rows(g: &mut [f32], xhat: &[f32], rstd: &[f32], d: usize, centered: bool) {
        let rows = g.chunks_exact_mut(d).zip(xhat.chunks_exact(d)).zip(rstd);
        for ((g, x), &r) in rows {
            backward_row(g, x, r, centered);
        }
    }
}

/// `dx` on Flex f32, into `grad`'s buffer when it can be reused.
pub(super) fn backward_flex(
    xhat: FlexTensor,
    rstd: FlexTensor,
    grad: FlexTensor,
    centered: bool,
) -> FlexTensor {
    assert_eq!(xhat.shape(), grad.shape(), "norm backward: shapes differ");
    let d = *xhat.shape().to_vec().last().expect("a last dim");
    let (xhat, rstd) = (host::contiguous(xhat), host::contiguous(rstd));
    let mut out = host::writable(grad);
    let buf = host::owned(&mut out).expect("a fresh buffer");
    backward_rows(buf, host::values(&xhat), host::values(&rstd), d, centered);
    out
}

// ---------------------------------------------------------------------------------------
// Autodiff
// ---------------------------------------------------------------------------------------

#[derive(Debug)]
struct NormCoreBackward {
    centered: bool,
}

impl<B: FusedBackend> Backward<B, 1> for NormCoreBackward {
    /// `x̂` and the rows' `rstd`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            let (xhat, rstd) = ops.state;
            let g = B::norm_core_backward(xhat, rstd, grad, self.centered);
            grads.register::<B>(parent.id, g);
        }
    }
}

/// Under Balanced checkpointing: backward recomputes `x̂` and `rstd` from the input, which
/// the checkpointer keeps or itself recomputes.
#[derive(Debug)]
struct NormCoreRecomputed {
    eps: f64,
    centered: bool,
}

impl<B: FusedBackend> Backward<B, 1> for NormCoreRecomputed {
    /// The input's node.
    type State = NodeId;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, ckpt: &mut Checkpointer) {
        let x: FloatTensor<B> = ckpt.retrieve_node_output(ops.state);
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            let (xhat, rstd) = B::norm_core_stats(x, self.eps, self.centered);
            let g = B::norm_core_backward(xhat, rstd, grad, self.centered);
            grads.register::<B>(parent.id, g);
        }
    }
}

/// The core run again from its input (Balanced checkpointing's recompute of an output).
struct RetroNormCore<B> {
    input_id: NodeId,
    eps: f64,
    centered: bool,
    _backend: PhantomData<fn() -> B>,
}

impl<B> std::fmt::Debug for RetroNormCore<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetroNormCore")
            .field("input_id", &self.input_id)
            .finish()
    }
}

impl<B: FusedBackend> RetroForward for RetroNormCore<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let x = states.get_state::<FloatTensor<B>>(&self.input_id);
        states.save(out_node, B::norm_core(x, self.eps, self.centered))
    }
}

/// The autodiff node of [`FusedBackend::norm_core`]. Under Burn's Balanced checkpointing
/// (ZeRO-3's) the node is memory-bound, as Burn's own element-wise ops are: it keeps no
/// `x̂`, and backward recomputes it from the input (a chain of memory-bound ops recomputed
/// back to the last compute-bound output); otherwise it keeps `x̂` and `rstd`.
pub(super) fn norm_core_autodiff<B: FusedBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    eps: f64,
    centered: bool,
) -> FloatTensor<Autodiff<B, C>> {
    if TypeId::of::<C>() == TypeId::of::<BalancedCheckpointing>() {
        let retro = RetroNormCore::<B> {
            input_id: x.id(),
            eps,
            centered,
            _backend: PhantomData,
        };
        return match (NormCoreRecomputed { eps, centered })
            .prepare::<C>([x.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x])
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = prep.checkpoint(&x);
                prep.finish(state, B::norm_core(x.into_primitive(), eps, centered))
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::norm_core(x.into_primitive(), eps, centered))
            }
        };
    }
    match (NormCoreBackward { centered })
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (xhat, rstd) = B::norm_core_stats(x.into_primitive(), eps, centered);
            prep.finish((xhat.clone(), rstd), xhat)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::norm_core(x.into_primitive(), eps, centered)),
    }
}
