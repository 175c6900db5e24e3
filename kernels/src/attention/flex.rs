//! The fused attention's host kernels on f32 buffers: forward (output and each query's
//! log-sum-exp) and flash-attention-2 backward, both over tiles of [`TILE`] keys with no
//! `Tq × Tk` buffer.
//!
//! Work is split by `(batch, kv head)`: one unit owns its kv head's `K`, `V`, their gradients
//! and the `h / h_kv` query heads that share them, so the GQA sums need no synchronization (the
//! units run one after another on the rank's thread). Inside a unit `K` (and `V` for the
//! backward) is transposed once to `[dh, Tk]`, so that a query's scores against a tile are
//! `dh` axpys over the tile's keys, and every other inner loop is an axpy over `dh`: all
//! vectorize, with no horizontal sums.
//! The unit functions are compiled three times — AVX-512, AVX2 + FMA and the portable
//! baseline — and the best the CPU has is picked at run time.

use crate::fused::fast_exp as exp;

/// Keys per tile.
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
    /// Whether query `i` sees only keys `0 ..= i + (Tk − Tq)`.
    pub causal: bool,
}

impl Dims {
    fn group(&self) -> usize {
        self.h / self.h_kv
    }

    /// The keys query `i` attends to: `0 .. keys(i)`.
    fn keys(&self, i: usize) -> usize {
        match self.causal {
            true => (i + self.tk.saturating_sub(self.tq) + 1).min(self.tk),
            false => self.tk,
        }
    }
}

/// `y += a · x`.
#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

/// `[rows, cols]` → `[cols, rows]` into `out`.
#[inline(always)]
fn transpose(x: &[f32], rows: usize, cols: usize, out: &mut Vec<f32>) {
    out.clear();
    out.resize(rows * cols, 0.0);
    for (r, row) in x.chunks_exact(cols).enumerate() {
        for (c, &e) in row.iter().enumerate() {
            out[c * rows + r] = e;
        }
    }
}

/// `s = Σ_d a[d] · xt[d, t0 .. t0 + s.len()]` (`xt` is `[dh, tk]`).
#[inline(always)]
fn scores(s: &mut [f32], a: &[f32], xt: &[f32], tk: usize, t0: usize) {
    s.fill(0.0);
    let n = s.len();
    for (d, &a) in a.iter().enumerate() {
        axpy(s, a, &xt[d * tk + t0..][..n]);
    }
}

/// One unit's forward: `q`, `o` are its `g` query heads `[g, Tq, dh]`, `lse` `[g, Tq]`,
/// `k`, `v` its kv head `[Tk, dh]`.
#[inline(always)]
fn forward_unit_body(d: &Dims, q: &[f32], k: &[f32], v: &[f32], o: &mut [f32], lse: &mut [f32]) {
    let (tk, dh) = (d.tk, d.dh);
    let mut kt = Vec::new();
    transpose(k, tk, dh, &mut kt);
    let mut qs = vec![0.0; dh];
    let mut s = [0.0f32; TILE];
    let rows = q.chunks_exact(dh).zip(o.chunks_exact_mut(dh));
    for (row, ((q, acc), lse)) in rows.zip(lse.iter_mut()).enumerate() {
        for (a, &x) in qs.iter_mut().zip(q) {
            *a = x * d.scale;
        }
        acc.fill(0.0);
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
        let end = d.keys(row % d.tq);
        for t0 in (0..end).step_by(TILE) {
            let s = &mut s[..(end - t0).min(TILE)];
            scores(s, &qs, &kt, tk, t0);
            let m_new = s.iter().fold(m, |a, &b| a.max(b));
            let alpha = exp(m - m_new);
            l *= alpha;
            acc.iter_mut().for_each(|a| *a *= alpha);
            for p in s.iter_mut() {
                *p = exp(*p - m_new);
            }
            l += s.iter().sum::<f32>();
            for (j, &p) in s.iter().enumerate() {
                axpy(acc, p, &v[(t0 + j) * dh..][..dh]);
            }
            m = m_new;
        }
        let inv = 1.0 / l;
        acc.iter_mut().for_each(|a| *a *= inv);
        *lse = m + l.ln();
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
}

/// The backward's outputs of one unit: `dq` `[g, Tq, dh]`, `dk`, `dv` `[Tk, dh]` (the sums
/// over the unit's query heads).
pub(crate) struct BackwardOut<'a> {
    pub dq: &'a mut [f32],
    pub dk: &'a mut [f32],
    pub dv: &'a mut [f32],
}

/// One unit's backward: `P` recomputed tile by tile from the kept log-sum-exp, then
/// `dV += Pᵀ dO`, `dP = dO Vᵀ`, `dS = P ⊙ (dP − D)` with `D = rowsum(dO ⊙ O)`,
/// `dQ = scale · dS K`, `dK += scale · dSᵀ Q`.
#[inline(always)]
fn backward_unit_body(d: &Dims, x: &BackwardIn, out: &mut BackwardOut) {
    let (tk, dh) = (d.tk, d.dh);
    let (mut kt, mut vt) = (Vec::new(), Vec::new());
    transpose(x.k, tk, dh, &mut kt);
    transpose(x.v, tk, dh, &mut vt);
    out.dk.fill(0.0);
    out.dv.fill(0.0);
    let mut qs = vec![0.0; dh];
    let (mut s, mut dp) = ([0.0f32; TILE], [0.0f32; TILE]);
    let rows = x.q.chunks_exact(dh).zip(x.grad.chunks_exact(dh));
    let rows = rows.zip(x.o.chunks_exact(dh).zip(x.lse));
    for (row, ((q, g), (o, &lse))) in rows.enumerate() {
        for (a, &e) in qs.iter_mut().zip(q) {
            *a = e * d.scale;
        }
        let big_d = dot(g, o);
        let dq = &mut out.dq[row * dh..][..dh];
        dq.fill(0.0);
        let end = d.keys(row % d.tq);
        for t0 in (0..end).step_by(TILE) {
            let n = (end - t0).min(TILE);
            let (s, dp) = (&mut s[..n], &mut dp[..n]);
            scores(s, &qs, &kt, tk, t0);
            for p in s.iter_mut() {
                *p = exp(*p - lse);
            }
            scores(dp, g, &vt, tk, t0);
            for (j, (&p, &dp)) in s.iter().zip(dp.iter()).enumerate() {
                let ds = p * (dp - big_d) * d.scale;
                let t = (t0 + j) * dh;
                axpy(&mut out.dv[t..][..dh], p, g);
                axpy(dq, ds, &x.k[t..][..dh]);
                axpy(&mut out.dk[t..][..dh], ds, q);
            }
        }
    }
}

/// `$name` runs `$body` compiled for the best instruction set the CPU has.
macro_rules! multiversion {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*)) => {
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                fn avx512($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

multiversion!(forward_unit, forward_unit_body, (d: &Dims, q: &[f32], k: &[f32], v: &[f32], o: &mut [f32], lse: &mut [f32]));
multiversion!(backward_unit, backward_unit_body, (d: &Dims, x: &BackwardIn, out: &mut BackwardOut));

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

/// Backward from [`forward`]'s inputs, output, log-sum-exp and the output's gradient `grad`:
/// `(dq, dk, dv)` in the inputs' shapes.
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
        };
        backward_unit(d, &unit, &mut BackwardOut { dq, dk, dv })
    });
    (dq, dk, dv)
}
