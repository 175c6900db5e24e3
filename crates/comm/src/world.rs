//! [`World::from_env`]: one entry point that picks the backend from how the process was
//! launched, the way clusters start jobs.
//!
//! | launched by | detected from | backend |
//! |---|---|---|
//! | `mpirun` / `mpiexec` (OpenMPI) | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | MPI |
//! | `srun` (Slurm) | `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (or `SLURM_NTASKS`) | MPI |
//! | PMI launchers (MPICH Hydra, `srun --mpi=pmi2/pmix`) | `PMI_RANK`/`PMI_SIZE`, `PMIX_RANK` | MPI |
//! | `torchrun`-style | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` | single rank if `WORLD_SIZE=1`, else an error pointing to `mpirun` (host) or the NCCL backend's TCP rendezvous (GPU) |
//! | nothing | — | a single rank |
//!
//! `BONFIRE_BACKEND=mpi|single` overrides the choice. Under an MPI launcher the torchrun
//! variables are honoured where they make sense: `LOCAL_RANK` is used when the launcher gives
//! no local rank, and `RANK`/`WORLD_SIZE`, when set, must agree with MPI's (a mismatch means
//! the job is misconfigured and is reported, not ignored).

use crate::backend::{Backend, CallContext};
use crate::collective::Collective;
use crate::{BufMut, BufRef, CommError, Fingerprint, ProcessGroup, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How this process was started (which launcher set its environment): read from the
/// environment, unlike `bonfire_train::Launcher`, which says how to start ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartedBy {
    /// OpenMPI's `mpirun` / `mpiexec`.
    Mpirun,
    /// Slurm's `srun`.
    Slurm,
    /// A PMI/PMIx launcher (MPICH Hydra, `srun --mpi=pmix`, ...).
    Pmi,
    /// `torchrun` or anything else that sets `RANK` / `WORLD_SIZE`.
    Torchrun,
    /// Nothing: a plain process.
    Single,
}

impl StartedBy {
    /// True for the launchers whose processes talk through MPI.
    pub fn is_mpi(self) -> bool {
        matches!(self, StartedBy::Mpirun | StartedBy::Slurm | StartedBy::Pmi)
    }
}

/// What the environment says about this process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// The launcher that started this process.
    pub started_by: StartedBy,
    /// The environment variable the launcher was recognised by.
    pub detected_by: &'static str,
    /// This process's rank in the job.
    pub rank: usize,
    /// Number of processes in the job.
    pub size: usize,
    /// Rank among the processes of this node (selects the GPU).
    pub local_rank: usize,
    /// Number of processes of this job on this node (`size` when the launcher does not say).
    pub local_size: usize,
    /// `MASTER_ADDR` / `MASTER_PORT`, for TCP rendezvous (NCCL bootstrap).
    pub master: Option<(String, u16)>,
    /// `BONFIRE_BACKEND`, lower-cased.
    pub backend_override: Option<String>,
}

fn invalid(message: String) -> CommError {
    CommError::InvalidGroup {
        group: "world".into(),
        message,
    }
}

