//! Flex's f32 buffers seen as slices: what the host kernels of [`super`] read and write.
//! A contiguous tensor is read in place; a strided one is made contiguous first. An output
//! reuses an input's buffer when that tensor is contiguous, starts its buffer and is not
//! shared; otherwise it is a fresh `Vec`.

use crate::simd::vectorized;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, Tensor, TensorData};
use std::mem::MaybeUninit;

/// A Flex float tensor.
pub(crate) type FlexTensor = FloatTensor<Flex>;

/// Whether `t` is an f32 tensor on Flex (what the host optimizer passes take).
pub(crate) fn is_flex_f32<const D: usize>(t: &Tensor<D>) -> bool {
    t.dtype() == DType::F32 && t.clone().try_into_primitive::<Flex>().is_ok()
}

/// `t`'s Flex primitive (`t` checked by [`is_flex_f32`]).
pub(crate) fn flex_primitive<const D: usize>(t: Tensor<D>) -> FlexTensor {
    t.try_into_primitive::<Flex>()
        .expect("bonfire-kernels: a Flex tensor")
}

/// Whether every tensor is f32 (the host kernels' one dtype).
pub(crate) fn all_f32(ts: &[&FlexTensor]) -> bool {
    ts.iter().all(|t| t.dtype() == DType::F32)
}

/// `t` laid out contiguously (itself when it already is; a transposed f32 matrix by register
/// transposes, `crate::matmul::row_major`).
pub(crate) fn contiguous(t: FlexTensor) -> FlexTensor {
    match t.is_contiguous() {
        true => t,
        false => crate::matmul::row_major(t),
    }
}

/// The values of a contiguous f32 tensor (see [`contiguous`]).
pub(crate) fn values(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>()
        .expect("bonfire-kernels: a contiguous f32 tensor")
}

/// A tensor of `shape` holding `v`.
pub(crate) fn from_vec(v: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(v, shape))
}

pub(crate) use crate::flex_buffer::owned;

/// `f` applied to every value of `x`, in place when `x`'s buffer can be reused.
pub(crate) fn map(mut x: FlexTensor, f: impl Fn(f32) -> f32) -> FlexTensor {
    if let Some(s) = owned(&mut x) {
        map_in_place(s, &f);
        return x;
    }
    let x = contiguous(x);
    let src = values(&x);
    let out = filled(src.len(), |out| map_into(src, out, &f));
    from_vec(out, x.shape().to_vec())
}

/// The concatenation of `parts` (f32, any shapes, flattened), each value through `f`: one
/// pass writing each output value once.
pub(crate) fn concat_map(parts: Vec<FlexTensor>, f: impl Fn(f32) -> f32) -> FlexTensor {
    let parts: Vec<FlexTensor> = parts.into_iter().map(contiguous).collect();
    let len = parts.iter().map(|p| p.shape().num_elements()).sum();
    let out = filled(len, |out| {
        let mut at = 0;
        for part in &parts {
            let src = values(part);
            map_into(src, &mut out[at..at + src.len()], &f);
            at += src.len();
        }
    });
    from_vec(out, vec![len])
}

/// A vector of `len` values, each written once by `fill` (no zero-fill before): what the
/// element-wise passes give a shared input instead of a copy to work over in place.
pub(crate) fn filled(len: usize, fill: impl FnOnce(&mut [MaybeUninit<f32>])) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: `fill` wrote each of the first `len` values (`map_into`, `zip_into`, `rows_into`:
    // one write per value of their equally long inputs — `rows_into`'s rows cover it, as
    // `zip_rows` checks; `concat_map`: its parts cover the `len` values; the norm's
    // `normalize_rows_into`: its rows of `d` cover its input, a whole number of rows).
    unsafe { out.set_len(len) };
    out
}

