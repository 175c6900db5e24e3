//! The bf16 product on Intel AMX (Advanced Matrix Extensions: Sapphire Rapids and later):
//! eight tile registers of 16 rows × 64 bytes and `TDPBF16PS`, which adds the products of a
//! 16 × 32 bf16 tile and a 32 × 16 bf16 tile (stored as 16 rows of 16 column pairs) into a
//! 16 × 16 f32 tile — 16,384 FLOPs an instruction.
//!
//! The micro-kernel keeps a 32 × 32 block of the output in four f32 tiles over the whole inner
//! dimension (two tiles of the left operand's rows, two of the right one's columns a step of
//! 32), then rounds it to bf16 once (`VCVTNEPS2BF16`, round to nearest even): every element is
//! one f32 sum over `k` in pairs, rounded once, as a product accumulated in f32 and returned in
//! bf16 should be. The left operand is packed into zero-padded rows (`[Mp, Kp]`, a row copy
//! when its rows are contiguous, a transpose when its columns are), the right one into panels
//! of 16 columns holding each row pair interleaved (`[Np/16, Kp/2, 16]` of two bf16 each), the
//! layout `TDPBF16PS` reads; the paddings are zeros, so they add nothing.
//!
//! Rust has no stable AMX intrinsics (nor their feature detection): the tile instructions are
//! inline assembly, the hardware is read from CPUID (leaf 7: AMX-TILE, AMX-BF16), and Linux
//! must grant the process the tiles' 8 KiB of register state (`arch_prctl`,
//! `ARCH_REQ_XCOMP_PERM`) before the first tile instruction, or it faults. [`ready`] does all
//! three once.

use burn::tensor::bf16;
use std::arch::asm;
use std::arch::x86_64::{
    __cpuid_count, __m256i, __m512, _mm256_mask_storeu_epi16, _mm512_cvtneps_pbh,
    _mm512_maskz_loadu_ps,
};

/// Whether this process runs bf16 products on AMX: the CPU has AMX-TILE, AMX-BF16 and
/// AVX-512 BF16 (the output's rounding), Linux granted the tile state, and `BONFIRE_AMX` is
/// not `0` (which keeps Burn's product, e.g. to reproduce a run made on a CPU without AMX).
/// Asked once a process.
pub(crate) fn ready() -> bool {
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| std::env::var("BONFIRE_AMX").as_deref() != Ok("0") && detect())
}

fn detect() -> bool {
    let leaf7 = __cpuid_count(7, 0);
    let (amx_bf16, amx_tile) = (leaf7.edx >> 22 & 1 == 1, leaf7.edx >> 24 & 1 == 1);
    amx_bf16
        && amx_tile
        && std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && request_tile_state()
}

/// Asks Linux for the tile data state (`XFEATURE_XTILEDATA`, 18); `true` once granted.
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a system call with two integer arguments; it only changes this process's
    // permissions.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
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

/// `x` rounded up to a multiple of 32.
fn up32(x: usize) -> usize {
    x.div_ceil(32) * 32
}

