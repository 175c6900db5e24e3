//! The threads backend's shrink: the survivors of a group agree on who is alive through one
//! decision in shared memory, made once by whichever caller first sees that every member has
//! either joined or died (or that the timeout passed), and read by every other caller. The
//! decision names the survivors and holds the fresh group they continue on, so every survivor
//! gets the same list and the same group (the contract is in [`crate::shrink`]).

use super::shared::{Agreed, Agreement, Decision, GroupShared, RankStatus, State};
use crate::CommError;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How often a caller waiting for the agreement re-checks its peers.
const POLL: Duration = Duration::from_millis(20);

impl Agreement {
    pub(crate) fn new(size: usize) -> Self {
        Self {
            state: Mutex::new(State {
                joined: vec![false; size],
                decision: None,
            }),
            changed: Condvar::new(),
        }
    }

    /// Wakes the callers waiting for the agreement (a member failed).
    pub(crate) fn alert(&self) {
        let _state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.changed.notify_all();
    }
}

impl GroupShared {
    fn alive(&self, member: usize) -> bool {
        self.world.status(self.members[member]) == RankStatus::Running
    }

    /// Member `me` joins the shrink of this group and waits (at most `timeout`) for the
    /// decision. `group` names the group in errors.
    pub(crate) fn shrink(
        &self,
        me: usize,
        group: &str,
        timeout: Duration,
    ) -> Result<Agreed, CommError> {
        // The group is over for this rank: a peer still blocked on it must not wait for it.
        self.abort(format!(
            "rank {me} left it to shrink the group after a failure"
        ));
        let invalid = |message: String| CommError::InvalidGroup {
            group: group.to_string(),
            message,
        };
        if !self.alive(me) {
            return Err(invalid(format!(
                "rank {me} itself failed ({}): it is not among the survivors",
                self.world.reason(self.members[me])
            )));
        }
        let deadline = Instant::now() + timeout;
        let agreement = &self.agreement;
        let mut state = agreement.state.lock().unwrap_or_else(|e| e.into_inner());
        if std::mem::replace(&mut state.joined[me], true) {
            return Err(invalid(format!(
                "rank {me} shrank this group already; shrink the group it got instead"
            )));
        }
        agreement.changed.notify_all();
        let decision = loop {
            if let Some(decision) = &state.decision {
                break decision.clone();
            }
            let missing: Vec<usize> = (0..self.size())
                .filter(|&m| !state.joined[m] && self.alive(m))
                .collect();
            let now = Instant::now();
            if missing.is_empty() || now >= deadline {
                let decision = self.decide(&state.joined, &missing, timeout);
                state.decision = Some(decision.clone());
                agreement.changed.notify_all();
                break decision;
            }
            state = agreement
                .changed
                .wait_timeout(state, POLL.min(deadline - now))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        match decision {
            Decision::Agreed {
                group: shared,
                survivors,
                failed,
            } if survivors.contains(&me) => Ok((shared, survivors, failed)),
            Decision::Agreed { survivors, .. } => Err(invalid(format!(
                "rank {me} joined the shrink after the survivors {survivors:?} agreed without it"
            ))),
            Decision::Failed(message) => Err(invalid(message)),
        }
    }

    /// The decision once every member joined or died (`missing` empty), or at the deadline.
    fn decide(&self, joined: &[bool], missing: &[usize], timeout: Duration) -> Decision {
        if !missing.is_empty() {
            return Decision::Failed(format!(
                "the survivors could not agree within {timeout:?}: ranks {missing:?} are alive \
                 but did not join the shrink (a live rank is never dropped; check what they \
                 are blocked on)"
            ));
        }
        let survivors: Vec<usize> = (0..self.size())
            .filter(|&m| joined[m] && self.alive(m))
            .collect();
        let failed = (0..self.size())
            .filter(|m| !survivors.contains(m))
            .map(|m| (m, self.world.reason(self.members[m])))
            .collect();
        let members = survivors.iter().map(|&m| self.members[m]).collect();
        Decision::Agreed {
            group: self.world.fresh_group(members),
            survivors,
            failed,
        }
    }
}
