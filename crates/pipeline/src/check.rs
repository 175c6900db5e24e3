//! The static checker: a schedule is verified before it runs, and a bad one is rejected with
//! the offending actions named.
//!
//! Checks, in order:
//! 1. *Shape*: one action list per rank; micro-batch and chunk indices in range; each send or
//!    receive names the rank that really holds the neighbouring stage.
//! 2. *Local order*, rank by rank: a forward comes after the receive (or local forward) of its
//!    input; a backward after its own forward and after the receive (or local backward) of
//!    its output gradient; a weight-gradient step after its input-gradient step; a send after
//!    the computation that produces what it sends. Nothing runs twice.
//! 3. *Completeness*: every (micro-batch, chunk) gets one forward and one backward (full, or
//!    input + weight).
//! 4. *Matching*: every send has exactly one receive on the destination, and every receive a
//!    send.
//! 5. *Deadlock freedom*: all ranks are simulated together — sends never block (as in
//!    `bonfire-comm`), a receive waits until its send has run. If every unfinished rank waits,
//!    the blocked receives and the cycle of ranks waiting on each other are reported.

use crate::schedule::{Action, Schedule, StageMap};
use std::collections::{HashMap, HashSet};
use std::fmt;

/// One problem found in a schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// The schedule has the wrong number of action lists.
    RankCount {
        /// Ranks of the stage map.
        expected: usize,
        /// Action lists in the schedule.
        found: usize,
    },
    /// An action that cannot be right on its own (index out of range, wrong peer, …).
    Invalid {
        /// The rank whose action list holds the action.
        rank: usize,
        /// Position of the action in that list.
        index: usize,
        /// The offending action.
        action: Action,
        /// What is wrong with it.
        why: String,
    },
    /// An action that runs before what it depends on, or runs twice.
    Order {
        /// The rank whose action list holds the action.
        rank: usize,
        /// Position of the action in that list.
        index: usize,
        /// The offending action.
        action: Action,
        /// What it should have come after, or that it already ran.
        why: String,
    },
    /// A (micro-batch, chunk) without its forward or backward.
    Missing {
        /// The rank that should run it.
        rank: usize,
        /// The missing computation, e.g. `Forward(mb=3, chunk=1)`.
        what: String,
    },
    /// A send that no receive takes.
    UnmatchedSend {
        /// The sending rank.
        rank: usize,
        /// Position of the action in that list.
        index: usize,
        /// The send.
        action: Action,
    },
    /// A receive that no send feeds.
    UnmatchedRecv {
        /// The receiving rank.
        rank: usize,
        /// Position of the action in that list.
        index: usize,
        /// The receive.
        action: Action,
    },
    /// Every unfinished rank waits on a receive: `blocked` lists them (rank, index, action),
    /// `cycle` the ranks that wait on each other in a ring (empty if none).
    Deadlock {
        /// Each waiting rank's blocked receive: (rank, index in its list, action).
        blocked: Vec<(usize, usize, Action)>,
        /// Ranks waiting on each other in a ring, in order (empty if none).
        cycle: Vec<usize>,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::RankCount { expected, found } => {
                write!(f, "{found} action lists for {expected} ranks")
            }
            Problem::Invalid {
                rank,
                index,
                action,
                why,
            } => {
                write!(f, "rank {rank} action #{index} {action}: {why}")
            }
            Problem::Order {
                rank,
                index,
                action,
                why,
            } => {
                write!(f, "rank {rank} action #{index} {action}: {why}")
            }
            Problem::Missing { rank, what } => write!(f, "rank {rank}: missing {what}"),
            Problem::UnmatchedSend {
                rank,
                index,
                action,
            } => {
                write!(
                    f,
                    "rank {rank} action #{index} {action}: no matching receive"
                )
            }
            Problem::UnmatchedRecv {
                rank,
                index,
                action,
            } => {
                write!(f, "rank {rank} action #{index} {action}: no matching send")
            }
            Problem::Deadlock { blocked, cycle } => {
                write!(f, "deadlock: ")?;
                for (i, (rank, index, action)) in blocked.iter().enumerate() {
                    if i > 0 {
                        write!(f, "; ")?;
                    }
                    write!(f, "rank {rank} waits at action #{index} {action}")?;
                }
                if !cycle.is_empty() {
                    let ring: Vec<String> = cycle.iter().map(|r| format!("rank {r}")).collect();
                    write!(f, " (cycle: {} -> {})", ring.join(" -> "), ring[0])?;
                }
                Ok(())
            }
        }
    }
}

