//! Time the calling thread spent blocked in communication — in blocking collectives, in
//! point-to-point sends and receives, and waiting on asynchronous handles — summed per thread
//! (a rank's thread) until [`take`]n: where a training step's time goes besides computing
//! (`bonfire_train`'s step phases, `cargo xtask bench profile --layouts`). Calls that run on a
//! group's communication thread count only where a rank waits for them.

use std::cell::Cell;
use std::time::Duration;

/// Blocked time of one thread, by kind of call.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Blocked {
    /// In collectives (blocking ones, and waits on asynchronous handles: an async
    /// all-reduce's exposed part, ring attention's shifts).
    pub collective: Duration,
    /// In blocking point-to-point sends and receives (a pipeline's activations and
    /// gradients: their transfer and the wait for the peer, i.e. the bubble).
    pub p2p: Duration,
}

thread_local! {
    static BLOCKED: Cell<Blocked> = Cell::new(Blocked::default());
}

/// Adds `d` to this thread's blocked time (`p2p`: a point-to-point call).
pub(crate) fn add(p2p: bool, d: Duration) {
    BLOCKED.with(|b| {
        let mut v = b.get();
        match p2p {
            true => v.p2p += d,
            false => v.collective += d,
        }
        b.set(v);
    });
}

/// This thread's blocked time since the last call, and starts counting again.
pub fn take() -> Blocked {
    BLOCKED.with(|b| b.replace(Blocked::default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_thread_and_resets() {
        take();
        add(false, Duration::from_millis(3));
        add(true, Duration::from_millis(2));
        add(false, Duration::from_millis(1));
        std::thread::spawn(|| add(false, Duration::from_secs(1)))
            .join()
            .unwrap();
        let b = take();
        assert_eq!(b.collective, Duration::from_millis(4));
        assert_eq!(b.p2p, Duration::from_millis(2));
        assert_eq!(take(), Blocked::default());
    }
}
