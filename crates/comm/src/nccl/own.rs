//! [`OwnMailbox`]: point-to-point messages a rank sends to itself. NCCL refuses a send to the
//! own rank without the matching receive in the same group call ("Trying to send to self
//! without a matching recv", seen on an H200 with NCCL 2.28), while Bonfire's `send` returns
//! before the receive is posted, as on the other backends. So a message to self never reaches
//! NCCL: its bytes wait here, host-side, until a receive whose description matches takes them
//! (by tag, in any order, within the call's timeout).

use crate::backend::CallContext;
use crate::{Fingerprint, Result};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// Messages sent to self and not yet received, in the order sent.
#[derive(Default)]
pub(super) struct OwnMailbox {
    waiting: Mutex<Vec<(Fingerprint, Vec<u8>)>>,
    arrived: Condvar,
}

impl OwnMailbox {
    /// Leaves `bytes`, sent under `ctx`'s description, for the receive that matches it.
    pub(super) fn post(&self, ctx: &CallContext<'_>, bytes: Vec<u8>) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.push((ctx.fingerprint, bytes));
        self.arrived.notify_all();
    }

    /// The first message whose description matches `ctx`'s, waiting for it up to the call's
    /// timeout (then the group's timeout error, naming this rank as the one missing).
    pub(super) fn take(&self, ctx: &CallContext<'_>) -> Result<Vec<u8>> {
        let started = Instant::now();
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(at) = waiting
                .iter()
                .position(|(sent, _)| sent.matches(&ctx.fingerprint))
            {
                return Ok(waiting.remove(at).1);
            }
            let left = ctx.timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(ctx.timeout_error(vec![ctx.rank], started.elapsed()));
            }
            waiting = self
                .arrived
                .wait_timeout(waiting, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CommError, DType, FlightRecorder, OpKind};
    use std::time::Duration;

    fn ctx<'a>(recorder: &'a FlightRecorder, op: OpKind, tag: u64) -> CallContext<'a> {
        CallContext {
            fingerprint: Fingerprint {
                seq: 0,
                op,
                dtype: DType::F32,
                count: 2,
                layout: 0,
                root: None,
                reduce_op: None,
                tag: Some(tag),
            },
            timeout: Duration::from_millis(50),
            group: "test",
            rank: 0,
            recorder,
        }
    }

    #[test]
    fn nccl_own_messages_are_taken_by_tag_in_any_order_and_time_out_alone() {
        let recorder = FlightRecorder::default();
        let own = OwnMailbox::default();
        own.post(&ctx(&recorder, OpKind::Send, 7), vec![7; 8]);
        own.post(&ctx(&recorder, OpKind::Send, 9), vec![9; 8]);
        assert_eq!(own.take(&ctx(&recorder, OpKind::Recv, 9)).unwrap(), [9; 8]);
        assert_eq!(own.take(&ctx(&recorder, OpKind::Recv, 7)).unwrap(), [7; 8]);
        // Nothing left: the receive waits its timeout, then fails as a timeout.
        let err = own.take(&ctx(&recorder, OpKind::Recv, 7)).unwrap_err();
        assert!(matches!(err, CommError::Timeout { .. }), "{err}");
        // A receive waiting when the send arrives from another thread gets it.
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(10));
                own.post(&ctx(&recorder, OpKind::Send, 3), vec![3; 8]);
            });
            assert_eq!(own.take(&ctx(&recorder, OpKind::Recv, 3)).unwrap(), [3; 8]);
        });
    }
}
