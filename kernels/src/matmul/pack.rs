//! The operands of the bf16 kernels (`amx.rs`, `dot.rs`) in the layout both read: the left
//! one as zero-padded rows `[Mp, Kp]` (read in place when its rows are contiguous and need no
//! padding — for AMX also on cache lines; else a row copy, or a transpose when its columns are
//! contiguous: for AMX a block of 32 rows at a time, see [`Left`]), the right one as panels of
//! 16 columns holding each row pair interleaved (`[Np/16, Kp/2, 16]` of two bf16 each: what
//! `TDPBF16PS` and `VDPBF16PS` multiply); the paddings are zeros, so they add nothing. The copies
//! start on a cache line, as every row of them does (AMX's tile loads read 64-byte rows: see
//! [`Lines`]). And the output's rounding to bf16.

use super::transpose::transpose_16x16;
use burn::tensor::bf16;
use std::arch::x86_64::*;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};

/// One cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// The element types a [`Lines`] holds: plain integers, for which zero bytes are zero and every
/// bit pattern a value.
pub(crate) trait Plain: Copy {}
impl Plain for u16 {}
impl Plain for u32 {}

/// `len` zeroed elements starting on a cache line. The kernels' operands live in these: a tile
/// load (`TILELOADD`, 16 rows of 64 bytes) whose rows straddle two lines reads twice the lines,
/// and the loads — not the `TDPBF16PS` — bound the AMX kernel. Measured on the 2-core Intel
/// Xeon (one 32 × 32 block over `k = 256`, both operands in L1): 0.83 TFLOP/s from the 16- and
/// 32-byte-aligned buffers `Vec` gave, 1.87 from line-aligned ones.
pub(crate) struct Lines<T: Plain> {
    lines: Vec<Line>,
    len: usize,
    _element: PhantomData<T>,
}

impl<T: Plain> Lines<T> {
    pub(crate) fn zeroed(len: usize) -> Self {
        let lines = vec![Line([0; 64]); (len * size_of::<T>()).div_ceil(64)];
        Self {
            lines,
            len,
            _element: PhantomData,
        }
    }
}

impl<T: Plain> Deref for Lines<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the lines hold at least `len` elements' bytes, aligned for `T` (64 ≥ its
        // alignment), initialized (zeroed, then written as `T`); every bit pattern is a `T`.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const T, self.len) }
    }
}

impl<T: Plain> DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut T, self.len) }
    }
}

/// A 2-d bf16 operand in its buffer: element `(r, c)` at `offset + r·row_stride + c·col_stride`,
/// one of the strides 1.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand<'a> {
    pub data: &'a [bf16],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

/// bf16 values as their bits.
fn bits(values: &[bf16]) -> &[u16] {
    // SAFETY: `bf16` is a `repr(transparent)` `u16`.
    unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u16, values.len()) }
}

/// `x` rounded up to a multiple of 32.
fn up32(x: usize) -> usize {
    x.div_ceil(32) * 32
}

/// Rows `first..` of the left operand into `out` (`out.len() / kp` rows of `kp`): rows past the
/// operand's zero; the columns past its `k` are left as they are (zero: nothing writes them).
fn pack_rows(a: &Operand, first: usize, kp: usize, out: &mut [u16]) {
    let valid = a.rows.saturating_sub(first).min(out.len() / kp);
    if a.col_stride == 1 {
        for (r, row) in out.chunks_exact_mut(kp).take(valid).enumerate() {
            let start = a.offset + (first + r) * a.row_stride;
            row[..a.cols].copy_from_slice(bits(&a.data[start..start + a.cols]));
        }
    } else {
        assert_eq!(
            a.row_stride, 1,
            "bonfire-kernels: an operand with neither stride 1"
        );
        // SAFETY: the kernels run only where AVX-512 BW is; the operand's elements lie in
        // `data`.
        unsafe {
            transpose_into(
                &a.data[a.offset + first..],
                valid,
                a.cols,
                a.col_stride,
                out,
                kp,
            )
        };
    }
    out[valid * kp..].fill(0);
}

