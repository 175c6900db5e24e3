//! The in-process backend: every rank is a thread of this process.
//!
//! This is the default backend — no setup, ideal for tests and for training on the cores of
//! one machine. [`launch`] (or [`ThreadWorld`] for options) starts the rank threads and hands
//! each a [`ProcessGroup`]; a rank that panics or returns early makes its peers' pending
//! calls fail instead of hang, and the panic is reported in [`LaunchError`].

mod backend;
mod barrier;
mod shared;
mod shrink;
mod world;

use crate::work::panic_message;
use crate::{ProcessGroup, group::default_timeout};
use backend::ThreadBackend;
use shared::{RankStatus, WorldState};
use std::time::Duration;

/// A rank thread that panicked.
#[derive(Debug, Clone)]
pub struct RankFailure {
    /// The rank whose thread panicked.
    pub rank: usize,
    /// The panic's message.
    pub message: String,
}

/// Some rank threads panicked. `failures` lists them in rank order; usually one is the root
/// cause and the others panicked on the errors it caused (see their messages).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{} of {world_size} ranks failed: {}", failures.len(), describe(failures))]
pub struct LaunchError {
    /// Number of ranks the world was launched with.
    pub world_size: usize,
    /// The ranks that panicked, in rank order.
    pub failures: Vec<RankFailure>,
}

fn describe(failures: &[RankFailure]) -> String {
    failures
        .iter()
        .map(|f| format!("[rank {}] {}", f.rank, f.message))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Options for a world of in-process ranks.
#[derive(Debug, Clone)]
pub struct ThreadWorld {
    size: usize,
    timeout: Duration,
    name: String,
    fault: Option<(usize, u64)>,
}

impl ThreadWorld {
    /// A world of `size` rank threads (at least 1).
    pub fn new(size: usize) -> Self {
        assert!(size >= 1, "a world needs at least one rank");
        Self {
            size,
            timeout: default_timeout(),
            name: "world".into(),
            fault: None,
        }
    }

    /// The timeout of every blocking call (default: [`crate::DEFAULT_TIMEOUT`] or
    /// `BONFIRE_TIMEOUT_SECS`).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The world group's name in errors and logs.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Injects a failure (tests, chaos runs): world rank `rank` dies entering its `call`-th
    /// communication call (collectives, sends and receives on any of its groups and threads,
    /// counted from 0). It is marked failed — its peers' calls fail at once, naming it — and
    /// that call returns an error; what the rank's code does afterwards no peer waits for.
    pub fn inject_failure(mut self, rank: usize, call: u64) -> Self {
        assert!(
            rank < self.size,
            "rank {rank} is not in a world of {}",
            self.size
        );
        self.fault = Some((rank, call));
        self
    }

    /// Runs `f` on every rank and returns each rank's outcome, in rank order.
    pub fn launch_each<R, F>(&self, f: F) -> Vec<Result<R, RankFailure>>
    where
        R: Send,
        F: Fn(ProcessGroup) -> R + Sync,
    {
        let world = WorldState::with_fault(self.size, self.fault);
        let members: Vec<usize> = (0..self.size).collect();
        // Join the world group on this thread so every rank shares one state.
        let groups: Vec<ProcessGroup> = (0..self.size)
            .map(|rank| {
                let shared = world.join_group(rank, members.clone());
                let pg = ProcessGroup::from_backend(
                    Box::new(ThreadBackend::new(shared, rank)),
                    self.name.clone(),
                );
                pg.set_timeout(self.timeout);
                pg
            })
            .collect();
        let f = &f;
        std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, pg)| {
                    let world = world.clone();
                    std::thread::Builder::new()
                        .name(format!("bonfire-rank-{rank}"))
                        .spawn_scoped(scope, move || {
                            let out =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(pg)));
                            match out {
                                Ok(value) => {
                                    // A rank that died of an injected failure stays failed.
                                    if world.status(rank) == RankStatus::Running {
                                        world.set_status(rank, RankStatus::Exited, None);
                                    }
                                    Ok(value)
                                }
                                Err(panic) => {
                                    let message = panic_message(&panic);
                                    world.set_status(
                                        rank,
                                        RankStatus::Failed,
                                        Some(format!("it panicked: {message}")),
                                    );
                                    Err(RankFailure { rank, message })
                                }
                            }
                        })
                        .expect("failed to spawn a rank thread")
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread result is caught"))
                .collect()
        })
    }

    /// Runs `f` on every rank and returns the results in rank order, or the ranks that
    /// panicked.
    pub fn launch<R, F>(&self, f: F) -> Result<Vec<R>, LaunchError>
    where
        R: Send,
        F: Fn(ProcessGroup) -> R + Sync,
    {
        let outcomes = self.launch_each(f);
        let mut results = Vec::with_capacity(outcomes.len());
        let mut failures = Vec::new();
        for outcome in outcomes {
            match outcome {
                Ok(r) => results.push(r),
                Err(failure) => failures.push(failure),
            }
        }
        if failures.is_empty() {
            Ok(results)
        } else {
            Err(LaunchError {
                world_size: self.size,
                failures,
            })
        }
    }
}

/// Runs `f` on `world_size` rank threads, each with its [`ProcessGroup`], and returns the
/// results in rank order. A rank that panics makes its peers' calls fail (not hang) and is
/// reported in the error.
///
/// ```
/// use bonfire_comm::{launch, ReduceOp};
/// let sums = launch(4, |pg| {
///     let mut v = vec![pg.rank() as f32; 3];
///     pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
///     v
/// })
/// .unwrap();
/// assert!(sums.iter().all(|v| v == &vec![6.0; 3]));
/// ```
pub fn launch<R, F>(world_size: usize, f: F) -> Result<Vec<R>, LaunchError>
where
    R: Send,
    F: Fn(ProcessGroup) -> R + Sync,
{
    ThreadWorld::new(world_size).launch(f)
}