/// Values an element-wise pass handles between two prefetches: 1 KiB of each input.
const BLOCK: usize = 256;
/// How far ahead of its position an element-wise pass asks for its inputs: 4 KiB. Measured on
/// a Xeon core, a standalone copy of the GELU's loops over 4 MiB inputs out of cache (the
/// step's sizes): forward 0.96 → 0.72 ms, backward 1.46 → 0.89 ms against the same loops
/// unprefetched — the hardware's prefetchers alone leave these compute-heavy loops waiting on
/// their loads (in the train step, `perf` found a third of the backward's samples on its
/// first load).
const AHEAD: usize = 4 * BLOCK;

/// Asks the CPU to bring `s[at..at + len]` into L1 (nothing past `s`'s end; nothing on other
/// architectures). A hint: it neither reads nor writes what the program sees, so `s` is a raw
/// pointer and may be a slice another reference is writing.
#[inline(always)]
pub(crate) fn prefetch(s: *const [f32], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (at..(at + len).min(s.len())).step_by(16) {
        // SAFETY: `line` is within `s`'s allocation; `_mm_prefetch` is SSE (the x86-64
        // baseline) and dereferences nothing.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                s.cast::<f32>().add(line).cast(),
            )
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (s, at, len);
}

/// The blocks `[i, i + BLOCK)` of `0..len`, each after prefetching the inputs' block
/// [`AHEAD`] of it: the loop every element-wise pass below runs its body in.
#[inline(always)]
fn by_blocks(len: usize, inputs: &[*const [f32]], mut body: impl FnMut(std::ops::Range<usize>)) {
    let mut i = 0;
    while i < len {
        for &s in inputs {
            prefetch(s, i + AHEAD, BLOCK);
        }
        let end = (i + BLOCK).min(len);
        body(i..end);
        i = end;
    }
}

vectorized! {
    /// `v ← f(v)` for every value of `s`.
    fn map_in_place(s: &mut [f32], f: &impl Fn(f32) -> f32) {
        let view: *const [f32] = s;
        by_blocks(s.len(), &[view], |r| {
            for v in s[r].iter_mut() {
                *v = f(*v);
            }
        });
    }
}

vectorized! {
    /// `out[i] ← f(src[i])` for every value of `src` (`out` as long), writing each once.
    fn map_into(src: &[f32], out: &mut [MaybeUninit<f32>], f: &impl Fn(f32) -> f32) {
        let out = &mut out[..src.len()];
        by_blocks(src.len(), &[src], |r| {
            for (o, &v) in out[r.clone()].iter_mut().zip(&src[r]) {
                o.write(f(v));
            }
        });
    }
}

/// `f(a, b)` element-wise over two tensors of one shape, into `a`'s buffer when it can be
/// reused.
pub(crate) fn zip(mut a: FlexTensor, b: FlexTensor, f: impl Fn(f32, f32) -> f32) -> FlexTensor {
    assert_eq!(a.shape(), b.shape(), "bonfire-kernels: shapes differ");
    let b = contiguous(b);
    let bv = values(&b);
    if let Some(s) = owned(&mut a) {
        zip_in_place(s, bv, &f);
        return a;
    }
    let a = contiguous(a);
    let av = values(&a);
    let out = filled(av.len(), |out| zip_into(av, bv, out, &f));
    from_vec(out, a.shape().to_vec())
}

vectorized! {
    /// `a ← f(a, b)` element-wise (`b` as long as `a`).
    fn zip_in_place(a: &mut [f32], b: &[f32], f: &impl Fn(f32, f32) -> f32) {
        let b = &b[..a.len()];
        let view: *const [f32] = a;
        by_blocks(a.len(), &[view, b], |r| {
            for (x, &y) in a[r.clone()].iter_mut().zip(&b[r]) {
                *x = f(*x, y);
            }
        });
    }
}

vectorized! {
    /// `out[i] ← f(a[i], b[i])` (all three as long as `a`), writing each once.
    fn zip_into(a: &[f32], b: &[f32], out: &mut [MaybeUninit<f32>], f: &impl Fn(f32, f32) -> f32) {
        let (b, out) = (&b[..a.len()], &mut out[..a.len()]);
        by_blocks(a.len(), &[a, b], |r| {
            for ((o, &x), &y) in out[r.clone()].iter_mut().zip(&a[r.clone()]).zip(&b[r]) {
                o.write(f(x, y));
            }
        });
    }
}