/// Environment variables, read through a lookup function.
struct Vars<F>(F);

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    /// The value of `key`, if set.
    fn get(&self, key: &str) -> Option<String> {
        (self.0)(key)
    }

    /// `key` as a number: `None` when unset or blank, an error when not a number.
    fn num(&self, key: &'static str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) if v.trim().is_empty() => Ok(None),
            Some(v) => {
                v.trim().parse::<usize>().map(Some).map_err(|_| {
                    invalid(format!("environment variable {key}={v:?} is not a number"))
                })
            }
        }
    }

    /// The first of `keys` that is set, as a number.
    fn first(&self, keys: &[&'static str]) -> Result<Option<usize>> {
        for &k in keys {
            if let Some(v) = self.num(k)? {
                return Ok(Some(v));
            }
        }
        Ok(None)
    }

    /// `MASTER_ADDR` and `MASTER_PORT`, when both are set.
    fn master(&self) -> Result<Option<(String, u16)>> {
        Ok(match (self.get("MASTER_ADDR"), self.get("MASTER_PORT")) {
            (Some(addr), Some(port)) => Some((
                addr,
                port.trim()
                    .parse::<u16>()
                    .map_err(|_| invalid(format!("MASTER_PORT={port:?} is not a port number")))?,
            )),
            _ => None,
        })
    }

    /// The launcher, the variable it was recognised by, and this process's rank and the job
    /// size it gives.
    fn launch(&self) -> Result<(StartedBy, &'static str, usize, usize)> {
        let num = |key| self.num(key);
        let slurm_tasks = self.first(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])?;
        Ok(if let Some(rank) = num("OMPI_COMM_WORLD_RANK")? {
            let size = num("OMPI_COMM_WORLD_SIZE")?.unwrap_or(rank + 1);
            (StartedBy::Mpirun, "OMPI_COMM_WORLD_RANK", rank, size)
        } else if let Some(rank) = num("PMI_RANK")? {
            let size = self
                .first(&["PMI_SIZE"])?
                .or(slurm_tasks)
                .unwrap_or(rank + 1);
            (StartedBy::Pmi, "PMI_RANK", rank, size)
        } else if let Some(rank) = num("PMIX_RANK")? {
            let size = self
                .first(&["PMIX_SIZE"])?
                .or(slurm_tasks)
                .unwrap_or(rank + 1);
            (StartedBy::Pmi, "PMIX_RANK", rank, size)
        } else if let (Some(rank), Some(size), true) = (
            num("SLURM_PROCID")?,
            slurm_tasks,
            self.get("SLURM_STEP_ID").is_some(),
        ) {
            // Inside an `srun` step (a batch script alone has no step of tasks).
            (StartedBy::Slurm, "SLURM_PROCID", rank, size)
        } else if let Some(size) = num("WORLD_SIZE")? {
            let rank =
                num("RANK")?.ok_or_else(|| invalid("WORLD_SIZE is set but RANK is not".into()))?;
            (StartedBy::Torchrun, "WORLD_SIZE", rank, size)
        } else {
            (StartedBy::Single, "", 0, 1)
        })
    }

    /// torchrun-style variables, when also set under an MPI launcher, must agree with it.
    fn check_torchrun_agrees(&self, detected_by: &str, rank: usize, size: usize) -> Result<()> {
        if let Some(r) = self.num("RANK")?
            && r != rank
        {
            return Err(invalid(format!(
                "RANK={r} disagrees with {detected_by}={rank}; unset RANK or fix the launch"
            )));
        }
        if let Some(s) = self.num("WORLD_SIZE")?
            && s != size
        {
            return Err(invalid(format!(
                "WORLD_SIZE={s} disagrees with the {size} processes of the MPI launch"
            )));
        }
        Ok(())
    }
}

