//! Asynchronous work: handles to calls running on a group's communication thread.
//!
//! Collectives issued asynchronously run in issue order on one background thread per group
//! handle (like a NCCL stream), so they overlap the caller's computation while keeping the
//! order every rank must agree on. Blocking collectives first wait for queued ones, so mixing
//! the two forms never reorders calls.

use crate::{CommError, Result};
use std::cell::Cell;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Slot<T> {
    result: Mutex<Option<Result<T>>>,
    /// When the call finished (set with the result).
    finished: Mutex<Option<Instant>>,
    done: Condvar,
}

/// A handle to an asynchronous call. Dropping it does not cancel the call.
#[must_use = "a Work handle must be waited on to observe the result"]
pub struct Work<T> {
    slot: Arc<Slot<T>>,
}

/// The producer side of a [`Work`].
pub(crate) struct Completer<T> {
    slot: Arc<Slot<T>>,
}

impl<T> Work<T> {
    pub(crate) fn pair() -> (Work<T>, Completer<T>) {
        let slot = Arc::new(Slot {
            result: Mutex::new(None),
            finished: Mutex::new(None),
            done: Condvar::new(),
        });
        (Work { slot: slot.clone() }, Completer { slot })
    }

    /// A handle that is already complete.
    pub fn ready(result: Result<T>) -> Self {
        let (work, completer) = Self::pair();
        completer.complete(result);
        work
    }

    /// True once the call finished (successfully or not); never blocks.
    pub fn is_completed(&self) -> bool {
        self.lock().is_some()
    }

    /// Blocks until the call finishes and returns its result. The call itself is bounded by
    /// the group's timeout, so this returns too.
    pub fn wait(self) -> Result<T> {
        let start = Instant::now();
        let mut guard = self.lock();
        loop {
            if let Some(result) = guard.take() {
                crate::blocked::add(false, start.elapsed());
                return result;
            }
            guard = self
                .slot
                .done
                .wait(guard)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// [`Work::wait`], with the instant the call finished (which may be long before this
    /// returns: how much of a transfer a caller's computation hid).
    pub fn wait_timed(self) -> Result<(T, Instant)> {
        let slot = self.slot.clone();
        let value = self.wait()?;
        let finished = slot.finished.lock().unwrap_or_else(|e| e.into_inner());
        Ok((value, finished.unwrap_or_else(Instant::now)))
    }

    /// Like [`Work::wait`] but gives the handle back if the call is still running after `d`.
    pub fn wait_timeout(self, d: Duration) -> std::result::Result<Result<T>, Work<T>> {
        let start = Instant::now();
        let guard = self.lock();
        let (mut guard, _) = self
            .slot
            .done
            .wait_timeout_while(guard, d, |r| r.is_none())
            .unwrap_or_else(|e| e.into_inner());
        crate::blocked::add(false, start.elapsed());
        match guard.take() {
            Some(result) => Ok(result),
            None => {
                drop(guard);
                Err(self)
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Result<T>>> {
        self.slot.result.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T> Completer<T> {
    pub(crate) fn complete(self, result: Result<T>) {
        *self.slot.finished.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        *self.slot.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
        self.slot.done.notify_all();
    }
}

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    /// On a communication thread, the address of its executor's queue counter, so that a
    /// blocking call made from a queued job does not wait for the queue it is part of (but
    /// still waits for other groups' queues).
    static CURRENT_QUEUE: Cell<usize> = const { Cell::new(0) };
}

thread_local! {
    /// Set while [`overlapping`] runs its closure on this thread.
    static OVERLAPPING: Cell<bool> = const { Cell::new(false) };
}

/// True on a communication thread (one that runs queued asynchronous work) or inside
/// [`overlapping`].
///
/// Waits there never spin: such a thread exists to overlap computation on the caller's
/// threads, and a spinning waiter would take the core that computation needs.
pub(crate) fn on_comm_thread() -> bool {
    CURRENT_QUEUE.with(|q| q.get()) != 0 || OVERLAPPING.with(Cell::get)
}

/// Runs `f` as overlap work: the collectives it makes on this thread wait without spinning,
/// as on a communication thread. For a helper thread of one's own that communicates while
/// the rank's thread computes (ZeRO-3's prefetched gathers): with more threads than cores,
/// a helper spinning in a wait takes the core the computation needs.
pub fn overlapping<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERLAPPING.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERLAPPING.with(|o| o.replace(true)));
    f()
}

/// A lazily started background thread that runs jobs in submission order.
pub(crate) struct Executor {
    name: String,
    sender: Mutex<Option<mpsc::Sender<Job>>>,
    pending: Arc<(Mutex<usize>, Condvar)>,
}

impl Executor {
    pub(crate) fn new(name: String) -> Self {
        Self {
            name,
            sender: Mutex::new(None),
            pending: Arc::new((Mutex::new(0), Condvar::new())),
        }
    }

    /// Queues `f`; its result completes the returned handle. A panic in `f` becomes an error.
    pub(crate) fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let (work, completer) = Work::pair();
        let pending = self.pending.clone();
        *pending.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let name = self.name.clone();
        let job: Job = Box::new(move || {
            let result =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
                    Err(CommError::Backend {
                        backend: "executor",
                        message: format!("async job on {name} panicked: {}", panic_message(&panic)),
                    })
                });
            completer.complete(result);
            let (count, cv) = &*pending;
            *count.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
            cv.notify_all();
        });
        let mut sender = self.sender.lock().unwrap_or_else(|e| e.into_inner());
        let tx = sender.get_or_insert_with(|| self.spawn());
        if let Err(mpsc::SendError(job)) = tx.send(job) {
            // The thread is gone (it only exits when the sender is dropped): run inline.
            job();
        }
        work
    }

    fn queue_id(&self) -> usize {
        Arc::as_ptr(&self.pending) as usize
    }

    fn spawn(&self) -> mpsc::Sender<Job> {
        let (tx, rx) = mpsc::channel::<Job>();
        let queue = self.queue_id();
        std::thread::Builder::new()
            .name(self.name.clone())
            .spawn(move || {
                CURRENT_QUEUE.with(|q| q.set(queue));
                while let Ok(job) = rx.recv() {
                    job();
                }
            })
            .expect("failed to spawn a communication thread");
        tx
    }

    /// Waits until every queued job has finished (no-op on this executor's own thread).
    pub(crate) fn drain(&self) {
        if CURRENT_QUEUE.with(|q| q.get()) == self.queue_id() {
            return;
        }
        let (count, cv) = &*self.pending;
        let guard = count.lock().unwrap_or_else(|e| e.into_inner());
        let _guard = cv
            .wait_while(guard, |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
    }
}

/// Extracts a readable message from a panic payload.
pub fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::{on_comm_thread, overlapping};

    /// Inside `overlapping` the thread waits as a communication thread does (never
    /// spinning); the mark is the caller's again afterwards, nested or unwound by a panic.
    #[test]
    fn overlapping_marks_the_thread_for_its_closure_only() {
        assert!(!on_comm_thread());
        let inner = overlapping(|| {
            let nested = overlapping(on_comm_thread);
            (on_comm_thread(), nested)
        });
        assert_eq!(inner, (true, true));
        assert!(!on_comm_thread(), "the mark outlived its closure");
        let unwound = std::panic::catch_unwind(|| overlapping(|| panic!("inside")));
        assert!(unwound.is_err());
        assert!(!on_comm_thread(), "a panic left the mark set");
    }
}
