//! The MPI backend (feature `mpi`): ranks are processes started by `mpirun` / `srun`,
//! talking through the system's MPI library (OpenMPI 4.1 tested) via the `mpi` crate.
//!
//! ```no_run
//! use bonfire_comm::{ReduceOp, mpi::MpiWorld};
//! let world = MpiWorld::init().expect("MPI");       // once per process
//! let pg = world.group();
//! let mut v = vec![pg.rank() as f32; 4];
//! pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
//! drop(world);                                       // tells peers, then MPI_Finalize
//! ```
//!
//! Usually you do not call this directly: [`crate::World::from_env`] picks MPI when the
//! process was launched by `mpirun`/`srun`.
//!
//! # Semantics
//! - Every collective first exchanges fingerprints (nonblocking, polled against the
//!   group's timeout), then moves data with MPI's own collective. See `backend.rs`.
//! - **Failures end the job.** A panic on any thread calls `MPI_Abort` from a panic hook
//!   (the job ends in well under a second with a non-zero exit). A timeout, or a peer that
//!   shut down while this rank waits for it, returns the error to the caller and then aborts
//!   the job after `BONFIRE_MPI_ABORT_GRACE_SECS` (default 2 s): an MPI communicator cannot
//!   recover from a missing rank, and waiting would hang the job. A mismatch, an invalid
//!   argument or an all-to-all count mismatch is seen by every rank identically and leaves
//!   the group usable, as in the in-process backend.
//! - **Shutdown.** Dropping [`MpiWorld`] sends an exit notice to every peer and waits for
//!   theirs (and for buffered sends) before `MPI_Finalize`; a peer still waiting for this
//!   rank in a collective sees the notice and fails fast with
//!   [`CommError::PeerFailed`](crate::CommError::PeerFailed) instead of hanging.
//! - Sends are buffered (they return at once, like the in-process backend) and complete in
//!   the background; user tags map onto MPI tags modulo 32768 and are checked in full by the
//!   receiver.

mod backend;
mod collectives;
mod handshake;
mod ring;
mod runtime;
mod scratch;
mod types;

pub use backend::RING_THRESHOLD_BYTES;
pub use runtime::abort_job;

use crate::{CommError, ProcessGroup, Result};
use backend::MpiBackend;
use mpi::environment::Universe;
use mpi::ffi;
use mpi::traits::Communicator;
use runtime::Runtime;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// This process's membership in the MPI job: the world [`ProcessGroup`] and the MPI library's
/// lifetime. Create it once per process; drop it (or call [`MpiWorld::finish`]) at the end.
pub struct MpiWorld {
    group: ProcessGroup,
    rt: Arc<Runtime>,
    multiple: bool,
    universe: Option<Universe>,
}

impl std::fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiWorld")
            .field("rank", &self.rt.world_rank)
            .field("size", &self.rt.world_size)
            .field("library", &self.rt.library)
            .field("thread_multiple", &self.multiple)
            .finish()
    }
}

static HOOK: AtomicBool = AtomicBool::new(false);

/// Makes any panic in this process end the whole MPI job (`MPI_Abort`), after the usual
/// panic message. Without it, a panicking rank leaves its peers blocked in `MPI_Finalize` or
/// a collective. Installed by [`MpiWorld::init`].
fn install_panic_hook(rank: usize) {
    if HOOK.swap(true, Ordering::SeqCst) {
        return;
    }
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        eprintln!("bonfire-comm[mpi] rank {rank}: panicked; aborting the MPI job (MPI_Abort)");
        abort_job(1);
    }));
}

impl MpiWorld {
    /// Initialises MPI (requesting `MPI_THREAD_MULTIPLE`), installs the abort-on-panic hook
    /// and builds the world group. Fails if MPI was already initialised in this process.
    pub fn init() -> Result<MpiWorld> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| CommError::Backend {
                backend: "mpi",
                message: "MPI is already initialised in this process (MpiWorld::init may \
                              run once per process)"
                    .into(),
            })?;
        let multiple = threading == mpi::Threading::Multiple;
        let rt = Runtime::new(multiple);
        runtime::install(rt.clone());
        install_panic_hook(rt.world_rank);
        let size = universe.world().size() as usize;
        // SAFETY: reads a constant handle the MPI bindings export (an immutable extern static).
        let mut coll: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: MPI is initialised; duplicate the world communicator for our collectives.
        unsafe { ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut coll) };
        let backend = MpiBackend::new(rt.clone(), coll, (0..size).collect());
        let group = ProcessGroup::from_backend(Box::new(backend), "world");
        Ok(MpiWorld {
            group,
            rt,
            multiple,
            universe: Some(universe),
        })
    }

    /// The group of every process in the job (`MPI_COMM_WORLD`).
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        self.rt.world_rank
    }

    /// Number of processes in the job.
    pub fn size(&self) -> usize {
        self.rt.world_size
    }

    /// The MPI library's version line (`MPI_Get_library_version`).
    pub fn library_version(&self) -> &str {
        &self.rt.library
    }

    /// Whether the library granted `MPI_THREAD_MULTIPLE` (otherwise MPI calls are serialised
    /// by a lock, and concurrent collectives on sub-groups that share two ranks may deadlock).
    pub fn thread_multiple(&self) -> bool {
        self.multiple
    }

    /// Ends this rank's part of the job: notifies peers, waits for theirs, finalises MPI.
    /// Same as dropping the world.
    pub fn finish(self) {}
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        self.rt.shutdown(crate::default_timeout());
        drop(self.universe.take());
    }
}