impl LaunchEnv {
    /// Reads the process environment.
    pub fn detect() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads variables through `get` (for tests and embedding).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let vars = Vars(get);
        let backend_override = vars
            .get("BONFIRE_BACKEND")
            .map(|s| s.trim().to_ascii_lowercase())
            .filter(|s| !s.is_empty());
        let master = vars.master()?;
        let (launcher, detected_by, rank, size) = vars.launch()?;
        if size == 0 || rank >= size {
            return Err(invalid(format!(
                "{detected_by}: rank {rank} is out of range for a job of {size} processes"
            )));
        }
        if launcher.is_mpi() {
            vars.check_torchrun_agrees(detected_by, rank, size)?;
        }
        let local_rank = vars
            .first(&[
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "MPI_LOCALRANKID",
                "SLURM_LOCALID",
                "LOCAL_RANK",
            ])?
            .unwrap_or(if launcher == StartedBy::Single {
                0
            } else {
                rank
            });
        let local_size = vars
            .first(&[
                "OMPI_COMM_WORLD_LOCAL_SIZE",
                "MPI_LOCALNRANKS",
                "LOCAL_WORLD_SIZE",
            ])?
            .unwrap_or(size);
        Ok(LaunchEnv {
            started_by: launcher,
            detected_by,
            rank,
            size,
            local_rank,
            local_size,
            master,
            backend_override,
        })
    }

    /// The backend [`World::from_env`] will use: `"mpi"` or `"single"`.
    pub fn backend(&self) -> Result<&'static str> {
        match self.backend_override.as_deref() {
            Some("mpi") => return Ok("mpi"),
            Some("single") | Some("threads") => {
                if self.size > 1 {
                    return Err(invalid(format!(
                        "BONFIRE_BACKEND={} cannot run a job of {} processes",
                        self.backend_override.as_deref().unwrap_or(""),
                        self.size
                    )));
                }
                return Ok("single");
            }
            Some(other) => {
                return Err(invalid(format!(
                    "BONFIRE_BACKEND={other:?} is not one of: mpi, single"
                )));
            }
            None => {}
        }
        match self.started_by {
            l if l.is_mpi() => Ok("mpi"),
            StartedBy::Torchrun if self.size > 1 => Err(invalid(format!(
                "torchrun-style launch (RANK={}, WORLD_SIZE={}): host collectives need the MPI \
                 backend, so launch with `mpirun -np {}` or `srun -n {}` instead; for GPU \
                 tensors the NCCL backend bootstraps from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT \
                 (bonfire_comm::nccl)",
                self.rank, self.size, self.size, self.size
            ))),
            _ => Ok("single"),
        }
    }
}

/// This process's membership in a job: the world [`ProcessGroup`], however it was launched.
///
/// ```
/// let world = bonfire_comm::World::from_env().unwrap();
/// let pg = world.group();
/// let mut v = vec![1.0f32; 4];
/// pg.all_reduce(&mut v, bonfire_comm::ReduceOp::Sum).unwrap();
/// assert_eq!(v, vec![world.size() as f32; 4]);
/// ```
pub struct World {
    env: LaunchEnv,
    group: ProcessGroup,
    #[cfg(feature = "mpi")]
    _mpi: Option<crate::mpi::MpiWorld>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("env", &self.env)
            .field("group", &self.group)
            .finish()
    }
}

impl World {
    /// Joins the job this process belongs to (see the module docs for the rules). Under
    /// MPI this initialises MPI, so call it once per process and keep the `World` alive
    /// until the end: dropping it shuts the backend down.
    pub fn from_env() -> Result<World> {
        let env = LaunchEnv::detect()?;
        match env.backend()? {
            "mpi" => Self::mpi(env),
            _ => Ok(World {
                group: ProcessGroup::from_backend(Box::new(SingleBackend::default()), "world"),
                env,
                #[cfg(feature = "mpi")]
                _mpi: None,
            }),
        }
    }

    #[cfg(feature = "mpi")]
    fn mpi(env: LaunchEnv) -> Result<World> {
        let mpi = crate::mpi::MpiWorld::init()?;
        if env.started_by.is_mpi() && (mpi.size() != env.size || mpi.rank() != env.rank) {
            return Err(invalid(format!(
                "{} says rank {} of {}, but MPI says rank {} of {}: the program's MPI library \
                 does not match the launcher's (e.g. MPICH's mpiexec with OpenMPI, or srun \
                 without --mpi=pmix)",
                env.detected_by,
                env.rank,
                env.size,
                mpi.rank(),
                mpi.size()
            )));
        }
        Ok(World {
            group: mpi.group().clone(),
            env,
            _mpi: Some(mpi),
        })
    }

