//! [`super::rope`]: rotary position embedding `x·cos + rotate_half(x)·sin` on `[B, h, T, hd]`
//! with tables `[T, hd]`, `rotate_half(x) = [−x₂, x₁]`, as one autodiff node. Its backward is
//! the transposed rotation: `dx₁ = g₁·cos₁ + g₂·sin₂`, `dx₂ = g₂·cos₂ − g₁·sin₁` (the same
//! rotation with `−sin` when the tables' halves are equal, as they are for RoPE). The tables
//! are constants: they get no gradient. On Flex in f32 each way is one pass over host slices.

use super::backend::FusedBackend;
use super::host::{self, FlexTensor};
use crate::simd::vectorized;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata};
use burn::tensor::{Shape, Slice};

/// The halves `[.., :hd/2]` and `[.., hd/2:]` of the last dim of a 4-d tensor.
fn halves<B: Backend>(t: FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let hd = t.shape()[3] as isize;
    let part = |a, b| {
        let mut s = [Slice::full(); 4];
        s[3] = Slice::new(a, Some(b), 1);
        s
    };
    (
        B::float_slice(t.clone(), &part(0, hd / 2)),
        B::float_slice(t, &part(hd / 2, hd)),
    )
}

/// `[T, hd]` as `[1, 1, T, hd]`, in `x`'s dtype.
fn table<B: Backend>(t: FloatTensor<B>, like: &FloatTensor<B>) -> FloatTensor<B> {
    let s = t.shape();
    let t = super::dtype::narrow_to::<B>(t, like.dtype());
    B::float_reshape(t, Shape::new([1, 1, s[0], s[1]]))
}

/// `x·cos + [−x₂, x₁]·sin` in Burn ops (any backend; the reference). With `transposed`, the
/// backward's rotation `g·cos + [g₂·sin₂, −g₁·sin₁]`.
pub(super) fn fallback<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    transposed: bool,
) -> FloatTensor<B> {
    let (cos, sin) = (table::<B>(cos, &x), table::<B>(sin, &x));
    let (x1, x2) = halves::<B>(x.clone());
    let rotated = match transposed {
        false => B::float_cat(vec![B::float_neg(x2), x1], 3),
        true => B::float_cat(vec![x2, B::float_neg(x1)], 3),
    };
    let swapped_sin = match transposed {
        false => sin,
        true => {
            let (s1, s2) = halves::<B>(sin);
            B::float_cat(vec![s2, s1], 3)
        }
    };
    B::float_add(B::float_mul(x, cos), B::float_mul(rotated, swapped_sin))
}

/// Whether the Flex kernel covers these shapes: `x` `[B, h, T, hd]` (even `hd`), tables
/// `[T, hd]`, all f32.
pub(super) fn flex_covers(x: &FlexTensor, cos: &FlexTensor, sin: &FlexTensor) -> bool {
    let (xs, cs) = (x.shape(), cos.shape());
    host::all_f32(&[x, cos, sin])
        && xs.num_dims() == 4
        && xs[3] % 2 == 0
        && cs.num_dims() == 2
        && cs == sin.shape()
        && cs[0] == xs[2]
        && cs[1] == xs[3]
}

/// One row's rotation, `dst = rot(src)` (or its transpose), `c`/`s` the row's tables.
#[inline(always)]
fn rotate_row(dst: &mut [f32], src: &[f32], c: &[f32], s: &[f32], transposed: bool) {
    let h = src.len() / 2;
    let (d1, d2) = dst.split_at_mut(h);
    let (x1, x2) = src.split_at(h);
    let (c1, c2) = c.split_at(h);
    let (s1, s2) = s.split_at(h);
    for j in 0..h {
        let (a, b) = (x1[j], x2[j]);
        match transposed {
            false => {
                d1[j] = a * c1[j] - b * s1[j];
                d2[j] = b * c2[j] + a * s2[j];
            }
            true => {
                d1[j] = a * c1[j] + b * s2[j];
                d2[j] = b * c2[j] - a * s1[j];
            }
        }
    }
}

vectorized! {
    /// Every row of `src` (`hd` values; the tables `c`, `s` cover one repetition of the rows)
    /// rotated into `out`.
    fn rotate_all(out: &mut [f32], src: &[f32], c: &[f32], s: &[f32], hd: usize, transposed: bool) {
        let table = c.len();
        for (dst, src) in out.chunks_exact_mut(table).zip(src.chunks_exact(table)) {
            let rows = dst
                .chunks_exact_mut(hd)
                .zip(src.chunks_exact(hd))
                .zip(c.chunks_exact(hd).zip(s.chunks_exact(hd)));
            for ((d, x), (c, sn)) in rows {
                match transposed {
                    false => rotate_row(d, x, c, sn, false),
                    true => rotate_row(d, x, c, sn, true),
                }
            }
        }
    }
}

/// The rotation (or its transpose) on Flex f32 (see [`flex_covers`]).
pub(super) fn flex(
    x: FlexTensor,
    cos: FlexTensor,
    sin: FlexTensor,
    transposed: bool,
) -> FlexTensor {
    let shape = x.shape().to_vec();
    let hd = shape[3];
    let (x, cos, sin) = (
        host::contiguous(x),
        host::contiguous(cos),
        host::contiguous(sin),
    );
    let (xv, cv, sv) = (host::values(&x), host::values(&cos), host::values(&sin));
    let mut out = vec![0f32; xv.len()];
    rotate_all(&mut out, xv, cv, sv, hd, transposed);
    host::from_vec(out, shape)
}

#[derive(Debug)]
struct RopeBackward;

impl<B: FusedBackend> Backward<B, 1> for RopeBackward {
    /// The tables `cos`, `sin`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            let (cos, sin) = ops.state;
            grads.register::<B>(parent.id, B::rope_backward(grad, cos, sin));
        }
    }
}

/// The autodiff node of [`FusedBackend::rope`]: it keeps the tables (not `x`).
pub(super) fn rope_autodiff<B: FusedBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    cos: FloatTensor<Autodiff<B, C>>,
    sin: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let (cos, sin) = (cos.into_primitive(), sin.into_primitive());
    match RopeBackward
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = B::rope(x.into_primitive(), cos.clone(), sin.clone());
            prep.finish((cos, sin), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::rope(x.into_primitive(), cos, sin)),
    }
}
