//! Transposes of 32-bit values by 16 × 16 blocks in AVX-512 registers: the building block of
//! the bf16 kernels' operand packing (`pack.rs`, on interleaved bf16 pairs) and the f32
//! copy [`super::contiguous`] makes of a column-major view.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// `out[c · rows + r] = src[r · cols + c]`: a contiguous `[rows, cols]` of 32-bit values
/// written transposed, `[cols, rows]`, by blocks of 16 × 16 transposed in registers
/// ([`transpose_16x16`]; scalar for the edges).
///
/// # Safety
/// AVX-512 F; `src` and `out` hold `rows · cols` values.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose_f32(
    src: &[f32],
    rows: usize,
    cols: usize,
    out: &mut [MaybeUninit<f32>],
) {
    let (src, out) = (&src[..rows * cols], &mut out[..rows * cols]);
    let (r16, c16) = (rows / 16 * 16, cols / 16 * 16);
    for r0 in (0..r16).step_by(16) {
        for c0 in (0..c16).step_by(16) {
            let mut block = [_mm512_setzero_si512(); 16];
            for (i, v) in block.iter_mut().enumerate() {
                let line = &src[(r0 + i) * cols + c0..][..16];
                // SAFETY: 16 f32 are 64 bytes.
                *v = unsafe { _mm512_loadu_si512(line.as_ptr() as *const __m512i) };
            }
            transpose_16x16(&mut block);
            for (i, v) in block.iter().enumerate() {
                let line = &mut out[(c0 + i) * rows + r0..][..16];
                // SAFETY: as above; `MaybeUninit<f32>` is laid out as `f32`.
                unsafe { _mm512_storeu_si512(line.as_mut_ptr() as *mut __m512i, *v) };
            }
        }
        for c in c16..cols {
            (r0..r0 + 16).for_each(|r| _ = out[c * rows + r].write(src[r * cols + c]));
        }
    }
    for r in r16..rows {
        (0..cols).for_each(|c| _ = out[c * rows + r].write(src[r * cols + c]));
    }
}

/// A 16 × 16 matrix of 32-bit elements, one row a register, transposed in place: pairs
/// (`unpack…_epi32`), then 2 × 2 blocks (`unpack…_epi64`), then 128-bit lanes twice.
#[target_feature(enable = "avx512f")]
pub(super) fn transpose_16x16(r: &mut [std::arch::x86_64::__m512i; 16]) {
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    let mut u = [_mm512_setzero_si512(); 16];
    for i in 0..4 {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // `u[4i + q]`'s 128-bit lane `L`: rows `4i..4i+4` of column `4L + q`.
    let mut v = [_mm512_setzero_si512(); 16];
    for q in 0..4 {
        for h in 0..2 {
            let (a, b) = (u[8 * h + q], u[8 * h + 4 + q]);
            v[8 * h + q] = _mm512_shuffle_i32x4::<0x88>(a, b);
            v[8 * h + 4 + q] = _mm512_shuffle_i32x4::<0xDD>(a, b);
        }
    }
    for q in 0..4 {
        for h in 0..2 {
            let (a, b) = (v[4 * h + q], v[8 + 4 * h + q]);
            r[4 * h + q] = _mm512_shuffle_i32x4::<0x88>(a, b);
            r[8 + 4 * h + q] = _mm512_shuffle_i32x4::<0xDD>(a, b);
        }
    }
}
