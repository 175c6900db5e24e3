//! The NCCL backend (feature `nccl`): GPU collectives through `cudarc`'s NCCL bindings,
//! loaded at run time (`dynamic-loading`), so the crate builds and its CPU-side logic runs
//! on machines with no CUDA at all.
//!
//! - [`probe`] checks that `libcuda.so.1` and `libnccl.so.2` can be loaded (the same names
//!   `cudarc` will try) *before* `cudarc` is touched: `cudarc` panics on a missing library,
//!   Bonfire returns [`CommError::Backend`] with what is missing and how to fix it.
//! - Bootstrap: rank 0 creates an [`UniqueId`] and shares it over an existing
//!   [`ProcessGroup`] (e.g. the MPI world: [`UniqueId::share_over`]) or over a TCP
//!   rendezvous at `MASTER_ADDR:MASTER_PORT` ([`UniqueId::share_tcp`], torchrun-style).
//!   [`NcclComm::from_env`] does the whole thing from the launch environment.
//! - [`NcclComm`] owns one communicator on one device with its own CUDA stream. Its
//!   `*_device` methods take raw device pointers and a caller stream: this is the path from
//!   Burn CUDA tensors to NCCL (no host staging) that `bonfire-dtensor`'s `Cube` backend uses
//!   — see `docs/multi-process.md`.
//! - [`NcclComm::into_group`] wraps it as a [`ProcessGroup`] over *host* buffers (staged
//!   through device scratch), so the conformance suite, mismatch detection and timeouts work
//!   exactly as on the other backends.
//!
//! Failure semantics: NCCL calls are enqueued on a stream; the host polls the stream and
//! `ncclCommGetAsyncError` against the group's timeout and, on timeout or error, calls
//! `ncclCommAbort` (the communicator cannot be reused) and returns the error.
//!
//! Everything that needs a GPU is compiled in CI (`cargo xtask check-gpu`) and run by
//! `cargo xtask test-multi-gpu` on a GPU machine; the CPU-side parts (probing, id sharing,
//! the TCP rendezvous, argument checks) are tested everywhere.

mod backend;

pub use backend::NcclBackend;

use crate::rendezvous::Rendezvous;
use crate::{CommError, DType, LaunchEnv, ProcessGroup, ReduceOp, Result};
use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nccl::{result as nccl, sys as nsys};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub(crate) fn error(message: impl Into<String>) -> CommError {
    CommError::Backend {
        backend: "nccl",
        message: message.into(),
    }
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libraries {
    /// `ncclGetVersion`, e.g. 22304 for 2.23.4.
    pub nccl_version: i32,
    /// Number of CUDA devices visible to this process.
    pub devices: usize,
}

/// Checks that the CUDA driver library and NCCL can be loaded, without letting `cudarc`
/// panic. Call it (or anything in this module, which calls it) before using `cudarc`.
pub fn probe() -> Result<Libraries> {
    // SAFETY: only dlopen()s the candidate names and closes them again.
    let (cuda, nccl_present) = unsafe { (cusys::is_culib_present(), nsys::is_culib_present()) };
    let mut missing = Vec::new();
    if !cuda {
        missing.push(
            "libcuda.so.1 not found (the NVIDIA driver library: is this a GPU machine with the \
             driver installed?)",
        );
    }
    if !nccl_present {
        missing.push(
            "libnccl.so.2 not found (install NCCL, e.g. `apt install libnccl2`, or add its \
             directory to LD_LIBRARY_PATH)",
        );
    }
    if !missing.is_empty() {
        return Err(error(missing.join("; ")));
    }
    cu::init().map_err(|e| error(format!("cuInit failed: {e:?}")))?;
    let devices = cu::device::get_count().map_err(|e| error(format!("cuDeviceGetCount: {e:?}")))?;
    let nccl_version =
        nccl::get_nccl_version().map_err(|e| error(format!("ncclGetVersion: {e:?}")))?;
    Ok(Libraries {
        nccl_version,
        devices: devices.max(0) as usize,
    })
}

/// The 128-byte id every rank of a new NCCL communicator must share.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({:02x?}…)", &self.0[..8])
    }
}

/// Status byte in front of a shared id: 0 = valid, 1 = rank 0 failed to create one.
const ID_OK: u8 = 0;
const ID_FAILED: u8 = 1;