/// A transposed view's rows (`[m, k]` whose columns are contiguous: element `(r, c)` at
/// `src[c·stride + r]`) into `out` `[·, kp]`. By blocks of 32 columns × 16 rows: each pair of
/// source rows interleaved into 32-bit pairs, a 16 × 16 transpose of those in registers,
/// 16 stores of 64 bytes (scalar for the edges). Measured against the element loop it
/// replaced: a `[4096, 1024]` operand 27 → 1.4 ms, `[688, 1024]` 2.4 → 0.14 ms.
///
/// # Safety
/// AVX-512 F and BW; `src` holds every element said, `out` `m` rows of `kp ≥ k`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn transpose_into(
    src: &[bf16],
    m: usize,
    k: usize,
    stride: usize,
    out: &mut [u16],
    kp: usize,
) {
    let at = |c: usize, r: usize| src[c * stride + r].to_bits();
    let (k32, m16) = (k / 32 * 32, m / 16 * 16);
    for c0 in (0..k32).step_by(32) {
        for r0 in (0..m16).step_by(16) {
            let mut rows = [_mm512_setzero_si512(); 16];
            for (p, row) in rows.iter_mut().enumerate() {
                let line = |c: usize| &src[c * stride + r0..][..16];
                *row = interleave(line(c0 + 2 * p), line(c0 + 2 * p + 1));
            }
            transpose_16x16(&mut rows);
            for (q, row) in rows.iter().enumerate() {
                let dst = &mut out[(r0 + q) * kp + c0..][..32];
                // SAFETY: 32 elements of `dst` are 64 bytes.
                unsafe { _mm512_storeu_si512(dst.as_mut_ptr() as *mut __m512i, *row) };
            }
        }
        for r in m16..m {
            (c0..c0 + 32).for_each(|c| out[r * kp + c] = at(c, r));
        }
    }
    for c in k32..k {
        (0..m).for_each(|r| out[r * kp + c] = at(c, r));
    }
}

/// Two rows of 16 bf16 as 16 pairs `lo[j] | hi[j] << 16`, in order.
#[target_feature(enable = "avx512f")]
fn interleave(lo: &[bf16], hi: &[bf16]) -> __m512i {
    let (lo, hi) = (&lo[..16], &hi[..16]);
    // SAFETY: 16 bf16 are 32 bytes.
    let load = |s: &[bf16]| unsafe { _mm256_loadu_si256(s.as_ptr() as *const __m256i) };
    let (a, b) = (load(lo), load(hi));
    // Within each 128-bit lane: pairs of columns 0–3 (`unpacklo`) and 4–7 (`unpackhi`).
    let (l, h) = (_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b));
    let first = _mm256_permute2x128_si256(l, h, 0x20);
    let second = _mm256_permute2x128_si256(l, h, 0x31);
    _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1)
}

/// The right operand `[k, n]` as panels of 16 columns, each row pair interleaved:
/// `[Np/16, Kp/2, 16]` of `row 2i | row 2i+1 << 16`.
fn pack_right(b: &Operand, kp: usize, np: usize) -> Lines<u32> {
    let (k, n) = (b.rows, b.cols);
    let panel = kp / 2 * 16;
    let mut out = Lines::zeroed(np / 16 * panel);
    if b.col_stride == 1 {
        // SAFETY: the kernels run only where AVX-512 F is; the operand's elements lie in
        // `data`.
        unsafe { pair_rows_into(b, &mut out, panel) };
    } else {
        assert_eq!(
            b.row_stride, 1,
            "bonfire-kernels: an operand with neither stride 1"
        );
        // Rows contiguous down each column (the transposed weight of `x Wᵀ`): each column's
        // pairs are adjacent, so a panel is a transpose of 32-bit pairs.
        // SAFETY: the kernels run only where AVX-512 F is; the operand's elements lie in
        // `data`.
        unsafe { pair_columns_into(&b.data[b.offset..], k, n, b.col_stride, &mut out, panel) };
    }
    out
}