/// A rejected schedule: every problem found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckError {
    /// The schedule's name.
    pub schedule: String,
    /// What is wrong, in the order found.
    pub problems: Vec<Problem>,
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "schedule `{}` rejected:", self.schedule)?;
        for p in &self.problems {
            write!(f, "\n  - {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for CheckError {}

/// The identity of a message: (is gradient, micro-batch, destination stage).
type MsgKey = (bool, usize, usize);

/// The message a send or receive carries, if it is one.
fn message(schedule: &Schedule, rank: usize, a: &Action) -> Option<(MsgKey, usize, bool)> {
    let pl = &schedule.stage_map;
    let stage = |c| pl.stage(rank, c);
    // (key, peer, is_send)
    match *a {
        Action::SendActivation { mb, chunk, to } => Some(((false, mb, stage(chunk) + 1), to, true)),
        Action::RecvActivation { mb, chunk, from } => {
            Some(((false, mb, stage(chunk)), from, false))
        }
        Action::SendGrad { mb, chunk, to } => {
            Some(((true, mb, stage(chunk).wrapping_sub(1)), to, true))
        }
        Action::RecvGrad { mb, chunk, from } => Some(((true, mb, stage(chunk)), from, false)),
        _ => None,
    }
}

/// Checks `schedule`; `Ok(())` if it is complete, consistent and deadlock-free.
pub fn check(schedule: &Schedule) -> Result<(), CheckError> {
    let fail = |problems: Vec<Problem>| {
        Err(CheckError {
            schedule: schedule.name.clone(),
            problems,
        })
    };
    let p = schedule.stage_map.ranks();
    if schedule.actions.len() != p {
        return fail(vec![Problem::RankCount {
            expected: p,
            found: schedule.actions.len(),
        }]);
    }

    // 1. Shape.
    let problems = shape_problems(schedule);
    if !problems.is_empty() {
        return fail(problems);
    }

    // 2. Local order and 3. completeness.
    let mut problems = Vec::new();
    for (rank, list) in schedule.actions.iter().enumerate() {
        let seen = order_problems(schedule.stage_map, rank, list, &mut problems);
        completeness_problems(schedule, rank, list, &seen, &mut problems);
    }

    // 4. Matching sends and receives.
    problems.extend(unmatched_messages(schedule));
    if !problems.is_empty() {
        return fail(problems);
    }

    // 5. Deadlock freedom.
    match deadlock(schedule) {
        None => Ok(()),
        Some(problem) => fail(vec![problem]),
    }
}

/// Check 1: every action whose indices are out of range or whose peer is not the neighbouring
/// stage's rank.
fn shape_problems(schedule: &Schedule) -> Vec<Problem> {
    let mut problems = Vec::new();
    for (rank, list) in schedule.actions.iter().enumerate() {
        for (index, a) in list.iter().enumerate() {
            if let Some(why) = shape_problem(schedule, rank, a) {
                problems.push(Problem::Invalid {
                    rank,
                    index,
                    action: *a,
                    why,
                });
            }
        }
    }
    problems
}

/// Why action `a` on `rank` is invalid on its own (indices out of range, wrong peer), if it is.
fn shape_problem(schedule: &Schedule, rank: usize, a: &Action) -> Option<String> {
    let pl = schedule.stage_map;
    let (v, stages, m) = (pl.chunks(), pl.stages(), schedule.microbatches);
    if a.mb() >= m {
        return Some(format!("micro-batch out of range (m = {m})"));
    }
    if a.chunk() >= v {
        return Some(format!("chunk out of range (v = {v})"));
    }
    let s = pl.stage(rank, a.chunk());
    let neighbour = |next: bool| {
        let t = if next { s + 1 } else { s.checked_sub(1)? };
        (t < stages).then(|| pl.locate(t).0)
    };
    let (peer, expected, what) = match *a {
        Action::SendActivation { to, .. } => (to, neighbour(true), "next"),
        Action::RecvActivation { from, .. } => (from, neighbour(false), "previous"),
        Action::SendGrad { to, .. } => (to, neighbour(false), "previous"),
        Action::RecvGrad { from, .. } => (from, neighbour(true), "next"),
        _ => return None,
    };
    match expected {
        None => Some(format!("stage {s} has no {what} stage")),
        Some(e) if e == rank => Some(format!(
            "the {what} stage is on this rank: data passes locally, no message"
        )),
        Some(e) if e != peer => Some(format!("the {what} stage lives on rank {e}, not {peer}")),
        Some(_) => None,
    }
}

/// Check 2 for one rank: pushes every action of `list` that runs before what it depends on,
/// or twice; returns the set of actions the rank runs.
fn order_problems(
    pl: StageMap,
    rank: usize,
    list: &[Action],
    problems: &mut Vec<Problem>,
) -> HashSet<Action> {
    let mut seen: HashSet<Action> = HashSet::new();
    for (index, a) in list.iter().enumerate() {
        if let Some(why) = order_problem(pl, rank, &seen, a) {
            problems.push(Problem::Order {
                rank,
                index,
                action: *a,
                why,
            });
        }
        seen.insert(*a);
    }
    seen
}

/// Whether the backward (full or input) of `(mb, chunk)` is among the actions already `seen`.
fn backward_done(seen: &HashSet<Action>, mb: usize, chunk: usize) -> bool {
    seen.contains(&Action::Backward { mb, chunk })
        || seen.contains(&Action::BackwardInput { mb, chunk })
}

/// Why action `a` on `rank` cannot run after the actions already `seen`, if it cannot.
fn order_problem(pl: StageMap, rank: usize, seen: &HashSet<Action>, a: &Action) -> Option<String> {
    if seen.contains(a) {
        return Some("runs twice".to_string());
    }
    let (mb, chunk) = (a.mb(), a.chunk());
    match *a {
        Action::Forward { .. } => forward_order(pl, rank, seen, mb, chunk),
        Action::Backward { .. } | Action::BackwardInput { .. } => backward_order(pl, rank, seen, a),
        Action::BackwardWeight { .. } if !seen.contains(&Action::BackwardInput { mb, chunk }) => {
            Some(format!("runs before BackwardInput(mb={mb}, chunk={chunk})"))
        }
        Action::SendActivation { .. } if !seen.contains(&Action::Forward { mb, chunk }) => {
            Some(format!("sends before Forward(mb={mb}, chunk={chunk}) ran"))
        }
        Action::SendGrad { .. } if !backward_done(seen, mb, chunk) => Some(format!(
            "sends before the backward of (mb={mb}, chunk={chunk}) ran"
        )),
        _ => None,
    }
}

/// Why `Forward(mb, chunk)` on `rank` cannot run yet: its input (the previous stage's forward
/// here, or the receive of its activation) has not come.
fn forward_order(
    pl: StageMap,
    rank: usize,
    seen: &HashSet<Action>,
    mb: usize,
    chunk: usize,
) -> Option<String> {
    let s = pl.stage(rank, chunk);
    if s == 0 {
        return None;
    }
    let (prev_rank, prev_chunk) = pl.locate(s - 1);
    if prev_rank == rank {
        let feed = Action::Forward {
            mb,
            chunk: prev_chunk,
        };
        (!seen.contains(&feed))
            .then(|| format!("runs before Forward(mb={mb}, chunk={prev_chunk}) that feeds it"))
    } else {
        let feed = Action::RecvActivation {
            mb,
            chunk,
            from: prev_rank,
        };
        (!seen.contains(&feed)).then(|| {
            format!(
                "runs before RecvActivation(mb={mb}, chunk={chunk}, from={prev_rank}) of its input"
            )
        })
    }
}

/// Why the backward `a` (full or input) on `rank` cannot run yet: its forward, or its output
/// gradient (the next stage's backward here, or its receive) has not come, or the other kind
/// of backward already ran.
fn backward_order(pl: StageMap, rank: usize, seen: &HashSet<Action>, a: &Action) -> Option<String> {
    let (mb, chunk) = (a.mb(), a.chunk());
    let other = match *a {
        Action::Backward { .. } => Action::BackwardInput { mb, chunk },
        _ => Action::Backward { mb, chunk },
    };
    if !seen.contains(&Action::Forward { mb, chunk }) {
        return Some(format!(
            "backward runs before Forward(mb={mb}, chunk={chunk})"
        ));
    }
    if seen.contains(&other) {
        return Some(format!("{other} already ran"));
    }
    let s = pl.stage(rank, chunk);
    if s + 1 >= pl.stages() {
        return None;
    }
    let (next_rank, next_chunk) = pl.locate(s + 1);
    if next_rank == rank {
        (!backward_done(seen, mb, next_chunk)).then(|| {
            format!("runs before the backward of (mb={mb}, chunk={next_chunk}) that feeds it")
        })
    } else {
        let feed = Action::RecvGrad {
            mb,
            chunk,
            from: next_rank,
        };
        (!seen.contains(&feed)).then(|| {
            format!(
                "runs before RecvGrad(mb={mb}, chunk={chunk}, from={next_rank}) of its output gradient"
            )
        })
    }
}

/// Check 3 for one rank: pushes every (micro-batch, chunk) whose forward or backward is
/// missing from `seen`, and every weight step after a full backward.
fn completeness_problems(
    schedule: &Schedule,
    rank: usize,
    list: &[Action],
    seen: &HashSet<Action>,
    problems: &mut Vec<Problem>,
) {
    let missing = |what: String| Problem::Missing { rank, what };
    for chunk in 0..schedule.stage_map.chunks() {
        for mb in 0..schedule.microbatches {
            if !seen.contains(&Action::Forward { mb, chunk }) {
                problems.push(missing(format!("Forward(mb={mb}, chunk={chunk})")));
            }
            let full = seen.contains(&Action::Backward { mb, chunk });
            let input = seen.contains(&Action::BackwardInput { mb, chunk });
            let weight = seen.contains(&Action::BackwardWeight { mb, chunk });
            if !full && !input {
                problems.push(missing(format!("the backward of (mb={mb}, chunk={chunk})")));
            } else if input && !weight {
                problems.push(missing(format!("BackwardWeight(mb={mb}, chunk={chunk})")));
            } else if full && weight {
                let action = Action::BackwardWeight { mb, chunk };
                problems.push(Problem::Order {
                    rank,
                    index: list.iter().position(|a| *a == action).unwrap_or(0),
                    action,
                    why: "the full Backward already computed the weight gradient".into(),
                });
            }
        }
    }
}

/// The messages of one direction, by (message, sender, receiver): (index, action) of each in
/// schedule order.
type Messages = HashMap<(MsgKey, usize, usize), Vec<(usize, Action)>>;

/// Every send and every receive of the schedule, by (message, sender, receiver).
fn messages(schedule: &Schedule) -> (Messages, Messages) {
    let mut sends: Messages = HashMap::new();
    let mut recvs: Messages = HashMap::new();
    for (rank, list) in schedule.actions.iter().enumerate() {
        for (index, a) in list.iter().enumerate() {
            if let Some((key, peer, is_send)) = message(schedule, rank, a) {
                if is_send {
                    sends
                        .entry((key, rank, peer))
                        .or_default()
                        .push((index, *a));
                } else {
                    recvs
                        .entry((key, peer, rank))
                        .or_default()
                        .push((index, *a));
                }
            }
        }
    }
    (sends, recvs)
}

/// Check 4: every send no receive takes and every receive no send feeds, by (rank, index).
fn unmatched_messages(schedule: &Schedule) -> Vec<Problem> {
    let (sends, recvs) = messages(schedule);
    let mut unmatched: Vec<Problem> = Vec::new();
    for (k, list) in &sends {
        let taken = recvs.get(k).map_or(0, Vec::len);
        for &(index, action) in list.iter().skip(taken) {
            unmatched.push(Problem::UnmatchedSend {
                rank: k.1,
                index,
                action,
            });
        }
    }
    for (k, list) in &recvs {
        let given = sends.get(k).map_or(0, Vec::len);
        for &(index, action) in list.iter().skip(given) {
            unmatched.push(Problem::UnmatchedRecv {
                rank: k.2,
                index,
                action,
            });
        }
    }
    unmatched.sort_by_key(|p| match p {
        Problem::UnmatchedSend { rank, index, .. } | Problem::UnmatchedRecv { rank, index, .. } => {
            (*rank, *index)
        }
        _ => (0, 0),
    });
    unmatched
}

/// Check 5: runs every rank together (sends are eager, receives wait for their send) and
/// reports the deadlock, if every unfinished rank ends up waiting.
fn deadlock(schedule: &Schedule) -> Option<Problem> {
    let blocked = blocked_actions(schedule);
    if blocked.is_empty() {
        return None;
    }
    let cycle = wait_cycle(schedule, &blocked);
    Some(Problem::Deadlock { blocked, cycle })
}

/// Simulates all ranks until none can progress; the (rank, index, action) each unfinished
/// rank is stuck at.
fn blocked_actions(schedule: &Schedule) -> Vec<(usize, usize, Action)> {
    let p = schedule.stage_map.ranks();
    let mut pc = vec![0usize; p];
    let mut posted: HashSet<(MsgKey, usize, usize)> = HashSet::new();
    loop {
        let mut progress = false;
        for (rank, pc) in pc.iter_mut().enumerate() {
            while let Some(a) = schedule.actions[rank].get(*pc) {
                if let Some((key, peer, is_send)) = message(schedule, rank, a) {
                    if is_send {
                        posted.insert((key, rank, peer));
                    } else if !posted.contains(&(key, peer, rank)) {
                        break;
                    }
                }
                *pc += 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    (0..p)
        .filter_map(|r| schedule.actions[r].get(pc[r]).map(|a| (r, pc[r], *a)))
        .collect()
}

/// The ring of ranks waiting on each other, found from the first blocked rank (empty if none).
fn wait_cycle(schedule: &Schedule, blocked: &[(usize, usize, Action)]) -> Vec<usize> {
    // Each blocked rank waits on exactly one peer: follow the pointers to find a ring.
    let waits_on: HashMap<usize, usize> = blocked
        .iter()
        .filter_map(|&(r, _, a)| message(schedule, r, &a).map(|(_, peer, _)| (r, peer)))
        .collect();
    let Some(&(start, _, _)) = blocked.first() else {
        return Vec::new();
    };
    let mut path = vec![start];
    let mut at = start;
    while let Some(&next) = waits_on.get(&at) {
        if let Some(pos) = path.iter().position(|&r| r == next) {
            return path[pos..].to_vec();
        }
        path.push(next);
        at = next;
    }
    Vec::new()
}
