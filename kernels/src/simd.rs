//! The host kernels' loops at the CPU's vector width. The workspace builds for the baseline
//! x86-64 (SSE2: four f32 lanes) so that one binary runs anywhere; a loop wrapped in
//! [`vectorized!`] is compiled three times — AVX-512 (F, BW, VL, DQ), AVX2 with FMA, and the
//! baseline — and each call takes the widest the CPU has (the `multiversion` crate's run-time
//! dispatch; the feature test is cached). Every version computes the same values bit for bit:
//! Rust never contracts `a * b + c` into a fused multiply-add, so a wider register only does
//! the same IEEE operations on more lanes at once; an explicit `mul_add` (the GELU's
//! polynomials) is rounded once in every version (an FMA instruction, or `fmaf` in
//! the baseline); and the reductions' order is written out (`host::sum_zip`'s partial sums).
//! Measured (one Xeon core, 2²⁰ values): the GELU forward 2.26 → 0.84 ms and backward
//! 2.4 → 0.9 ms against the baseline build (less the copy).
//!
//! What a wrapped function must do for the wider versions to be wider: keep its loops in its
//! own body — `for` loops over slices, chunks and `zip`s, and `#[inline(always)]` helpers —
//! not in `Iterator::for_each`/`fold`/`sum` over long slices, whose bodies the compiler may
//! leave out of line and so compile for the baseline.

/// Compiles the function it wraps for AVX-512, for AVX2 + FMA and for the baseline, and
/// dispatches each call to the widest the CPU has (see the module's doc).
macro_rules! vectorized {
    ($(#[$meta:meta])* $vis:vis fn $($rest:tt)*) => {
        $(#[$meta])*
        #[multiversion::multiversion(targets(
            "x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+fma",
            "x86_64+avx2+fma",
        ))]
        $vis fn $($rest)*
    };
}
pub(crate) use vectorized;