/// A `[k, n]` operand with contiguous rows into panels of 16 columns of row pairs (`panel`
/// u32 each): two rows' 16 columns interleaved a store (scalar for the edges).
///
/// # Safety
/// AVX-512 F; `out` holds `n.div_ceil(16)` panels.
#[target_feature(enable = "avx512f")]
unsafe fn pair_rows_into(b: &Operand, out: &mut [u32], panel: usize) {
    let (k, n) = (b.rows, b.cols);
    let pair = |lo: u16, hi: u16| lo as u32 | (hi as u32) << 16;
    let n16 = n / 16 * 16;
    for i in 0..k.div_ceil(2) {
        let row = |r: usize| {
            let start = b.offset + r * b.row_stride;
            &b.data[start..start + n]
        };
        let r0 = row(2 * i);
        let r1 = (2 * i + 1 < k).then(|| row(2 * i + 1));
        if let Some(r1) = r1 {
            for j0 in (0..n16).step_by(16) {
                let dst = &mut out[j0 / 16 * panel + i * 16..][..16];
                let v = interleave(&r0[j0..j0 + 16], &r1[j0..j0 + 16]);
                // SAFETY: `dst` is 64 bytes.
                unsafe { _mm512_storeu_si512(dst.as_mut_ptr() as *mut __m512i, v) };
            }
        }
        let from = if r1.is_some() { n16 } else { 0 };
        for j in from..n {
            let hi = r1.map_or(0, |r1| r1[j].to_bits());
            out[j / 16 * panel + i * 16 + j % 16] = pair(r0[j].to_bits(), hi);
        }
    }
}

/// The columns of a `[k, n]` view whose columns are contiguous (element `(r, c)` at
/// `src[c·stride + r]`) into panels of 16 columns of row pairs (`panel` u32 each): 16 columns
/// × 16 pairs at a time, loaded as 16 rows of 32-bit pairs and transposed in registers
/// (scalar for the edges).
///
/// # Safety
/// AVX-512 F; `src` holds every element said, `out` `n.div_ceil(16)` panels.
#[target_feature(enable = "avx512f")]
unsafe fn pair_columns_into(
    src: &[bf16],
    k: usize,
    n: usize,
    stride: usize,
    out: &mut [u32],
    panel: usize,
) {
    let (k32, n16) = (k / 32 * 32, n / 16 * 16);
    for j0 in (0..n16).step_by(16) {
        for i0 in (0..k32).step_by(32) {
            let mut rows = [_mm512_setzero_si512(); 16];
            for (q, row) in rows.iter_mut().enumerate() {
                let s = &src[(j0 + q) * stride + i0..][..32];
                // SAFETY: 32 elements of `s` are 64 bytes.
                *row = unsafe { _mm512_loadu_si512(s.as_ptr() as *const __m512i) };
            }
            transpose_16x16(&mut rows);
            for (p, row) in rows.iter().enumerate() {
                let dst = &mut out[j0 / 16 * panel + (i0 / 2 + p) * 16..][..16];
                // SAFETY: 16 elements of `dst` are 64 bytes.
                unsafe { _mm512_storeu_si512(dst.as_mut_ptr() as *mut __m512i, *row) };
            }
        }
    }
    let pair = |j: usize, i: usize| {
        let at = |r: usize| match r < k {
            true => src[j * stride + r].to_bits() as u32,
            false => 0,
        };
        at(2 * i) | at(2 * i + 1) << 16
    };
    for j in 0..n {
        let from = match j < n16 {
            true => k32 / 2,
            false => 0,
        };
        for i in from..k.div_ceil(2) {
            out[j / 16 * panel + i * 16 + j % 16] = pair(j, i);
        }
    }
}

/// Both operands of `a · b` in the kernels' layout, and the padded sizes.
pub(crate) struct Packed<'a> {
    pub left: Left<'a>,
    pub right: Lines<u32>,
    pub mp: usize,
    pub kp: usize,
    pub np: usize,
}

impl<'a> Packed<'a> {
    /// `a` `[m, k]` and `b` `[k, n]` for an output of `out_len = m·n`, the left operand as
    /// [`Left::new`] says; `None` when it is empty.
    pub(crate) fn new(a: &Operand<'a>, b: &Operand, out_len: usize, tiles: bool) -> Option<Self> {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        assert!(
            b.rows == k && out_len == m * n,
            "bonfire-kernels: matmul's shapes"
        );
        if m == 0 || n == 0 {
            return None;
        }
        let (mp, kp, np) = (up32(m), up32(k.max(1)), up32(n));
        let (left, right) = (Left::new(a, mp, kp, tiles), pack_right(b, kp, np));
        Some(Self {
            left,
            right,
            mp,
            kp,
            np,
        })
    }
}

