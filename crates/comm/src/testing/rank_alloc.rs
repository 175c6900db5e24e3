//! Memory measured by an allocator, per rank and for the whole process: [`RankAllocator`]
//! wraps the system allocator and charges every heap block to the rank whose thread
//! allocated it — the one counting allocator of every test and bench.
//!
//! A binary installs it and each rank marks its thread:
//!
//! ```ignore
//! use bonfire_comm::testing::rank_alloc::{self, RankAllocator};
//! #[global_allocator]
//! static HEAP: RankAllocator = RankAllocator;
//! // in each rank's closure:
//! let _rank = rank_alloc::enter_rank(pg.rank());
//! // ... later, from any thread:
//! let (live, peak) = (rank_alloc::live(0), rank_alloc::peak(0));
//! ```
//!
//! - **Attribution.** A thread-local rank id, set by [`enter_rank`] (a guard restores the
//!   previous one), names the owner of every block the thread allocates; threads with no rank
//!   (the main thread, communication and prefetch helpers) charge the *other* bucket
//!   ([`other_live`], [`other_peak`]). The owner is written in a 16-byte header in front of
//!   the block (the block itself keeps its alignment: the header area is `max(align, 16)`
//!   bytes), so a block freed or grown on another thread is still credited to its owner, and
//!   `realloc` keeps the owner.
//! - **Counters.** Per rank: live bytes, the peak of live bytes since [`reset_peak`] and the
//!   allocation calls made ([`allocations`]); for the whole process, every thread's blocks
//!   together: [`process_live`] and [`process_peak`]. All atomics — no lock, and nothing is
//!   allocated inside the allocator. The bytes counted are
//!   what the program asked for (`Layout::size`), not the header or the system allocator's
//!   own overhead.
//! - **Budget.** [`set_budget`] caps every rank's live bytes (not the other bucket). An
//!   allocation that would take its rank over the cap is refused: the allocator writes one
//!   line to stderr (for the first refusal only) (formatted on the stack, written straight to file descriptor 2) —
//!   `out of memory: rank 1 asked for 25165824 bytes with 1073741824 live; its budget is
//!   1100000000 bytes (--memory-budget)` — and returns null, so Rust's allocation-error
//!   handler aborts the process: the honest equivalent of a device out-of-memory error.
//!
//! Ranks `r` and `r + MAX_RANKS` share one counter (one process hosts at most a few rank
//! threads; under MPI it hosts one). A program measuring several runs one after another
//! gives each run its own ids (`enter_rank(first_id + rank)`): a block a run leaves behind
//! and something frees later is then credited back to that run's counter, not to the
//! measurement of the run going on.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

/// Rank counters kept (rank ids wrap around this).
pub const MAX_RANKS: usize = 256;
/// The bucket of threads with no rank.
const OTHER: usize = MAX_RANKS;
/// The bucket of the whole process (every block, whoever allocated it).
const PROCESS: usize = MAX_RANKS + 1;
/// Bytes in front of every block for its owner (the block's alignment is kept on top).
const HEADER: usize = 16;

/// One rank's counters, on a cache line of its own (rank threads count concurrently).
#[repr(align(128))]
struct Bucket {
    live: AtomicUsize,
    peak: AtomicUsize,
    allocations: AtomicUsize,
}

impl Bucket {
    /// Starts a new peak measurement from the live bytes now.
    fn reset_peak(&self) {
        self.peak.store(self.live.load(Relaxed), Relaxed);
    }
}

static BUCKETS: [Bucket; MAX_RANKS + 2] = [const {
    Bucket {
        live: AtomicUsize::new(0),
        peak: AtomicUsize::new(0),
        allocations: AtomicUsize::new(0),
    }
}; MAX_RANKS + 2];
/// Every rank's cap on live bytes; 0: none.
static BUDGET: AtomicUsize = AtomicUsize::new(0);
/// Set by the first allocation through [`RankAllocator`].
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// Set by the first refusal: the line is written once (what follows a refusal — Rust's
/// handler trying to print a backtrace — may be refused too, silently).
static REFUSED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// This thread's bucket (const-initialized, no destructor: reading it never allocates).
    static SLOT: Cell<usize> = const { Cell::new(OTHER) };
}

