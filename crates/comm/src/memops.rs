//! Bulk copies for the shared-memory backend.
//!
//! Above a few MiB the destination will not stay in cache anyway, and ordinary stores first
//! read every destination line (read-for-ownership) — a third more memory traffic than the
//! copy itself. Non-temporal ("streaming") stores skip that read, which is what a good
//! `memcpy` does for large sizes too; without them a large collective cannot keep up with
//! memcpy.

/// Copies `len` bytes; with `stream`, bypasses the cache where the CPU allows it.
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes, and the ranges must not
/// overlap. After streaming copies, call [`fence`] before publishing the data to another
/// thread.
#[inline]
pub(crate) unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize, stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream && len >= 256 {
        // SAFETY: forwarded from the caller.
        unsafe { stream_copy_x86_64(dst, src, len) };
        return;
    }
    let _ = stream;
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Orders preceding streaming stores before any later store (such as a barrier's).
#[inline]
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions; SSE is part of the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy_x86_64(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // SAFETY: (whole body) the caller guarantees both ranges; SSE2 is baseline on x86-64;
    // stores are made on 16-byte aligned destination addresses only.
    unsafe {
        let head = dst.align_offset(16).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            let s = src.add(i) as *const __m128i;
            let d = dst.add(i) as *mut __m128i;
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_and_plain_copies_agree_at_every_alignment() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        for offset in 0..17 {
            for len in [0, 1, 63, 255, 256, 1000, 4000] {
                let mut a = vec![0u8; 5100];
                let mut b = vec![0u8; 5100];
                // SAFETY: `a` and `b` hold 5100 bytes and `offset + len` ≤ 4016 are written;
                // `src` holds 5000 and `3 + len` ≤ 4003 are read; the three are distinct
                // allocations.
                unsafe {
                    copy_bytes(a.as_mut_ptr().add(offset), src.as_ptr().add(3), len, true);
                    copy_bytes(b.as_mut_ptr().add(offset), src.as_ptr().add(3), len, false);
                }
                fence();
                assert_eq!(a, b, "offset {offset} len {len}");
                assert_eq!(&a[offset..offset + len], &src[3..3 + len]);
            }
        }
    }
}