/// The left operand's rows as a kernel reads them: `Kp` values a row (zeros past `k`), `Mp`
/// rows (zeros past `m`).
pub(crate) struct Left<'a> {
    a: Operand<'a>,
    kp: usize,
    rows: Rows,
}

/// Where [`Left`]'s rows are.
enum Rows {
    /// The operand's own.
    InPlace,
    /// A copy of the whole operand, `[Mp, Kp]`.
    Whole(Lines<u16>),
    /// A copy of one block of 32 rows at a time (the block starting at `held`), `[32, Kp]`.
    Blocks { buffer: Lines<u16>, held: usize },
}

impl<'a> Left<'a> {
    /// `a`'s rows in place where contiguous with whole blocks of 32 rows and columns — and, for
    /// AMX's tiles (`tiles`), each row on a cache line (see [`Lines`]; Flex's buffers start 16
    /// bytes into one) — else a copy: for AMX one block of 32 rows at a time, packed as the
    /// kernel reaches it (the kernel runs every product of a row block before the next, so each
    /// is packed once, and is still in L1 and L2 when read; no operand-sized buffer is
    /// allocated and faulted in), for the dot-product kernel (whose row blocks are inside its
    /// column loop) the whole operand at once.
    fn new(a: &Operand<'a>, mp: usize, kp: usize, tiles: bool) -> Self {
        let whole = a.rows.is_multiple_of(32) && a.cols.is_multiple_of(32);
        let first = a.data[a.offset..].as_ptr();
        let on_lines = first.addr().is_multiple_of(64) && a.row_stride.is_multiple_of(32);
        let rows = match (a.col_stride == 1 && whole && (on_lines || !tiles), tiles) {
            (true, _) => Rows::InPlace,
            (false, true) => Rows::Blocks {
                buffer: Lines::zeroed(32 * kp),
                held: usize::MAX,
            },
            (false, false) => {
                let mut copy = Lines::zeroed(mp * kp);
                pack_rows(a, 0, kp, &mut copy);
                Rows::Whole(copy)
            }
        };
        Self { a: *a, kp, rows }
    }

    /// Row `r`'s first element and the stride between rows (in elements), valid until the next
    /// call: for a copy by blocks, rows `r..` of `r`'s block of 32.
    pub(crate) fn row(&mut self, r: usize) -> (*const u16, usize) {
        // The pointers are only formed here; the kernels read rows `r < Mp`.
        match &mut self.rows {
            Rows::InPlace => {
                let first = self.a.data[self.a.offset..].as_ptr() as *const u16;
                let stride = self.a.row_stride;
                (first.wrapping_add(r * stride), stride)
            }
            Rows::Whole(copy) => (copy.as_ptr().wrapping_add(r * self.kp), self.kp),
            Rows::Blocks { buffer, held } => {
                let block = r / 32 * 32;
                if *held != block {
                    pack_rows(&self.a, block, self.kp, buffer);
                    *held = block;
                }
                (buffer.as_ptr().wrapping_add((r - block) * self.kp), self.kp)
            }
        }
    }
}

