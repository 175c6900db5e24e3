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
//! the portable baseline — and the best the CPU has is picked at run time; their sums and
//! maxima (the softmax's row max and sum, the backward's `D`) go in `host::sum_zip`'s 16
//! partial sums, which vectorize where a sequential `f32` sum stays scalar.
//!
//! The inputs are read where they lie ([`Heads`]: any batch, head and row strides, each row's
//! `dh` values contiguous) — the models' heads split from their projections without the copy
//! each of them cost — and the outputs are written so that the models' next reshape is a
//! view: the output sequence-major, each gradient in its input's layout.

use super::Mask;
use crate::fused::fast_exp as exp;
use crate::fused::host;
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

/// Where a `[B, heads, T, dh]` tensor's rows lie in its buffer: row `t` of head `j` of batch
/// `i` starts at `i·batch + j·head + t·row`, its `dh` values contiguous. The models' `q`, `k`,
/// `v` are `[B, T, heads·dh]` projections split into heads (a reshape and a swap: rows
/// `heads·dh` apart), which the kernels read in place. The output is written sequence-major
/// (`[B, T, heads, dh]` seen as `[B, heads, T, dh]`: what the models merge the heads back from,
/// so the merge is a view), and each gradient in the layout of its input (`dq` like `q`, `dk`
/// like `k`, `dv` like `v`), so that the split's backward is a view too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Heads {
    pub batch: usize,
    pub head: usize,
    pub row: usize,
}

impl Heads {
    /// `[B, heads, T, dh]` contiguous.
    pub(crate) fn contiguous(heads: usize, t: usize, dh: usize) -> Self {
        Self {
            batch: heads * t * dh,
            head: t * dh,
            row: dh,
        }
    }

    /// `[B, T, heads, dh]` contiguous, seen as `[B, heads, T, dh]` (the heads of a projection).
    pub(crate) fn sequence_major(heads: usize, t: usize, dh: usize) -> Self {
        Self {
            batch: t * heads * dh,
            head: dh,
            row: heads * dh,
        }
    }

    /// Whether the heads' rows interleave (rows further apart than heads).
    pub(crate) fn is_sequence_major(&self) -> bool {
        self.row > self.head
    }

    /// The start of row `t` of head `j` of batch `i`.
    fn at(&self, i: usize, j: usize, t: usize) -> usize {
        i * self.batch + j * self.head + t * self.row
    }
}

/// A `[B, heads, T, dh]` f32 input: its buffer from its first element, and its [`Heads`].
#[derive(Clone, Copy)]
pub(crate) struct Input<'a> {
    pub data: &'a [f32],
    pub heads: Heads,
}

impl Input<'_> {
    /// The values from row `t` of head `j` of batch `i` to the buffer's end.
    fn from(&self, i: usize, j: usize, t: usize) -> &[f32] {
        &self.data[self.heads.at(i, j, t)..]
    }
}

/// A `[B, heads, T, dh]` f32 output being written: its buffer and its [`Heads`].
pub(crate) struct Output {
    pub data: Vec<f32>,
    pub heads: Heads,
}

impl Output {
    /// A zeroed output of `b × heads × t × dh` values laid out as `layout`.
    fn zeroed(b: usize, heads: usize, t: usize, dh: usize, sequence_major: bool) -> Self {
        let layout = match sequence_major {
            true => Heads::sequence_major(heads, t, dh),
            false => Heads::contiguous(heads, t, dh),
        };
        Self {
            data: vec![0.0; b * heads * t * dh],
            heads: layout,
        }
    }

