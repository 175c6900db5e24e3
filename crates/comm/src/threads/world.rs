//! State shared by every rank thread of one in-process world: which ranks are alive, and the
//! registry through which members of a new sub-group find its shared state.

use super::shared::GroupShared;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Weak};

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
    status: Vec<AtomicU8>,
    reasons: Mutex<Vec<Option<String>>>,
    /// Shared state of every group, keyed by its world ranks and the creation index.
    registry: Mutex<HashMap<GroupKey, Weak<GroupShared>>>,
    /// How many groups each world rank created with a given member list.
    created: Mutex<HashMap<(usize, Vec<usize>), u64>>,
}

impl WorldState {
    pub(crate) fn new(size: usize) -> Arc<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Arc::new(Self {
            spin: size <= cores,
            status: (0..size)
                .map(|_| AtomicU8::new(RankStatus::Running as u8))
                .collect(),
            reasons: Mutex::new(vec![None; size]),
            registry: Mutex::new(HashMap::new()),
            created: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn status(&self, world_rank: usize) -> RankStatus {
        match self.status[world_rank].load(Ordering::SeqCst) {
            0 => RankStatus::Running,
            1 => RankStatus::Exited,
            _ => RankStatus::Failed,
        }
    }

    /// Why `world_rank` stopped, for error messages.
    pub(crate) fn reason(&self, world_rank: usize) -> String {
        let reasons = self.reasons.lock().unwrap_or_else(|e| e.into_inner());
        match (self.status(world_rank), &reasons[world_rank]) {
            (_, Some(reason)) => reason.clone(),
            (RankStatus::Exited, None) => "it returned without making this call".into(),
            (status, None) => format!("{status:?}"),
        }
    }

    /// Records that a rank thread ended and wakes every waiter so that peers stop waiting
    /// for it.
    pub(crate) fn set_status(&self, world_rank: usize, status: RankStatus, reason: Option<String>) {
        self.reasons.lock().unwrap_or_else(|e| e.into_inner())[world_rank] = reason;
        self.status[world_rank].store(status as u8, Ordering::SeqCst);
        let groups: Vec<Arc<GroupShared>> = self
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for group in groups {
            group.alert();
        }
    }

    /// The shared state of the group with these world ranks, as seen by member `me`:
    /// the n-th group `me` creates with a member list is the n-th every member creates.
    pub(crate) fn join_group(self: &Arc<Self>, me: usize, members: Vec<usize>) -> Arc<GroupShared> {
        let index = {
            let mut created = self.created.lock().unwrap_or_else(|e| e.into_inner());
            let n = created.entry((me, members.clone())).or_insert(0);
            *n += 1;
            *n - 1
        };
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let key = (members, index);
        if let Some(group) = registry.get(&key).and_then(Weak::upgrade) {
            return group;
        }
        let group = Arc::new(GroupShared::new(self.clone(), key.0.clone()));
        registry.insert(key, Arc::downgrade(&group));
        group
    }
}
