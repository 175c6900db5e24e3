//! The MPI backend: one communicator per group.
//!
//! A collective runs in two phases:
//! 1. **Handshake.** Every rank sends its encoded [`Fingerprint`](crate::Fingerprint) to every
//!    peer with nonblocking point-to-point calls and polls them (`MPI_Test`, backing off to
//!    short sleeps) until all arrived or the timeout passed. Then every rank holds every
//!    fingerprint, so a mismatch is reported by every rank with both views and nothing is
//!    moved; a missing rank is named in a timeout; a peer that shut down is reported as failed.
//! 2. **Data.** Once every rank is known to be in the same call, the data moves with the
//!    library's tuned blocking collective (all ranks are present, so it cannot wait on an
//!    absent peer): `MPI_Allreduce` with `MPI_IN_PLACE`, `MPI_Reduce_scatter` for uneven
//!    pieces, `MPI_Allgatherv`, `MPI_Alltoallv`... through `mpi-sys`, because the safe API
//!    of the `mpi` crate has neither in-place reductions nor uneven reduce-scatter.
//!
//! `f16`/`bf16` reductions are widened to `f32` in a reused scratch buffer, reduced as `f32`
//! and rounded once (MPI has no 16-bit float type; this also matches the in-process backend
//! bit for bit). `Avg` is a `Sum` followed by a local division. Large `f32`/`f64`
//! all-reduces take a ring path with persistent scratch (see [`RING_THRESHOLD_BYTES`]).

use super::runtime::{Backoff, Comm, Request, Runtime};
use crate::backend::{Backend, CallContext};
use crate::collective::{Collective, offsets_into};
use crate::reduce::finish_avg;
use crate::wire;
use crate::{BufMut, BufRef, CommError, DType, ReduceOp, Result};
use half::{bf16, f16};
use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tag of handshake messages on a group's collective communicator.
const HANDSHAKE_TAG: c_int = 1;
/// Tag of `new_group` agreement messages.
const NEW_GROUP_TAG: c_int = 2;
/// Tags of ring all-reduce steps.
const RING_TAG: c_int = 3;
/// User tags map onto MPI tags modulo this (the smallest `MPI_TAG_UB` the standard allows);
/// the full tag travels in the message header and is checked by the receiver.
const USER_TAG_SPACE: u64 = 32768;

/// All-reduces of at least this many bytes (f32/f64) use the ring path with persistent
/// scratch. OpenMPI's own large-message all-reduce mallocs a temporary of half the message
/// each call; glibc serves that (≥ 32 MiB) with a fresh `mmap`, so every call page-faults
/// it in — measured at half the bandwidth. Override with `BONFIRE_MPI_RING_BYTES`
/// (`0` disables the ring path).
pub const RING_THRESHOLD_BYTES: usize = 16 << 20;

fn ring_threshold() -> usize {
    std::env::var("BONFIRE_MPI_RING_BYTES")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .map(|v| if v == 0 { usize::MAX } else { v })
        .unwrap_or(RING_THRESHOLD_BYTES)
}

/// Reused scratch memory of one group (no allocation in steady state).
#[derive(Default)]
struct Scratch {
    /// f32 scratch for widened 16-bit floats, and ring receive space (as u64 for alignment).
    a: Vec<u64>,
    b: Vec<u64>,
    ints: Vec<c_int>,
    offsets: Vec<usize>,
    matrix: Vec<u64>,
    /// Handshake buffers: this rank's notice and one per peer.
    mine: Box<wire::Words>,
    theirs: Vec<wire::Words>,
    reqs: Vec<Request>,
    peers: Vec<usize>,
}

fn words_for(bytes: usize) -> usize {
    bytes.div_ceil(8)
}

fn grow(v: &mut Vec<u64>, bytes: usize) -> &mut [u8] {
    let words = words_for(bytes);
    if v.len() < words {
        v.resize(words, 0);
    }
    &mut bytemuck::cast_slice_mut::<u64, u8>(v)[..bytes]
}

pub(crate) struct MpiBackend {
    rt: Arc<Runtime>,
    /// Collectives and handshakes.
    coll: Comm,
    /// User point-to-point messages.
    p2p: Comm,
    rank: usize,
    size: usize,
    world: Vec<usize>,
    scratch: Mutex<Scratch>,
    aborted: Mutex<Option<String>>,
    ring_threshold: usize,
}

/// MPI datatype moving elements of `size` bytes.
fn move_type(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading initialised extern constants.
    unsafe {
        match dtype.size() {
            1 => ffi::RSMPI_UINT8_T,
            2 => ffi::RSMPI_UINT16_T,
            4 => ffi::RSMPI_UINT32_T,
            _ => ffi::RSMPI_UINT64_T,
        }
    }
}

