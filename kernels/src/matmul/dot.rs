//! The bf16 product with AVX-512 BF16's dot products (`VDPBF16PS`: each of 16 f32 lanes adds
//! the products of one pair of bf16 from each operand), for CPUs without AMX that have them
//! (AMD Zen 4 and later, Intel Cooper Lake).
//!
//! The micro-kernel keeps an 8 × 32 block of the output in 16 registers over the whole inner
//! dimension: per row pair of the right operand, the two 16-column panels' pairs (one load
//! each, the layout of `pack.rs`) and each of the 8 rows' pair broadcast, 16 dot products;
//! then the block is rounded to bf16 once, as on AMX. Std's run-time detection reads the
//! features. Taken on request (`BONFIRE_BF16_MATMUL=avx512bf16`): measured on an Intel Xeon
//! core (2026-12-05, `cargo xtask bench gemm`) at 91–113 GFLOP/s, 0.70–1.00 of Burn's product
//! — that core's `VDPBF16PS` does 64 FLOPs a cycle, as do its two 512-bit FMA units — while
//! on AMD Zen 4 the dot products run at twice its FMA rate (PyTorch measured 1.7–1.9× its f32
//! peak there); to be measured there before it is anyone's default.

use super::pack::{Operand, Packed, store_rounded};
use burn::tensor::bf16;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Whether the CPU has AVX-512 F, BW, VL and BF16 (asked once a process).
pub(crate) fn ready() -> bool {
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    })
}

/// Rows of a micro-kernel's block.
const ROWS: usize = 8;

/// `a · b` into `out` (`[m, n]` row-major bf16, every element written): `a` `[m, k]`,
/// `b` `[k, n]`. Call only where [`ready`].
pub(crate) fn matmul(a: &Operand, b: &Operand, out: &mut [MaybeUninit<bf16>]) {
    assert!(ready());
    let Some(Packed {
        mut left,
        right,
        kp,
        np,
        ..
    }) = Packed::new(a, b, out.len(), false)
    else {
        return;
    };
    let (m, n) = (a.rows, b.cols);
    let panel = kp / 2 * 16;
    let mut block = [0f32; ROWS * 32];
    for j in (0..np).step_by(32) {
        for i in (0..m).step_by(ROWS) {
            let (rows, lda) = left.row(i);
            // SAFETY: `ready` checked the features; rows `i..i+ROWS ≤ Mp` of `left` hold `kp`
            // values, panels `j/16` and `j/16 + 1` of `right` `kp/2` pairs each.
            unsafe {
                block_product(
                    rows,
                    lda,
                    &right[j / 16 * panel..][..2 * panel],
                    kp / 2,
                    &mut block,
                );
                store_rounded(&block, &mut out[i * n + j..], n, (m - i).min(ROWS), n - j);
            }
        }
    }
}

/// The 8 × 32 f32 block of `left`'s 8 rows (`lda` apart, `pairs` pairs each) times the two
/// panels `right` (`pairs` rows of 16 pairs each, one after the other) into `out`, rows of 32.
///
/// # Safety
/// AVX-512 F and BF16; the rows hold `2·pairs` values.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn block_product(
    left: *const u16,
    lda: usize,
    right: &[u32],
    pairs: usize,
    out: &mut [f32; 256],
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
    let (p0, p1) = right.split_at(pairs * 16);
    for p in 0..pairs {
        let bf = |v: __m512i| {
            // SAFETY: two 64-byte vectors; `__m512bh` is 32 bf16, any bits.
            unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
        };
        // SAFETY: pair `p` of each panel is 16 u32 (64 bytes).
        let (b0, b1) = unsafe {
            (
                bf(_mm512_loadu_si512(p0[p * 16..].as_ptr() as *const __m512i)),
                bf(_mm512_loadu_si512(p1[p * 16..].as_ptr() as *const __m512i)),
            )
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row `r`'s pair `p` is two bf16 within the row (the caller's contract).
            let pair = unsafe { (left.add(r * lda + 2 * p) as *const u32).read_unaligned() };
            let a = bf(_mm512_set1_epi32(pair as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], a, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], a, b1);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row `r` of `out` holds 32 f32.
        unsafe {
            _mm512_storeu_ps(out[r * 32..].as_mut_ptr(), acc[0]);
            _mm512_storeu_ps(out[r * 32 + 16..].as_mut_ptr(), acc[1]);
        }
    }
}
