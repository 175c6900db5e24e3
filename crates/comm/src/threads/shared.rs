//! The state one in-process group shares between its member threads.

use super::barrier::{Barrier, WaitError};
use crate::backend::CallContext;
use crate::{CommError, Fingerprint};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

/// What a member publishes about the call it entered: its fingerprint and where its buffers
/// are. Peers read the buffers directly between the two barriers of the call.
#[derive(Clone, Copy)]
pub(crate) struct Slot {
    pub fp: Fingerprint,
    pub send: *const u8,
    pub recv: *mut u8,
    /// Uneven all-to-all counts (pointers into the caller's slices; `counts_len` entries).
    pub send_counts: *const usize,
    pub recv_counts: *const usize,
}

// SAFETY: the pointers are only dereferenced by peers while the owner is blocked inside the
// call that published them (between the entry and completion barriers).
unsafe impl Send for Slot {}

impl Slot {
    pub(crate) const EMPTY: Slot = Slot {
        fp: Fingerprint {
            seq: 0,
            op: crate::OpKind::Barrier,
            dtype: crate::DType::U8,
            count: 0,
            layout: 0,
            root: None,
            reduce_op: None,
            tag: None,
        },
        send: std::ptr::null(),
        recv: std::ptr::null_mut(),
        send_counts: std::ptr::null(),
        recv_counts: std::ptr::null(),
    };
}

/// A point-to-point message waiting for its receiver.
pub(crate) struct Message {
    pub fp: Fingerprint,
    pub data: Vec<u8>,
}

#[derive(Default)]
pub(crate) struct Mailbox {
    /// Queues keyed by (source, destination, tag), in group ranks.
    pub queues: HashMap<(usize, usize, u64), VecDeque<Message>>,
    /// Buffers of delivered messages, reused by later sends.
    pub pool: Vec<Vec<u8>>,
}

/// How many delivered message buffers are kept for reuse.
pub(crate) const POOL_LIMIT: usize = 16;

pub(crate) struct GroupShared {
    pub world: Arc<WorldState>,
    /// World rank of each member.
    pub members: Vec<usize>,
    pub slots: Vec<Mutex<Slot>>,
    pub entry: Barrier,
    aborted: Mutex<Option<String>>,
    pub mailbox: Mutex<Mailbox>,
    pub mail: Condvar,
    /// The survivors' agreement when the group is shrunk after a failure.
    pub agreement: Agreement,
}

impl GroupShared {
    pub(crate) fn new(world: Arc<WorldState>, members: Vec<usize>) -> Self {
        let n = members.len();
        Self {
            entry: Barrier::new(n, world.spin),
            world,
            slots: (0..n).map(|_| Mutex::new(Slot::EMPTY)).collect(),
            members,
            aborted: Mutex::new(None),
            mailbox: Mutex::new(Mailbox::default()),
            mail: Condvar::new(),
            agreement: Agreement::new(n),
        }
    }

    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    /// Wakes every waiter of this group so that it re-checks peers and the abort flag.
    pub(crate) fn alert(&self) {
        self.entry.alert();
        self.agreement.alert();
        let _mailbox = self.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        self.mail.notify_all();
    }