/// `f(x, row)` for every row of `x` (its last dim as long as `row`), into `x`'s buffer when it
/// can be reused.
pub(crate) fn zip_rows(mut x: FlexTensor, row: &[f32], f: impl Fn(f32, f32) -> f32) -> FlexTensor {
    let n = x.shape().last().copied().unwrap_or(1);
    assert_eq!(
        n,
        row.len(),
        "bonfire-kernels: a row's length differs from the last dim"
    );
    if let Some(s) = owned(&mut x) {
        rows_in_place(s, row, &f);
        return x;
    }
    let x = contiguous(x);
    let src = values(&x);
    let out = filled(src.len(), |out| rows_into(src, row, out, &f));
    from_vec(out, x.shape().to_vec())
}

vectorized! {
    /// `x[r·N + j] ← f(x[r·N + j], row[j])` for every row of `x` (`N = row.len()`).
    fn rows_in_place(x: &mut [f32], row: &[f32], f: &impl Fn(f32, f32) -> f32) {
        let (n, view) = (row.len(), x as *const [f32]);
        for (r, xs) in x.chunks_exact_mut(n.max(1)).enumerate() {
            prefetch(view, r * n + AHEAD, n);
            for (v, &b) in xs.iter_mut().zip(row) {
                *v = f(*v, b);
            }
        }
    }
}

vectorized! {
    /// `out[r·N + j] ← f(x[r·N + j], row[j])` (`out` as long as `x`), writing each once.
    fn rows_into(x: &[f32], row: &[f32], out: &mut [MaybeUninit<f32>], f: &impl Fn(f32, f32) -> f32) {
        let n = row.len().max(1);
        let rows = out[..x.len()].chunks_exact_mut(n).zip(x.chunks_exact(n));
        for (r, (os, xs)) in rows.enumerate() {
            prefetch(x, r * n + AHEAD, n);
            for ((o, &v), &b) in os.iter_mut().zip(xs).zip(row) {
                o.write(f(v, b));
            }
        }
    }
}

/// `x` with a buffer of its own, contiguous from the start (itself when it already has one,
/// else a copy) — for kernels that write their output over an input.
pub(crate) fn writable(mut x: FlexTensor) -> FlexTensor {
    if owned(&mut x).is_some() {
        return x;
    }
    let x = contiguous(x);
    from_vec(values(&x).to_vec(), x.shape().to_vec())
}

/// Independent accumulators of [`sum_zip`] and [`max_of`]: a sequential `f32` sum (or
/// fold) is not reassociated by the compiler, so it stays scalar; this many lanes vectorize.
const LANES: usize = 16;

/// `Σ f(a[i], b[i])` over two slices of one length, in [`LANES`] partial sums (the row
/// reductions of the norm and cross-entropy kernels).
#[inline(always)]
pub(crate) fn sum_zip(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = (ca.remainder().iter().zip(cb.remainder()))
        .map(|(&x, &y)| f(x, y))
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += f(x[l], y[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ f(a[i])`, as [`sum_zip`].
#[inline(always)]
pub(crate) fn sum_map(a: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    sum_zip(a, a, |x, _| f(x))
}

/// The largest of `xs` (`−∞` when empty), in [`LANES`] partial maxima.
#[inline(always)]
pub(crate) fn max_of(xs: &[f32]) -> f32 {
    let bigger = |a: f32, b: f32| if b > a { b } else { a };
    let mut acc = [f32::NEG_INFINITY; LANES];
    let c = xs.chunks_exact(LANES);
    let tail = c
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| bigger(a, b));
    for x in c {
        for l in 0..LANES {
            acc[l] = bigger(acc[l], x[l]);
        }
    }
    acc.iter().fold(tail, |a, &b| bigger(a, b))
}
