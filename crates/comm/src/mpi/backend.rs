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
//!
//! This file holds the backend itself and its `Backend` glue (including point-to-point
//! messages and `new_group`); the handshake, the data phase, the ring path, the scratch and
//! the MPI type helpers live in the sibling files `handshake.rs`, `collectives.rs`,
//! `ring.rs`, `scratch.rs` and `types.rs`.
//!
//! [`RING_THRESHOLD_BYTES`]: super::RING_THRESHOLD_BYTES

use super::runtime::{Backoff, Comm, Request, Runtime};
use super::scratch::Scratch;
use super::types::{check, cint};
use crate::backend::{Backend, CallContext};
use crate::collective::Collective;
use crate::wire;
use crate::{BufMut, BufRef, CommError, Result};
use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tag of `new_group` agreement messages.
const NEW_GROUP_TAG: c_int = 2;
/// User tags map onto MPI tags modulo this (the smallest `MPI_TAG_UB` the standard allows);
/// the full tag travels in the message header and is checked by the receiver.
const USER_TAG_SPACE: u64 = 32768;

pub(crate) struct MpiBackend {
    pub(super) rt: Arc<Runtime>,
    /// Collectives and handshakes.
    pub(super) coll: Comm,
    /// User point-to-point messages.
    p2p: Comm,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) world: Vec<usize>,
    scratch: Mutex<Scratch>,
    aborted: Mutex<Option<String>>,
    pub(super) ring_threshold: usize,
}

impl MpiBackend {
    /// A backend on a new communicator: `coll` is used for collectives; a duplicate is made
    /// for point-to-point traffic.
    pub(crate) fn new(rt: Arc<Runtime>, coll: ffi::MPI_Comm, world: Vec<usize>) -> Self {
        let (mut rank, mut size) = (0, 0);
        // SAFETY: reads a constant handle the MPI bindings export (an immutable extern static).
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
    pub(super) fn fatal(&self, e: CommError) -> CommError {
        let mut aborted = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        if aborted.is_none() {
            *aborted = Some(format!("an earlier call failed: {e}"));
        }
        drop(aborted);
        self.rt.fail(&e.to_string());
        e
    }

    pub(super) fn comm(&self) -> ffi::MPI_Comm {
        self.coll.0
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
        match call.move_with(self, s, ctx) {
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
        // SAFETY: reads a constant handle the MPI bindings export (an immutable extern static).
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
        // SAFETY: `status` was filled in by the probe that matched this message; `count` is a
        // live out-pointer.
        unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
        let mut staging = self.rt.buffer();
        staging.clear();
        staging.resize(count.max(0) as usize, 0);
        let sp = staging.as_mut_ptr() as *mut c_void;
        check(
            // SAFETY: the staging buffer holds exactly the probed message.
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
        // SAFETY: reads a constant handle the MPI bindings export (an immutable extern static).
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

/// All-reduces of at least this many bytes (f32/f64) use the ring path with persistent
/// scratch. OpenMPI's own large-message all-reduce mallocs a temporary of half the message
/// each call; glibc serves that (≥ 32 MiB) with a fresh `mmap`, so every call page-faults
/// it in — measured at half the bandwidth. Override with `BONFIRE_MPI_RING_BYTES`
/// (`0` disables the ring path).
pub const RING_THRESHOLD_BYTES: usize = 16 << 20;

pub(super) fn ring_threshold() -> usize {
    std::env::var("BONFIRE_MPI_RING_BYTES")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .map(|v| if v == 0 { usize::MAX } else { v })
        .unwrap_or(RING_THRESHOLD_BYTES)
}
