//! The fused attention on a CubeCL device (wgpu, CUDA): flash-attention-2's forward and
//! backward as four kernels, each unit one row — a query's for the forward, `D` and `dQ`, a
//! key's for `dK` and `dV` — so no `Tq × Tk` matrix exists in memory, no unit writes another's
//! output (no atomics), and the kv heads are never repeated (query head `j` reads kv head
//! `j / group`). Every score is recomputed from `q`, `k` and the saved log-sum-exp.
//!
//! - `forward`: each query's keys (its [`super::Mask`] range) with an online softmax in f32
//!   registers; out 0 and log-sum-exp −∞ for a query that sees no key, as on Flex.
//! - `row_delta`: `D = rowsum(dO ⊙ O) − dlse` per query (ring attention's log-sum-exp
//!   gradient shifts it).
//! - `query_grad`: `dQ = scale · Σⱼ Pᵢⱼ (dPᵢⱼ − Dᵢ) kⱼ`, over the query's keys.
//! - `key_grads`: `dV = Σᵢ Pᵢⱼ dOᵢ`, `dK = scale · Σᵢ Pᵢⱼ (dPᵢⱼ − Dᵢ) qᵢ` over the queries of
//!   every query head sharing the kv head that see the key.
//!
//! Inputs and outputs in the tensors' float type (f32, f16, bf16), every accumulation and the
//! log-sum-exp in f32; the head width is a compile-time constant (one kernel per width).
//! One unit per row is the simplest correct schedule, not the fastest: tiles in shared memory
//! and tensor-core products are what a GPU needs for speed (measured in the GPU kit).

use super::Mask;
use crate::cube::{empty, grid, prepared, with_float};
use burn::backend::Cube;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// The sizes and the mask of a call, as the kernels read them.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub(super) struct Sizes {
    /// Query heads.
    h: usize,
    /// Query heads per kv head.
    group: usize,
    tq: usize,
    tk: usize,
    /// The first query's position on the keys' axis.
    off: usize,
    /// The window (0: none).
    window: usize,
    scale: f32,
    /// −∞, passed in: WGSL has no literal for it.
    neg_inf: f32,
}

/// The end of the keys a query at position `p` sees.
#[cube]
fn keys_end(p: usize, tk: usize, #[comptime] causal: bool) -> usize {
    let mut hi = tk;
    if causal && p + 1 < tk {
        hi = p + 1;
    }
    hi
}

/// The start of the keys a query at position `p` sees, given their end `hi`.
#[cube]
fn keys_start(p: usize, hi: usize, window: usize) -> usize {
    let mut lo = 0;
    if window > 0 && p + 1 > window {
        lo = p + 1 - window;
    }
    if lo > hi {
        lo = hi;
    }
    lo
}

/// `Σ_d a[ab + d] · b[bb + d]` in f32.
#[cube]
fn dot<E: Float>(a: &[E], ab: usize, b: &[E], bb: usize, #[comptime] dh: usize) -> f32 {
    let mut sum = 0.0f32;
    for d in 0..dh {
        sum += f32::cast_from(a[ab + d]) * f32::cast_from(b[bb + d]);
    }
    sum
}

/// The first element of query row `r`'s kv head's keys (`k`, `v` `[B, h_kv, Tk, dh]`).
#[cube]
fn kv_base(r: usize, s: &Sizes, #[comptime] dh: usize) -> usize {
    let bh = r / s.tq;
    let head = bh % s.h;
    let b = bh / s.h;
    let h_kv = s.h / s.group;
    (b * h_kv + head / s.group) * s.tk * dh
}

#[cube(launch_unchecked)]
fn forward<E: Float>(
    q: &[E],
    k: &[E],
    v: &[E],
    out: &mut [E],
    lse: &mut [f32],
    s: Sizes,
    #[comptime] dh: usize,
    #[comptime] causal: bool,
) {
    let r = ABSOLUTE_POS;
    if r < lse.len() {
        let p = r % s.tq + s.off;
        let hi = keys_end(p, s.tk, causal);
        let lo = keys_start(p, hi, s.window);
        let kb = kv_base(r, &s, dh);
        let mut acc = Array::<f32>::new(dh);
        for d in 0..dh {
            acc[d] = 0.0f32;
        }
        // Below any score (exp of its difference to one underflows to 0), finite.
        let mut m = f32::new(-3.0e38);
        let mut l = 0.0f32;
        for j in lo..hi {
            let score = dot::<E>(q, r * dh, k, kb + j * dh, dh) * s.scale;
            let mut m_new = m;
            if score > m {
                m_new = score;
            }
            let alpha = (m - m_new).exp();
            let w = (score - m_new).exp();
            l = l * alpha + w;
            for d in 0..dh {
                acc[d] = acc[d] * alpha + w * f32::cast_from(v[kb + j * dh + d]);
            }
            m = m_new;
        }
        if hi > lo {
            for d in 0..dh {
                out[r * dh + d] = E::cast_from(acc[d] / l);
            }
            lse[r] = m + l.ln();
        } else {
            for d in 0..dh {
                out[r * dh + d] = E::cast_from(0.0f32);
            }
            lse[r] = s.neg_inf;
        }
    }
}