    #[cfg(not(feature = "mpi"))]
    fn mpi(env: LaunchEnv) -> Result<World> {
        Err(CommError::Unsupported {
            backend: "mpi",
            what: format!(
                "this process was launched for MPI ({} is set) but bonfire-comm was built \
                 without the `mpi` feature; rebuild with `--features bonfire-comm/mpi`",
                if env.detected_by.is_empty() {
                    "BONFIRE_BACKEND=mpi"
                } else {
                    env.detected_by
                }
            ),
        })
    }

    /// The group of every process in the job.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }
    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }
    /// Number of processes in the job.
    pub fn size(&self) -> usize {
        self.group.size()
    }
    /// Rank among this node's processes (use it to pick the GPU).
    pub fn local_rank(&self) -> usize {
        self.env.local_rank
    }
    /// The launcher that started this process.
    pub fn started_by(&self) -> StartedBy {
        self.env.started_by
    }
    /// Everything read from the environment.
    pub fn env(&self) -> &LaunchEnv {
        &self.env
    }
    /// Shuts the backend down (same as dropping the world).
    pub fn finish(self) {}
}

/// Messages a single rank sent to itself, by tag.
type SelfMailbox = HashMap<u64, VecDeque<(Fingerprint, Vec<u8>)>>;

/// The backend of a job of one process: collectives are copies, messages go to itself.
#[derive(Default)]
pub(crate) struct SingleBackend {
    mailbox: Mutex<SelfMailbox>,
    mail: Condvar,
}

