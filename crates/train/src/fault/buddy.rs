//! The in-memory copy that lets survivors continue: after every step each rank exports what it
//! owns of the training state ([`Engine::save_state`], the checkpoint's export) and keeps it,
//! and hands a copy to its *buddy*, the previous rank in the ring — so rank r holds its own
//! state and rank r+1's. A step is committed once that exchange succeeded on every rank (its
//! last call is one collective: all ranks pass it or none does).
//!
//! After a failure the survivors pool their committed copies — their own, plus the buddy copy
//! of each dead rank — and every survivor takes from the pool what its new layout holds
//! ([`super::state::answer`]). Their live state is never used: a failure that struck after
//! some ranks stepped (ZeRO's parameter all-gather after the optimizer step, the exchange
//! itself) is rolled back to the last committed step on every rank alike. The state is lost
//! only when a rank and its buddy both die before the next commit (reported as such).

use super::state::{self, decode, encode, push_frame};
use crate::checkpoint::RankState;
use crate::engine::Engine;
use crate::error::TrainError;
use bonfire_comm::ProcessGroup;
use std::time::Instant;

/// What keeping the buddy copies cost this rank, measured (clock and byte counts): totals
/// over the run, and the last commit made with a buddy (the steady state of a step).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct BuddyCost {
    /// Commits made (one per step, plus one at the start and after each recovery).
    pub commits: usize,
    /// Seconds spent exporting this rank's state to the host and encoding it.
    pub export_s: f64,
    /// Seconds spent in the exchange with the buddy (two collectives).
    pub exchange_s: f64,
    /// Bytes this rank sent to its buddy, over all commits.
    pub bytes_sent: u64,
    /// Bytes held now: this rank's own copy and its buddy's.
    pub bytes_held: u64,
    /// The last commit made in a group of two or more ranks.
    pub last: CommitCost,
}

/// One commit's cost on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct CommitCost {
    /// Seconds spent exporting this rank's state to the host and encoding it.
    pub export_s: f64,
    /// Seconds spent in the exchange with the buddy (two collectives).
    pub exchange_s: f64,
    /// Bytes this rank sent to its buddy (0 in a group of one).
    pub bytes_sent: u64,
    /// Its own copy and its buddy's, after the commit.
    pub bytes_held: u64,
}

/// A rank's committed copies: its own state and its buddy's, as of `step`.
pub(crate) struct Snapshot {
    /// The step the copies are the state before (the next step to run).
    pub step: usize,
    /// World ranks of the group the copies were taken in, in its order.
    pub members: Vec<usize>,
    /// Whether each member's own copy holds any slice (DDP: only dp rank 0's does).
    holds: Vec<bool>,
    /// This rank's position in `members`.
    me: usize,
    own: Vec<u8>,
    /// `members[me + 1]`'s own copy (none in a group of one).
    buddy: Option<Vec<u8>>,
    pub cost: BuddyCost,
}

impl Snapshot {
    /// Exports `engine`'s state as of `step` and exchanges it with the buddy in `group` (the
    /// engine's world). A collective.
    pub fn take<B>(
        engine: &mut dyn Engine<B>,
        group: &ProcessGroup,
        step: usize,
        mut cost: BuddyCost,
    ) -> Result<Self, TrainError> {
        let started = Instant::now();
        let mine = engine.save_state()?;
        let own = encode(&mine);
        let export_s = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let (n, me) = (group.size(), group.rank());
        let mut sizes = vec![0i64; 2 * n];
        let said = [own.len() as i64, i64::from(!mine.slices.is_empty())];
        group.all_gather(&said, &mut sizes)?;
        let buddy = match n {
            1 => None,
            _ => {
                let (to, from) = ((me + n - 1) % n, (me + 1) % n);
                let mut send_counts = vec![0; n];
                send_counts[to] = own.len();
                let mut recv_counts = vec![0; n];
                recv_counts[from] = sizes[2 * from] as usize;
                let mut recv = vec![0u8; recv_counts[from]];
                group.all_to_all_uneven(&own, &send_counts, &mut recv, &recv_counts)?;
                Some(recv)
            }
        };
        let this = CommitCost {
            export_s,
            exchange_s: started.elapsed().as_secs_f64(),
            bytes_sent: if n > 1 { own.len() as u64 } else { 0 },
            bytes_held: (own.len() + buddy.as_ref().map_or(0, Vec::len)) as u64,
        };
        cost.commits += 1;
        cost.export_s += this.export_s;
        cost.exchange_s += this.exchange_s;
        cost.bytes_sent += this.bytes_sent;
        cost.bytes_held = this.bytes_held;
        if n > 1 {
            cost.last = this;
        }
        Ok(Self {
            step,
            members: group.world_ranks(),
            holds: (0..n).map(|r| sizes[2 * r + 1] != 0).collect(),
            me,
            own,
            buddy,
            cost,
        })
    }

    /// The members (world ranks) of the commit's group that are not in `alive`, and a clear
    /// error if the state of one of them is lost: it held some and its buddy died too. Every
    /// survivor computes the same answer from the same agreement.
    pub fn check_recoverable(&self, alive: &[usize]) -> Result<Vec<usize>, TrainError> {
        let n = self.members.len();
        let dead: Vec<usize> = (0..n)
            .filter(|&i| !alive.contains(&self.members[i]))
            .collect();
        for &i in &dead {
            let holder = (i + n - 1) % n;
            if self.holds[i] && (n == 1 || dead.contains(&holder)) {
                return Err(TrainError::Io(format!(
                    "fault tolerance: rank {} and rank {}, which kept the copy of its state, \
                     both failed before the next commit: that state exists nowhere now \
                     (resume from a checkpoint)",
                    self.members[i], self.members[holder]
                )));
            }
        }
        Ok(dead.iter().map(|&i| self.members[i]).collect())
    }

    /// What this rank brings to the pool: its own copy, and its buddy's when the buddy died.
    fn contribution(&self, alive: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        push_frame(&mut out, &self.own);
        let n = self.members.len();
        let next = self.members[(self.me + 1) % n];
        if let Some(buddy) = self.buddy.as_ref().filter(|_| !alive.contains(&next)) {
            push_frame(&mut out, buddy);
        }
        out
    }

    /// Every survivor's contribution, gathered over `group` (the survivors) and decoded: the
    /// whole committed state. A collective; returns the states and the bytes received.
    pub fn pool(&self, group: &ProcessGroup) -> Result<(Vec<RankState>, u64), TrainError> {
        let mine = self.contribution(&group.world_ranks());
        let mut lens = vec![0i64; group.size()];
        group.all_gather(&[mine.len() as i64], &mut lens)?;
        let counts: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
        let mut all = vec![0u8; counts.iter().sum()];
        group.all_gather_uneven(&mine, &mut all, &counts)?;
        let states = state::frames(&all)?
            .into_iter()
            .map(decode)
            .collect::<Result<Vec<_>, _>>()?;
        Ok((states, all.len() as u64))
    }
}