/// MPI datatype for reducing `dtype`, or `None` for the 16-bit floats (widened to f32).
fn reduce_type(dtype: DType) -> Option<ffi::MPI_Datatype> {
    // SAFETY: reading initialised extern constants.
    unsafe {
        match dtype {
            DType::F32 => Some(ffi::RSMPI_FLOAT),
            DType::F64 => Some(ffi::RSMPI_DOUBLE),
            DType::I32 => Some(ffi::RSMPI_INT32_T),
            DType::I64 => Some(ffi::RSMPI_INT64_T),
            DType::U8 => Some(ffi::RSMPI_UINT8_T),
            DType::F16 | DType::BF16 => None,
        }
    }
}

fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading initialised extern constants.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
            ReduceOp::Product => ffi::RSMPI_PROD,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Min => ffi::RSMPI_MIN,
        }
    }
}

/// Converts 16-bit floats to f32 into `out` (resized).
fn widen(dtype: DType, src: &[u8], out: &mut Vec<u64>) -> usize {
    let n = src.len() / 2;
    let dst: &mut [f32] = bytemuck::cast_slice_mut(grow(out, n * 4));
    match dtype {
        DType::F16 => {
            for (d, s) in dst.iter_mut().zip(bytemuck::cast_slice::<u8, f16>(src)) {
                *d = s.to_f32();
            }
        }
        _ => {
            for (d, s) in dst.iter_mut().zip(bytemuck::cast_slice::<u8, bf16>(src)) {
                *d = s.to_f32();
            }
        }
    }
    n
}

/// Rounds f32 back to 16-bit floats, dividing by `avg` first when given.
fn narrow(dtype: DType, src: &[f32], dst: &mut [u8], avg: Option<usize>) {
    let div = avg.map_or(1.0, |n| n as f32);
    match dtype {
        DType::F16 => {
            for (d, s) in bytemuck::cast_slice_mut::<u8, f16>(dst).iter_mut().zip(src) {
                *d = f16::from_f32(if avg.is_some() { s / div } else { *s });
            }
        }
        _ => {
            for (d, s) in bytemuck::cast_slice_mut::<u8, bf16>(dst)
                .iter_mut()
                .zip(src)
            {
                *d = bf16::from_f32(if avg.is_some() { s / div } else { *s });
            }
        }
    }
}

/// Zero-length buffers get this address: an empty Rust slice's dangling pointer can equal
/// `MPI_IN_PLACE` (`(void*)1` in OpenMPI, for `u8`), which MPI would misread.
static EMPTY: [u64; 8] = [0; 8];

fn cptr(bytes: &[u8]) -> *const c_void {
    if bytes.is_empty() {
        EMPTY.as_ptr() as *const c_void
    } else {
        bytes.as_ptr() as *const c_void
    }
}

fn mptr(bytes: &mut [u8]) -> *mut c_void {
    if bytes.is_empty() {
        // Never written through: MPI moves zero bytes into an empty buffer.
        EMPTY.as_ptr() as *mut c_void
    } else {
        bytes.as_mut_ptr() as *mut c_void
    }
}

fn cint(n: usize, ctx: &CallContext<'_>) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| CommError::Unsupported {
        backend: "mpi",
        what: format!(
            "{} with {n} elements (MPI counts are C ints; split the call) in {}",
            ctx.fingerprint.op, ctx.fingerprint
        ),
    })
}

fn check(rc: c_int, what: &str) -> Result<()> {
    // MPI_SUCCESS is 0 in every implementation.
    if rc == 0 {
        Ok(())
    } else {
        Err(CommError::Backend {
            backend: "mpi",
            message: format!("{what} failed with MPI error code {rc}"),
        })
    }
}

impl MpiBackend {
    /// A backend on a new communicator: `coll` is used for collectives; a duplicate is made
    /// for point-to-point traffic.
    pub(crate) fn new(rt: Arc<Runtime>, coll: ffi::MPI_Comm, world: Vec<usize>) -> Self {
        let (mut rank, mut size) = (0, 0);
        let mut p2p: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: `coll` is a valid communicator of which this process is a member.
        rt.call(|| unsafe {
            ffi::MPI_Comm_rank(coll, &mut rank);
            ffi::MPI_Comm_size(coll, &mut size);
            ffi::MPI_Comm_dup(coll, &mut p2p);
        });
        Self {
            rt,
            coll: Comm(coll),
            p2p: Comm(p2p),
            rank: rank as usize,
            size: size as usize,
            world,
            scratch: Mutex::new(Scratch::default()),
            aborted: Mutex::new(None),
            ring_threshold: ring_threshold(),
        }
    }

