//! The fused ops' kernels on a CubeCL device (wgpu, CUDA): SwiGLU's `silu(gate) ⊙ up`, RoPE,
//! the norms' core and the cross-entropy (each row's log-sum-exp in two passes over the
//! vocabulary: no `[N, V]` exponentials kept), each direction one launch — one unit an
//! element (SwiGLU, RoPE, the cross-entropy's gradient) or one cube a row (the norms'
//! statistics, `x̂`, `rstd` and the backward's two row means; the log-sum-exp), its units
//! striding over the row and reducing in shared memory — in the tensors' float type (f32,
//! f16, bf16) with f32 arithmetic. What Burn's ops do in three to eight kernels with their
//! intermediate tensors (the plain-Burn fallbacks, which are the tests' reference:
//! `testing::fused_ops_match_fallback`).

use crate::cube::{empty, grid, prepared, row_grid, with_float};
use burn::backend::Cube;
use burn::backend::tensor::FloatTensor;
use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

#[cube]
fn sigmoid(x: f32) -> f32 {
    1.0f32 / (1.0f32 + (-x).exp())
}

#[cube(launch_unchecked)]
fn silu_mul_kernel<E: Float>(gate: &[E], up: &[E], out: &mut [E]) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let g = f32::cast_from(gate[i]);
        out[i] = E::cast_from(g * sigmoid(g) * f32::cast_from(up[i]));
    }
}

#[cube(launch_unchecked)]
fn silu_mul_backward_kernel<E: Float>(
    gate: &[E],
    up: &[E],
    grad: &[E],
    d_gate: &mut [E],
    d_up: &mut [E],
) {
    let i = ABSOLUTE_POS;
    if i < grad.len() {
        let x = f32::cast_from(gate[i]);
        let g = f32::cast_from(grad[i]);
        let s = sigmoid(x);
        d_up[i] = E::cast_from(g * x * s);
        d_gate[i] = E::cast_from(g * f32::cast_from(up[i]) * s * (1.0f32 + x * (1.0f32 - s)));
    }
}

/// `x·cos + rotate_half(x)·sin` on `[.., T, hd]` with tables `[T, hd]` (f32); with
/// `transposed`, the backward's `g·cos + [g₂·sin₂, −g₁·sin₁]`.
#[cube(launch_unchecked)]
fn rope_kernel<E: Float>(
    x: &[E],
    cos: &[f32],
    sin: &[f32],
    out: &mut [E],
    t: usize,
    hd: usize,
    #[comptime] transposed: bool,
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let c = i % hd;
        let row = (i / hd) % t;
        let half = hd / 2;
        let at = row * hd + c;
        let mut v = f32::cast_from(x[i]) * cos[at];
        if transposed {
            if c < half {
                v += f32::cast_from(x[i + half]) * sin[at + half];
            } else {
                v -= f32::cast_from(x[i - half]) * sin[at - half];
            }
        } else if c < half {
            v -= f32::cast_from(x[i + half]) * sin[at];
        } else {
            v += f32::cast_from(x[i - half]) * sin[at];
        }
        out[i] = E::cast_from(v);
    }
}

/// The sum (or, `max_of`, the largest) of each unit's `value` over this cube's `units` units
/// (a power of two), handed to every unit: a tree in shared memory, `log2(units)` steps.
#[cube]
fn cube_reduce(value: f32, #[comptime] units: usize, #[comptime] max_of: bool) -> f32 {
    let mut acc = Shared::<[f32]>::new_slice(units);
    let u = UNIT_POS as usize;
    acc[u] = value;
    sync_cube();
    let mut half = (units / 2).runtime();
    while half > 0 {
        if u < half {
            let a = acc[u];
            let b = acc[u + half];
            if max_of {
                acc[u] = max(a, b);
            } else {
                acc[u] = a + b;
            }
        }
        sync_cube();
        half /= 2;
    }
    let total = acc[0];
    // Every unit has read the total before a later reduction writes over the buffer.
    sync_cube();
    total
}

/// [`cube_reduce`]'s sum.
#[cube]
fn cube_sum(value: f32, #[comptime] units: usize) -> f32 {
    cube_reduce(value, units, false)
}

