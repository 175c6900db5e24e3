//! The bf16 product on Intel AMX (Advanced Matrix Extensions: Sapphire Rapids and later):
//! eight tile registers of 16 rows × 64 bytes and `TDPBF16PS`, which adds the products of a
//! 16 × 32 bf16 tile and a 32 × 16 bf16 tile (stored as 16 rows of 16 column pairs) into a
//! 16 × 16 f32 tile — 16,384 FLOPs an instruction.
//!
//! The micro-kernel keeps a 32 × 32 block of the output in four f32 tiles over the whole inner
//! dimension (two tiles of the left operand's rows, two of the right one's columns a step of
//! 32), then rounds it to bf16 once (`VCVTNEPS2BF16`, round to nearest even): every element is
//! one f32 sum over `k` in pairs, rounded once, as a product accumulated in f32 and returned in
//! bf16 should be. The operands are laid out by `pack.rs`.
//!
//! Rust has no stable AMX intrinsics (nor their feature detection): the tile instructions are
//! inline assembly, the hardware is read from CPUID (leaf 7: AMX-TILE, AMX-BF16), and Linux
//! must grant the process the tiles' 8 KiB of register state (`arch_prctl`,
//! `ARCH_REQ_XCOMP_PERM`) before the first tile instruction, or it faults. [`ready`] does all
//! three once.

use super::pack::{Operand, Packed, store_rounded};
use burn::tensor::bf16;
use std::arch::asm;
use std::arch::x86_64::__cpuid_count;
use std::mem::MaybeUninit;

/// Whether this process can run the AMX kernel: the CPU has AMX-TILE and AMX-BF16 and what
/// [`super::dot::ready`] needs (the operands' packing and the output's rounding), and Linux
/// granted the tile state. Asked once a process.
pub(crate) fn ready() -> bool {
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| {
        let leaf7 = __cpuid_count(7, 0);
        let (amx_bf16, amx_tile) = (leaf7.edx >> 22 & 1 == 1, leaf7.edx >> 24 & 1 == 1);
        amx_bf16 && amx_tile && super::dot::ready() && request_tile_state()
    })
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

/// The right operand's panels one pass of the row blocks reads: columns of at most 1 MiB of
/// packed pairs (half the Sapphire Rapids core's L2). Chosen on the bench shapes (`cargo
/// bench -p bonfire-examples --bench gemm`, 2026-12-05): the head's forward (panels of 2 MiB)
/// 695 → 852 GFLOP/s against none, no other shape moved beyond the noise; 256 KiB lost
/// 10–45 % where it cut (the left blocks are packed again for each pass).
const PANEL_BYTES: usize = 1 << 20;

/// `a · b` into `out` (`[m, n]` row-major bf16, every element written): `a` `[m, k]`,
/// `b` `[k, n]`. Call only where [`ready`].
pub(crate) fn matmul(a: &Operand, b: &Operand, out: &mut [MaybeUninit<bf16>]) {
    assert!(ready());
    let Some(Packed {
        mut left,
        right,
        mp,
        kp,
        np,
    }) = Packed::new(a, b, out.len(), true)
    else {
        return;
    };
    let (m, n) = (a.rows, b.cols);
    // On cache lines, as the tiles stored into it (see `pack::Lines`).
    #[repr(C, align(64))]
    struct Block([f32; 32 * 32]);
    let mut block = Block([0f32; 32 * 32]);
    let block = &mut block.0;
    // SAFETY: `ready` checked the CPU and the tile permission; the configuration is valid.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig) };
    // Row blocks outside: a block's 32 rows stay in L1 while the right operand's panels pass
    // from L2 (measured against keeping 64–1,024 rows in L2 while each panel passes: 5–15 %
    // faster on the bench shapes) — the panels of at most `PANEL_BYTES` at a time, so that
    // they stay in L2 while every row block passes.
    let chunk = (PANEL_BYTES / (kp * 2)).max(32) / 32 * 32;
    for j0 in (0..np).step_by(chunk) {
        for i in (0..mp).step_by(32) {
            let (rows, lda) = left.row(i);
            for j in (j0..np.min(j0 + chunk)).step_by(32) {
                // SAFETY: rows `i..i+32` of `left` (`lda` apart) and panels `j/16, j/16+1` of
                // `right` hold `kp` values each; `block` is 32 × 32 f32.
                unsafe {
                    block_product(
                        rows,
                        lda * 2,
                        right[j / 16 * (kp / 2 * 16)..].as_ptr(),
                        kp / 2 * 64,
                        kp / 32,
                        block.as_mut_ptr(),
                    );
                    store_rounded(&block[..], &mut out[i * n + j..], n, m - i, n - j);
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