/// The left operand `[m, k]` as zero-padded rows `[Mp, Kp]`.
fn pack_left(a: &Operand, mp: usize, kp: usize) -> Vec<u16> {
    let mut out = vec![0u16; mp * kp];
    if a.col_stride == 1 {
        for (r, row) in out.chunks_exact_mut(kp).take(a.rows).enumerate() {
            let start = a.offset + r * a.row_stride;
            let src = &a.data[start..start + a.cols];
            row[..a.cols]
                .iter_mut()
                .zip(src)
                .for_each(|(d, s)| *d = s.to_bits());
        }
    } else {
        assert_eq!(
            a.row_stride, 1,
            "bonfire-kernels: an operand with neither stride 1"
        );
        // SAFETY: `ready` checked AVX-512 BW; the operand's elements lie in `data`.
        unsafe {
            transpose_into(
                &a.data[a.offset..],
                a.rows,
                a.cols,
                a.col_stride,
                &mut out,
                kp,
            )
        };
    }
    out
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
    use std::arch::x86_64::*;
    let at = |c: usize, r: usize| src[c * stride + r].to_bits();
    let (k32, m16) = (k / 32 * 32, m / 16 * 16);
    for c0 in (0..k32).step_by(32) {
        for r0 in (0..m16).step_by(16) {
            let mut rows = [_mm512_setzero_si512(); 16];
            for (p, row) in rows.iter_mut().enumerate() {
                let line = |c: usize| {
                    let s = &src[c * stride + r0..][..16];
                    // SAFETY: 16 elements of `s` are 32 bytes.
                    unsafe { _mm256_loadu_si256(s.as_ptr() as *const __m256i) }
                };
                let (a, b) = (line(c0 + 2 * p), line(c0 + 2 * p + 1));
                let (lo, hi) = (_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b));
                let first = _mm256_permute2x128_si256(lo, hi, 0x20);
                let second = _mm256_permute2x128_si256(lo, hi, 0x31);
                *row = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
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

/// A 16 × 16 matrix of 32-bit elements, one row a register, transposed in place: pairs
/// (`unpack…_epi32`), then 2 × 2 blocks (`unpack…_epi64`), then 128-bit lanes twice.
#[target_feature(enable = "avx512f")]
fn transpose_16x16(r: &mut [std::arch::x86_64::__m512i; 16]) {
    use std::arch::x86_64::*;
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

/// The right operand `[k, n]` as panels of 16 columns, each row pair interleaved:
/// `[Np/16, Kp/2, 16]` of `row 2i | row 2i+1 << 16`.
fn pack_right(b: &Operand, kp: usize, np: usize) -> Vec<u32> {
    let (k, n) = (b.rows, b.cols);
    let panel = kp / 2 * 16;
    let mut out = vec![0u32; np / 16 * panel];
    let pair = |lo: u16, hi: u16| lo as u32 | (hi as u32) << 16;
    if b.col_stride == 1 {
        for i in 0..k.div_ceil(2) {
            let row = |r: usize| {
                let start = b.offset + r * b.row_stride;
                &b.data[start..start + n]
            };
            let r0 = row(2 * i);
            let r1 = (2 * i + 1 < k).then(|| row(2 * i + 1));
            for j0 in (0..n).step_by(16) {
                let dst = &mut out[j0 / 16 * panel + i * 16..][..16.min(n - j0)];
                for (j, d) in dst.iter_mut().enumerate() {
                    let hi = r1.map_or(0, |r1| r1[j0 + j].to_bits());
                    *d = pair(r0[j0 + j].to_bits(), hi);
                }
            }
        }
    } else {
        assert_eq!(
            b.row_stride, 1,
            "bonfire-kernels: an operand with neither stride 1"
        );
        // Rows contiguous down each column (the transposed weight of `x Wᵀ`): each column's
        // pairs are adjacent, so a panel is a transpose of 32-bit pairs.
        // SAFETY: `ready` checked AVX-512 F; the operand's elements lie in `data`.
        unsafe { pair_columns_into(&b.data[b.offset..], k, n, b.col_stride, &mut out, panel) };
    }
    out
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
    use std::arch::x86_64::*;
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

/// The tile configuration (palette 1): tiles 0–3 the f32 output block, 4–5 the left rows,
/// 6–7 the right panels; each 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    TileConfig(c)
};

/// Rows of the left operand a block of the loop keeps (in L2) while the right panels pass.
const BLOCK_ROWS: usize = 256;

/// `a · b` into `out` (`[m, n]` row-major bf16): `a` `[m, k]`, `b` `[k, n]`. Call only where
/// [`ready`].
pub(crate) fn matmul(a: &Operand, b: &Operand, out: &mut [bf16]) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(ready() && b.rows == k && out.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    let (mp, kp, np) = (up32(m), up32(k.max(1)), up32(n));
    // Rows read where they are when they need no padding (contiguous, whole blocks of 32 rows
    // and of 32 columns), else packed.
    let packed;
    let (left, lda) = match a.col_stride == 1 && m % 32 == 0 && k % 32 == 0 {
        true => (a.data[a.offset..].as_ptr() as *const u16, a.row_stride),
        false => {
            packed = pack_left(a, mp, kp);
            (packed.as_ptr(), kp)
        }
    };
    let right = pack_right(b, kp, np);
    let mut block = [0f32; 32 * 32];
    // SAFETY: `ready` checked the CPU and the tile permission; the configuration is valid.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig) };
    for i0 in (0..mp).step_by(BLOCK_ROWS) {
        for j in (0..np).step_by(32) {
            for i in (i0..mp.min(i0 + BLOCK_ROWS)).step_by(32) {
                // SAFETY: rows `i..i+32` of `left` (`lda` apart) and panels `j/16, j/16+1` of
                // `right` hold `kp` values each; `block` is 32 × 32 f32.
                unsafe {
                    block_product(
                        left.add(i * lda),
                        lda * 2,
                        right[j / 16 * (kp / 2 * 16)..].as_ptr(),
                        kp / 2 * 64,
                        kp / 32,
                        block.as_mut_ptr(),
                    );
                    store_rounded(&block, &mut out[i * n + j..], n, m - i, n - j);
                }
            }
        }
    }
    // SAFETY: releases the tile state this call configured.
    unsafe { asm!("tilerelease") };
}

/// The 32 × 32 f32 block `Σₖ left[32 rows, k] · right[k, 32 columns]` into `out` (row stride
/// 128 bytes): `left` rows `lda` bytes apart, the two right panels `panel` bytes apart, each
/// `k/2` rows of 64 bytes; `steps = k/32`.
///
/// # Safety
/// AMX configured by [`CONFIG`]; the pointers hold what is said above; `steps > 0`.
#[inline(never)]
unsafe fn block_product(
    left: *const u16,
    lda: usize,
    right: *const u32,
    panel: usize,
    steps: usize,
    out: *mut f32,
) {
    // SAFETY: the caller's contract; the tile registers are not used by compiled code.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {lda}*1]",
            "tileloadd tmm6, [{b0} + {row}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm7, [{b1} + {row}*1]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm5, [{a1} + {lda}*1]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b0}, 1024",
            "add {b1}, 1024",
            "dec {n}",
            "jnz 2b",
            "tilestored [{c} + {ldc}*1], tmm0",
            "tilestored [{c} + {ldc}*1 + 64], tmm1",
            "tilestored [{c10} + {ldc}*1], tmm2",
            "tilestored [{c10} + {ldc}*1 + 64], tmm3",
            a0 = inout(reg) left => _,
            a1 = inout(reg) (left as *const u8).add(16 * lda) => _,
            b0 = inout(reg) right => _,
            b1 = inout(reg) (right as *const u8).add(panel) => _,
            lda = in(reg) lda,
            row = in(reg) 64usize,
            n = inout(reg) steps => _,
            c = in(reg) out,
            c10 = in(reg) out.add(16 * 32),
            ldc = in(reg) 128usize,
            options(nostack),
        );
    }
}

/// The first `rows × cols` (each at most 32) of the f32 `block` rounded to bf16 (nearest even)
/// into `out`, rows `ldo` apart.
///
/// # Safety
/// AVX-512 F, BW, VL and BF16 (checked by [`ready`]); `out` holds the rows and columns said.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn store_rounded(
    block: &[f32; 1024],
    out: &mut [bf16],
    ldo: usize,
    rows: usize,
    cols: usize,
) {
    for r in 0..rows.min(32) {
        for h in 0..2 {
            let lanes = cols.saturating_sub(16 * h).min(16);
            if lanes == 0 {
                break;
            }
            let mask = (1u32 << lanes) - 1;
            // SAFETY: the mask keeps the load within the block's row and the store within
            // `out`'s `cols` columns of row `r`.
            unsafe {
                let v: __m512 =
                    _mm512_maskz_loadu_ps(mask as u16, block[r * 32 + 16 * h..].as_ptr());
                let rounded: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
                let dst = out[r * ldo + 16 * h..].as_mut_ptr() as *mut i16;
                _mm256_mask_storeu_epi16(dst, mask as u16, rounded);
            }
        }
    }
}
