//! The fused attention's host kernels on f32 buffers: forward (output and each query's
//! log-sum-exp) and flash-attention-2 backward, both over tiles of [`TILE`] keys with no
//! `Tq × Tk` buffer.
//!
//! Work is split by `(batch, kv head)`: one unit owns its kv head's `K`, `V`, their gradients
//! and the `h / h_kv` query heads that share them, so the GQA sums need no synchronization (the
//! units run one after another on the rank's thread). Inside a unit the work goes by tiles of
//! [`TILE`] queries × [`TILE`] keys: every product is a `gemm` call on the tile (the crate
//! Flex's own matrix products use; strides stand for the transposes), the softmax and masking
//! run over the tile's rows. The row loops are compiled three times — AVX-512, AVX2 + FMA and
//! the portable baseline — and the best the CPU has is picked at run time.

use super::Mask;
use crate::fused::fast_exp as exp;
use crate::simd::vectorized;
use std::ops::Range;

/// Keys (and queries) per tile.
pub(crate) const TILE: usize = 64;

/// The sizes of one call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    /// Batch.
    pub b: usize,
    /// Query heads.
    pub h: usize,
    /// Key/value heads (`h % h_kv == 0`).
    pub h_kv: usize,
    /// Queries.
    pub tq: usize,
    /// Keys.
    pub tk: usize,
    /// Head width.
    pub dh: usize,
    /// Scale of the scores.
    pub scale: f32,
    /// Which keys each query sees.
    pub mask: Mask,
}

impl Dims {
    fn group(&self) -> usize {
        self.h / self.h_kv
    }

    /// The keys query `i` attends to (a range: both ends grow with `i`).
    fn keys(&self, i: usize) -> Range<usize> {
        self.mask.keys(i, self.tq, self.tk)
    }
}

/// `dst[m × n] (+)= beta · lhs[m × k] · rhs[k × n]` through `gemm` (the matrix product Flex
/// uses), each operand given as `(pointer offset base, row stride, column stride)`; with
/// `add` the product is added to `dst`, otherwise it replaces it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn product(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    add: bool,
    (lhs, lhs_rs, lhs_cs): (&[f32], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[f32], usize, usize),
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    // The last element each operand's strides reach must lie inside its slice.
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(last(m, n, dst_rs, 1) < dst.len());
    assert!(k == 0 || last(m, k, lhs_rs, lhs_cs) < lhs.len());
    assert!(k == 0 || last(k, n, rhs_rs, rhs_cs) < rhs.len());
    // SAFETY: every index the strides reach lies inside its slice (asserted above), `dst`
    // is borrowed mutably and so aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            add,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// A tile of up to [`TILE`] queries of one head against a tile of up to [`TILE`] keys: the
/// queries from position `i0` (in `0 .. Tq`), the keys `t0 .. t0 + n`.
#[derive(Clone, Copy)]
struct Tile {
    i0: usize,
    t0: usize,
    n: usize,
}

impl Dims {
    /// The key tiles the query tile `i0 .. i0 + rows` sees any key of, as `(t0, n)`: from its
    /// first query's first key to its last query's last.
    fn key_tiles(&self, i0: usize, rows: usize) -> impl Iterator<Item = (usize, usize)> {
        let (start, end) = (self.keys(i0).start, self.keys(i0 + rows - 1).end);
        (start..end)
            .step_by(TILE)
            .map(move |t0| (t0, (end - t0).min(TILE)))
    }

    /// The tile's keys query row `r` of it sees, as a range of the tile's columns (the rest
    /// are masked; empty when it sees none of them).
    fn seen(&self, tile: Tile, r: usize) -> Range<usize> {
        let keys = self.keys(tile.i0 + r);
        let at = |k: usize| k.saturating_sub(tile.t0).min(tile.n);
        at(keys.start)..at(keys.end).max(at(keys.start))
    }
}