/// Row `CUBE_POS` of width `d` normalized, by one cube whose units stride over the row
/// (adjacent units, adjacent elements): `x̂ = (x − mean)·rstd` (`mean` 0 unless `centered`),
/// `rstd = 1/√(mean((x − mean)²) + eps)`.
#[cube(launch_unchecked)]
fn norm_kernel<E: Float>(
    x: &[E],
    xhat: &mut [E],
    rstd: &mut [E],
    d: usize,
    eps: f32,
    #[comptime] centered: bool,
    #[comptime] units: usize,
) {
    let r = CUBE_POS;
    if r < rstd.len() {
        let base = r * d;
        let u = UNIT_POS as usize;
        let n = f32::cast_from(d);
        let mut mean = 0.0f32;
        if centered {
            let mut part = 0.0f32;
            let mut j = u;
            while j < d {
                part += f32::cast_from(x[base + j]);
                j += units;
            }
            mean = cube_sum(part, units) / n;
        }
        let mut part = 0.0f32;
        let mut j = u;
        while j < d {
            let v = f32::cast_from(x[base + j]) - mean;
            part += v * v;
            j += units;
        }
        let s = 1.0f32 / (cube_sum(part, units) / n + eps).sqrt();
        let mut j = u;
        while j < d {
            xhat[base + j] = E::cast_from((f32::cast_from(x[base + j]) - mean) * s);
            j += units;
        }
        if u == 0 {
            rstd[r] = E::cast_from(s);
        }
    }
}

/// `rstd·(g − mean(g) − x̂·mean(g ⊙ x̂))` per row (RMS: without `mean(g)`), a cube a row.
#[cube(launch_unchecked)]
fn norm_backward_kernel<E: Float>(
    xhat: &[E],
    rstd: &[E],
    grad: &[E],
    dx: &mut [E],
    d: usize,
    #[comptime] centered: bool,
    #[comptime] units: usize,
) {
    let r = CUBE_POS;
    if r < rstd.len() {
        let base = r * d;
        let u = UNIT_POS as usize;
        let n = f32::cast_from(d);
        let mut part_g = 0.0f32;
        let mut part_gx = 0.0f32;
        let mut j = u;
        while j < d {
            let g = f32::cast_from(grad[base + j]);
            part_g += g;
            part_gx += g * f32::cast_from(xhat[base + j]);
            j += units;
        }
        let mgx = cube_sum(part_gx, units) / n;
        let mut mg = 0.0f32;
        if centered {
            mg = cube_sum(part_g, units) / n;
        }
        let s = f32::cast_from(rstd[r]);
        let mut j = u;
        while j < d {
            let g = f32::cast_from(grad[base + j]);
            dx[base + j] = E::cast_from((g - mg - f32::cast_from(xhat[base + j]) * mgx) * s);
            j += units;
        }
    }
}

/// Row `CUBE_POS` of `logits` `[N, V]`, a cube a row: its log-sum-exp (in f32: the row's
/// largest value, then the sum of exponentials below it) and its loss `lse − logits[r, target]`.
#[cube(launch_unchecked)]
fn cross_entropy_rows<E: Float>(
    logits: &[E],
    targets: &[i32],
    lse: &mut [E],
    loss: &mut [f32],
    v: usize,
    #[comptime] units: usize,
) {
    let r = CUBE_POS;
    if r < loss.len() {
        let base = r * v;
        let u = UNIT_POS as usize;
        let mut part = f32::new(-3.0e38);
        let mut c = u;
        while c < v {
            part = max(part, f32::cast_from(logits[base + c]));
            c += units;
        }
        let m = cube_reduce(part, units, true);
        let mut part = 0.0f32;
        let mut c = u;
        while c < v {
            part += (f32::cast_from(logits[base + c]) - m).exp();
            c += units;
        }
        let s = m + cube_sum(part, units).ln();
        if u == 0 {
            lse[r] = E::cast_from(s);
            let t = usize::cast_from(targets[r]);
            loss[r] = s - f32::cast_from(logits[base + t]);
        }
    }
}

/// `(softmax(logits) − onehot(targets)) · grad[0] / N`, one unit per element (the loss's
/// gradient read on the device: no host synchronization).
#[cube(launch_unchecked)]
fn cross_entropy_grad<E: Float>(
    logits: &[E],
    lse: &[E],
    targets: &[i32],
    grad: &[E],
    out: &mut [E],
    v: usize,
    n: usize,
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let r = i / v;
        let s = f32::cast_from(grad[0]) / f32::cast_from(n);
        let mut d = (f32::cast_from(logits[i]) - f32::cast_from(lse[r])).exp() * s;
        if i % v == usize::cast_from(targets[r]) {
            d -= s;
        }
        out[i] = E::cast_from(d);
    }
}