impl UniqueId {
    /// Creates a new id (`ncclGetUniqueId`); needs the libraries.
    pub fn new() -> Result<UniqueId> {
        probe()?;
        let id = nccl::get_uniqueid().map_err(|e| error(format!("ncclGetUniqueId: {e:?}")))?;
        let mut bytes = [0u8; 128];
        for (b, c) in bytes.iter_mut().zip(id.internal.iter()) {
            *b = *c as u8;
        }
        Ok(UniqueId(bytes))
    }

    fn to_sys(self) -> nsys::ncclUniqueId {
        let mut id = nsys::ncclUniqueId { internal: [0; 128] };
        for (c, b) in id.internal.iter_mut().zip(self.0) {
            *c = b as _;
        }
        id
    }

    /// Rank 0 of `pg` creates the id and broadcasts it; every rank returns it. If rank 0
    /// cannot create one (no NCCL there), every rank returns that error instead of hanging.
    pub fn share_over(pg: &ProcessGroup) -> Result<UniqueId> {
        Self::share_over_with(pg, UniqueId::new)
    }

    /// [`UniqueId::share_over`] with the id made by `make` on rank 0 (testable without NCCL).
    pub fn share_over_with(
        pg: &ProcessGroup,
        make: impl FnOnce() -> Result<UniqueId>,
    ) -> Result<UniqueId> {
        let mut msg = [0u8; 129];
        let mut failure = None;
        if pg.rank() == 0 {
            match make() {
                Ok(id) => msg[1..].copy_from_slice(&id.0),
                Err(e) => {
                    msg[0] = ID_FAILED;
                    let text = e.to_string();
                    let n = text.len().min(128);
                    msg[1..1 + n].copy_from_slice(&text.as_bytes()[..n]);
                    failure = Some(e);
                }
            }
        }
        pg.broadcast(&mut msg, 0)?;
        if let Some(e) = failure {
            return Err(e);
        }
        if msg[0] != ID_OK {
            let text = String::from_utf8_lossy(&msg[1..]);
            return Err(error(format!(
                "rank 0 could not create the NCCL id: {}",
                text.trim_end_matches('\0')
            )));
        }
        let mut id = [0u8; 128];
        id.copy_from_slice(&msg[1..]);
        Ok(UniqueId(id))
    }

    /// Shares the id over the TCP rendezvous `rv` (rank 0 creates it).
    pub fn share_tcp(rv: &Rendezvous) -> Result<UniqueId> {
        Self::share_tcp_with(rv, UniqueId::new)
    }

    /// [`UniqueId::share_tcp`] with the id made by `make` on rank 0 (testable without NCCL).
    pub fn share_tcp_with(
        rv: &Rendezvous,
        make: impl FnOnce() -> Result<UniqueId>,
    ) -> Result<UniqueId> {
        let bytes = if rv.rank == 0 {
            let id = make()?;
            rv.share(Some(&id.0))?
        } else {
            rv.share(None)?
        };
        let id: [u8; 128] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| error(format!("rendezvous sent {} bytes, not 128", bytes.len())))?;
        Ok(UniqueId(id))
    }
}

/// The NCCL data type of a dtype.
pub(crate) fn nccl_dtype(d: DType) -> nsys::ncclDataType_t {
    use nsys::ncclDataType_t::*;
    match d {
        DType::F32 => ncclFloat32,
        DType::F64 => ncclFloat64,
        DType::F16 => ncclFloat16,
        DType::BF16 => ncclBfloat16,
        DType::I32 => ncclInt32,
        DType::I64 => ncclInt64,
        DType::U8 => ncclUint8,
    }
}

/// The NCCL reduction of a reduce op (`Avg` is native since NCCL 2.10).
pub(crate) fn nccl_op(op: ReduceOp) -> nsys::ncclRedOp_t {
    use nsys::ncclRedOp_t::*;
    match op {
        ReduceOp::Sum => ncclSum,
        ReduceOp::Avg => ncclAvg,
        ReduceOp::Max => ncclMax,
        ReduceOp::Min => ncclMin,
        ReduceOp::Product => ncclProd,
    }
}

/// A raw CUDA stream handle (as used by Burn's CUDA runtime and cudarc).
pub type Stream = cusys::CUstream;
/// A raw device pointer.
pub type DevicePtr = cusys::CUdeviceptr;

