//! [`NcclBackend`]: a [`ProcessGroup`](crate::ProcessGroup) backend over NCCL. Host buffers
//! are staged through device scratch that is reused across calls, so that the conformance
//! suite, fingerprint checks and timeouts run on GPUs exactly as on the other backends.
//!
//! Each collective first all-gathers the 64-byte encoded fingerprint of every rank (one tiny
//! NCCL all-gather), compares them on the host and fails on every rank with both views if
//! they differ; then it moves the data. Uneven all-gather is a grouped broadcast per rank,
//! uneven reduce-scatter a grouped reduce per root, all-to-all grouped send/recv. Every
//! wait polls the stream against the group's timeout and aborts the communicator on expiry.
//!
//! It also takes device buffers itself (`device_collective`, `device_send`, `device_recv`:
//! the same fingerprint handshake, then NCCL on the caller's memory; see `ops.rs`). Host
//! point-to-point is staged through scratch and has NCCL's rendezvous semantics (`ops.rs`).

use super::own::OwnMailbox;
use super::{DevicePtr, NcclComm, UniqueId, WaitFailure, error};
use crate::backend::{Backend, CallContext};
use crate::collective::{AllToAllCounts, Collective, Counts, MoveData, offsets_into};
use crate::{BufMut, BufRef, DType, DeviceBuf, DeviceCollective, ReduceOp, Result, wire};
use cudarc::driver::result as cu;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A grow-only device allocation.
#[derive(Default)]
pub(super) struct ScratchBuf {
    ptr: DevicePtr,
    bytes: usize,
}

impl ScratchBuf {
    pub(super) fn ensure(&mut self, bytes: usize) -> Result<DevicePtr> {
        if self.bytes < bytes.max(1) {
            self.release();
            // SAFETY: the communicator's context is current (ensure_usable).
            self.ptr = unsafe { cu::malloc_sync(bytes.max(256)) }
                .map_err(|e| error(format!("cuMemAlloc({bytes}): {e:?}")))?;
            self.bytes = bytes.max(256);
        }
        Ok(self.ptr)
    }
    /// Copies host `bytes` into the buffer (grown as needed), on the communicator's stream.
    fn stage(&mut self, backend: &NcclBackend, bytes: &[u8]) -> Result<DevicePtr> {
        let ptr = self.ensure(bytes.len())?;
        backend.h2d(ptr, bytes)?;
        Ok(ptr)
    }

    fn release(&mut self) {
        if self.bytes > 0 {
            // SAFETY: allocated by `ensure`, freed once.
            let _ = unsafe { cu::free_sync(self.ptr) };
            self.bytes = 0;
        }
    }
}

#[derive(Default)]
pub(crate) struct Scratch {
    a: ScratchBuf,
    b: ScratchBuf,
    pub(super) fps: ScratchBuf,
    host_fps: Vec<u8>,
    pub(super) offsets: Vec<usize>,
    offsets2: Vec<usize>,
    counts: Vec<usize>,
    matrix: Vec<u64>,
}

/// The [`Backend`] over one [`NcclComm`]: host buffers staged through reused device scratch,
/// device buffers passed to NCCL as they are. [`NcclComm::into_group`] wraps one as a
/// [`ProcessGroup`](crate::ProcessGroup).
pub struct NcclBackend {
    comm: NcclComm,
    world: Vec<usize>,
    scratch: Mutex<Scratch>,
    /// Messages this rank sent to itself (NCCL refuses them; see [`OwnMailbox`]).
    own: OwnMailbox,
}

impl NcclBackend {
    pub(crate) fn new(comm: NcclComm) -> Self {
        let world = (0..comm.size()).collect();
        Self::with_world(comm, world)
    }

    fn with_world(comm: NcclComm, world: Vec<usize>) -> Self {
        Self {
            comm,
            world,
            scratch: Mutex::new(Scratch::default()),
            own: OwnMailbox::default(),
        }
    }

    pub(super) fn comm(&self) -> &NcclComm {
        &self.comm
    }