/// Whether the kernels take `dtype` (the float types a device may store; f64 and the rest run
/// the fallbacks).
pub(super) fn takes(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// `silu(gate) ⊙ up`.
pub(super) fn silu_mul(gate: FloatTensor<Cube>, up: FloatTensor<Cube>) -> FloatTensor<Cube> {
    let dtype = gate.dtype;
    let [gate, up] = [gate, up].map(|t| prepared(t, dtype));
    let out = empty(&gate, gate.meta.shape().clone(), dtype);
    let (count, dim) = grid(&gate.client, out.meta.num_elements());
    let client = gate.client.clone();
    with_float!(dtype, E => {
        // SAFETY: the three buffers hold the same number of elements; unit `i` touches `i`.
        unsafe {
            silu_mul_kernel::launch_unchecked::<E>(
                &client, count, dim,
                gate.into_buffer_arg(), up.into_buffer_arg(), out.clone().into_buffer_arg(),
            );
        }
    });
    out
}

/// `(d_gate, d_up)` of [`silu_mul`].
pub(super) fn silu_mul_backward(
    gate: FloatTensor<Cube>,
    up: FloatTensor<Cube>,
    grad: FloatTensor<Cube>,
) -> (FloatTensor<Cube>, FloatTensor<Cube>) {
    let dtype = gate.dtype;
    let [gate, up, grad] = [gate, up, grad].map(|t| prepared(t, dtype));
    let shape = grad.meta.shape().clone();
    let (d_gate, d_up) = (
        empty(&grad, shape.clone(), dtype),
        empty(&grad, shape, dtype),
    );
    let (count, dim) = grid(&grad.client, d_gate.meta.num_elements());
    let client = grad.client.clone();
    with_float!(dtype, E => {
        // SAFETY: the five buffers hold the same number of elements; unit `i` touches `i`.
        unsafe {
            silu_mul_backward_kernel::launch_unchecked::<E>(
                &client, count, dim,
                gate.into_buffer_arg(), up.into_buffer_arg(), grad.into_buffer_arg(),
                d_gate.clone().into_buffer_arg(), d_up.clone().into_buffer_arg(),
            );
        }
    });
    (d_gate, d_up)
}

/// RoPE on `x` `[B, h, T, hd]` with tables `[T, hd]`, or (`transposed`) its backward.
pub(super) fn rope(
    x: FloatTensor<Cube>,
    cos: FloatTensor<Cube>,
    sin: FloatTensor<Cube>,
    transposed: bool,
) -> FloatTensor<Cube> {
    let dtype = x.dtype;
    let x = prepared(x, dtype);
    let [cos, sin] = [cos, sin].map(|t| prepared(t, DType::F32));
    let shape = x.meta.shape().clone();
    let (t, hd) = (shape[2], shape[3]);
    let out = empty(&x, shape, dtype);
    let (count, dim) = grid(&x.client, out.meta.num_elements());
    let client = x.client.clone();
    with_float!(dtype, E => {
        // SAFETY: `x` and `out` hold `B·h·T·hd` elements, the tables `T·hd`; unit `i` reads
        // `x[i ± hd/2]` within its own row of `hd` and the tables at its (position, column).
        unsafe {
            rope_kernel::launch_unchecked::<E>(
                &client, count, dim,
                x.into_buffer_arg(), cos.into_buffer_arg(), sin.into_buffer_arg(),
                out.clone().into_buffer_arg(), t, hd, transposed,
            );
        }
    });
    out
}

/// `(x̂, rstd)` of the norms' core over the last dim (`rstd` `[.., 1]`).
pub(super) fn norm_stats(
    x: FloatTensor<Cube>,
    eps: f64,
    centered: bool,
) -> (FloatTensor<Cube>, FloatTensor<Cube>) {
    let dtype = x.dtype;
    let x = prepared(x, dtype);
    let shape = x.meta.shape().clone();
    let d = shape[shape.num_dims() - 1];
    let mut stats = shape.clone();
    stats[shape.num_dims() - 1] = 1;
    let rows = stats.num_elements();
    let (xhat, rstd) = (empty(&x, shape, dtype), empty(&x, stats, dtype));
    let (count, dim, units) = row_grid(&x.client, rows);
    let client = x.client.clone();
    with_float!(dtype, E => {
        // SAFETY: `x`, `xhat` hold `rows · d` elements, `rstd` `rows`; cube `r` touches row `r`.
        unsafe {
            norm_kernel::launch_unchecked::<E>(
                &client, count, dim,
                x.into_buffer_arg(), xhat.clone().into_buffer_arg(),
                rstd.clone().into_buffer_arg(), d, eps as f32, centered, units,
            );
        }
    });
    (xhat, rstd)
}

/// The input gradient of the norms' core from `x̂`, `rstd` and the output gradient.
pub(super) fn norm_backward(
    xhat: FloatTensor<Cube>,
    rstd: FloatTensor<Cube>,
    grad: FloatTensor<Cube>,
    centered: bool,
) -> FloatTensor<Cube> {
    let dtype = grad.dtype;
    let [xhat, rstd, grad] = [xhat, rstd, grad].map(|t| prepared(t, dtype));
    let shape = grad.meta.shape().clone();
    let d = shape[shape.num_dims() - 1];
    let rows = rstd.meta.num_elements();
    let dx = empty(&grad, shape, dtype);
    let (count, dim, units) = row_grid(&grad.client, rows);
    let client = grad.client.clone();
    with_float!(dtype, E => {
        // SAFETY: `xhat`, `grad`, `dx` hold `rows · d` elements, `rstd` `rows`; cube `r`
        // touches row `r`.
        unsafe {
            norm_backward_kernel::launch_unchecked::<E>(
                &client, count, dim,
                xhat.into_buffer_arg(), rstd.into_buffer_arg(), grad.into_buffer_arg(),
                dx.clone().into_buffer_arg(), d, centered, units,
            );
        }
    });
    dx
}

/// Token ids as a contiguous i32 tensor.
fn ids(t: CubeTensor) -> CubeTensor {
    use burn::backend::ops::IntTensorOps;
    let t = match t.dtype == DType::I32 {
        true => t,
        false => <Cube as IntTensorOps<Cube>>::int_cast(t, burn::tensor::IntDType::I32),
    };
    into_contiguous(t)
}

/// The mean cross-entropy `[1]` of `logits` `[N, V]` and each row's log-sum-exp `[N, 1]`, in
/// the logits' type.
pub(super) fn cross_entropy(
    logits: FloatTensor<Cube>,
    targets: CubeTensor,
) -> (FloatTensor<Cube>, FloatTensor<Cube>) {
    use burn::backend::ops::FloatTensorOps;
    let dtype = logits.dtype;
    let (logits, targets) = (prepared(logits, dtype), ids(targets));
    let shape = logits.meta.shape().clone();
    let (n, v) = (shape[0], shape[1]);
    let lse = empty(&logits, burn::tensor::Shape::new([n, 1]), dtype);
    let loss = empty(&logits, burn::tensor::Shape::new([n]), DType::F32);
    let (count, dim, units) = row_grid(&logits.client, n);
    let client = logits.client.clone();
    with_float!(dtype, E => {
        // SAFETY: `logits` holds `n · v` elements, `targets` and `loss` `n`, `lse` `n`; cube
        // `r` reads row `r` (its target, an id below `v`, inside it) and writes its own entries.
        unsafe {
            cross_entropy_rows::launch_unchecked::<E>(
                &client, count, dim,
                logits.into_buffer_arg(), targets.into_buffer_arg(),
                lse.clone().into_buffer_arg(), loss.clone().into_buffer_arg(), v, units,
            );
        }
    });
    let mean = <Cube as FloatTensorOps<Cube>>::float_mean(loss);
    (
        <Cube as FloatTensorOps<Cube>>::float_cast(mean, dtype.into()),
        lse,
    )
}

/// The logits' gradient of [`cross_entropy`] from the kept log-sum-exp and the loss's
/// gradient `[1]`.
pub(super) fn cross_entropy_backward(
    logits: FloatTensor<Cube>,
    lse: FloatTensor<Cube>,
    targets: CubeTensor,
    grad: FloatTensor<Cube>,
) -> FloatTensor<Cube> {
    let dtype = logits.dtype;
    let [logits, lse, grad] = [logits, lse, grad].map(|t| prepared(t, dtype));
    let targets = ids(targets);
    let shape = logits.meta.shape().clone();
    let (n, v) = (shape[0], shape[1]);
    let out = empty(&logits, shape, dtype);
    let (count, dim) = grid(&logits.client, n * v);
    let client = logits.client.clone();
    with_float!(dtype, E => {
        // SAFETY: `logits` and `out` hold `n · v` elements, `lse` and `targets` `n`, `grad` 1;
        // unit `i` writes element `i`.
        unsafe {
            cross_entropy_grad::launch_unchecked::<E>(
                &client, count, dim,
                logits.into_buffer_arg(), lse.into_buffer_arg(), targets.into_buffer_arg(),
                grad.into_buffer_arg(), out.clone().into_buffer_arg(), v, n,
            );
        }
    });
    out
}