    fn check_aborted(&self, ctx: &CallContext<'_>) -> Result<()> {
        if let Some(reason) = self
            .aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Err(ctx.aborted(reason));
        }
        Ok(())
    }

    /// Marks this group unusable and schedules the end of the job.
    fn fatal(&self, e: CommError) -> CommError {
        let mut aborted = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        if aborted.is_none() {
            *aborted = Some(format!("an earlier call failed: {e}"));
        }
        drop(aborted);
        self.rt.fail(&e.to_string());
        e
    }

    /// Polls `reqs` (each waiting on group rank `peers[i]`) until all completed.
    fn wait_all(
        &self,
        reqs: &mut [Request],
        peers: &[usize],
        ctx: &CallContext<'_>,
        started: Instant,
    ) -> Result<()> {
        let deadline = started + ctx.timeout;
        let mut backoff = Backoff::new();
        loop {
            self.rt.progress();
            let mut pending = false;
            for req in reqs.iter_mut() {
                if !self.rt.test(req) {
                    pending = true;
                }
            }
            if !pending {
                return Ok(());
            }
            let waiting = || {
                let mut m: Vec<usize> = reqs
                    .iter()
                    .zip(peers)
                    .filter(|(r, _)| !r.is_null())
                    .map(|(_, &p)| p)
                    .collect();
                m.sort_unstable();
                m.dedup();
                m
            };
            if let Some(&gone) = waiting().iter().find(|&&p| self.rt.gone(self.world[p])) {
                return Err(self.fatal(ctx.peer_failed(
                    gone,
                    format!(
                        "it shut down (world rank {}) without making this call",
                        self.world[gone]
                    ),
                )));
            }
            if Instant::now() >= deadline {
                return Err(self.fatal(ctx.timeout_error(waiting(), started.elapsed())));
            }
            backoff.snooze();
        }
    }

    /// Phase 1: exchange fingerprints with every peer; returns the first disagreeing peer.
    fn handshake(&self, s: &mut Scratch, ctx: &CallContext<'_>) -> Result<()> {
        let started = Instant::now();
        let n = self.size;
        *s.mine = wire::encode(&ctx.fingerprint);
        s.theirs.resize(n, [0; wire::WORDS]);
        s.reqs.clear();
        s.peers.clear();
        for peer in (0..n).filter(|&p| p != self.rank) {
            let (mut rreq, mut sreq) = (Request::null().0, Request::null().0);
            let recv = s.theirs[peer].as_mut_ptr() as *mut c_void;
            let send = s.mine.as_ptr() as *const c_void;
            // SAFETY: the buffers live in the scratch, which outlives the requests (they are
            // completed below, or the job is aborted with the scratch still alive).
            self.rt.call(|| unsafe {
                ffi::MPI_Irecv(
                    recv,
                    wire::WORDS as c_int,
                    ffi::RSMPI_UINT64_T,
                    peer as c_int,
                    HANDSHAKE_TAG,
                    self.coll.0,
                    &mut rreq,
                );
                ffi::MPI_Isend(
                    send,
                    wire::WORDS as c_int,
                    ffi::RSMPI_UINT64_T,
                    peer as c_int,
                    HANDSHAKE_TAG,
                    self.coll.0,
                    &mut sreq,
                );
            });
            s.reqs.push(Request(rreq));
            s.peers.push(peer);
            s.reqs.push(Request(sreq));
            s.peers.push(peer);
        }
        let (mut reqs, peers) = (std::mem::take(&mut s.reqs), std::mem::take(&mut s.peers));
        let waited = self.wait_all(&mut reqs, &peers, ctx, started);
        s.reqs = reqs;
        s.peers = peers;
        if waited.is_err() {
            // Requests are still posted on the scratch buffers: keep them alive for good.
            std::mem::forget(std::mem::take(s));
        }
        waited?;
        for peer in (0..n).filter(|&p| p != self.rank) {
            match wire::decode(&s.theirs[peer]) {
                Some(fp) if fp == ctx.fingerprint => {}
                Some(fp) => return Err(ctx.mismatch(peer, fp)),
                None => {
                    return Err(self.fatal(CommError::Backend {
                        backend: "mpi",
                        message: format!("rank {peer} sent a malformed handshake"),
                    }));
                }
            }
        }
        Ok(())
    }

    fn comm(&self) -> ffi::MPI_Comm {
        self.coll.0
    }

    /// Phase 2: moves the data of a call every rank agreed on.
    fn move_data(
        &self,
        call: Collective<'_>,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let n = self.size;
        let comm = self.comm();
        let dtype = call.dtype();
        let mt = move_type(dtype);
        let rt = &self.rt;
        match call {
            Collective::Barrier => Ok(()),
            Collective::AllReduce { mut buf, op } => {
                let count = cint(buf.len(), ctx)?;
                let avg = (op == ReduceOp::Avg).then_some(n);
                match reduce_type(dtype) {
                    Some(rt_type) => {
                        if n > 1
                            && matches!(dtype, DType::F32 | DType::F64)
                            && buf.bytes().len() >= self.ring_threshold
                        {
                            self.ring_all_reduce(buf.reborrow(), op, s, ctx)?;
                        } else {
                            self.all_reduce_raw(buf.bytes_mut(), count, rt_type, op, s)?;
                        }
                        if let Some(n) = avg {
                            finish_avg(&mut buf, n);
                        }
                        Ok(())
                    }
                    None => {
                        let len = widen(dtype, buf.bytes(), &mut s.a);
                        let wide = grow(&mut s.a, len * 4);
                        let ft = unsafe { ffi::RSMPI_FLOAT };
                        let mut tmp = std::mem::take(&mut s.b);
                        let r = self.all_reduce_raw_with(wide, count, ft, op, &mut tmp);
                        s.b = tmp;
                        r?;
                        let wide: &[f32] = bytemuck::cast_slice(&grow(&mut s.a, len * 4)[..]);
                        narrow(dtype, wide, buf.bytes_mut(), avg);
                        Ok(())
                    }
                }
            }
            Collective::Broadcast { mut buf, root } => {
                let count = cint(buf.len(), ctx)?;
                let p = mptr(buf.bytes_mut());
                check(
                    rt.call(|| unsafe { ffi::MPI_Bcast(p, count, mt, root as c_int, comm) }),
                    "MPI_Bcast",
                )
            }
            Collective::Reduce { mut buf, op, root } => {
                let count = cint(buf.len(), ctx)?;
                let is_root = self.rank == root;
                let avg = (op == ReduceOp::Avg).then_some(n);
                let (wide_type, len) = match reduce_type(dtype) {
                    Some(t) => (t, 0),
                    None => (
                        unsafe { ffi::RSMPI_FLOAT },
                        widen(dtype, buf.bytes(), &mut s.a),
                    ),
                };
                let data: &mut [u8] = if reduce_type(dtype).is_some() {
                    buf.bytes_mut()
                } else {
                    grow(&mut s.a, len * 4)
                };
                if is_root {
                    self.reduce_root(data, count, wide_type, op, root, &mut s.b)?;
                } else {
                    let p = cptr(data);
                    check(
                        rt.call(|| unsafe {
                            ffi::MPI_Reduce(
                                p,
                                std::ptr::null_mut(),
                                count,
                                wide_type,
                                mpi_op(op),
                                root as c_int,
                                comm,
                            )
                        }),
                        "MPI_Reduce",
                    )?;
                }
                if is_root {
                    if reduce_type(dtype).is_some() {
                        if let Some(n) = avg {
                            finish_avg(&mut buf, n);
                        }
                    } else {
                        let wide: &[f32] = bytemuck::cast_slice(&grow(&mut s.a, len * 4)[..]);
                        narrow(dtype, wide, buf.bytes_mut(), avg);
                    }
                }
                Ok(())
            }
            Collective::AllGather {
                send,
                mut recv,
                counts,
            } => {
                let sp = cptr(send.bytes());
                let rp = mptr(recv.bytes_mut());
                match counts {
                    None => {
                        let c = cint(send.len(), ctx)?;
                        check(
                            rt.call(|| unsafe { ffi::MPI_Allgather(sp, c, mt, rp, c, mt, comm) }),
                            "MPI_Allgather",
                        )
                    }
                    Some(counts) => {
                        let (cs, ds) = self.counts_displs(counts, s, ctx)?;
                        let c = cint(send.len(), ctx)?;
                        check(
                            rt.call(|| unsafe {
                                ffi::MPI_Allgatherv(sp, c, mt, rp, cs, ds, mt, comm)
                            }),
                            "MPI_Allgatherv",
                        )
                    }
                }
            }
            Collective::ReduceScatter {
                send,
                mut recv,
                op,
                counts,
            } => {
                let avg = (op == ReduceOp::Avg).then_some(n);
                let total = send.len();
                let mine = recv.len();
                // Per-rank counts as C ints (even: all equal).
                s.ints.clear();
                match counts {
                    None => s.ints.extend(std::iter::repeat_n(cint(mine, ctx)?, n)),
                    Some(c) => s.ints.extend(c.iter().map(|&x| x as c_int)),
                }
                let cs = s.ints.as_ptr();
                cint(total, ctx)?;
                match reduce_type(dtype) {
                    Some(t) => {
                        let sp = cptr(send.bytes());
                        let rp = mptr(recv.bytes_mut());
                        check(
                            rt.call(|| unsafe {
                                ffi::MPI_Reduce_scatter(sp, rp, cs, t, mpi_op(op), comm)
                            }),
                            "MPI_Reduce_scatter",
                        )?;
                        if let Some(n) = avg {
                            finish_avg(&mut recv, n);
                        }
                    }
                    None => {
                        widen(dtype, send.bytes(), &mut s.a);
                        let sp = cptr(grow(&mut s.a, total * 4));
                        let rp = mptr(grow(&mut s.b, mine * 4));
                        let ft = unsafe { ffi::RSMPI_FLOAT };
                        check(
                            rt.call(|| unsafe {
                                ffi::MPI_Reduce_scatter(sp, rp, cs, ft, mpi_op(op), comm)
                            }),
                            "MPI_Reduce_scatter",
                        )?;
                        let wide: &[f32] = bytemuck::cast_slice(&grow(&mut s.b, mine * 4)[..]);
                        narrow(dtype, wide, recv.bytes_mut(), avg);
                    }
                }
                Ok(())
            }
            Collective::AllToAll {
                send,
                mut recv,
                counts,
            } => {
                let sp = cptr(send.bytes());
                let rp = mptr(recv.bytes_mut());
                match counts {
                    None => {
                        let piece = cint(send.len() / n, ctx)?;
                        check(
                            rt.call(|| unsafe {
                                ffi::MPI_Alltoall(sp, piece, mt, rp, piece, mt, comm)
                            }),
                            "MPI_Alltoall",
                        )
                    }
                    Some(c) => {
                        self.check_all_to_all_counts(c.send, c.recv, s, ctx)?;
                        cint(send.len(), ctx)?;
                        cint(recv.len(), ctx)?;
                        let mut ints = std::mem::take(&mut s.ints);
                        ints.clear();
                        for counts in [c.send, c.recv] {
                            offsets_into(counts, &mut s.offsets);
                            ints.extend(counts.iter().map(|&x| x as c_int));
                            ints.extend(s.offsets.iter().map(|&x| x as c_int));
                        }
                        let (sc, sd, rc, rd) = (
                            ints.as_ptr(),
                            ints[n..].as_ptr(),
                            ints[2 * n..].as_ptr(),
                            ints[3 * n..].as_ptr(),
                        );
                        let r = check(
                            rt.call(|| unsafe {
                                ffi::MPI_Alltoallv(sp, sc, sd, mt, rp, rc, rd, mt, comm)
                            }),
                            "MPI_Alltoallv",
                        );
                        s.ints = ints;
                        r
                    }
                }
            }
        }
    }

    /// Fills the scratch with per-rank counts and displacements as C ints; returns pointers.
    fn counts_displs(
        &self,
        counts: &[usize],
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<(*const c_int, *const c_int)> {
        cint(counts.iter().sum(), ctx)?;
        offsets_into(counts, &mut s.offsets);
        s.ints.clear();
        s.ints.extend(counts.iter().map(|&c| c as c_int));
        s.ints.extend(s.offsets.iter().map(|&o| o as c_int));
        let n = counts.len();
        Ok((s.ints.as_ptr(), s.ints[n..].as_ptr()))
    }

    /// Every rank learns every rank's all-to-all counts and checks each (sender, receiver)
    /// pair, so a disagreement is reported identically everywhere before data moves.
    fn check_all_to_all_counts(
        &self,
        send: &[usize],
        recv: &[usize],
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let n = self.size;
        let mut row: Vec<u64> = Vec::with_capacity(2 * n);
        row.extend(send.iter().map(|&c| c as u64));
        row.extend(recv.iter().map(|&c| c as u64));
        s.matrix.resize(2 * n * n, 0);
        let (rp, mp) = (
            row.as_ptr() as *const c_void,
            s.matrix.as_mut_ptr() as *mut c_void,
        );
        let c = (2 * n) as c_int;
        check(
            self.rt.call(|| unsafe {
                ffi::MPI_Allgather(
                    rp,
                    c,
                    ffi::RSMPI_UINT64_T,
                    mp,
                    c,
                    ffi::RSMPI_UINT64_T,
                    self.comm(),
                )
            }),
            "MPI_Allgather (all_to_all counts)",
        )?;
        ctx.check_all_to_all_counts(
            n,
            |i, j| s.matrix[i * 2 * n + j] as usize,
            |i, j| s.matrix[j * 2 * n + n + i] as usize,
        )?;
        Ok(())
    }

    fn all_reduce_raw(
        &self,
        data: &mut [u8],
        count: c_int,
        t: ffi::MPI_Datatype,
        op: ReduceOp,
        s: &mut Scratch,
    ) -> Result<()> {
        let mut tmp = std::mem::take(&mut s.b);
        let r = self.all_reduce_raw_with(data, count, t, op, &mut tmp);
        s.b = tmp;
        r
    }

    /// In-place `MPI_Allreduce`: `MPI_IN_PLACE` when the library's value is known, otherwise
    /// via a reused scratch copy.
    fn all_reduce_raw_with(
        &self,
        data: &mut [u8],
        count: c_int,
        t: ffi::MPI_Datatype,
        op: ReduceOp,
        tmp: &mut Vec<u64>,
    ) -> Result<()> {
        let comm = self.comm();
        let p = mptr(data);
        match self.rt.in_place() {
            Some(inplace) => check(
                self.rt
                    .call(|| unsafe { ffi::MPI_Allreduce(inplace, p, count, t, mpi_op(op), comm) }),
                "MPI_Allreduce",
            ),
            None => {
                let copy = grow(tmp, data.len());
                copy.copy_from_slice(data);
                let cp = cptr(copy);
                check(
                    self.rt
                        .call(|| unsafe { ffi::MPI_Allreduce(cp, p, count, t, mpi_op(op), comm) }),
                    "MPI_Allreduce",
                )
            }
        }
    }

    fn reduce_root(
        &self,
        data: &mut [u8],
        count: c_int,
        t: ffi::MPI_Datatype,
        op: ReduceOp,
        root: usize,
        tmp: &mut Vec<u64>,
    ) -> Result<()> {
        let comm = self.comm();
        let p = mptr(data);
        let send = match self.rt.in_place() {
            Some(inplace) => inplace,
            None => {
                let copy = grow(tmp, data.len());
                copy.copy_from_slice(data);
                cptr(copy)
            }
        };
        check(
            self.rt.call(|| unsafe {
                ffi::MPI_Reduce(send, p, count, t, mpi_op(op), root as c_int, comm)
            }),
            "MPI_Reduce",
        )
    }

    /// Ring all-reduce (reduce-scatter then all-gather) with `MPI_Sendrecv` and scratch that
    /// persists across calls, so large messages never page-fault a fresh temporary.
    /// Each rank sends and receives 2·(n−1)/n of the buffer, as in OpenMPI's ring.
    fn ring_all_reduce(
        &self,
        mut buf: BufMut<'_>,
        op: ReduceOp,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let n = self.size;
        let me = self.rank;
        let dtype = buf.dtype();
        let esize = dtype.size();
        let len = buf.len();
        let t = reduce_type(dtype).expect("ring path is for f32/f64");
        let piece = len.div_ceil(n);
        let range = |k: usize| (k * piece).min(len)..((k + 1) * piece).min(len);
        let right = ((me + 1) % n) as c_int;
        let left = ((me + n - 1) % n) as c_int;
        let comm = self.comm();
        let scratch = grow(&mut s.a, piece * esize);
        let sp = scratch.as_mut_ptr();
        let op_sum = if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        let base = buf.bytes_mut().as_mut_ptr();
        // Reduce-scatter: after step k, rank r holds the partial reduction of piece
        // (r − k − 1) mod n over k + 2 ranks; at the end, piece (r + 1) mod n is complete.
        for step in 0..n - 1 {
            let send_piece = range((me + n - step) % n);
            let recv_piece = range((me + n - step - 1) % n);
            let sc = cint(send_piece.len(), ctx)?;
            let rc = cint(recv_piece.len(), ctx)?;
            // SAFETY: disjoint pieces of the caller's buffer and the scratch, sized above.
            let rc_ = unsafe {
                let sbuf = base.add(send_piece.start * esize) as *const c_void;
                self.rt.call(|| {
                    ffi::MPI_Sendrecv(
                        sbuf,
                        sc,
                        t,
                        right,
                        RING_TAG,
                        sp as *mut c_void,
                        rc,
                        t,
                        left,
                        RING_TAG,
                        comm,
                        ffi::RSMPI_STATUS_IGNORE,
                    )
                })
            };
            check(rc_, "MPI_Sendrecv (ring reduce-scatter)")?;
            let dst = unsafe { base.add(recv_piece.start * esize) };
            let m = recv_piece.len();
            // SAFETY: `dst` and the scratch hold `m` elements each and do not overlap; the
            // caller's buffer is exclusively borrowed by this call.
            let (acc, other) = unsafe {
                (
                    std::slice::from_raw_parts_mut(dst, m * esize),
                    std::slice::from_raw_parts(sp as *const u8, m * esize),
                )
            };
            crate::reduce::reduce_into(
                op_sum,
                &mut BufMut::from_bytes(dtype, acc),
                BufRef::from_bytes(dtype, other),
            );
        }
        // All-gather: circulate the completed pieces.
        for step in 0..n - 1 {
            let send_piece = range((me + 1 + n - step) % n);
            let recv_piece = range((me + n - step) % n);
            let sc = cint(send_piece.len(), ctx)?;
            let rc = cint(recv_piece.len(), ctx)?;
            // SAFETY: disjoint pieces of the caller's buffer.
            let rc_ = unsafe {
                let sbuf = base.add(send_piece.start * esize) as *const c_void;
                let rbuf = base.add(recv_piece.start * esize) as *mut c_void;
                self.rt.call(|| {
                    ffi::MPI_Sendrecv(
                        sbuf,
                        sc,
                        t,
                        right,
                        RING_TAG,
                        rbuf,
                        rc,
                        t,
                        left,
                        RING_TAG,
                        comm,
                        ffi::RSMPI_STATUS_IGNORE,
                    )
                })
            };
            check(rc_, "MPI_Sendrecv (ring all-gather)")?;
        }
        Ok(())
    }

    fn user_tag(tag: u64) -> c_int {
        (tag % USER_TAG_SPACE) as c_int
    }
}

