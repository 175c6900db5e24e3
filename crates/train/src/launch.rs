//! Where ranks come from: threads of this process (the default), or this process as one
//! rank of a job started by a launcher (`mpirun`, with the `mpi` feature).

use crate::error::TrainError;
use bonfire_comm::{ProcessGroup, RankFailure, ThreadWorld, World};

/// How ranks are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `ranks` threads in this process.
    Threads {
        /// Rank threads to start (the world size).
        ranks: usize,
    },
    /// This process is one rank of a job its launcher started (`World::from_env`).
    Env,
}

impl Launcher {
    /// `threads` (with `ranks` ranks) or `env`.
    pub fn parse(name: &str, ranks: usize) -> Result<Self, String> {
        match name {
            "threads" => Ok(Launcher::Threads { ranks }),
            "env" => Ok(Launcher::Env),
            other => Err(format!("--launcher {other}: expected `threads` or `env`")),
        }
    }

    /// Runs `f` on every rank this process hosts and returns their results in rank order
    /// (one result under `Env`). Rank threads share one timeout: a rank that fails makes its
    /// peers' collectives fail instead of hang.
    pub fn run<R: Send>(
        self,
        name: &str,
        f: impl Fn(ProcessGroup) -> R + Sync,
    ) -> Result<Vec<R>, TrainError> {
        match self {
            Launcher::Threads { ranks } => Ok(ThreadWorld::new(ranks).name(name).launch(f)?),
            Launcher::Env => {
                let world = World::from_env()?;
                let out = f(world.group().clone());
                Ok(vec![out])
            }
        }
    }

    /// Like [`run`](Self::run), but every rank's own outcome, in rank order: the ranks that
    /// panicked as [`RankFailure`]s, the others' results — what a fault-tolerant run, whose
    /// survivors finish without the dead, returns (under `Env` a panic ends the process).
    pub fn run_each<R: Send>(
        self,
        name: &str,
        f: impl Fn(ProcessGroup) -> R + Sync,
    ) -> Result<Vec<Result<R, RankFailure>>, TrainError> {
        match self {
            Launcher::Threads { ranks } => Ok(ThreadWorld::new(ranks).name(name).launch_each(f)),
            Launcher::Env => self
                .run(name, f)
                .map(|out| out.into_iter().map(Ok).collect()),
        }
    }
}
