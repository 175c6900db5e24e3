//! Transposes of 32-bit values by square blocks in registers: 16 × 16 in AVX-512's, the
//! building block of the bf16 kernels' operand packing (`pack.rs`, on interleaved bf16 pairs),
//! and, for the f32 copy [`super::row_major`] makes of a column-major view, those or 8 × 8 in
//! AVX's where the CPU has no AVX-512.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// The register width a blocked transpose runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Width {
    /// 16 × 16 blocks in AVX-512 registers.
    Avx512,
    /// 8 × 8 blocks in AVX registers (AVX2-only CPUs: AMD Zen 1–3, Intel before Skylake-SP).
    Avx,
}

impl Width {
    /// Every width, widest first.
    const ALL: [Self; 2] = [Self::Avx512, Self::Avx];

    /// Whether this CPU has the width's instructions.
    pub(super) fn on_this_cpu(self) -> bool {
        match self {
            Self::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            Self::Avx => std::arch::is_x86_feature_detected!("avx"),
        }
    }

    /// The widest this CPU has, if any.
    pub(super) fn widest() -> Option<Self> {
        Self::ALL.into_iter().find(|w| w.on_this_cpu())
    }

    /// Every width this CPU has, widest first.
    #[cfg(test)]
    pub(super) fn available() -> Vec<Self> {
        Self::ALL.into_iter().filter(|w| w.on_this_cpu()).collect()
    }
}

/// `out[c · rows + r] = src[r · cols + c]`: a contiguous `[rows, cols]` of 32-bit values
/// written transposed, `[cols, rows]`, by square blocks transposed in registers of `width`
/// (scalar for the edges).
///
/// # Panics
/// If the CPU lacks `width` ([`Width::on_this_cpu`]).
pub(super) fn transpose_f32(
    width: Width,
    src: &[f32],
    rows: usize,
    cols: usize,
    out: &mut [MaybeUninit<f32>],
) {
    assert!(width.on_this_cpu(), "{width:?}: not on this CPU");
    let (src, out) = (&src[..rows * cols], &mut out[..rows * cols]);
    // SAFETY: the CPU has the width's features (checked above).
    unsafe {
        match width {
            Width::Avx512 => by_16(src, rows, cols, out),
            Width::Avx => by_8(src, rows, cols, out),
        }
    }
}

/// [`transpose_f32`] by 16 × 16 blocks ([`transpose_16x16`]).
///
/// # Safety
/// AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn by_16(src: &[f32], rows: usize, cols: usize, out: &mut [MaybeUninit<f32>]) {
    by_blocks::<16>(src, rows, cols, out, |from, to| {
        let mut block = [_mm512_setzero_si512(); 16];
        for (i, v) in block.iter_mut().enumerate() {
            // SAFETY: row `i` of the block holds 16 f32 (64 bytes) at `from + i · cols`.
            *v = unsafe { _mm512_loadu_si512(from.add(i * cols) as *const __m512i) };
        }
        transpose_16x16(&mut block);
        for (i, v) in block.iter().enumerate() {
            // SAFETY: as above, at `to + i · rows`; `MaybeUninit<f32>` is laid out as `f32`.
            unsafe { _mm512_storeu_si512(to.add(i * rows) as *mut __m512i, *v) };
        }
    })
}

/// [`transpose_f32`] by 8 × 8 blocks in AVX registers: pairs (`unpack…_ps`), then 2 × 2
/// blocks (`shuffle_ps`), then 128-bit halves (`permute2f128_ps`).
///
/// # Safety
/// AVX.
#[target_feature(enable = "avx")]
unsafe fn by_8(src: &[f32], rows: usize, cols: usize, out: &mut [MaybeUninit<f32>]) {
    by_blocks::<8>(src, rows, cols, out, |from, to| {
        // SAFETY: row `i` of the block holds 8 f32 at `from + i · cols`.
        let r: [__m256; 8] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(from.add(i * cols)) });
        let t: [__m256; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
            match i % 2 {
                0 => _mm256_unpacklo_ps(a, b),
                _ => _mm256_unpackhi_ps(a, b),
            }
        });
        // `s[4h + 2p + q]`: rows `4h..4h+4` of columns `2p + q` (low half) and `2p + q + 4`.
        let s: [__m256; 8] = std::array::from_fn(|i| {
            let (h, p, q) = (i / 4, i / 2 % 2, i % 2);
            let (a, b) = (t[4 * h + p], t[4 * h + 2 + p]);
            match q {
                0 => _mm256_shuffle_ps::<0x44>(a, b),
                _ => _mm256_shuffle_ps::<0xEE>(a, b),
            }
        });
        for c in 0..8 {
            let (a, b) = (s[c % 4], s[4 + c % 4]);
            let column = match c < 4 {
                true => _mm256_permute2f128_ps::<0x20>(a, b),
                false => _mm256_permute2f128_ps::<0x31>(a, b),
            };
            // SAFETY: column `c` of the block is 8 f32 at `to + c · rows`.
            unsafe { _mm256_storeu_ps(to.add(c * rows) as *mut f32, column) };
        }
    })
}

/// The loop over `B × B` blocks both widths share: `block(from, to)` transposes the block
/// whose first value is at `from` (rows `cols` apart) into `to` (rows `rows` apart); the
/// edges outside whole blocks are copied one value at a time.
#[inline(always)]
fn by_blocks<const B: usize>(
    src: &[f32],
    rows: usize,
    cols: usize,
    out: &mut [MaybeUninit<f32>],
    mut block: impl FnMut(*const f32, *mut MaybeUninit<f32>),
) {
    let (rb, cb) = (rows / B * B, cols / B * B);
    for r0 in (0..rb).step_by(B) {
        for c0 in (0..cb).step_by(B) {
            // Both blocks lie inside the slices: `r0 + B ≤ rows`, `c0 + B ≤ cols`.
            block(
                src[r0 * cols + c0..].as_ptr(),
                out[c0 * rows + r0..].as_mut_ptr(),
            );
        }
        for c in cb..cols {
            (r0..r0 + B).for_each(|r| _ = out[c * rows + r].write(src[r * cols + c]));
        }
    }
    for r in rb..rows {
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