    pub(super) fn lock_scratch(&self) -> std::sync::MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for the communicator's stream, mapping failures to the call's errors.
    pub(super) fn wait(&self, ctx: &CallContext<'_>, started: Instant) -> Result<()> {
        let deadline = started + ctx.timeout;
        self.comm.wait_own(deadline).map_err(|f| match f {
            // NCCL cannot tell which peers are missing: name them all.
            WaitFailure::Timeout => ctx.timeout_error(
                (0..self.comm.size())
                    .filter(|&r| r != self.comm.rank())
                    .collect(),
                started.elapsed(),
            ),
            WaitFailure::Error(message) => error(message),
        })
    }

    pub(super) fn h2d(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` holds at least `src.len()` bytes (ensured by the caller).
        unsafe { cu::memcpy_htod_async(dst, src, self.comm.stream()) }
            .map_err(|e| error(format!("cuMemcpyHtoDAsync: {e:?}")))
    }

    pub(super) fn d2h(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` holds at least `dst.len()` bytes; the caller waits on the stream
        // before reading `dst`.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.comm.stream()) }
            .map_err(|e| error(format!("cuMemcpyDtoHAsync: {e:?}")))
    }

    /// All-gathers `row` (u64 words per rank) into `s.matrix`.
    fn gather_words(
        &self,
        row: &[u64],
        s: &mut Scratch,
        ctx: &CallContext<'_>,
        started: Instant,
    ) -> Result<()> {
        let n = self.comm.size();
        let bytes = row.len() * 8;
        let dev = s.b.ensure(bytes * n)?;
        self.h2d(
            dev + (self.comm.rank() * bytes) as u64,
            bytemuck::cast_slice(row),
        )?;
        // SAFETY: in-place all-gather inside `dev` (n × bytes).
        unsafe {
            self.comm.all_gather_device(
                dev + (self.comm.rank() * bytes) as u64,
                dev,
                bytes,
                DType::U8,
                self.comm.stream(),
            )?;
        }
        s.matrix.resize(row.len() * n, 0);
        self.d2h(bytemuck::cast_slice_mut(&mut s.matrix), dev)?;
        self.wait(ctx, started)
    }

    pub(super) fn handshake(
        &self,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
        started: Instant,
    ) -> Result<()> {
        let n = self.comm.size();
        let me = self.comm.rank();
        let dev = s.fps.ensure(wire::BYTES * n)?;
        self.h2d(dev + (me * wire::BYTES) as u64, &encoded(ctx))?;
        // SAFETY: in-place all-gather inside `dev`.
        unsafe {
            self.comm.all_gather_device(
                dev + (me * wire::BYTES) as u64,
                dev,
                wire::BYTES,
                DType::U8,
                self.comm.stream(),
            )?;
        }
        s.host_fps.resize(wire::BYTES * n, 0);
        self.d2h(&mut s.host_fps, dev)?;
        self.wait(ctx, started)?;
        for peer in (0..n).filter(|&p| p != me) {
            check_peer(&s.host_fps[peer * wire::BYTES..], peer, ctx)?;
        }
        Ok(())
    }

    /// Runs `call(send, recv)` through device scratch: `send` (or, in place, `recv`'s own
    /// values) staged into `a`, the output in `b` (in place: `a`), copied back into `recv`.
    fn staged<'c>(
        &self,
        send: Option<BufRef<'_>>,
        recv: &mut BufMut<'_>,
        s: &mut Scratch,
        t: Timing<'_>,
        call: impl FnOnce(DeviceBuf, DeviceBuf) -> DeviceCollective<'c>,
    ) -> Result<()> {
        let (bytes, len, dtype) = match &send {
            Some(b) => (b.bytes(), b.len(), b.dtype()),
            None => (recv.bytes(), recv.len(), recv.dtype()),
        };
        let a = DeviceBuf::new(s.a.stage(self, bytes)?, len, dtype);
        let b = match send {
            Some(_) => DeviceBuf::new(s.b.ensure(recv.bytes().len())?, recv.len(), dtype),
            None => a,
        };
        // SAFETY: `a` holds the input, `b` has room for the output.
        unsafe { self.enqueue(call(a, b), s)? };
        self.d2h(recv.bytes_mut(), b.ptr)?;
        self.wait(t.ctx, t.started)
    }
}