impl Backend for SingleBackend {
    fn name(&self) -> &'static str {
        "single"
    }
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn world_ranks(&self) -> Vec<usize> {
        vec![0]
    }
    fn collective(&self, call: Collective<'_>, _ctx: &CallContext<'_>) -> Result<()> {
        match call {
            Collective::AllGather { send, mut recv, .. }
            | Collective::ReduceScatter { send, mut recv, .. }
            | Collective::AllToAll { send, mut recv, .. } => {
                recv.bytes_mut().copy_from_slice(send.bytes());
            }
            // One rank: the reduction (even Avg, divided by 1) and the broadcast are identity.
            Collective::AllReduce { .. }
            | Collective::Broadcast { .. }
            | Collective::Reduce { .. }
            | Collective::Barrier => {}
        }
        Ok(())
    }
    fn send(&self, buf: BufRef<'_>, _dst: usize, ctx: &CallContext<'_>) -> Result<()> {
        let mut mailbox = self.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        mailbox
            .entry(ctx.fingerprint.tag.unwrap_or(0))
            .or_default()
            .push_back((ctx.fingerprint, buf.bytes().to_vec()));
        self.mail.notify_all();
        Ok(())
    }
    fn recv(&self, mut buf: BufMut<'_>, src: usize, ctx: &CallContext<'_>) -> Result<()> {
        let started = Instant::now();
        let deadline = started + ctx.timeout;
        let mut mailbox = self.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some((fp, data)) = mailbox
                .get_mut(&ctx.fingerprint.tag.unwrap_or(0))
                .and_then(|q| q.pop_front())
            {
                if !fp.matches(&ctx.fingerprint) || data.len() != buf.bytes().len() {
                    return Err(ctx.mismatch(src, fp));
                }
                buf.bytes_mut().copy_from_slice(&data);
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ctx.timeout_error(vec![src], started.elapsed()));
            }
            mailbox = self
                .mail
                .wait_timeout(mailbox, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
    fn new_group(&self, _ranks: &[usize], _timeout: Duration) -> Result<Box<dyn Backend>> {
        Ok(Box::new(SingleBackend::default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReduceOp;

    fn env(vars: &[(&str, &str)]) -> Result<LaunchEnv> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn plain_process_is_a_single_rank() {
        let e = env(&[]).unwrap();
        assert_eq!(
            (e.started_by, e.rank, e.size, e.local_rank),
            (StartedBy::Single, 0, 1, 0)
        );
        assert_eq!(e.backend().unwrap(), "single");
    }

    #[test]
    fn mpirun_is_detected_with_local_rank() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(e.started_by, StartedBy::Mpirun);
        assert_eq!((e.rank, e.size, e.local_rank, e.local_size), (3, 4, 1, 2));
        assert_eq!(e.backend().unwrap(), "mpi");
    }

    #[test]
    fn srun_step_is_mpi_but_a_batch_script_is_not() {
        let step = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_LOCALID", "1"),
        ])
        .unwrap();
        assert_eq!(step.started_by, StartedBy::Slurm);
        assert_eq!((step.rank, step.size, step.local_rank), (5, 8, 1));
        assert_eq!(step.backend().unwrap(), "mpi");
        let batch = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8")]).unwrap();
        assert_eq!(batch.started_by, StartedBy::Single);
        let pmi = env(&[("PMI_RANK", "2"), ("PMI_SIZE", "3")]).unwrap();
        assert_eq!((pmi.started_by, pmi.rank, pmi.size), (StartedBy::Pmi, 2, 3));
    }

    #[test]
    fn torchrun_variables() {
        let one = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")]).unwrap();
        assert_eq!(one.started_by, StartedBy::Torchrun);
        assert_eq!(one.backend().unwrap(), "single");
        let four = env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!((four.rank, four.size, four.local_rank), (2, 4, 0));
        assert_eq!(four.master, Some(("10.0.0.1".to_string(), 29500)));
        let err = four.backend().unwrap_err().to_string();
        assert!(err.contains("mpirun -np 4"), "{err}");
        assert!(env(&[("WORLD_SIZE", "4")]).is_err(), "RANK missing");
        assert!(
            env(&[("RANK", "4"), ("WORLD_SIZE", "4")]).is_err(),
            "rank out of range"
        );
        assert!(
            env(&[("RANK", "x"), ("WORLD_SIZE", "4")]).is_err(),
            "not a number"
        );
    }

    #[test]
    fn torchrun_variables_must_agree_with_mpi() {
        let base = [("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")];
        let ok = env(&[
            base[0],
            base[1],
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
        ])
        .unwrap();
        assert_eq!(
            ok.local_rank, 0,
            "LOCAL_RANK used when the launcher gives none"
        );
        assert!(env(&[base[0], base[1], ("RANK", "0")]).is_err());
        assert!(env(&[base[0], base[1], ("WORLD_SIZE", "3")]).is_err());
    }

    #[test]
    fn backend_override() {
        let e = env(&[("BONFIRE_BACKEND", "MPI")]).unwrap();
        assert_eq!(e.backend().unwrap(), "mpi");
        let e = env(&[("BONFIRE_BACKEND", "nope")]).unwrap();
        assert!(e.backend().is_err());
    }

    #[test]
    fn single_rank_world_runs_every_collective() {
        let pg = ProcessGroup::from_backend(Box::new(SingleBackend::default()), "world");
        let mut v = vec![2.0f32, 4.0];
        pg.all_reduce(&mut v, ReduceOp::Avg).unwrap();
        assert_eq!(v, vec![2.0, 4.0]);
        let mut g = vec![0i32; 2];
        pg.all_gather(&[7, 8], &mut g).unwrap();
        assert_eq!(g, vec![7, 8]);
        let mut r = vec![0u8; 3];
        pg.reduce_scatter(&[1, 2, 3], &mut r, ReduceOp::Sum)
            .unwrap();
        assert_eq!(r, vec![1, 2, 3]);
        pg.send(&[1.5f64, 2.5], 0, 3).unwrap();
        let mut m = vec![0f64; 2];
        pg.recv(&mut m, 0, 3).unwrap();
        assert_eq!(m, vec![1.5, 2.5]);
        let sub = pg.new_group(&[0]).unwrap();
        sub.barrier().unwrap();
        assert_eq!(pg.backend_name(), "single");
    }
}