fn slot_of(rank: usize) -> usize {
    rank % MAX_RANKS
}

fn current_slot() -> usize {
    SLOT.try_with(Cell::get).unwrap_or(OTHER)
}

/// Restores the thread's previous rank when dropped.
#[must_use = "the thread is a rank only while the guard lives"]
pub struct RankGuard {
    previous: usize,
}

impl Drop for RankGuard {
    fn drop(&mut self) {
        let _ = SLOT.try_with(|s| s.set(self.previous));
    }
}

/// From now until the guard drops, this thread's allocations are charged to `rank`.
pub fn enter_rank(rank: usize) -> RankGuard {
    let previous = SLOT.with(|s| s.replace(slot_of(rank)));
    RankGuard { previous }
}

/// The rank this thread allocates for (`None`: the other bucket).
pub fn current_rank() -> Option<usize> {
    let slot = current_slot();
    (slot != OTHER).then_some(slot)
}

/// Whether the running binary allocates through [`RankAllocator`] (otherwise every count
/// here stays 0).
pub fn installed() -> bool {
    INSTALLED.load(Relaxed)
}

/// Bytes `rank` allocated and nobody has freed yet.
pub fn live(rank: usize) -> usize {
    BUCKETS[slot_of(rank)].live.load(Relaxed)
}

/// The most bytes `rank` had live at once since its last [`reset_peak`].
pub fn peak(rank: usize) -> usize {
    BUCKETS[slot_of(rank)].peak.load(Relaxed)
}

/// Starts a new peak measurement for `rank` from its live bytes now.
pub fn reset_peak(rank: usize) {
    BUCKETS[slot_of(rank)].reset_peak();
}

/// Live bytes of threads with no rank.
pub fn other_live() -> usize {
    BUCKETS[OTHER].live.load(Relaxed)
}

/// Peak live bytes of threads with no rank since [`reset_other_peak`].
pub fn other_peak() -> usize {
    BUCKETS[OTHER].peak.load(Relaxed)
}

/// Starts a new peak measurement of the other bucket.
pub fn reset_other_peak() {
    BUCKETS[OTHER].reset_peak();
}

/// Allocation calls (`alloc`, `alloc_zeroed`, `realloc`) `rank`'s threads have made.
pub fn allocations(rank: usize) -> usize {
    BUCKETS[slot_of(rank)].allocations.load(Relaxed)
}

/// Bytes the whole process has live (every thread's, ranked or not).
pub fn process_live() -> usize {
    BUCKETS[PROCESS].live.load(Relaxed)
}

/// The most bytes the whole process had live at once since [`reset_process_peak`].
pub fn process_peak() -> usize {
    BUCKETS[PROCESS].peak.load(Relaxed)
}

/// Starts a new peak measurement of the whole process.
pub fn reset_process_peak() {
    BUCKETS[PROCESS].reset_peak();
}

/// Caps every rank's live bytes at `bytes` (`None`: no cap). See the module docs.
pub fn set_budget(bytes: Option<usize>) {
    BUDGET.store(bytes.unwrap_or(0), Relaxed);
}

/// The cap [`set_budget`] set.
pub fn budget() -> Option<usize> {
    Some(BUDGET.load(Relaxed)).filter(|&b| b > 0)
}

/// Whether asking for `asked` more bytes with `live` live goes over `budget` (`None`: never).
pub fn over_budget(live: usize, asked: usize, budget: Option<usize>) -> bool {
    budget.is_some_and(|b| live.saturating_add(asked) > b)
}

/// A line formatted on the stack (the allocator must not allocate to report).
pub struct StackLine {
    buf: [u8; 256],
    len: usize,
}