    /// The values from row `t` of head `j` of batch `i` to the buffer's end.
    fn from(&mut self, i: usize, j: usize, t: usize) -> &mut [f32] {
        let at = self.heads.at(i, j, t);
        &mut self.data[at..]
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

/// The forward's inputs: `q` `[B, h, Tq, dh]`, `k`, `v` `[B, h_kv, Tk, dh]`.
pub(crate) struct ForwardIn<'a> {
    pub q: Input<'a>,
    pub k: Input<'a>,
    pub v: Input<'a>,
}

/// One unit's forward — batch `i`, kv head `kvh` and its `h / h_kv` query heads — into `o`
/// and `lse` (`[B, h, Tq]`). Per tile of queries and tile of keys: the scores
/// `S = scale · Q Kᵀ` and the update `O ← α O + P V` are matrix products, the online softmax
/// (running maximum `m`, sum `l`) runs over `S`'s rows. `o` starts zeroed.
#[inline(always)]
fn forward_unit_body(
    d: &Dims,
    (i, kvh): (usize, usize),
    x: &ForwardIn,
    o: &mut Output,
    lse: &mut [f32],
) {
    let dh = d.dh;
    let mut s = vec![0.0f32; TILE * TILE];
    let (mut m, mut l) = ([0.0f32; TILE], [0.0f32; TILE]);
    let (qr, kr, vr, or) = (x.q.heads.row, x.k.heads.row, x.v.heads.row, o.heads.row);
    for j in kvh * d.group()..(kvh + 1) * d.group() {
        for i0 in (0..d.tq).step_by(TILE) {
            let rows = (d.tq - i0).min(TILE);
            let (q, acc) = (x.q.from(i, j, i0), o.from(i, j, i0));
            m.fill(f32::NEG_INFINITY);
            l.fill(0.0);
            for (t0, n) in d.key_tiles(i0, rows) {
                let tile = Tile { i0, t0, n };
                let kt = (x.k.from(i, kvh, t0), 1, kr);
                product((rows, n, dh), &mut s, TILE, false, (q, qr, 1), kt, d.scale);
                for r in 0..rows {
                    let row = &mut s[r * TILE..][..n];
                    let seen = d.seen(tile, r);
                    row[..seen.start].fill(0.0);
                    row[seen.end..].fill(0.0);
                    if seen.is_empty() {
                        continue; // nothing of this tile: the row's state stays
                    }
                    let row = &mut row[seen];
                    let m_new = host::max_of(row).max(m[r]);
                    let alpha = exp(m[r] - m_new);
                    row.iter_mut().for_each(|p| *p = exp(*p - m_new));
                    l[r] = l[r] * alpha + host::sum_map(row, |p| p);
                    m[r] = m_new;
                    acc[r * or..][..dh].iter_mut().for_each(|a| *a *= alpha);
                }
                let vt = (x.v.from(i, kvh, t0), vr, 1);
                product((rows, dh, n), acc, or, true, (&s, TILE, 1), vt, 1.0);
            }
            let lse = &mut lse[(i * d.h + j) * d.tq + i0..][..rows];
            for (r, lse) in lse.iter_mut().enumerate() {
                // A query that saw no key: output 0 (the accumulator's), log-sum-exp −∞.
                let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
                acc[r * or..][..dh].iter_mut().for_each(|a| *a *= inv);
                *lse = m[r] + l[r].ln();
            }
        }
    }
}

/// The backward's inputs (shapes as in [`ForwardIn`]; `o` and `grad` like `q`).
pub(crate) struct BackwardIn<'a> {
    pub q: Input<'a>,
    pub k: Input<'a>,
    pub v: Input<'a>,
    pub o: Input<'a>,
    pub grad: Input<'a>,
    /// The log-sum-exp, contiguous `[B, h, Tq]`.
    pub lse: &'a [f32],
    /// The gradient of the log-sum-exp (contiguous `[B, h, Tq]`; zeros when only the output
    /// is used).
    pub dlse: &'a [f32],
}

/// The backward's outputs: `dq` `[B, h, Tq, dh]`, `dk`, `dv` `[B, h_kv, Tk, dh]` (the sums
/// over the query heads that share a kv head), zeroed before the units add into them.
pub(crate) struct BackwardOut {
    pub dq: Output,
    pub dk: Output,
    pub dv: Output,
}