impl MoveData for NcclBackend {
    type Scratch = Scratch;
    type Ctx<'c> = Timing<'c>;

    /// All-reduce, in place in device scratch.
    fn all_reduce(
        &self,
        mut buf: BufMut<'_>,
        op: ReduceOp,
        s: &mut Scratch,
        t: Timing<'_>,
    ) -> Result<()> {
        self.staged(None, &mut buf, s, t, |send, recv| {
            DeviceCollective::AllReduce { send, recv, op }
        })
    }

    /// Broadcast from `root`, in place in device scratch.
    fn broadcast(
        &self,
        mut buf: BufMut<'_>,
        root: usize,
        s: &mut Scratch,
        t: Timing<'_>,
    ) -> Result<()> {
        self.staged(None, &mut buf, s, t, |send, recv| {
            DeviceCollective::Broadcast { send, recv, root }
        })
    }

    /// Reduce to `root`, in place in device scratch; only the root copies the result back.
    fn reduce(
        &self,
        mut buf: BufMut<'_>,
        op: ReduceOp,
        root: usize,
        s: &mut Scratch,
        t: Timing<'_>,
    ) -> Result<()> {
        let (stream, dtype) = (self.comm.stream(), buf.dtype());
        let a = s.a.ensure(buf.bytes().len())?;
        self.h2d(a, buf.bytes())?;
        // SAFETY: `a` holds the buffer (in place on the root).
        unsafe {
            self.comm
                .reduce_device(a, a, buf.len(), dtype, op, root, stream)?
        };
        if self.comm.rank() == root {
            self.d2h(buf.bytes_mut(), a)?;
        }
        self.wait(t.ctx, t.started)
    }

    /// All-gather through device scratch (see [`Self::enqueue`]).
    fn all_gather(
        &self,
        send: BufRef<'_>,
        mut recv: BufMut<'_>,
        counts: Counts<'_>,
        s: &mut Scratch,
        t: Timing<'_>,
    ) -> Result<()> {
        self.staged(Some(send), &mut recv, s, t, |send, recv| {
            DeviceCollective::AllGather { send, recv, counts }
        })
    }

    /// Reduce-scatter through device scratch (see [`Self::enqueue`]).
    fn reduce_scatter(
        &self,
        send: BufRef<'_>,
        mut recv: BufMut<'_>,
        op: ReduceOp,
        counts: Counts<'_>,
        s: &mut Scratch,
        t: Timing<'_>,
    ) -> Result<()> {
        self.staged(Some(send), &mut recv, s, t, |send, recv| {
            DeviceCollective::ReduceScatter {
                send,
                recv,
                op,
                counts,
            }
        })
    }

    /// All-to-all as grouped send/recv; uneven (`counts`): every rank checks every pair's
    /// counts first.
    fn all_to_all(
        &self,
        send: BufRef<'_>,
        mut recv: BufMut<'_>,
        counts: Option<AllToAllCounts<'_>>,
        s: &mut Scratch,
        t: Timing<'_>,
    ) -> Result<()> {
        let (n, stream, dtype) = (self.comm.size(), self.comm.stream(), send.dtype());
        let es = dtype.size() as u64;
        s.counts.clear();
        let (send_counts, recv_counts): (&[usize], &[usize]) = match counts {
            Some(c) => {
                let mut row: Vec<u64> = c.send.iter().map(|&x| x as u64).collect();
                row.extend(c.recv.iter().map(|&x| x as u64));
                self.gather_words(&row, s, t.ctx, t.started)?;
                t.ctx.check_all_to_all_counts(
                    n,
                    |i, j| s.matrix[i * 2 * n + j] as usize,
                    |i, j| s.matrix[j * 2 * n + n + i] as usize,
                )?;
                (c.send, c.recv)
            }
            None => {
                s.counts.extend(std::iter::repeat_n(send.len() / n, n));
                (&s.counts[..], &s.counts[..])
            }
        };
        let a = s.a.ensure(send.bytes().len())?;
        let b = s.b.ensure(recv.bytes().len())?;
        self.h2d(a, send.bytes())?;
        offsets_into(send_counts, &mut s.offsets);
        offsets_into(recv_counts, &mut s.offsets2);
        let sends: Vec<(DevicePtr, usize, usize)> = (0..n)
            .map(|j| (a + s.offsets[j] as u64 * es, send_counts[j], j))
            .collect();
        let recvs: Vec<(DevicePtr, usize, usize)> = (0..n)
            .map(|j| (b + s.offsets2[j] as u64 * es, recv_counts[j], j))
            .collect();
        // SAFETY: pieces of `a` and `b` by validated counts.
        unsafe { self.comm.exchange_device(&sends, &recvs, dtype, stream)? };
        self.d2h(recv.bytes_mut(), b)?;
        self.wait(t.ctx, t.started)
    }
}