impl Backend for MpiBackend {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn world_ranks(&self) -> Vec<usize> {
        self.world.clone()
    }

    fn collective(&self, call: Collective<'_>, ctx: &CallContext<'_>) -> Result<()> {
        self.check_aborted(ctx)?;
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *guard;
        if self.size > 1 {
            self.handshake(s, ctx)?;
        }
        match self.move_data(call, s, ctx) {
            Ok(()) => Ok(()),
            Err(e @ (CommError::CountMismatch { .. } | CommError::Unsupported { .. })) => Err(e),
            Err(e) => Err(self.fatal(e)),
        }
    }

    fn send(&self, buf: BufRef<'_>, dst: usize, ctx: &CallContext<'_>) -> Result<()> {
        self.check_aborted(ctx)?;
        let total = wire::BYTES + buf.bytes().len();
        cint(total, ctx)?;
        let mut msg = self.rt.buffer();
        msg.clear();
        msg.resize(wire::BYTES, 0);
        wire::to_bytes(&wire::encode(&ctx.fingerprint), &mut msg);
        msg.extend_from_slice(buf.bytes());
        let tag = Self::user_tag(ctx.fingerprint.tag.unwrap_or(0));
        self.rt.isend(msg, dst, tag, self.p2p);
        self.rt.progress();
        Ok(())
    }