#[cube(launch_unchecked)]
fn row_delta<E: Float>(
    out: &[E],
    grad: &[E],
    dlse: &[f32],
    delta: &mut [f32],
    #[comptime] dh: usize,
) {
    let r = ABSOLUTE_POS;
    if r < delta.len() {
        delta[r] = dot::<E>(out, r * dh, grad, r * dh, dh) - dlse[r];
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn query_grad<E: Float>(
    q: &[E],
    k: &[E],
    v: &[E],
    lse: &[f32],
    grad: &[E],
    delta: &[f32],
    dq: &mut [E],
    s: Sizes,
    #[comptime] dh: usize,
    #[comptime] causal: bool,
) {
    let r = ABSOLUTE_POS;
    if r < lse.len() {
        let p = r % s.tq + s.off;
        let hi = keys_end(p, s.tk, causal);
        let lo = keys_start(p, hi, s.window);
        let kb = kv_base(r, &s, dh);
        let mut acc = Array::<f32>::new(dh);
        for d in 0..dh {
            acc[d] = 0.0f32;
        }
        let l = lse[r];
        let dr = delta[r];
        for j in lo..hi {
            let prob = (dot::<E>(q, r * dh, k, kb + j * dh, dh) * s.scale - l).exp();
            let dp = dot::<E>(grad, r * dh, v, kb + j * dh, dh);
            let ds = prob * (dp - dr) * s.scale;
            for d in 0..dh {
                acc[d] += ds * f32::cast_from(k[kb + j * dh + d]);
            }
        }
        for d in 0..dh {
            dq[r * dh + d] = E::cast_from(acc[d]);
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn key_grads<E: Float>(
    q: &[E],
    k: &[E],
    v: &[E],
    lse: &[f32],
    grad: &[E],
    delta: &[f32],
    dk: &mut [E],
    dv: &mut [E],
    s: Sizes,
    #[comptime] dh: usize,
    #[comptime] causal: bool,
) {
    // Unit `c` is key row `c` of `[B, h_kv, Tk]`.
    let c = ABSOLUTE_POS;
    if c * dh < dk.len() {
        let j = c % s.tk;
        let bkv = c / s.tk;
        let h_kv = s.h / s.group;
        let b = bkv / h_kv;
        let kvh = bkv % h_kv;
        let mut ak = Array::<f32>::new(dh);
        let mut av = Array::<f32>::new(dh);
        for d in 0..dh {
            ak[d] = 0.0f32;
            av[d] = 0.0f32;
        }
        for g in 0..s.group {
            let head = kvh * s.group + g;
            let row0 = (b * s.h + head) * s.tq;
            for a in 0..s.tq {
                let p = a + s.off;
                let hi = keys_end(p, s.tk, causal);
                let lo = keys_start(p, hi, s.window);
                if j >= lo && j < hi {
                    let r = row0 + a;
                    let prob = (dot::<E>(q, r * dh, k, c * dh, dh) * s.scale - lse[r]).exp();
                    let dp = dot::<E>(grad, r * dh, v, c * dh, dh);
                    let ds = prob * (dp - delta[r]) * s.scale;
                    for d in 0..dh {
                        av[d] += prob * f32::cast_from(grad[r * dh + d]);
                        ak[d] += ds * f32::cast_from(q[r * dh + d]);
                    }
                }
            }
        }
        for d in 0..dh {
            dk[c * dh + d] = E::cast_from(ak[d]);
            dv[c * dh + d] = E::cast_from(av[d]);
        }
    }
}

/// What a launch needs of a call: its sizes, head width and mask kind, and its rows.
struct Call {
    sizes: [usize; 6],
    scale: f32,
    dh: usize,
    causal: bool,
    rows: usize,
    key_rows: usize,
}

impl Call {
    fn new(q: &CubeTensor, k: &CubeTensor, scale: f64, mask: Mask) -> Self {
        let (qs, ks) = (q.meta.shape().clone(), k.meta.shape().clone());
        let (b, h, tq, dh) = (qs[0], qs[1], qs[2], qs[3]);
        let (h_kv, tk) = (ks[1], ks[2]);
        let off = mask.offset.unwrap_or(tk.saturating_sub(tq));
        Self {
            sizes: [h, h / h_kv, tq, tk, off, mask.window.unwrap_or(0)],
            scale: scale as f32,
            dh,
            causal: mask.causal,
            rows: b * h * tq,
            key_rows: b * h_kv * tk,
        }
    }

    /// The kernels' [`Sizes`], one per launch (a launch takes its argument by value and the
    /// derived launch type is not `Clone`).
    fn sizes(&self) -> SizesLaunch {
        let [h, group, tq, tk, off, window] = self.sizes;
        SizesLaunch::new(h, group, tq, tk, off, window, self.scale, f32::NEG_INFINITY)
    }
}

/// The output `[B, h, Tq, dh]` (in the inputs' type) and the log-sum-exp `[B, h, Tq]` (f32).
pub(super) fn attention_forward(
    q: FloatTensor<Cube>,
    k: FloatTensor<Cube>,
    v: FloatTensor<Cube>,
    scale: f64,
    mask: Mask,
) -> (FloatTensor<Cube>, FloatTensor<Cube>) {
    let dtype = q.dtype;
    let [q, k, v] = [q, k, v].map(|t| prepared(t, dtype));
    let c = Call::new(&q, &k, scale, mask);
    let shape = q.meta.shape().clone();
    let out = empty(&q, shape.clone(), dtype);
    let lse = empty(&q, Shape::new([shape[0], shape[1], shape[2]]), DType::F32);
    let (count, dim) = grid(&q.client, c.rows);
    let client = q.client.clone();
    with_float!(dtype, E => {
        // SAFETY: unit `r < rows` reads its query row and its kv head's `tk` key and value
        // rows (inside `q`, `k`, `v` by the shapes the caller checked) and writes its own
        // output row and log-sum-exp.
        unsafe {
            forward::launch_unchecked::<E>(
                &client, count, dim,
                q.into_buffer_arg(), k.into_buffer_arg(), v.into_buffer_arg(),
                out.clone().into_buffer_arg(), lse.clone().into_buffer_arg(),
                c.sizes(), c.dh, c.causal,
            );
        }
    });
    (out, lse)
}

/// The gradients `(dq, dk, dv)` in the inputs' type (see [`super::AttentionBackend`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_backward(
    q: FloatTensor<Cube>,
    k: FloatTensor<Cube>,
    v: FloatTensor<Cube>,
    out: FloatTensor<Cube>,
    lse: FloatTensor<Cube>,
    grad: FloatTensor<Cube>,
    dlse: FloatTensor<Cube>,
    scale: f64,
    mask: Mask,
) -> (FloatTensor<Cube>, FloatTensor<Cube>, FloatTensor<Cube>) {
    let dtype = q.dtype;
    let [q, k, v, out, grad] = [q, k, v, out, grad].map(|t| prepared(t, dtype));
    let [lse, dlse] = [lse, dlse].map(|t| prepared(t, DType::F32));
    let c = Call::new(&q, &k, scale, mask);
    let (qs, ks) = (q.meta.shape().clone(), k.meta.shape().clone());
    let delta = empty(&q, lse.meta.shape().clone(), DType::F32);
    let dq = empty(&q, qs, dtype);
    let dk = empty(&q, ks.clone(), dtype);
    let dv = empty(&q, ks, dtype);
    let client = q.client.clone();
    let (rows, dim_rows) = grid(&client, c.rows);
    let (keys, dim_keys) = grid(&client, c.key_rows);
    with_float!(dtype, E => {
        // SAFETY: as in the forward — each unit reads rows inside the inputs (shapes checked
        // by the caller) and writes only its own row of `delta`, of `dq`, or of `dk` and `dv`.
        unsafe {
            row_delta::launch_unchecked::<E>(
                &client, rows.clone(), dim_rows,
                out.into_buffer_arg(), grad.clone().into_buffer_arg(), dlse.into_buffer_arg(),
                delta.clone().into_buffer_arg(), c.dh,
            );
            query_grad::launch_unchecked::<E>(
                &client, rows, dim_rows,
                q.clone().into_buffer_arg(), k.clone().into_buffer_arg(),
                v.clone().into_buffer_arg(), lse.clone().into_buffer_arg(),
                grad.clone().into_buffer_arg(), delta.clone().into_buffer_arg(),
                dq.clone().into_buffer_arg(), c.sizes(), c.dh, c.causal,
            );
            key_grads::launch_unchecked::<E>(
                &client, keys, dim_keys,
                q.into_buffer_arg(), k.into_buffer_arg(), v.into_buffer_arg(),
                lse.into_buffer_arg(), grad.into_buffer_arg(), delta.into_buffer_arg(),
                dk.clone().into_buffer_arg(), dv.clone().into_buffer_arg(),
                c.sizes(), c.dh, c.causal,
            );
        }
    });
    (dq, dk, dv)
}