/// One unit's backward (batch `i`, kv head `kvh`), per tile of queries and tile of keys: `P`
/// recomputed from the kept log-sum-exp, then `dV += Pᵀ dO`, `dP = dO Vᵀ`,
/// `dS = scale · P ⊙ (dP − D)` with `D = rowsum(dO ⊙ O) − dlse` (`∂lse/∂S = P`: the
/// log-sum-exp's own gradient enters as a shift of `D`), `dQ += dS K`, `dK += dSᵀ Q` — the
/// five matrix products of flash-attention-2.
#[inline(always)]
fn backward_unit_body(d: &Dims, (i, kvh): (usize, usize), x: &BackwardIn, out: &mut BackwardOut) {
    let dh = d.dh;
    let (mut p, mut ds) = (vec![0.0f32; TILE * TILE], vec![0.0f32; TILE * TILE]);
    let mut big_d = [0.0f32; TILE];
    let (qr, kr, vr) = (x.q.heads.row, x.k.heads.row, x.v.heads.row);
    let (gr, or) = (x.grad.heads.row, x.o.heads.row);
    let (dqr, dkr, dvr) = (out.dq.heads.row, out.dk.heads.row, out.dv.heads.row);
    for j in kvh * d.group()..(kvh + 1) * d.group() {
        for i0 in (0..d.tq).step_by(TILE) {
            let rows = (d.tq - i0).min(TILE);
            let (q, g, o) = (
                x.q.from(i, j, i0),
                x.grad.from(i, j, i0),
                x.o.from(i, j, i0),
            );
            let at = (i * d.h + j) * d.tq + i0;
            let (lse, dlse) = (&x.lse[at..][..rows], &x.dlse[at..][..rows]);
            for (r, big_d) in big_d[..rows].iter_mut().enumerate() {
                let (g, o) = (&g[r * gr..][..dh], &o[r * or..][..dh]);
                *big_d = host::sum_zip(g, o, |a, b| a * b) - dlse[r];
            }
            let dq = out.dq.from(i, j, i0);
            for (t0, n) in d.key_tiles(i0, rows) {
                let tile = Tile { i0, t0, n };
                let (k, v) = (x.k.from(i, kvh, t0), x.v.from(i, kvh, t0));
                let (kt, vt) = ((k, 1, kr), (v, 1, vr));
                product((rows, n, dh), &mut p, TILE, false, (q, qr, 1), kt, d.scale);
                product((rows, n, dh), &mut ds, TILE, false, (g, gr, 1), vt, 1.0);
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
                let dv = out.dv.from(i, kvh, t0);
                product((n, dh, rows), dv, dvr, true, (&p, 1, TILE), (g, gr, 1), 1.0);
                let (ds_rows, ds_cols) = ((&ds[..], TILE, 1), (&ds[..], 1, TILE));
                product((rows, dh, n), &mut *dq, dqr, true, ds_rows, (k, kr, 1), 1.0);
                let dk = out.dk.from(i, kvh, t0);
                product((n, dh, rows), dk, dkr, true, ds_cols, (q, qr, 1), 1.0);
            }
        }
    }
}

vectorized! {
    /// [`forward_unit_body`] at the CPU's vector width.
    fn forward_unit(
        d: &Dims,
        unit: (usize, usize),
        x: &ForwardIn,
        o: &mut Output,
        lse: &mut [f32],
    ) {
        forward_unit_body(d, unit, x, o, lse)
    }
}

vectorized! {
    /// [`backward_unit_body`] at the CPU's vector width.
    fn backward_unit(d: &Dims, unit: (usize, usize), x: &BackwardIn, out: &mut BackwardOut) {
        backward_unit_body(d, unit, x, out)
    }
}

/// The units `(batch, kv head)`, in order: a rank computes on one thread, as every other Flex
/// op here does (Burn is built without `rayon`; the ranks are the cores, and a rank's
/// communication thread needs the rest).
fn units(d: &Dims) -> impl Iterator<Item = (usize, usize)> {
    let h_kv = d.h_kv;
    (0..d.b).flat_map(move |i| (0..h_kv).map(move |kvh| (i, kvh)))
}

/// Forward: the output `[B, h, Tq, dh]`, written sequence-major (`[B, Tq, h, dh]`: the heads
/// merged back are contiguous), and each query's log-sum-exp of its scaled scores, contiguous
/// `[B, h, Tq]`.
pub(crate) fn forward(d: &Dims, x: &ForwardIn) -> (Output, Vec<f32>) {
    let mut o = Output::zeroed(d.b, d.h, d.tq, d.dh, true);
    let mut lse = vec![0.0; d.b * d.h * d.tq];
    units(d).for_each(|unit| forward_unit(d, unit, x, &mut o, &mut lse));
    (o, lse)
}

/// Backward from [`forward`]'s inputs, output, log-sum-exp, the output's gradient `grad` and
/// the log-sum-exp's `dlse`: `(dq, dk, dv)`, each laid out like its input.
pub(crate) fn backward(d: &Dims, x: &BackwardIn) -> BackwardOut {
    let like = |input: &Input| input.heads.is_sequence_major();
    let mut out = BackwardOut {
        dq: Output::zeroed(d.b, d.h, d.tq, d.dh, like(&x.q)),
        dk: Output::zeroed(d.b, d.h_kv, d.tk, d.dh, like(&x.k)),
        dv: Output::zeroed(d.b, d.h_kv, d.tk, d.dh, like(&x.v)),
    };
    units(d).for_each(|unit| backward_unit(d, unit, x, &mut out));
    out
}