/// One unit's forward: `q`, `o` are its `g` query heads `[g, Tq, dh]`, `lse` `[g, Tq]`,
/// `k`, `v` its kv head `[Tk, dh]`. Per tile of queries and tile of keys: the scores
/// `S = scale · Q Kᵀ` and the update `O ← α O + P V` are matrix products, the online softmax
/// (running maximum `m`, sum `l`) runs over `S`'s rows.
#[inline(always)]
fn forward_unit_body(d: &Dims, q: &[f32], k: &[f32], v: &[f32], o: &mut [f32], lse: &mut [f32]) {
    let dh = d.dh;
    let mut s = vec![0.0f32; TILE * TILE];
    let (mut m, mut l) = ([0.0f32; TILE], [0.0f32; TILE]);
    for head in 0..d.group() {
        for i0 in (0..d.tq).step_by(TILE) {
            let rows = (d.tq - i0).min(TILE);
            let at = (head * d.tq + i0) * dh;
            let (q, acc) = (&q[at..][..rows * dh], &mut o[at..][..rows * dh]);
            acc.fill(0.0);
            m.fill(f32::NEG_INFINITY);
            l.fill(0.0);
            for (t0, n) in d.key_tiles(i0, rows) {
                let tile = Tile { i0, t0, n };
                let kt = (&k[t0 * dh..], 1, dh);
                product((rows, n, dh), &mut s, TILE, false, (q, dh, 1), kt, d.scale);
                for r in 0..rows {
                    let row = &mut s[r * TILE..][..n];
                    let seen = d.seen(tile, r);
                    row[..seen.start].fill(0.0);
                    row[seen.end..].fill(0.0);
                    if seen.is_empty() {
                        continue; // nothing of this tile: the row's state stays
                    }
                    let row = &mut row[seen];
                    let m_new = row.iter().fold(m[r], |a, &b| a.max(b));
                    let alpha = exp(m[r] - m_new);
                    row.iter_mut().for_each(|p| *p = exp(*p - m_new));
                    l[r] = l[r] * alpha + row.iter().sum::<f32>();
                    m[r] = m_new;
                    acc[r * dh..][..dh].iter_mut().for_each(|a| *a *= alpha);
                }
                let vt = (&v[t0 * dh..], dh, 1);
                product((rows, dh, n), acc, dh, true, (&s, TILE, 1), vt, 1.0);
            }
            let lse = &mut lse[head * d.tq + i0..][..rows];
            for (r, lse) in lse.iter_mut().enumerate() {
                // A query that saw no key: output 0 (the accumulator's), log-sum-exp −∞.
                let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
                acc[r * dh..][..dh].iter_mut().for_each(|a| *a *= inv);
                *lse = m[r] + l[r].ln();
            }
        }
    }
}

/// The backward's inputs of one unit (shapes as in [`forward_unit_body`]).
pub(crate) struct BackwardIn<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub o: &'a [f32],
    pub lse: &'a [f32],
    pub grad: &'a [f32],
    /// The gradient of the log-sum-exp (`[g, Tq]`; zeros when only the output is used).
    pub dlse: &'a [f32],
}

/// The backward's outputs of one unit: `dq` `[g, Tq, dh]`, `dk`, `dv` `[Tk, dh]` (the sums
/// over the unit's query heads).
pub(crate) struct BackwardOut<'a> {
    pub dq: &'a mut [f32],
    pub dk: &'a mut [f32],
    pub dv: &'a mut [f32],
}

/// One unit's backward, per tile of queries and tile of keys: `P` recomputed from the kept
/// log-sum-exp, then `dV += Pᵀ dO`, `dP = dO Vᵀ`, `dS = scale · P ⊙ (dP − D)` with
/// `D = rowsum(dO ⊙ O) − dlse` (`∂lse/∂S = P`: the log-sum-exp's own gradient enters as a
/// shift of `D`), `dQ += dS K`, `dK += dSᵀ Q` — the five matrix products of
/// flash-attention-2.
#[inline(always)]
fn backward_unit_body(d: &Dims, x: &BackwardIn, out: &mut BackwardOut) {
    let dh = d.dh;
    out.dk.fill(0.0);
    out.dv.fill(0.0);
    out.dq.fill(0.0);
    let (mut p, mut ds) = (vec![0.0f32; TILE * TILE], vec![0.0f32; TILE * TILE]);
    let mut big_d = [0.0f32; TILE];
    for head in 0..d.group() {
        for i0 in (0..d.tq).step_by(TILE) {
            let rows = (d.tq - i0).min(TILE);
            let at = (head * d.tq + i0) * dh;
            let (q, g) = (&x.q[at..][..rows * dh], &x.grad[at..][..rows * dh]);
            let (o, dq) = (&x.o[at..][..rows * dh], &mut out.dq[at..][..rows * dh]);
            let lse = &x.lse[head * d.tq + i0..][..rows];
            let dlse = &x.dlse[head * d.tq + i0..][..rows];
            for (r, big_d) in big_d[..rows].iter_mut().enumerate() {
                let (g, o) = (&g[r * dh..][..dh], &o[r * dh..][..dh]);
                *big_d = g.iter().zip(o).map(|(a, b)| a * b).sum::<f32>() - dlse[r];
            }
            for (t0, n) in d.key_tiles(i0, rows) {
                let tile = Tile { i0, t0, n };
                let (kt, vt) = ((&x.k[t0 * dh..], 1, dh), (&x.v[t0 * dh..], 1, dh));
                product((rows, n, dh), &mut p, TILE, false, (q, dh, 1), kt, d.scale);
                product((rows, n, dh), &mut ds, TILE, false, (g, dh, 1), vt, 1.0);
                for r in 0..rows {
                    let seen = d.seen(tile, r);
                    let (pr, dsr) = (&mut p[r * TILE..][..n], &mut ds[r * TILE..][..n]);
                    let (ps, dss) = (&mut pr[seen.clone()], &mut dsr[seen.clone()]);
                    for (p, ds) in ps.iter_mut().zip(dss.iter_mut()) {
                        *p = exp(*p - lse[r]);
                        *ds = *p * (*ds - big_d[r]) * d.scale;
                    }
                    pr[..seen.start].fill(0.0);
                    pr[seen.end..].fill(0.0);
                    dsr[..seen.start].fill(0.0);
                    dsr[seen.end..].fill(0.0);
                }
                let (dk, dv) = (&mut out.dk[t0 * dh..], &mut out.dv[t0 * dh..]);
                product((n, dh, rows), dv, dh, true, (&p, 1, TILE), (g, dh, 1), 1.0);
                product(
                    (rows, dh, n),
                    dq,
                    dh,
                    true,
                    (&ds, TILE, 1),
                    (&x.k[t0 * dh..], dh, 1),
                    1.0,
                );
                product((n, dh, rows), dk, dh, true, (&ds, 1, TILE), (q, dh, 1), 1.0);
            }
        }
    }
}