    pub(crate) fn aborted(&self) -> Option<String> {
        self.aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Marks the group unusable (first reason wins) and wakes every waiter.
    pub(crate) fn abort(&self, reason: String) {
        {
            let mut aborted = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
            if aborted.is_none() {
                *aborted = Some(reason);
            }
        }
        self.alert();
    }

    /// The error for the first of `members` that will never arrive, if any.
    pub(crate) fn failed_peer(
        &self,
        mut members: impl Iterator<Item = usize>,
        ctx: &CallContext<'_>,
    ) -> Option<CommError> {
        members.find_map(|m| {
            let world_rank = self.members[m];
            (self.world.status(world_rank) != RankStatus::Running)
                .then(|| ctx.peer_failed(m, self.world.reason(world_rank)))
        })
    }

    /// Waits at the entry barrier of a call as member `me`: every member has published its
    /// slot once this returns `Ok`. On timeout, failure or abort the arrival is withdrawn,
    /// the group is aborted and the error returned.
    pub(crate) fn enter(&self, me: usize, ctx: &CallContext<'_>) -> Result<(), CommError> {
        if let Some(reason) = self.aborted() {
            return Err(ctx.aborted(reason));
        }
        let started = Instant::now();
        let deadline = started + ctx.timeout;
        let waited = self.entry.wait(me, Some(deadline), |barrier| {
            if let Some(reason) = self.aborted() {
                return Err(ctx.aborted(reason));
            }
            match self.failed_peer(barrier.behind(me), ctx) {
                Some(e) => Err(e),
                None => Ok(()),
            }
        });
        match waited {
            Ok(()) => Ok(()),
            Err(WaitError::Stopped(e)) => {
                if !matches!(e, CommError::Aborted { .. }) {
                    self.abort(format!("rank {me} stopped in {}: {e}", ctx.fingerprint));
                }
                Err(e)
            }
            Err(WaitError::Timeout { missing }) => {
                let e = ctx.timeout_error(missing.clone(), started.elapsed());
                self.abort(format!(
                    "rank {me} timed out in {} waiting for ranks {missing:?}",
                    ctx.fingerprint
                ));
                Err(e)
            }
        }
    }

    /// Waits at the completion barrier: peers may still be reading this member's buffers, and
    /// that work is bounded, so there is no deadline; only a peer that died stops the wait.
    pub(crate) fn complete(&self, me: usize, ctx: &CallContext<'_>) -> Result<(), CommError> {
        let waited = self.entry.wait(me, None, |barrier| {
            match self.failed_peer(barrier.behind(me), ctx) {
                Some(e) => Err(e),
                None => Ok(()),
            }
        });
        match waited {
            Ok(()) => Ok(()),
            Err(WaitError::Stopped(e)) => {
                self.abort(format!("rank {me} lost a peer in {}: {e}", ctx.fingerprint));
                Err(e)
            }
            Err(WaitError::Timeout { .. }) => unreachable!("no deadline was given"),
        }
    }

    /// How long a sleeping receiver naps before re-checking peers and deadlines.
    pub(crate) const MAIL_POLL: Duration = Duration::from_millis(20);
}

/// What became of a rank thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RankStatus {
    Running = 0,
    /// Returned from its closure; it will take part in no further calls.
    Exited = 1,
    /// Panicked.
    Failed = 2,
}

/// Identifies a group: its members' world ranks and its creation index for that list.
type GroupKey = (Vec<usize>, u64);

pub(crate) struct WorldState {
    /// Whether waiters may spin: only when every rank thread can have a core of its own.
    pub(crate) spin: bool,
    pub(super) status: Vec<AtomicU8>,
    pub(super) reasons: Mutex<Vec<Option<String>>>,
    /// Shared state of every group, keyed by its world ranks and the creation index.
    pub(super) registry: Mutex<HashMap<GroupKey, Weak<GroupShared>>>,
    /// How many groups each world rank created with a given member list.
    pub(super) created: Mutex<HashMap<(usize, Vec<usize>), u64>>,
    /// Groups made by a shrink so far (their keys are apart from `new_group`'s).
    pub(super) fresh: AtomicU64,
    /// An injected failure: this world rank dies entering its n-th call (counted from 0).
    pub(super) fault: Option<(usize, u64)>,
    /// Calls (collectives, sends, receives, on any group and thread) each rank entered.
    pub(super) calls: Vec<AtomicU64>,
}

/// The state of one group's shrink.
pub(crate) struct Agreement {
    pub(super) state: Mutex<State>,
    pub(super) changed: Condvar,
}

pub(super) struct State {
    /// Members (group ranks) that called shrink.
    pub(super) joined: Vec<bool>,
    pub(super) decision: Option<Decision>,
}

#[derive(Clone)]
pub(super) enum Decision {
    Agreed {
        group: Arc<GroupShared>,
        survivors: Vec<usize>,
        failed: Vec<(usize, String)>,
    },
    /// No agreement: the message every caller gets.
    Failed(String),
}

/// The survivors' new group, who they are and who failed (group ranks of the old group).
pub(crate) type Agreed = (Arc<GroupShared>, Vec<usize>, Vec<(usize, String)>);
