//! [`keep_freed_memory`]: the C allocator tuned for a training loop on the host — large freed
//! blocks kept for the next step instead of handed back to the system.
//!
//! Flex allocates every product's output afresh (zero-filled). glibc serves a large request
//! with its own `mmap` (above a threshold it moves to the size of the last such block freed)
//! or from the heap top, which it trims back to the system once more than a threshold is free:
//! either way a step's large buffers come back as new pages, faulted in while the product
//! writes them. Measured (`cargo xtask bench gemm`, one thread): the bench GPT's products with 4
//! and 16 MB outputs ran at 61–66 GFLOP/s with glibc's defaults and at 99–110 with a fixed
//! mmap threshold of 32 MiB (its largest) and a trim threshold of 1 GiB — both needed, neither
//! alone moved them — where `gemm` called directly on the same shapes runs at 107–110 and
//! PyTorch at 89–100. The cost: freed memory stays with the process (its resident set holds
//! the step's high-water mark), as PyTorch's caching allocators hold theirs.

/// Sets glibc's mmap threshold to 32 MiB (fixed: no longer raised to the last freed block) and
/// its trim threshold to 1 GiB, process-wide; `true` where applied (Linux with glibc), `false`
/// elsewhere (no-op). A binary calls it once, first thing (`train` and the benches do).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only sets allocator parameters; both values are in glibc's range.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_both_settings() {
        assert!(super::keep_freed_memory());
    }
}