fn stream_cast(s: Stream) -> nsys::cudaStream_t {
    s as nsys::cudaStream_t
}

/// One rank's NCCL communicator on one GPU.
pub struct NcclComm {
    comm: nsys::ncclComm_t,
    rank: usize,
    size: usize,
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
unsafe impl Sync for NcclComm {}

fn check_nccl(r: std::result::Result<nccl::NcclStatus, nccl::NcclError>, what: &str) -> Result<()> {
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

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn size(&self) -> usize {
        self.size
    }
    pub fn device(&self) -> usize {
        self.device
    }
    /// The communicator's own stream (used by host-staged calls).
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// Wraps this communicator as a [`ProcessGroup`] over host buffers.
    pub fn into_group(self, name: impl Into<String>) -> ProcessGroup {
        ProcessGroup::from_backend(Box::new(NcclBackend::new(self)), name)
    }

    fn ensure_usable(&self) -> Result<()> {
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

    fn check_count(&self, what: &str, root: Option<usize>) -> Result<()> {
        if let Some(root) = root {
            if root >= self.size {
                return Err(CommError::InvalidArgument {
                    group: "nccl".into(),
                    op: crate::OpKind::Broadcast,
                    message: format!("{what}: root {root} out of range for {} ranks", self.size),
                });
            }
        }
        Ok(())
    }

    // ----- device-pointer API: no host staging ---------------------------------------------
    //
    // These enqueue on `stream` and return at once, like NCCL itself; synchronise the stream
    // (or `wait_stream` with a deadline) before reading the results. Every rank must make the
    // same calls in the same order — nothing here compares fingerprints, which is what the
    // `ProcessGroup` wrapper adds.

    /// `recv = reduce(send)` over all ranks (`send == recv` for in place), `count` elements.
    ///
    /// # Safety
    /// `send`/`recv` must be device allocations of this communicator's device holding
    /// `count` elements of `dtype`, valid until the stream work completes.
    pub unsafe fn all_reduce_device(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: Stream,
    ) -> Result<()> {
        self.ensure_usable()?;
        // SAFETY: forwarded from the caller.
        unsafe {
            check_nccl(
                nccl::all_reduce(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    nccl_dtype(dtype),
                    nccl_op(op),
                    self.comm,
                    stream_cast(stream),
                ),
                "ncclAllReduce",
            )
        }
    }

    /// Broadcast of `count` elements from `root` (in place when `send == recv`).
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_device`].
    pub unsafe fn broadcast_device(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        root: usize,
        stream: Stream,
    ) -> Result<()> {
        self.ensure_usable()?;
        self.check_count("broadcast", Some(root))?;
        // SAFETY: forwarded from the caller.
        unsafe {
            check_nccl(
                nccl::broadcast(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    nccl_dtype(dtype),
                    root as i32,
                    self.comm,
                    stream_cast(stream),
                ),
                "ncclBroadcast",
            )
        }
    }

    /// Reduction of `count` elements into `recv` on `root`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_device`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_device(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        stream: Stream,
    ) -> Result<()> {
        self.ensure_usable()?;
        self.check_count("reduce", Some(root))?;
        // SAFETY: forwarded from the caller.
        unsafe {
            check_nccl(
                nccl::reduce(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    nccl_dtype(dtype),
                    nccl_op(op),
                    root as i32,
                    self.comm,
                    stream_cast(stream),
                ),
                "ncclReduce",
            )
        }
    }

    /// `recv` (size × `send_count`) = every rank's `send`, in rank order.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_device`], with `recv` holding `size × send_count` elements.
    pub unsafe fn all_gather_device(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: DType,
        stream: Stream,
    ) -> Result<()> {
        self.ensure_usable()?;
        // SAFETY: forwarded from the caller.
        unsafe {
            check_nccl(
                nccl::all_gather(
                    send as *const c_void,
                    recv as *mut c_void,
                    send_count,
                    nccl_dtype(dtype),
                    self.comm,
                    stream_cast(stream),
                ),
                "ncclAllGather",
            )
        }
    }

    /// `recv` (`recv_count`) = reduction of every rank's piece `rank` of `send`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_device`], with `send` holding `size × recv_count` elements.
    pub unsafe fn reduce_scatter_device(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: Stream,
    ) -> Result<()> {
        self.ensure_usable()?;
        // SAFETY: forwarded from the caller.
        unsafe {
            check_nccl(
                nccl::reduce_scatter(
                    send as *const c_void,
                    recv as *mut c_void,
                    recv_count,
                    nccl_dtype(dtype),
                    nccl_op(op),
                    self.comm,
                    stream_cast(stream),
                ),
                "ncclReduceScatter",
            )
        }
    }

    /// Point-to-point exchanges fused into one NCCL group (all-to-all, uneven gathers, ring
    /// steps): `sends[i] = (ptr, count, peer)`, `recvs[i] = (ptr, count, peer)`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_device`] for every pointer and count.
    pub unsafe fn exchange_device(
        &self,
        sends: &[(DevicePtr, usize, usize)],
        recvs: &[(DevicePtr, usize, usize)],
        dtype: DType,
        stream: Stream,
    ) -> Result<()> {
        self.ensure_usable()?;
        if let Some(&(_, _, p)) = sends.iter().chain(recvs).find(|(_, _, p)| *p >= self.size) {
            return Err(error(format!(
                "peer {p} out of range for {} ranks",
                self.size
            )));
        }
        check_nccl(nccl::group_start(), "ncclGroupStart")?;
        let mut result = Ok(());
        for &(ptr, count, peer) in sends {
            if count > 0 && result.is_ok() {
                // SAFETY: forwarded from the caller.
                result = check_nccl(
                    unsafe {
                        nccl::send(
                            ptr as *const c_void,
                            count,
                            nccl_dtype(dtype),
                            peer as i32,
                            self.comm,
                            stream_cast(stream),
                        )
                    },
                    "ncclSend",
                );
            }
        }
        for &(ptr, count, peer) in recvs {
            if count > 0 && result.is_ok() {
                // SAFETY: forwarded from the caller.
                result = check_nccl(
                    unsafe {
                        nccl::recv(
                            ptr as *mut c_void,
                            count,
                            nccl_dtype(dtype),
                            peer as i32,
                            self.comm,
                            stream_cast(stream),
                        )
                    },
                    "ncclRecv",
                );
            }
        }
        let end = check_nccl(nccl::group_end(), "ncclGroupEnd");
        result.and(end)
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
    Timeout,
    Error(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch;

    #[test]
    fn missing_libraries_are_an_error_not_a_panic() {
        // On a machine without the NVIDIA driver / NCCL (CI), every entry point must say so.
        match probe() {
            Ok(libs) => eprintln!("CUDA + NCCL present here: {libs:?}"),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("not found"), "{msg}");
                assert!(matches!(
                    e,
                    CommError::Backend {
                        backend: "nccl",
                        ..
                    }
                ));
                assert!(UniqueId::new().is_err());
                assert!(NcclComm::init(&UniqueId([0; 128]), 0, 1, 0).is_err());
            }
        }
    }

    #[test]
    fn init_checks_arguments_before_touching_cuda() {
        let e = NcclComm::init(&UniqueId([0; 128]), 2, 2, 0).unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");
    }

    #[test]
    fn id_is_shared_over_a_process_group_and_failures_reach_every_rank() {
        let want = UniqueId([7; 128]);
        let ids = launch(3, |pg| UniqueId::share_over_with(&pg, || Ok(want))).unwrap();
        assert!(ids.into_iter().all(|id| id.unwrap() == want));
        let errs = launch(3, |pg| {
            UniqueId::share_over_with(&pg, || Err(error("libnccl.so.2 not found")))
        })
        .unwrap();
        for e in errs {
            let msg = e.unwrap_err().to_string();
            assert!(msg.contains("libnccl.so.2 not found"), "{msg}");
        }
    }

    #[test]
    fn id_is_shared_over_tcp_rendezvous() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let want = UniqueId([42; 128]);
        let ids: Vec<Result<UniqueId>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    s.spawn(move || {
                        let rv = Rendezvous {
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            rank,
                            size: 3,
                            key: 0,
                            timeout: Duration::from_secs(10),
                        };
                        UniqueId::share_tcp_with(&rv, || Ok(want))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(ids.into_iter().all(|id| id.unwrap() == want));
    }

    #[test]
    fn dtype_and_op_mapping() {
        assert_eq!(nccl_dtype(DType::BF16), nsys::ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_op(ReduceOp::Avg), nsys::ncclRedOp_t::ncclAvg);
    }
}