/// This call's fingerprint as the bytes peers compare.
pub(super) fn encoded(ctx: &CallContext<'_>) -> [u8; wire::BYTES] {
    let mut bytes = [0u8; wire::BYTES];
    wire::to_bytes(&wire::encode(&ctx.fingerprint), &mut bytes);
    bytes
}

/// Checks the fingerprint `peer` sent (its wire bytes) against this call's: the same
/// collective, or the send matching this receive; a mismatch fails with both views.
pub(super) fn check_peer(bytes: &[u8], peer: usize, ctx: &CallContext<'_>) -> Result<()> {
    match wire::from_bytes(bytes).as_ref().and_then(wire::decode) {
        Some(remote) if remote.matches(&ctx.fingerprint) => Ok(()),
        Some(remote) => Err(ctx.mismatch(peer, remote)),
        None => Err(error(format!("rank {peer} sent a malformed fingerprint"))),
    }
}

/// What the waits of a collective need: the call's context (timeout, errors) and when it
/// started.
#[derive(Clone, Copy)]
pub(crate) struct Timing<'a> {
    ctx: &'a CallContext<'a>,
    started: Instant,
}

/// Copies a message this rank sent itself into the receive's buffer `into`.
fn own_into(into: &mut [u8], bytes: &[u8]) -> Result<()> {
    same_size(into.len(), bytes.len())?;
    into.copy_from_slice(bytes);
    Ok(())
}

/// Refuses a receive of `want` bytes from this rank itself that matched a send of `got` (the
/// descriptions matched, so only a caller's wrong count gets here).
fn same_size(want: usize, got: usize) -> Result<()> {
    match want == got {
        true => Ok(()),
        false => Err(error(format!(
            "a receive of {want} bytes from this rank itself matched a send of {got}"
        ))),
    }
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        let s = self.scratch.get_mut().unwrap_or_else(|e| e.into_inner());
        s.a.release();
        s.b.release();
        s.fps.release();
    }
}

impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        "nccl"
    }
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn world_ranks(&self) -> Vec<usize> {
        self.world.clone()
    }

    fn collective(&self, call: Collective<'_>, ctx: &CallContext<'_>) -> Result<()> {
        self.comm.ensure_usable()?;
        let started = Instant::now();
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.handshake(&mut guard, ctx, started)?;
        call.move_with(self, &mut guard, Timing { ctx, started })
    }

    /// Host send: staged into device scratch, then [`Self::send_device`]'s rendezvous (to
    /// self: left in the [`OwnMailbox`]).
    fn send(&self, buf: BufRef<'_>, dst: usize, ctx: &CallContext<'_>) -> Result<()> {
        if dst == self.comm.rank() {
            self.own.post(ctx, buf.bytes().to_vec());
            return Ok(());
        }
        let mut s = self.lock_scratch();
        let staged = s.a.stage(self, buf.bytes())?;
        let staged = DeviceBuf::new(staged, buf.len(), buf.dtype());
        self.send_device(staged, dst, &mut s, ctx)
    }

    /// Host receive: into device scratch by [`Self::recv_device`], then copied out (from
    /// self: taken from the [`OwnMailbox`]).
    fn recv(&self, mut buf: BufMut<'_>, src: usize, ctx: &CallContext<'_>) -> Result<()> {
        if src == self.comm.rank() {
            let bytes = self.own.take(ctx)?;
            return own_into(buf.bytes_mut(), &bytes);
        }
        let mut s = self.lock_scratch();
        let staged = s.a.ensure(buf.bytes().len())?;
        let staged = DeviceBuf::new(staged, buf.len(), buf.dtype());
        self.recv_device(staged, src, &mut s, ctx)?;
        self.d2h(buf.bytes_mut(), staged.ptr)?;
        self.wait(ctx, Instant::now())
    }

    fn takes_device_buffers(&self) -> bool {
        true
    }

    unsafe fn device_collective(
        &self,
        call: DeviceCollective<'_>,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        self.run_device(call, ctx)
    }

    unsafe fn device_send(&self, buf: DeviceBuf, dst: usize, ctx: &CallContext<'_>) -> Result<()> {
        if dst == self.comm.rank() {
            let mut bytes = vec![0u8; buf.len * buf.dtype.size()];
            self.d2h(&mut bytes, buf.ptr)?;
            self.wait(ctx, Instant::now())?;
            self.own.post(ctx, bytes);
            return Ok(());
        }
        self.send_device(buf, dst, &mut self.lock_scratch(), ctx)
    }

    unsafe fn device_recv(&self, buf: DeviceBuf, src: usize, ctx: &CallContext<'_>) -> Result<()> {
        if src == self.comm.rank() {
            let bytes = self.own.take(ctx)?;
            same_size(buf.len * buf.dtype.size(), bytes.len())?;
            self.h2d(buf.ptr, &bytes)?;
            return self.wait(ctx, Instant::now());
        }
        self.recv_device(buf, src, &mut self.lock_scratch(), ctx)
    }

    /// Sub-groups: the new group's first rank creates an id and sends it to the other members
    /// over the parent communicator (grouped NCCL send/recv among members only), then every
    /// member joins the new communicator.
    fn new_group(&self, ranks: &[usize], timeout: Duration) -> Result<Box<dyn Backend>> {
        self.comm.ensure_usable()?;
        let me = self.comm.rank();
        let sub_rank = ranks
            .iter()
            .position(|&r| r == me)
            .expect("validated by ProcessGroup");
        let leader = ranks[0];
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let dev = s.fps.ensure(128)?;
        if me == leader {
            let id = UniqueId::new()?;
            self.h2d(dev, &id.0)?;
        }
        let (sends, recvs): (Vec<_>, Vec<_>) = if me == leader {
            (ranks[1..].iter().map(|&r| (dev, 128, r)).collect(), vec![])
        } else {
            (vec![], vec![(dev, 128, leader)])
        };
        // SAFETY: `dev` holds 128 bytes.
        unsafe {
            self.comm
                .exchange_device(&sends, &recvs, DType::U8, self.comm.stream())?
        };
        let mut id = [0u8; 128];
        self.d2h(&mut id, dev)?;
        let deadline = Instant::now() + timeout;
        self.comm
            .wait_own(deadline)
            .map_err(|f| error(format!("new_group({ranks:?}): id exchange failed: {f:?}")))?;
        drop(s);
        let comm = NcclComm::init(&UniqueId(id), sub_rank, ranks.len(), self.comm.device())?;
        let world = ranks.iter().map(|&r| self.world[r]).collect();
        Ok(Box::new(NcclBackend::with_world(comm, world)))
    }
}

impl NcclComm {
    /// Wraps this communicator as a [`ProcessGroup`] over host buffers.
    pub fn into_group(self, name: impl Into<String>) -> crate::ProcessGroup {
        crate::ProcessGroup::from_backend(Box::new(NcclBackend::new(self)), name)
    }
}
