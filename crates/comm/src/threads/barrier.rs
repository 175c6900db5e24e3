//! A reusable barrier for the ranks of one in-process group that can time out, withdraw, and
//! notice failed peers.
//!
//! The state is one atomic word: the generation in the high half, the number of arrived ranks
//! in the low half. The last rank to arrive bumps the generation; the others spin briefly
//! (only when every rank thread can have its own core) and then sleep on a condition
//! variable. A rank that gives up withdraws its arrival with a compare-and-swap that fails if
//! the barrier completed meanwhile, so no rank ever proceeds on a barrier another rank left:
//! peers never touch the buffers of a rank that has returned.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

const COUNT_MASK: u64 = 0xffff_ffff;
const GENERATION: u64 = 1 << 32;

/// How long a waiter busy-spins, when spinning is allowed (every rank has a core).
const SPIN_FOR: Duration = Duration::from_micros(20);
/// How long it then keeps polling while yielding its core to any other runnable thread,
/// before sleeping. Waking a sleeping thread costs tens of microseconds, which would dominate
/// collectives of a few MiB; yielding keeps the core available to computation.
const YIELD_FOR: Duration = Duration::from_millis(2);
/// How often a sleeping waiter wakes to re-check deadlines and peers.
const POLL: Duration = Duration::from_millis(20);

/// Why a wait ended without the barrier completing.
pub(crate) enum WaitError<E> {
    /// The deadline passed; `missing` are the member indices that had not arrived.
    Timeout { missing: Vec<usize> },
    /// The check callback reported a reason to stop waiting.
    Stopped(E),
}

pub(crate) struct Barrier {
    size: usize,
    state: AtomicU64,
    /// Barriers entered by each member, to name the missing ones.
    entered: Vec<AtomicU64>,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    spin: bool,
}

impl Barrier {
    pub(crate) fn new(size: usize, spin: bool) -> Self {
        Self {
            size,
            state: AtomicU64::new(0),
            entered: (0..size).map(|_| AtomicU64::new(0)).collect(),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            spin,
        }
    }

    /// Wakes every sleeping waiter so it re-runs its checks (a peer failed, the group was
    /// aborted).
    pub(crate) fn alert(&self) {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.wake.notify_all();
    }

    /// Member indices that have entered fewer barriers than `me` (without allocating: this
    /// runs on every wake-up of a waiter).
    pub(crate) fn behind(&self, me: usize) -> impl Iterator<Item = usize> + '_ {
        let mine = self.entered[me].load(Ordering::SeqCst);
        (0..self.size).filter(move |&m| self.entered[m].load(Ordering::SeqCst) < mine)
    }

    /// Arrives as member `me` and waits for every member.
    ///
    /// With a `deadline`, gives up after it (withdrawing the arrival). `check` runs whenever
    /// the waiter wakes without completion; returning `Err` withdraws and stops the wait.
    /// Without a deadline the wait only ends by completion or `check`.
    pub(crate) fn wait<E>(
        &self,
        me: usize,
        deadline: Option<Instant>,
        mut check: impl FnMut(&Self) -> Result<(), E>,
    ) -> Result<(), WaitError<E>> {
        self.entered[me].fetch_add(1, Ordering::SeqCst);
        let prev = self.state.fetch_add(1, Ordering::SeqCst);
        let generation = prev & !COUNT_MASK;
        if (prev & COUNT_MASK) + 1 == self.size as u64 {
            // Last to arrive: reset the count and open the next generation in one step.
            self.state
                .fetch_add(GENERATION - self.size as u64, Ordering::SeqCst);
            if self.sleepers.load(Ordering::SeqCst) > 0 {
                let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                self.wake.notify_all();
            }
            return Ok(());
        }
        let done = || self.state.load(Ordering::SeqCst) & !COUNT_MASK != generation;

        if self.spin && !crate::work::on_comm_thread() {
            let start = Instant::now();
            let mut i = 0u32;
            loop {
                if done() {
                    return Ok(());
                }
                i = i.wrapping_add(1);
                if i.is_multiple_of(64) {
                    let spun = start.elapsed();
                    if spun > SPIN_FOR + YIELD_FOR {
                        break;
                    }
                    if spun > SPIN_FOR {
                        std::thread::yield_now();
                        continue;
                    }
                }
                std::hint::spin_loop();
            }
        }

        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let result = loop {
            if done() {
                break Ok(());
            }
            if let Err(e) = check(self) {
                break self
                    .withdraw(generation)
                    .map_or(Ok(()), |()| Err(WaitError::Stopped(e)));
            }
            let now = Instant::now();
            let mut nap = POLL;
            if let Some(deadline) = deadline {
                if now >= deadline {
                    let missing = self.behind(me).collect();
                    break self
                        .withdraw(generation)
                        .map_or(Ok(()), |()| Err(WaitError::Timeout { missing }));
                }
                nap = nap.min(deadline - now);
            }
            guard = self
                .wake
                .wait_timeout(guard, nap)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(guard);
        result
    }

    /// Takes back one arrival in `generation`. Returns `None` when the barrier completed
    /// meanwhile (the caller must then proceed as if it had not given up).
    fn withdraw(&self, generation: u64) -> Option<()> {
        let mut s = self.state.load(Ordering::SeqCst);
        loop {
            if s & !COUNT_MASK != generation || (s & COUNT_MASK) as usize == self.size {
                // Completed, or about to be: everyone arrived.
                while self.state.load(Ordering::SeqCst) & !COUNT_MASK == generation {
                    std::hint::spin_loop();
                }
                return None;
            }
            match self
                .state
                .compare_exchange(s, s - 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Some(()),
                Err(actual) => s = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn barrier_completes_many_generations() {
        for spin in [false, true] {
            let b = Arc::new(Barrier::new(3, spin));
            std::thread::scope(|s| {
                for me in 0..3 {
                    let b = b.clone();
                    s.spawn(move || {
                        for _ in 0..200 {
                            b.wait::<()>(me, None, |_| Ok(())).ok().unwrap();
                        }
                    });
                }
            });
        }
    }

    #[test]
    fn timeout_names_missing_member_and_withdraws() {
        let b = Barrier::new(2, false);
        let deadline = Instant::now() + Duration::from_millis(50);
        match b.wait::<()>(0, Some(deadline), |_| Ok(())) {
            Err(WaitError::Timeout { missing }) => assert_eq!(missing, vec![1]),
            _ => panic!("expected a timeout"),
        }
        // The arrival was withdrawn: the count is back to zero.
        assert_eq!(b.state.load(Ordering::SeqCst) & COUNT_MASK, 0);
    }
}
