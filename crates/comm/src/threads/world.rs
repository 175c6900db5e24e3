//! State shared by every rank thread of one in-process world: which ranks are alive, and the
//! registry through which members of a new sub-group find its shared state.

use super::shared::{GroupShared, RankStatus, WorldState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

impl WorldState {
    /// A world where `fault` = (world rank, call) dies entering that call.
    pub(crate) fn with_fault(size: usize, fault: Option<(usize, u64)>) -> Arc<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Arc::new(Self {
            spin: size <= cores,
            status: (0..size)
                .map(|_| AtomicU8::new(RankStatus::Running as u8))
                .collect(),
            reasons: Mutex::new(vec![None; size]),
            registry: Mutex::new(HashMap::new()),
            created: Mutex::new(HashMap::new()),
            fresh: AtomicU64::new(0),
            fault,
            calls: (0..size).map(|_| AtomicU64::new(0)).collect(),
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

    /// Counts a call `world_rank` enters; when it is the injected failure's, the rank dies
    /// there: marked failed (its peers stop waiting for it at once) and the call fails.
    pub(crate) fn enter_call(&self, world_rank: usize) -> Result<(), crate::CommError> {
        let n = self.calls[world_rank].fetch_add(1, Ordering::SeqCst);
        if self.fault != Some((world_rank, n)) {
            return Ok(());
        }
        let message = format!("injected failure: rank {world_rank} died entering its call #{n}");
        self.set_status(world_rank, RankStatus::Failed, Some(message.clone()));
        Err(crate::CommError::Backend {
            backend: "threads",
            message,
        })
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

    /// A new group of these world ranks that no `join_group` can reach (the decision of a
    /// shrink hands it to the survivors), registered so that failures alert it.
    pub(crate) fn fresh_group(self: &Arc<Self>, members: Vec<usize>) -> Arc<GroupShared> {
        let n = self.fresh.fetch_add(1, Ordering::SeqCst);
        let group = Arc::new(GroupShared::new(self.clone(), members.clone()));
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        registry.insert((members, (1 << 63) | n), Arc::downgrade(&group));
        group
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
