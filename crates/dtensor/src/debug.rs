//! Counting the collectives a region of code issued, like PyTorch's `CommDebugMode`.
//!
//! A [`CommCounter`] counts every communication call that this crate's operations issue on
//! the current thread while the counter is alive — forward calls, the dual calls run by
//! `backward()` (which runs on the thread that calls it) and recomputations. In a world of
//! ranks as threads, each rank thread therefore counts its own calls. Counters nest: every
//! live counter on the thread sees each call.
//!
//! ```
//! use bonfire_comm::OpKind;
//! use bonfire_dtensor::CommCounter;
//! let counter = CommCounter::start();
//! // ... run distributed code on this thread ...
//! assert_eq!(counter.count(OpKind::AllGather), 0);
//! assert_eq!(counter.total(), 0);
//! ```

use bonfire_comm::OpKind;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

type Counts = Rc<RefCell<BTreeMap<OpKind, usize>>>;

thread_local! {
    static ACTIVE: RefCell<Vec<Counts>> = const { RefCell::new(Vec::new()) };
}

/// Records one call on every counter alive on this thread.
pub(crate) fn record(op: OpKind) {
    ACTIVE.with(|active| {
        for counts in active.borrow().iter() {
            *counts.borrow_mut().entry(op).or_insert(0) += 1;
        }
    });
}

/// Counts the communication calls this crate issues on the current thread from
/// [`CommCounter::start`] until the counter is dropped.
#[derive(Debug)]
pub struct CommCounter {
    counts: Counts,
}

impl CommCounter {
    /// Starts counting on the current thread.
    pub fn start() -> Self {
        let counts: Counts = Rc::default();
        ACTIVE.with(|active| active.borrow_mut().push(counts.clone()));
        Self { counts }
    }

    /// The calls counted so far, by kind (kinds never issued are absent).
    pub fn counts(&self) -> BTreeMap<OpKind, usize> {
        self.counts.borrow().clone()
    }

    /// How many calls of this kind were counted.
    pub fn count(&self, op: OpKind) -> usize {
        self.counts.borrow().get(&op).copied().unwrap_or(0)
    }

    /// How many calls were counted in all.
    pub fn total(&self) -> usize {
        self.counts.borrow().values().sum()
    }

    /// Forgets the calls counted so far.
    pub fn reset(&self) {
        self.counts.borrow_mut().clear();
    }
}

impl Drop for CommCounter {
    fn drop(&mut self) {
        ACTIVE.with(|active| {
            active
                .borrow_mut()
                .retain(|counts| !Rc::ptr_eq(counts, &self.counts))
        });
    }
}