/// The first `rows × cols` (each at most 32) of the f32 `block` rounded to bf16 (nearest even)
/// into `out`, rows `ldo` apart.
///
/// # Safety
/// AVX-512 F, BW, VL and BF16; `block` holds `rows` rows of 32; `out` holds the rows and
/// columns said.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn store_rounded(
    block: &[f32],
    out: &mut [MaybeUninit<bf16>],
    ldo: usize,
    rows: usize,
    cols: usize,
) {
    // A row's 32 values rounded by one instruction and stored by one (masked to `cols`): half
    // the instructions of two 16-lane halves; 0–10 % faster on the bench shapes (two runs of
    // each, alternated). Skipping the rounding altogether (a wrong product, timed only) made the
    // shapes with `k = 256` 25–50 % faster: the output's writes, more than the instructions.
    let mask: u32 = match cols >= 32 {
        true => u32::MAX,
        false => (1 << cols) - 1,
    };
    for r in 0..rows.min(32) {
        // SAFETY: the masks keep the loads within the block's row and the store within `out`'s
        // `cols` columns of row `r`.
        unsafe {
            let lo = _mm512_maskz_loadu_ps(mask as u16, block[r * 32..].as_ptr());
            let hi = _mm512_maskz_loadu_ps((mask >> 16) as u16, block[r * 32 + 16..].as_ptr());
            let rounded: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            let dst = out[r * ldo..].as_mut_ptr() as *mut i16;
            _mm512_mask_storeu_epi16(dst, mask, rounded);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row a kernel reads through [`Left::row`], `Kp` values each: the operand's values,
    /// zeros past them.
    fn read(left: &mut Left, rows: impl IntoIterator<Item = usize>) -> Vec<Vec<u16>> {
        let kp = left.kp;
        let read_row = |left: &mut Left, r: usize| {
            let (first, _) = left.row(r);
            // SAFETY: `row` promises `Kp` readable values from row `r`'s first.
            unsafe { std::slice::from_raw_parts(first, kp).to_vec() }
        };
        rows.into_iter().map(|r| read_row(left, r)).collect()
    }

    /// The left operand's rows are its values (zero-padded) wherever they are read from: in
    /// place (rows on cache lines), copied a block of 32 rows at a time (rows off the lines, a
    /// partial last block, a transposed view; blocks revisited out of order), copied whole (the
    /// dot kernel's).
    #[test]
    fn the_left_rows_are_the_operands_wherever_they_are() {
        let value = |r: usize, c: usize| (r * 131 + c * 7 + 1) as u16;
        let rows = [0, 40, 95, 64, 3, 33, 90, 89];
        for m in [96, 90] {
            let (k, mp, kp) = (64, 96, 64);
            let want: Vec<Vec<u16>> = rows
                .iter()
                .map(|&r| {
                    let at = |c| if r < m && c < k { value(r, c) } else { 0 };
                    (0..kp).map(at).collect()
                })
                .collect();
            // The operand row-major on cache lines at `shift` elements in.
            let mut lines: Lines<u16> = Lines::zeroed(m * k + 64);
            for shift in [0, 8] {
                for (r, c) in (0..m).flat_map(|r| (0..k).map(move |c| (r, c))) {
                    lines[shift + r * k + c] = value(r, c);
                }
                // SAFETY: `bf16` is a `repr(transparent)` `u16`.
                let data: &[bf16] = unsafe {
                    std::slice::from_raw_parts(lines.as_ptr() as *const bf16, lines.len())
                };
                let a = Operand {
                    data,
                    offset: shift,
                    rows: m,
                    cols: k,
                    row_stride: k,
                    col_stride: 1,
                };
                for tiles in [true, false] {
                    let mut left = Left::new(&a, mp, kp, tiles);
                    let in_place = m % 32 == 0 && (shift == 0 || !tiles);
                    let kind = match (&left.rows, in_place, tiles) {
                        (Rows::InPlace, true, _) => "in place",
                        (Rows::Blocks { .. }, false, true) => "blocks",
                        (Rows::Whole(_), false, false) => "whole",
                        _ => panic!("m {m}, shift {shift}, tiles {tiles}: another copy"),
                    };
                    assert_eq!(read(&mut left, rows), want, "{kind}, m {m}, shift {shift}");
                }
            }
            if std::arch::is_x86_feature_detected!("avx512bw") {
                let mut transposed = vec![bf16::ZERO; m * k];
                for (r, c) in (0..m).flat_map(|r| (0..k).map(move |c| (r, c))) {
                    transposed[c * m + r] = bf16::from_bits(value(r, c));
                }
                let a = Operand {
                    data: &transposed,
                    offset: 0,
                    rows: m,
                    cols: k,
                    row_stride: 1,
                    col_stride: m,
                };
                for tiles in [true, false] {
                    let mut left = Left::new(&a, mp, kp, tiles);
                    assert!(matches!(
                        (&left.rows, tiles),
                        (Rows::Blocks { .. }, true) | (Rows::Whole(_), false)
                    ));
                    assert_eq!(read(&mut left, rows), want, "transposed, m {m}, {tiles}");
                }
            }
        }
    }
}