impl StackLine {
    fn new() -> Self {
        Self {
            buf: [0; 256],
            len: 0,
        }
    }
    /// The text written so far (at most 256 bytes; longer writes are cut).
    pub fn as_str(&self) -> &str {
        // Only whole `&str`s are copied in, cut at a char boundary.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }
}

impl std::fmt::Write for StackLine {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let room = self.buf.len() - self.len;
        let mut n = s.len().min(room);
        while !s.is_char_boundary(n) {
            n -= 1;
        }
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

/// The out-of-memory line (with its newline) for `rank` asking for `asked` bytes with `live`
/// live under `budget`; `grown`: the request grows a block from `.0` to `.1` bytes.
pub fn oom_line(
    rank: usize,
    asked: usize,
    live: usize,
    budget: usize,
    grown: Option<(usize, usize)>,
) -> StackLine {
    let mut line = StackLine::new();
    let _ = write!(line, "out of memory: rank {rank} asked for {asked} bytes");
    if let Some((old, new)) = grown {
        let _ = write!(line, " (growing a {old}-byte block to {new})");
    }
    let _ = writeln!(
        line,
        " with {live} live; its budget is {budget} bytes (--memory-budget)"
    );
    line
}

/// Writes to file descriptor 2 without allocating or locking.
fn write_stderr(text: &str) {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    // SAFETY: fd 2 is stderr; ManuallyDrop keeps it open.
    let mut stderr = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(2) });
    let _ = stderr.write_all(text.as_bytes());
}

/// Adds `bytes` to `slot`'s live count, unless that takes a rank over its budget (then says
/// so on stderr and charges nothing). `grown`: a realloc's old and new sizes.
fn charge(slot: usize, bytes: usize, grown: Option<(usize, usize)>) -> bool {
    let b = &BUCKETS[slot];
    let before = b.live.fetch_add(bytes, Relaxed);
    if slot != OTHER {
        let budget = budget();
        if over_budget(before, bytes, budget) {
            b.live.fetch_sub(bytes, Relaxed);
            if !REFUSED.swap(true, Relaxed) {
                let line = oom_line(slot, bytes, before, budget.unwrap_or(0), grown);
                write_stderr(line.as_str());
            }
            return false;
        }
    }
    b.peak.fetch_max(before + bytes, Relaxed);
    let p = &BUCKETS[PROCESS];
    let now = p.live.fetch_add(bytes, Relaxed) + bytes;
    if now > p.peak.load(Relaxed) {
        p.peak.fetch_max(now, Relaxed);
    }
    true
}

/// Counts one allocation call of this thread.
fn count_call() {
    BUCKETS[current_slot()].allocations.fetch_add(1, Relaxed);
}

fn uncharge(slot: usize, bytes: usize) {
    BUCKETS[slot].live.fetch_sub(bytes, Relaxed);
    BUCKETS[PROCESS].live.fetch_sub(bytes, Relaxed);
}

/// Bytes in front of a block of alignment `align`: the header, rounded to the alignment.
fn prefix(align: usize) -> usize {
    align.max(HEADER)
}

/// The system block holding the header and a `size`-byte block of alignment `align`.
fn outer(size: usize, align: usize) -> Option<Layout> {
    let total = size.checked_add(prefix(align))?;
    Layout::from_size_align(total, align.max(HEADER)).ok()
}

/// The owner's slot, written just in front of the user's block.
///
/// # Safety
/// `user` must come from [`RankAllocator`].
unsafe fn owner_cell(user: *mut u8) -> *mut usize {
    // SAFETY: `user` came from `allocate`, which put at least `HEADER` (16) bytes of the same
    // system block in front of it, the owner's slot among them.
    unsafe { user.sub(size_of::<usize>()) as *mut usize }
}

/// The global allocator: the system's, with per-rank counting and the budget (module docs).
pub struct RankAllocator;

