//! A gradient rounded to 16 bits with error feedback: `v = g·scale + residual`, `q = v` in
//! bf16 or fp16, and the new residual `v − q` (what rounding lost, carried into the next
//! step so that the error does not accumulate). One pass in the kernel; four Burn ops (and
//! three intermediate tensors) in the fallback.

use burn::tensor::{DType, Tensor};

/// `(q, residual')`: `g·scale + residual` (f32; `residual` of `g`'s length or `None`) cast to
/// `dtype` (`BF16` or `F16`), and the f32 difference between that value and `q`.
///
/// Panics where the device cannot store `dtype` (see [`crate::stores`]): callers choose a
/// compression dtype once, and check it there.
pub fn quantize_with_feedback(
    g: Tensor<1>,
    residual: Option<Tensor<1>>,
    scale: f32,
    dtype: DType,
) -> (Tensor<1>, Tensor<1>) {
    assert!(
        matches!(dtype, DType::BF16 | DType::F16),
        "quantize_with_feedback: {dtype:?} is not a 16-bit float type"
    );
    assert!(
        stores(&g, dtype),
        "quantize_with_feedback: the device of this gradient cannot store {dtype:?}"
    );
    if let Some(r) = &residual {
        assert_eq!(r.dims(), g.dims(), "quantize_with_feedback: residual shape");
    }
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if kernel::covers(&g) {
        return kernel::quantize_with_feedback(g, residual, scale, dtype);
    }
    fallback::quantize_with_feedback(g, residual, scale, dtype)
}

/// [`crate::stores`] for `g`'s device, asked through `g` itself.
fn stores(g: &Tensor<1>, dtype: DType) -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if crate::cube::is_cube(&g.device()) {
        return crate::cube::stores_like(g, dtype);
    }
    let _ = (g, dtype);
    true
}

pub(crate) mod fallback {
    use burn::tensor::{DType, Tensor};

    /// [`crate::quantize_with_feedback`] with Burn's ops.
    pub fn quantize_with_feedback(
        g: Tensor<1>,
        residual: Option<Tensor<1>>,
        scale: f32,
        dtype: DType,
    ) -> (Tensor<1>, Tensor<1>) {
        let mut v = g.mul_scalar(scale);
        if let Some(r) = residual {
            v = v + r;
        }
        let q = v.clone().cast(dtype);
        let residual = v - q.clone().cast(DType::F32);
        (q, residual)
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernel {
    use crate::cube::{self, empty, from_cube, grid, to_cube};
    use burn::tensor::{DType, Shape, Tensor};
    use cubecl::prelude::*;
    use half::{bf16, f16};

    /// Whether the kernel handles `g`: f32 on a CubeCL device (which stores the target
    /// dtype: checked by the caller).
    pub(super) fn covers(g: &Tensor<1>) -> bool {
        g.dtype() == DType::F32 && cube::is_cube(&g.device())
    }

    #[cube(launch_unchecked)]
    fn round_with_feedback<Q: Float>(
        g: &[f32],
        residual: &[f32],
        q: &mut [Q],
        residual_out: &mut [f32],
        scale: f32,
        #[comptime] has_residual: bool,
    ) {
        if ABSOLUTE_POS < g.len() {
            let mut v = g[ABSOLUTE_POS] * scale;
            if has_residual {
                v += residual[ABSOLUTE_POS];
            }
            let rounded = Q::cast_from(v);
            q[ABSOLUTE_POS] = rounded;
            residual_out[ABSOLUTE_POS] = v - f32::cast_from(rounded);
        }
    }

    pub(super) fn quantize_with_feedback(
        g: Tensor<1>,
        residual: Option<Tensor<1>>,
        scale: f32,
        dtype: DType,
    ) -> (Tensor<1>, Tensor<1>) {
        let g = to_cube(g);
        let n = cube::len(&g);
        let has_residual = residual.is_some();
        // Without a residual the kernel never reads it: `g` stands in for the binding.
        let residual = residual.map(to_cube).unwrap_or_else(|| g.clone());
        let q = empty(&g, Shape::new([n]), dtype);
        let residual_out = empty(&g, Shape::new([n]), DType::F32);
        let (count, dim) = grid(&g.client, n);
        let client = g.client.clone();
        macro_rules! launch {
            ($q:ty) => {
                // SAFETY: every buffer holds `n` elements; each unit touches index `i < n`.
                unsafe {
                    round_with_feedback::launch_unchecked::<$q>(
                        &client,
                        count,
                        dim,
                        g.into_buffer_arg(),
                        residual.into_buffer_arg(),
                        q.clone().into_buffer_arg(),
                        residual_out.clone().into_buffer_arg(),
                        scale,
                        has_residual,
                    )
                }
            };
        }
        match dtype {
            DType::BF16 => launch!(bf16),
            _ => launch!(f16),
        }
        (from_cube(q), from_cube(residual_out))
    }
}