    fn recv(&self, mut buf: BufMut<'_>, src: usize, ctx: &CallContext<'_>) -> Result<()> {
        self.check_aborted(ctx)?;
        let tag = Self::user_tag(ctx.fingerprint.tag.unwrap_or(0));
        let started = Instant::now();
        let deadline = started + ctx.timeout;
        let mut backoff = Backoff::new();
        let mut message: ffi::MPI_Message = unsafe { ffi::RSMPI_MESSAGE_NULL };
        // SAFETY: a plain C struct filled in by MPI.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        loop {
            self.rt.progress();
            let mut flag: c_int = 0;
            // SAFETY: valid out-pointers; matched probe is thread-safe.
            self.rt.call(|| unsafe {
                ffi::MPI_Improbe(
                    src as c_int,
                    tag,
                    self.p2p.0,
                    &mut flag,
                    &mut message,
                    &mut status,
                )
            });
            if flag != 0 {
                break;
            }
            if self.rt.gone(self.world[src]) {
                return Err(self.fatal(ctx.peer_failed(
                    src,
                    format!(
                        "it shut down (world rank {}) without sending",
                        self.world[src]
                    ),
                )));
            }
            if Instant::now() >= deadline {
                return Err(self.fatal(ctx.timeout_error(vec![src], started.elapsed())));
            }
            backoff.snooze();
        }
        let mut count: c_int = 0;
        unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
        let mut staging = self.rt.buffer();
        staging.clear();
        staging.resize(count.max(0) as usize, 0);
        let sp = staging.as_mut_ptr() as *mut c_void;
        // SAFETY: the staging buffer holds exactly the probed message.
        check(
            self.rt.call(|| unsafe {
                ffi::MPI_Mrecv(
                    sp,
                    count,
                    ffi::RSMPI_UINT8_T,
                    &mut message,
                    ffi::RSMPI_STATUS_IGNORE,
                )
            }),
            "MPI_Mrecv",
        )
        .map_err(|e| self.fatal(e))?;
        let remote = wire::from_bytes(&staging).and_then(|w| wire::decode(&w));
        let result = match remote {
            Some(fp)
                if fp.matches(&ctx.fingerprint)
                    && staging.len() - wire::BYTES == buf.bytes().len() =>
            {
                buf.bytes_mut().copy_from_slice(&staging[wire::BYTES..]);
                Ok(())
            }
            Some(fp) => Err(ctx.mismatch(src, fp)),
            None => Err(self.fatal(CommError::Backend {
                backend: "mpi",
                message: format!("malformed message from rank {src}"),
            })),
        };
        self.rt.recycle(staging);
        result
    }

    fn new_group(&self, ranks: &[usize], timeout: Duration) -> Result<Box<dyn Backend>> {
        let world: Vec<usize> = ranks.iter().map(|&r| self.world[r]).collect();
        // Agree on the member list with every member (with a timeout), so that the blocking
        // MPI_Comm_create_group below only runs when every member is there.
        let digest = crate::digest_counts(&world);
        let mine = Box::new([digest, world.len() as u64, 0, 0, 0, 0, 0, 0u64]);
        let mut theirs = vec![[0u64; wire::WORDS]; ranks.len()];
        let mut reqs = Vec::new();
        let mut peers = Vec::new();
        for (i, &peer) in ranks.iter().enumerate() {
            if peer == self.rank {
                continue;
            }
            let (mut rreq, mut sreq) = (Request::null().0, Request::null().0);
            let recv = theirs[i].as_mut_ptr() as *mut c_void;
            let send = mine.as_ptr() as *const c_void;
            // SAFETY: buffers outlive the requests (leaked on failure below).
            self.rt.call(|| unsafe {
                ffi::MPI_Irecv(
                    recv,
                    8,
                    ffi::RSMPI_UINT64_T,
                    peer as c_int,
                    NEW_GROUP_TAG,
                    self.coll.0,
                    &mut rreq,
                );
                ffi::MPI_Isend(
                    send,
                    8,
                    ffi::RSMPI_UINT64_T,
                    peer as c_int,
                    NEW_GROUP_TAG,
                    self.coll.0,
                    &mut sreq,
                );
            });
            reqs.extend([Request(rreq), Request(sreq)]);
            peers.extend([peer, peer]);
        }
        let started = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            self.rt.progress();
            let mut pending = Vec::new();
            for (req, &p) in reqs.iter_mut().zip(&peers) {
                if !self.rt.test(req) {
                    pending.push(p);
                }
            }
            if pending.is_empty() {
                break;
            }
            let gone = pending.iter().any(|&p| self.rt.gone(self.world[p]));
            if gone || started.elapsed() > timeout {
                std::mem::forget(theirs);
                std::mem::forget(mine);
                pending.dedup();
                let e = CommError::InvalidGroup {
                    group: format!("mpi{:?}", self.world),
                    message: format!(
                        "ranks {pending:?} did not join new_group({ranks:?}) within {timeout:?}"
                    ),
                };
                self.rt.fail(&e.to_string());
                return Err(e);
            }
            backoff.snooze();
        }
        for (i, w) in theirs.iter().enumerate() {
            if ranks[i] != self.rank && w[0] != digest {
                return Err(CommError::InvalidGroup {
                    group: format!("mpi{:?}", self.world),
                    message: format!(
                        "rank {} called new_group with a different rank list than {ranks:?}",
                        ranks[i]
                    ),
                });
            }
        }
        let ints: Vec<c_int> = ranks.iter().map(|&r| r as c_int).collect();
        let mut newcomm: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: every member reached this point with the same list (checked above).
        let rc = self.rt.call(|| unsafe {
            let mut parent: ffi::MPI_Group = ffi::RSMPI_GROUP_NULL;
            let mut sub: ffi::MPI_Group = ffi::RSMPI_GROUP_NULL;
            ffi::MPI_Comm_group(self.coll.0, &mut parent);
            ffi::MPI_Group_incl(parent, ints.len() as c_int, ints.as_ptr(), &mut sub);
            let rc = ffi::MPI_Comm_create_group(self.coll.0, sub, 0, &mut newcomm);
            ffi::MPI_Group_free(&mut sub);
            ffi::MPI_Group_free(&mut parent);
            rc
        });
        check(rc, "MPI_Comm_create_group")?;
        Ok(Box::new(MpiBackend::new(self.rt.clone(), newcomm, world)))
    }
}
