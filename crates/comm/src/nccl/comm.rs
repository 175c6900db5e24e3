//! [`NcclComm`], one rank's NCCL communicator on one GPU: creation (from an id, the launch
//! environment or an existing group), its CUDA context and stream, waiting on a stream
//! against a deadline while watching NCCL's asynchronous error, abort and teardown. The
//! device-pointer collectives are in `device.rs`.

use super::id::UniqueId;
use super::{error, probe};
use crate::rendezvous::Rendezvous;
use crate::{CommError, LaunchEnv, ProcessGroup, Result};
use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nccl::{result as nccl, sys as nsys};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A raw CUDA stream handle (as used by Burn's CUDA runtime and cudarc).
pub type Stream = cusys::CUstream;
/// A raw device pointer.
pub type DevicePtr = cusys::CUdeviceptr;

/// One rank's NCCL communicator on one GPU.
pub struct NcclComm {
    pub(super) comm: nsys::ncclComm_t,
    rank: usize,
    pub(super) size: usize,
    device: usize,
    ctx: cusys::CUcontext,
    /// The stream host-staged calls run on.
    stream: Stream,
    aborted: AtomicBool,
}

// SAFETY: NCCL communicators and CUDA streams may be used from any thread as long as calls on
// one communicator are serialised, which `ProcessGroup` (one call at a time per group) and
// the `&self` device API's documented contract ensure.
unsafe impl Send for NcclComm {}
// SAFETY: as for `Send`: calls on one communicator are serialised by its process group.
unsafe impl Sync for NcclComm {}

pub(super) fn check_nccl(
    r: std::result::Result<nccl::NcclStatus, nccl::NcclError>,
    what: &str,
) -> Result<()> {
    r.map(|_| ()).map_err(|e| error(format!("{what}: {e:?}")))
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `size` on CUDA device `device`.
    pub fn init(id: &UniqueId, rank: usize, size: usize, device: usize) -> Result<NcclComm> {
        if size == 0 || rank >= size {
            return Err(error(format!(
                "rank {rank} is out of range for {size} ranks"
            )));
        }
        let libs = probe()?;
        if device >= libs.devices {
            return Err(error(format!(
                "CUDA device {device} requested but {} visible (LOCAL_RANK / CUDA_VISIBLE_DEVICES?)",
                libs.devices
            )));
        }
        // SAFETY: the driver is initialised (probe); primary context of a valid device.
        let (ctx, stream) = unsafe {
            let dev =
                cu::device::get(device as i32).map_err(|e| error(format!("cuDeviceGet: {e:?}")))?;
            let ctx = cu::primary_ctx::retain(dev)
                .map_err(|e| error(format!("cuDevicePrimaryCtxRetain: {e:?}")))?;
            cu::ctx::set_current(ctx).map_err(|e| error(format!("cuCtxSetCurrent: {e:?}")))?;
            let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
                .map_err(|e| error(format!("cuStreamCreate: {e:?}")))?;
            (ctx, stream)
        };
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer and id; every rank calls this with the same id and size.
        unsafe {
            check_nccl(
                nccl::comm_init_rank(&mut comm, size as i32, id.to_sys(), rank as i32),
                "ncclCommInitRank",
            )?;
        }
        Ok(NcclComm {
            comm,
            rank,
            size,
            device,
            ctx,
            stream,
            aborted: AtomicBool::new(false),
        })
    }

    /// Builds the world communicator from the launch environment: rank and size from
    /// `mpirun`/`srun`/torchrun variables, the GPU from the local rank, and the id over the
    /// TCP rendezvous at `MASTER_ADDR:MASTER_PORT`. Under MPI without `MASTER_ADDR`, use
    /// [`NcclComm::from_group`] with the MPI world group instead.
    pub fn from_env() -> Result<NcclComm> {
        let env = LaunchEnv::detect()?;
        if env.master.is_none() {
            return Err(error(
                "NcclComm::from_env needs MASTER_ADDR and MASTER_PORT for the TCP rendezvous; \
                 under mpirun/srun use NcclComm::from_group(world.group(), local_rank) instead",
            ));
        }
        let rv = Rendezvous::from_env(env.rank, env.size, crate::default_timeout())?;
        probe()?;
        let id = UniqueId::share_tcp(&rv)?;
        Self::init(&id, env.rank, env.size, env.local_rank)
    }

    /// Builds a communicator over the ranks of `pg` (e.g. the MPI world), sharing the id
    /// through `pg`, on CUDA device `device`.
    pub fn from_group(pg: &ProcessGroup, device: usize) -> Result<NcclComm> {
        let id = UniqueId::share_over(pg)?;
        Self::init(&id, pg.rank(), pg.size(), device)
    }

    /// This rank's index in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks in the communicator.
    pub fn size(&self) -> usize {
        self.size
    }
    /// Index of the CUDA device the communicator runs on.
    pub fn device(&self) -> usize {
        self.device
    }
    /// The communicator's own stream (used by host-staged calls).
    pub fn stream(&self) -> Stream {
        self.stream
    }

    pub(super) fn ensure_usable(&self) -> Result<()> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(error(
                "the NCCL communicator was aborted by an earlier failure",
            ));
        }
        // SAFETY: make this device's context current on the calling thread.
        unsafe { cu::ctx::set_current(self.ctx) }
            .map_err(|e| error(format!("cuCtxSetCurrent: {e:?}")))
    }

    /// Aborts the communicator (pending operations fail; it cannot be used again).
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: a valid communicator, aborted once.
            let _ = unsafe { nccl::comm_abort(self.comm) };
        }
    }

    /// Waits for this communicator's own stream (host-staged calls) until `deadline`.
    pub fn wait_own(&self, deadline: Instant) -> Result<(), WaitFailure> {
        // SAFETY: the stream was created by and belongs to this communicator.
        unsafe { self.wait_stream(self.stream, deadline) }
    }

    /// Waits for `stream` until `deadline`, watching NCCL's asynchronous error. On timeout or
    /// error the communicator is aborted.
    ///
    /// # Safety
    /// `stream` must be a live CUDA stream of this communicator's device.
    pub unsafe fn wait_stream(&self, stream: Stream, deadline: Instant) -> Result<(), WaitFailure> {
        let mut naps = 0u32;
        loop {
            // SAFETY: a valid stream of this context.
            let status = unsafe { cusys::cuStreamQuery(stream) };
            match status {
                cusys::CUresult::CUDA_SUCCESS => return Ok(()),
                cusys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    self.abort();
                    return Err(WaitFailure::Error(format!("cuStreamQuery: {other:?}")));
                }
            }
            let mut async_err = nsys::ncclResult_t::ncclSuccess;
            // SAFETY: valid communicator and out-pointer.
            unsafe { nsys::ncclCommGetAsyncError(self.comm, &mut async_err) };
            if async_err != nsys::ncclResult_t::ncclSuccess
                && async_err != nsys::ncclResult_t::ncclInProgress
            {
                self.abort();
                return Err(WaitFailure::Error(format!(
                    "NCCL asynchronous error: {async_err:?}"
                )));
            }
            if Instant::now() >= deadline {
                self.abort();
                return Err(WaitFailure::Timeout);
            }
            naps += 1;
            if naps < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    pub(super) fn check_count(&self, what: &str, root: Option<usize>) -> Result<()> {
        if let Some(root) = root
            && root >= self.size
        {
            return Err(CommError::InvalidArgument {
                group: "nccl".into(),
                op: crate::OpKind::Broadcast,
                message: format!("{what}: root {root} out of range for {} ranks", self.size),
            });
        }
        Ok(())
    }
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device)
            .field("aborted", &self.aborted.load(Ordering::SeqCst))
            .finish()
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: owned handles, released once; an aborted communicator is already freed.
        unsafe {
            let _ = cu::ctx::set_current(self.ctx);
            if !self.aborted.load(Ordering::SeqCst) {
                let _ = nccl::comm_destroy(self.comm);
            }
            let _ = cu::stream::destroy(self.stream);
        }
    }
}

/// Why [`NcclComm::wait_stream`] gave up.
#[derive(Debug, Clone)]
pub enum WaitFailure {
    /// The deadline passed before the stream's work finished.
    Timeout,
    /// CUDA or NCCL reported an error while waiting (the message says which).
    Error(String),
}
