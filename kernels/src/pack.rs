//! A bucket's gradients into one flat tensor and back, with a scale factor applied on the
//! way (the averaging of a sum, a loss scale): one pass over each part in the kernel, where
//! Burn's ops would concatenate and then scale (or scale and then copy each slice out).

use crate::fused::host;
use burn::tensor::Tensor;

/// The flat concatenation of `parts` (one-dimensional, on one device), each element times
/// `scale`. Panics on an empty `parts`.
pub fn pack_scaled(parts: &[Tensor<1>], scale: f32) -> Tensor<1> {
    assert!(!parts.is_empty(), "pack_scaled: no parts to pack");
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if kernel::covers(parts) {
        return kernel::pack_scaled(parts, scale);
    }
    if parts.iter().all(host::is_flex_f32) {
        // One pass: each value scaled as it is copied (the same product as `mul_scalar`).
        let prims = parts.iter().cloned().map(host::flex_primitive).collect();
        return Tensor::from_primitive::<burn::backend::Flex>(host::concat_map(prims, |v| {
            v * scale
        }));
    }
    fallback::pack_scaled(parts, scale)
}

/// `flat` cut into consecutive parts of `lens` elements (which sum to its length), each
/// element times `scale`; each part is its own tensor (no view into `flat` is kept).
pub fn unpack_scaled(flat: Tensor<1>, lens: &[usize], scale: f32) -> Vec<Tensor<1>> {
    let total: usize = lens.iter().sum();
    assert_eq!(
        total,
        flat.dims()[0],
        "unpack_scaled: the parts' lengths sum to {total}, the flat tensor has {}",
        flat.dims()[0]
    );
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if kernel::covers(std::slice::from_ref(&flat)) {
        return kernel::unpack_scaled(flat, lens, scale);
    }
    fallback::unpack_scaled(flat, lens, scale)
}

pub(crate) mod fallback {
    use burn::tensor::Tensor;

    /// [`crate::pack_scaled`] with Burn's ops: `cat`, then a scalar multiply.
    pub fn pack_scaled(parts: &[Tensor<1>], scale: f32) -> Tensor<1> {
        let flat = Tensor::cat(parts.to_vec(), 0);
        if scale == 1.0 {
            flat
        } else {
            flat.mul_scalar(scale)
        }
    }

    /// [`crate::unpack_scaled`] with Burn's ops: a scalar multiply, then a slice per part.
    pub fn unpack_scaled(flat: Tensor<1>, lens: &[usize], scale: f32) -> Vec<Tensor<1>> {
        let flat = if scale == 1.0 {
            flat
        } else {
            flat.mul_scalar(scale)
        };
        let mut start = 0;
        lens.iter()
            .map(|&len| {
                let part = flat.clone().slice(start..start + len);
                start += len;
                part
            })
            .collect()
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernel {
    use crate::cube::{self, empty, from_cube, grid, to_cube};
    use burn::tensor::{Shape, Tensor};
    use cubecl::prelude::*;

    /// Whether the kernels handle `tensors`: f32, on a CubeCL device.
    pub(super) fn covers(tensors: &[Tensor<1>]) -> bool {
        tensors
            .iter()
            .all(|t| t.dtype() == burn::tensor::DType::F32 && cube::is_cube(&t.device()))
    }

    /// `output[offset + i] = input[i] * scale`.
    #[cube(launch_unchecked)]
    fn scale_into(input: &[f32], output: &mut [f32], offset: usize, scale: f32) {
        if ABSOLUTE_POS < input.len() {
            output[ABSOLUTE_POS + offset] = input[ABSOLUTE_POS] * scale;
        }
    }

    /// `output[i] = input[offset + i] * scale`.
    #[cube(launch_unchecked)]
    fn scale_from(input: &[f32], output: &mut [f32], offset: usize, scale: f32) {
        if ABSOLUTE_POS < output.len() {
            output[ABSOLUTE_POS] = input[ABSOLUTE_POS + offset] * scale;
        }
    }

    pub(super) fn pack_scaled(parts: &[Tensor<1>], scale: f32) -> Tensor<1> {
        let parts: Vec<_> = parts.iter().map(|p| to_cube(p.clone())).collect();
        let total: usize = parts.iter().map(cube::len).sum();
        let out = empty(&parts[0], Shape::new([total]), parts[0].dtype);
        let mut offset = 0;
        for part in parts {
            let n = cube::len(&part);
            if n == 0 {
                continue;
            }
            let (count, dim) = grid(&part.client, n);
            // SAFETY: each unit writes `offset + i < total` for its `i < n`, inside `out`.
            unsafe {
                scale_into::launch_unchecked(
                    &out.client,
                    count,
                    dim,
                    part.into_buffer_arg(),
                    out.clone().into_buffer_arg(),
                    offset,
                    scale,
                );
            }
            offset += n;
        }
        from_cube(out)
    }

    pub(super) fn unpack_scaled(flat: Tensor<1>, lens: &[usize], scale: f32) -> Vec<Tensor<1>> {
        let flat = to_cube(flat);
        let mut offset = 0;
        lens.iter()
            .map(|&n| {
                let out = empty(&flat, Shape::new([n]), flat.dtype);
                if n > 0 {
                    let (count, dim) = grid(&flat.client, n);
                    // SAFETY: each unit reads `offset + i < offset + n <= len(flat)`.
                    unsafe {
                        scale_from::launch_unchecked(
                            &flat.client,
                            count,
                            dim,
                            flat.clone().into_buffer_arg(),
                            out.clone().into_buffer_arg(),
                            offset,
                            scale,
                        );
                    }
                }
                offset += n;
                from_cube(out)
            })
            .collect()
    }
}
