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

use crate::schedule::{Action, Schedule};
use std::collections::{HashMap, HashSet};
use std::fmt;

/// One problem found in a schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// The schedule has the wrong number of action lists.
    RankCount { expected: usize, found: usize },
    /// An action that cannot be right on its own (index out of range, wrong peer, …).
    Invalid {
        rank: usize,
        index: usize,
        action: Action,
        why: String,
    },
    /// An action that runs before what it depends on, or runs twice.
    Order {
        rank: usize,
        index: usize,
        action: Action,
        why: String,
    },
    /// A (micro-batch, chunk) without its forward or backward.
    Missing { rank: usize, what: String },
    /// A send that no receive takes.
    UnmatchedSend {
        rank: usize,
        index: usize,
        action: Action,
    },
    /// A receive that no send feeds.
    UnmatchedRecv {
        rank: usize,
        index: usize,
        action: Action,
    },
    /// Every unfinished rank waits on a receive: `blocked` lists them (rank, index, action),
    /// `cycle` the ranks that wait on each other in a ring (empty if none).
    Deadlock {
        blocked: Vec<(usize, usize, Action)>,
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
    let mut problems = Vec::new();
    let pl = schedule.stage_map;
    let (p, v, stages, m) = (pl.ranks(), pl.chunks(), pl.stages(), schedule.microbatches);
    let fail = |problems: Vec<Problem>| {
        Err(CheckError {
            schedule: schedule.name.clone(),
            problems,
        })
    };
    if schedule.actions.len() != p {
        return fail(vec![Problem::RankCount {
            expected: p,
            found: schedule.actions.len(),
        }]);
    }

    // 1. Shape.
    for (rank, list) in schedule.actions.iter().enumerate() {
        for (index, a) in list.iter().enumerate() {
            let mut invalid = |why: String| {
                problems.push(Problem::Invalid {
                    rank,
                    index,
                    action: *a,
                    why,
                })
            };
            if a.mb() >= m {
                invalid(format!("micro-batch out of range (m = {m})"));
                continue;
            }
            if a.chunk() >= v {
                invalid(format!("chunk out of range (v = {v})"));
                continue;
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
                _ => continue,
            };
            match expected {
                None => invalid(format!("stage {s} has no {what} stage")),
                Some(e) if e == rank => invalid(format!(
                    "the {what} stage is on this rank: data passes locally, no message"
                )),
                Some(e) if e != peer => {
                    invalid(format!("the {what} stage lives on rank {e}, not {peer}"))
                }
                Some(_) => {}
            }
        }
    }
    if !problems.is_empty() {
        return fail(problems);
    }

    // 2. Local order and 3. completeness.
    for (rank, list) in schedule.actions.iter().enumerate() {
        let mut seen: HashSet<Action> = HashSet::new();
        let has = |seen: &HashSet<Action>, a: Action| seen.contains(&a);
        for (index, a) in list.iter().enumerate() {
            let (mb, chunk) = (a.mb(), a.chunk());
            let s = pl.stage(rank, chunk);
            let backward_done = |seen: &HashSet<Action>, c: usize| {
                has(seen, Action::Backward { mb, chunk: c })
                    || has(seen, Action::BackwardInput { mb, chunk: c })
            };
            let mut why = None;
            if seen.contains(a) {
                why = Some("runs twice".to_string());
            }
            match *a {
                Action::Forward { .. } if why.is_none() && s > 0 => {
                    let (prev_rank, prev_chunk) = pl.locate(s - 1);
                    let ok = if prev_rank == rank {
                        has(
                            &seen,
                            Action::Forward {
                                mb,
                                chunk: prev_chunk,
                            },
                        )
                    } else {
                        has(
                            &seen,
                            Action::RecvActivation {
                                mb,
                                chunk,
                                from: prev_rank,
                            },
                        )
                    };
                    if !ok {
                        why = Some(if prev_rank == rank {
                            format!(
                                "runs before Forward(mb={mb}, chunk={prev_chunk}) that feeds it"
                            )
                        } else {
                            format!(
                                "runs before RecvActivation(mb={mb}, chunk={chunk}, from={prev_rank}) of its input"
                            )
                        });
                    }
                }
                Action::Backward { .. } | Action::BackwardInput { .. } if why.is_none() => {
                    let other = match *a {
                        Action::Backward { .. } => Action::BackwardInput { mb, chunk },
                        _ => Action::Backward { mb, chunk },
                    };
                    if !has(&seen, Action::Forward { mb, chunk }) {
                        why = Some(format!(
                            "backward runs before Forward(mb={mb}, chunk={chunk})"
                        ));
                    } else if has(&seen, other) {
                        why = Some(format!("{other} already ran"));
                    } else if s + 1 < stages {
                        let (next_rank, next_chunk) = pl.locate(s + 1);
                        let ok = if next_rank == rank {
                            backward_done(&seen, next_chunk)
                        } else {
                            has(
                                &seen,
                                Action::RecvGrad {
                                    mb,
                                    chunk,
                                    from: next_rank,
                                },
                            )
                        };
                        if !ok {
                            why = Some(if next_rank == rank {
                                format!(
                                    "runs before the backward of (mb={mb}, chunk={next_chunk}) that feeds it"
                                )
                            } else {
                                format!(
                                    "runs before RecvGrad(mb={mb}, chunk={chunk}, from={next_rank}) of its output gradient"
                                )
                            });
                        }
                    }
                }
                Action::BackwardWeight { .. }
                    if why.is_none() && !has(&seen, Action::BackwardInput { mb, chunk }) =>
                {
                    why = Some(format!("runs before BackwardInput(mb={mb}, chunk={chunk})"));
                }
                Action::SendActivation { .. }
                    if why.is_none() && !has(&seen, Action::Forward { mb, chunk }) =>
                {
                    why = Some(format!("sends before Forward(mb={mb}, chunk={chunk}) ran"));
                }
                Action::SendGrad { .. } if why.is_none() && !backward_done(&seen, chunk) => {
                    why = Some(format!(
                        "sends before the backward of (mb={mb}, chunk={chunk}) ran"
                    ));
                }
                _ => {}
            }
            if let Some(why) = why {
                problems.push(Problem::Order {
                    rank,
                    index,
                    action: *a,
                    why,
                });
            }
            seen.insert(*a);
        }
        for chunk in 0..v {
            for mb in 0..m {
                if !seen.contains(&Action::Forward { mb, chunk }) {
                    problems.push(Problem::Missing {
                        rank,
                        what: format!("Forward(mb={mb}, chunk={chunk})"),
                    });
                }
                let full = seen.contains(&Action::Backward { mb, chunk });
                let input = seen.contains(&Action::BackwardInput { mb, chunk });
                let weight = seen.contains(&Action::BackwardWeight { mb, chunk });
                if !full && !input {
                    problems.push(Problem::Missing {
                        rank,
                        what: format!("the backward of (mb={mb}, chunk={chunk})"),
                    });
                } else if input && !weight {
                    problems.push(Problem::Missing {
                        rank,
                        what: format!("BackwardWeight(mb={mb}, chunk={chunk})"),
                    });
                } else if full && weight {
                    problems.push(Problem::Order {
                        rank,
                        index: list
                            .iter()
                            .position(|a| *a == Action::BackwardWeight { mb, chunk })
                            .unwrap_or(0),
                        action: Action::BackwardWeight { mb, chunk },
                        why: "the full Backward already computed the weight gradient".into(),
                    });
                }
            }
        }
    }

    // 4. Matching sends and receives.
    let mut sends: HashMap<(MsgKey, usize, usize), Vec<(usize, Action)>> = HashMap::new();
    let mut recvs: HashMap<(MsgKey, usize, usize), Vec<(usize, Action)>> = HashMap::new();
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
    problems.extend(unmatched);
    if !problems.is_empty() {
        return fail(problems);
    }

    // 5. Deadlock freedom: run every rank; sends are eager, receives wait for their send.
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
    let blocked: Vec<(usize, usize, Action)> = (0..p)
        .filter_map(|r| schedule.actions[r].get(pc[r]).map(|a| (r, pc[r], *a)))
        .collect();
    if blocked.is_empty() {
        return Ok(());
    }
    // Each blocked rank waits on exactly one peer: follow the pointers to find a ring.
    let waits_on: HashMap<usize, usize> = blocked
        .iter()
        .filter_map(|&(r, _, a)| message(schedule, r, &a).map(|(_, peer, _)| (r, peer)))
        .collect();
    let mut cycle = Vec::new();
    if let Some(&(start, _, _)) = blocked.first() {
        let mut path = vec![start];
        let mut at = start;
        while let Some(&next) = waits_on.get(&at) {
            if let Some(pos) = path.iter().position(|&r| r == next) {
                cycle = path[pos..].to_vec();
                break;
            }
            path.push(next);
            at = next;
        }
    }
    fail(vec![Problem::Deadlock { blocked, cycle }])
}