impl RankAllocator {
    unsafe fn allocate(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        if !INSTALLED.load(Relaxed) {
            INSTALLED.store(true, Relaxed);
        }
        count_call();
        let slot = current_slot();
        let Some(outer) = outer(layout.size(), layout.align()) else {
            return std::ptr::null_mut();
        };
        if !charge(slot, layout.size(), None) {
            return std::ptr::null_mut();
        }
        // SAFETY: `outer` has a non-zero size (it adds the header to `layout`'s) and a valid
        // alignment (`outer` built it with `Layout::from_size_align`).
        let base = unsafe {
            if zeroed {
                System.alloc_zeroed(outer)
            } else {
                System.alloc(outer)
            }
        };
        if base.is_null() {
            uncharge(slot, layout.size());
            return base;
        }
        // SAFETY: `base` is a live block of `outer` bytes; `prefix(align)` < its size, so `user`
        // and the slot in front of it lie inside it.
        unsafe {
            let user = base.add(prefix(layout.align()));
            owner_cell(user).write(slot);
            user
        }
    }
}

// SAFETY: every block is a system block with a header in front; the user's pointer keeps the
// requested alignment (the prefix is a multiple of it) and the header is read back with the
// same layout arithmetic on free and realloc.
unsafe impl GlobalAlloc for RankAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from `alloc`'s contract.
        unsafe { self.allocate(layout, false) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from `alloc_zeroed`'s contract.
        unsafe { self.allocate(layout, true) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator with `layout` (the caller's contract), so the
        // header in front of it and the system block of `outer(layout)` starting `prefix` before
        // it are ours.
        unsafe {
            let slot = owner_cell(ptr).read();
            let outer = outer(layout.size(), layout.align()).expect("allocated with it");
            System.dealloc(ptr.sub(prefix(layout.align())), outer);
            uncharge(slot, layout.size());
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_call();
        let (old, align) = (layout.size(), layout.align());
        // SAFETY: as for `dealloc`: `ptr` came from this allocator with `layout`; the system
        // block is reallocated whole, header included.
        unsafe {
            let slot = owner_cell(ptr).read();
            let Some(grown) = outer(new_size, align) else {
                return std::ptr::null_mut();
            };
            if new_size > old && !charge(slot, new_size - old, Some((old, new_size))) {
                return std::ptr::null_mut();
            }
            let base = ptr.sub(prefix(align));
            let old_outer = outer(old, align).expect("allocated with it");
            // The header moves with the block: realloc copies the prefix too.
            let moved = System.realloc(base, old_outer, grown.size());
            if moved.is_null() {
                if new_size > old {
                    uncharge(slot, new_size - old);
                }
                return moved;
            }
            if new_size < old {
                uncharge(slot, old - new_size);
            }
            moved.add(prefix(align))
        }
    }
}

#[cfg(test)]
#[global_allocator]
static TEST_HEAP: RankAllocator = RankAllocator;

#[cfg(test)]
mod tests {
    use super::*;

    // Each test uses its own rank ids: the test harness runs tests on parallel threads.

    #[test]
    fn charges_the_allocating_rank_even_when_another_thread_frees() {
        let rank = 40;
        let before = live(rank);
        let v: Vec<u8> = {
            let _r = enter_rank(rank);
            vec![7u8; 1 << 20]
        };
        assert_eq!(current_rank(), None);
        assert_eq!(live(rank) - before, 1 << 20);
        std::thread::spawn(move || drop(v)).join().unwrap();
        assert_eq!(live(rank), before);
        assert!(installed());
    }

    #[test]
    fn realloc_keeps_the_owner_and_alignment_holds() {
        let rank = 41;
        let before = live(rank);
        let mut v: Vec<u64> = {
            let _r = enter_rank(rank);
            Vec::with_capacity(1000)
        };
        assert_eq!(live(rank) - before, 8000);
        // Grown on a thread of another rank: still charged to its owner.
        let mut v = std::thread::spawn(move || {
            let _r = enter_rank(42);
            v.reserve_exact(3000);
            v
        })
        .join()
        .unwrap();
        assert_eq!(live(rank) - before, v.capacity() * 8);
        assert_eq!(live(42), 0);
        v.shrink_to(10);
        assert_eq!(live(rank) - before, v.capacity() * 8);
        drop(v);
        assert_eq!(live(rank), before);
        let _r = enter_rank(rank);
        for align in [1usize, 8, 16, 64, 4096] {
            let layout = Layout::from_size_align(100, align).unwrap();
            // SAFETY: a block of 100 bytes with `align` is allocated, read within its 100 bytes,
            // grown to 5000 and freed with the layout it then has.
            unsafe {
                let p = std::alloc::alloc_zeroed(layout);
                assert_eq!(p as usize % align, 0);
                assert!(std::slice::from_raw_parts(p, 100).iter().all(|&b| b == 0));
                let p = std::alloc::realloc(p, layout, 5000);
                assert_eq!(p as usize % align, 0);
                std::alloc::dealloc(p, Layout::from_size_align(5000, align).unwrap());
            }
        }
        assert_eq!(live(rank), before);
    }

    #[test]
    fn peak_follows_the_highest_live_since_reset() {
        let rank = 43;
        let _r = enter_rank(rank);
        reset_peak(rank);
        let base = live(rank);
        let a = vec![0u8; 3 << 20];
        let b = vec![0u8; 1 << 20];
        drop(a);
        assert_eq!(peak(rank) - base, 4 << 20);
        reset_peak(rank);
        assert_eq!(peak(rank) - base, 1 << 20);
        drop(b);
        assert_eq!(live(rank), base);
    }

    #[test]
    fn the_process_counts_every_thread_and_calls_are_counted_per_rank() {
        let rank = 46;
        let calls = allocations(rank);
        let v = {
            let _r = enter_rank(rank);
            let mut v = Vec::<u8>::with_capacity(1 << 20);
            v.reserve_exact(2 << 20);
            v
        };
        assert_eq!(allocations(rank) - calls, 2, "an alloc and a realloc");
        // Other test threads allocate too: the process holds at least this block, and its
        // peak since a reset at least what is live now.
        assert!(process_live() >= v.capacity());
        reset_process_peak();
        let w = std::thread::spawn(|| vec![0u8; 4 << 20]).join().unwrap();
        assert!(process_peak() >= v.capacity() + w.len());
        drop((v, w));
    }

    #[test]
    fn threads_without_a_rank_charge_other() {
        let before = live(44);
        std::thread::spawn(|| {
            assert_eq!(current_rank(), None);
            let _v = vec![0u8; 1 << 16];
        })
        .join()
        .unwrap();
        assert_eq!(live(44), before);
        let outer = enter_rank(44);
        {
            let _inner = enter_rank(45);
            assert_eq!(current_rank(), Some(45));
        }
        assert_eq!(current_rank(), Some(44));
        drop(outer);
        assert_eq!(current_rank(), None);
    }

    #[test]
    fn budget_check_and_its_line() {
        assert!(!over_budget(10, 5, None));
        assert!(!over_budget(10, 5, Some(15)));
        assert!(over_budget(10, 6, Some(15)));
        assert!(over_budget(usize::MAX, 1, Some(15)));
        assert_eq!(
            oom_line(1, 25165824, 1073741824, 1100000000, None).as_str(),
            "out of memory: rank 1 asked for 25165824 bytes with 1073741824 live; its budget \
             is 1100000000 bytes (--memory-budget)\n"
        );
        assert_eq!(
            oom_line(0, 12288, 67099160, 67108864, Some((12288, 24576))).as_str(),
            "out of memory: rank 0 asked for 12288 bytes (growing a 12288-byte block to 24576) \
             with 67099160 live; its budget is 67108864 bytes (--memory-budget)\n"
        );
    }
}