vectorized! {
    /// [`forward_unit_body`] at the CPU's vector width.
    fn forward_unit(d: &Dims, q: &[f32], k: &[f32], v: &[f32], o: &mut [f32], lse: &mut [f32]) {
        forward_unit_body(d, q, k, v, o, lse)
    }
}

vectorized! {
    /// [`backward_unit_body`] at the CPU's vector width.
    fn backward_unit(d: &Dims, x: &BackwardIn, out: &mut BackwardOut) {
        backward_unit_body(d, x, out)
    }
}

/// Runs `f` on each of `units`, in order, on the calling thread: a rank computes on one
/// thread, as every other Flex op here does (Burn is built without `rayon`; the ranks are the
/// cores, and a rank's communication thread needs the rest).
fn parallel<T: Send>(units: Vec<T>, f: impl Fn(T) + Sync) {
    units.into_iter().for_each(f);
}

/// Forward over contiguous `q` `[B, h, Tq, dh]`, `k`, `v` `[B, h_kv, Tk, dh]`: the output
/// `[B, h, Tq, dh]` and each query's log-sum-exp of its scaled scores `[B, h, Tq]`.
pub(crate) fn forward(d: &Dims, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (qn, kn) = (d.group() * d.tq * d.dh, d.tk * d.dh);
    let mut o = vec![0.0; d.b * d.h * d.tq * d.dh];
    let mut lse = vec![0.0; d.b * d.h * d.tq];
    let units: Vec<_> = o
        .chunks_exact_mut(qn)
        .zip(lse.chunks_exact_mut(d.group() * d.tq))
        .enumerate()
        .collect();
    parallel(units, |(u, (o, lse))| {
        let (q, k, v) = (&q[u * qn..][..qn], &k[u * kn..][..kn], &v[u * kn..][..kn]);
        forward_unit(d, q, k, v, o, lse)
    });
    (o, lse)
}

/// Backward from [`forward`]'s inputs, output, log-sum-exp, the output's gradient `grad` and
/// the log-sum-exp's `dlse`: `(dq, dk, dv)` in the inputs' shapes.
pub(crate) fn backward(d: &Dims, x: &BackwardIn) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (qn, kn, ln) = (d.group() * d.tq * d.dh, d.tk * d.dh, d.group() * d.tq);
    let mut dq = vec![0.0; d.b * d.h * d.tq * d.dh];
    let mut dk = vec![0.0; d.b * d.h_kv * kn];
    let mut dv = vec![0.0; d.b * d.h_kv * kn];
    let units: Vec<_> = dq
        .chunks_exact_mut(qn)
        .zip(dk.chunks_exact_mut(kn).zip(dv.chunks_exact_mut(kn)))
        .enumerate()
        .collect();
    parallel(units, |(u, (dq, (dk, dv)))| {
        let unit = BackwardIn {
            q: &x.q[u * qn..][..qn],
            k: &x.k[u * kn..][..kn],
            v: &x.v[u * kn..][..kn],
            o: &x.o[u * qn..][..qn],
            lse: &x.lse[u * ln..][..ln],
            grad: &x.grad[u * qn..][..qn],
            dlse: &x.dlse[u * ln..][..ln],
        };
        backward_unit(d, &unit, &mut BackwardOut { dq, dk, dv })
    });
    (dq, dk, dv)
}
