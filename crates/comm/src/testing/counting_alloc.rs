//! [`CountingAllocator`]: heap bytes in use and their peak, for tests and benchmarks that
//! measure what a parallelism really saves.
//!
//! A test or bench binary installs it as its global allocator:
//!
//! ```ignore
//! use bonfire_comm::testing::counting_alloc::CountingAllocator;
//! #[global_allocator]
//! static HEAP: CountingAllocator = CountingAllocator::new();
//! // ... HEAP.reset_peak(); run(); let grew = HEAP.peak() - before;
//! ```
//!
//! It counts the whole process (every rank thread): measure one thing at a time.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

/// The system allocator, counting the bytes it has handed out.
pub struct CountingAllocator {
    live: AtomicIsize,
    peak: AtomicIsize,
}

impl CountingAllocator {
    /// A counter at zero live bytes and zero peak (`const`, for a `static`).
    pub const fn new() -> Self {
        Self {
            live: AtomicIsize::new(0),
            peak: AtomicIsize::new(0),
        }
    }

    /// Bytes allocated and not yet freed.
    pub fn live(&self) -> isize {
        self.live.load(Ordering::Relaxed)
    }

    /// The most bytes in use at once since the last [`reset_peak`](Self::reset_peak).
    pub fn peak(&self) -> isize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Starts a new peak measurement from the bytes in use now.
    pub fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::Relaxed);
    }

    fn grew(&self, bytes: isize) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
}

impl Default for CountingAllocator {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are updated.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from `alloc`'s contract (a non-zero-size `layout`).
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            self.grew(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from `alloc_zeroed`'s contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            self.grew(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes through
        // this forwarding allocator).
        unsafe { System.dealloc(ptr, layout) };
        self.live
            .fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded from `realloc`'s contract; `ptr` came from `System` through this
        // allocator.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            self.grew(new_size as isize - layout.size() as isize);
        }
        p
    }
}
