//! [`ProcessGroup`]: the handle every layer of Bonfire communicates through.

use crate::backend::{Backend, CallContext};
use crate::collective::{AllToAllCounts, Collective};
use crate::device::{DeviceBuf, DeviceCollective};
use crate::work::{Executor, Work};
use crate::{BufMut, BufRef, CommError, Element, Fingerprint, FlightRecorder, OpKind, ReduceOp};
use crate::{DType, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default timeout of every blocking call: generous, because a slow first step (compilation,
/// data loading) must not look like a hang. Override with [`ProcessGroup::set_timeout`] or
/// the `BONFIRE_TIMEOUT_SECS` environment variable.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The timeout from `BONFIRE_TIMEOUT_SECS`, or [`DEFAULT_TIMEOUT`].
pub fn default_timeout() -> Duration {
    std::env::var("BONFIRE_TIMEOUT_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(DEFAULT_TIMEOUT)
}

/// One rank's handle on a group of ranks: collectives, point-to-point messages, sub-groups.
///
/// Cheap to clone (clones share the handle). Calls on one group must be issued in the same
/// order on every rank, from one thread at a time per rank — the usual rule of
/// torch.distributed and MPI. Blocking calls return an error rather than hang: see
/// [`CommError`].
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Box<dyn Backend>,
    name: String,
    timeout_ms: AtomicU64,
    seq: AtomicU64,
    /// Sequence numbers of point-to-point channels, keyed by (is_send, peer, tag).
    p2p_seq: Mutex<HashMap<(bool, usize, u64), u64>>,
    recorder: FlightRecorder,
    collectives: Executor,
    sends: Executor,
    recvs: Executor,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("name", &self.inner.name)
            .field("backend", &self.inner.backend.name())
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish()
    }
}

impl ProcessGroup {
    /// Wraps a backend. `name` identifies the group in errors and logs.
    pub fn from_backend(backend: Box<dyn Backend>, name: impl Into<String>) -> Self {
        Self::with_timeout(backend, name.into(), default_timeout())
    }

    fn with_timeout(backend: Box<dyn Backend>, name: String, timeout: Duration) -> Self {
        let thread = format!("bonfire-comm {name} r{}", backend.rank());
        Self {
            inner: Arc::new(Inner {
                name,
                timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
                seq: AtomicU64::new(0),
                p2p_seq: Mutex::new(HashMap::new()),
                recorder: FlightRecorder::default(),
                collectives: Executor::new(format!("{thread} coll")),
                sends: Executor::new(format!("{thread} send")),
                recvs: Executor::new(format!("{thread} recv")),
                backend,
            }),
        }
    }

    /// This rank's index in the group, in `0..size()`.
    pub fn rank(&self) -> usize {
        self.inner.backend.rank()
    }
    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.backend.size()
    }
    /// The group's name (used in errors).
    pub fn name(&self) -> &str {
        &self.inner.name
    }
    /// The backend's name (`"threads"`, `"mpi"`, `"nccl"`).
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend.name()
    }
    /// The world rank of every group rank.
    pub fn world_ranks(&self) -> Vec<usize> {
        self.inner.backend.world_ranks()
    }
    /// The timeout applied to every blocking call on this handle.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.inner.timeout_ms.load(Ordering::Relaxed))
    }
    /// Sets the timeout of this handle (sub-groups created later inherit it).
    pub fn set_timeout(&self, timeout: Duration) {
        self.inner
            .timeout_ms
            .store(timeout.as_millis().max(1) as u64, Ordering::Relaxed);
    }
    /// This rank's flight recorder for the group: the last calls and their outcome.
    pub fn flight_recorder(&self) -> &FlightRecorder {
        &self.inner.recorder
    }

    /// Creates a sub-group of the given ranks (numbered in this group), in which this rank
    /// has its position in `ranks` as its new rank. Every member must call this with the same
    /// list, in the same order relative to its other `new_group` calls; non-members do not
    /// call it. Collectives on disjoint sub-groups run concurrently.
    pub fn new_group(&self, ranks: &[usize]) -> Result<ProcessGroup> {
        let invalid = |message: String| CommError::InvalidGroup {
            group: self.inner.name.clone(),
            message,
        };
        if ranks.is_empty() {
            return Err(invalid("the rank list is empty".into()));
        }
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            if r >= self.size() {
                return Err(invalid(format!(
                    "rank {r} is out of range for a group of {} ranks",
                    self.size()
                )));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(invalid(format!("rank {r} appears twice in {ranks:?}")));
            }
        }
        if !seen[self.rank()] {
            return Err(invalid(format!(
                "this rank ({}) is not in {ranks:?}; only members create a group",
                self.rank()
            )));
        }
        let backend = self.inner.backend.new_group(ranks, self.timeout())?;
        let world: Vec<usize> = backend.world_ranks();
        let name = format!("{}/{:?}", self.inner.name, world);
        Ok(Self::with_timeout(backend, name, self.timeout()))
    }

    /// After a failure: agrees with the other survivors on who is alive and returns a fresh
    /// group of them (ranks renumbered in the old order), as ULFM's `MPI_Comm_shrink`. Every
    /// survivor calls it, at any point after its call failed; this handle is unusable
    /// afterwards. Bounded by the timeout; backends that cannot shrink (MPI, NCCL) return
    /// [`CommError::Unsupported`]. See [`crate::shrink`] for the contract.
    pub fn shrink(&self) -> Result<Shrunk> {
        let shrink = self
            .inner
            .backend
            .shrink(&self.inner.name, self.timeout())?;
        let world: Vec<usize> = shrink.backend.world_ranks();
        let name = format!("{}/shrunk{:?}", self.inner.name, world);
        if self.rank() == shrink.survivors[0] {
            tracing::warn!(
                group = %self.inner.name,
                "shrunk to old ranks {:?} after losing {:?}",
                shrink.survivors,
                shrink.failed
            );
        }
        Ok(Shrunk {
            group: Self::with_timeout(shrink.backend, name, self.timeout()),
            survivors: shrink.survivors,
            failed: shrink.failed,
        })
    }

    fn context(&self, fingerprint: Fingerprint) -> CallContext<'_> {
        CallContext {
            fingerprint,
            timeout: self.timeout(),
            group: &self.inner.name,
            rank: self.rank(),
            recorder: &self.inner.recorder,
        }
    }

    fn invalid(&self, op: OpKind, message: String) -> CommError {
        CommError::InvalidArgument {
            group: self.inner.name.clone(),
            op,
            message,
        }
    }

    /// Runs any collective, given as data; the typed methods are shorthands for this.
    /// Waits for queued asynchronous collectives first, so the order is preserved.
    pub fn collective(&self, call: Collective<'_>) -> Result<()> {
        self.inner.collectives.drain();
        call.validate(self.rank(), self.size())
            .map_err(|m| self.invalid(call.kind(), m))?;
        let seq = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        let fingerprint = call.fingerprint(seq, self.size());
        self.record(fingerprint, |ctx| self.inner.backend.collective(call, ctx))
    }

    fn record(
        &self,
        fp: Fingerprint,
        f: impl FnOnce(&CallContext<'_>) -> Result<()>,
    ) -> Result<()> {
        let started: Instant = self.inner.recorder.start(fp);
        let ctx = self.context(fp);
        let result = f(&ctx);
        let p2p = matches!(fp.op, OpKind::Send | OpKind::Recv);
        crate::blocked::add(p2p, started.elapsed());
        self.inner.recorder.finish(started, result.is_ok());
        if let Err(e) = &result {
            tracing::error!(group = %self.inner.name, rank = self.rank(), "{e}");
        }
        result
    }

    fn p2p_fingerprint(
        &self,
        op: OpKind,
        peer: usize,
        tag: u64,
        dtype: DType,
        count: usize,
    ) -> Result<Fingerprint> {
        if peer >= self.size() {
            return Err(self.invalid(
                op,
                format!(
                    "peer {peer} is out of range for a group of {} ranks",
                    self.size()
                ),
            ));
        }
        let mut channels = self.inner.p2p_seq.lock().unwrap_or_else(|e| e.into_inner());
        let seq = channels.entry((op == OpKind::Send, peer, tag)).or_insert(0);
        let fp = Fingerprint {
            seq: *seq,
            op,
            dtype,
            count: count as u64,
            layout: 0,
            root: None,
            reduce_op: None,
            tag: Some(tag),
        };
        *seq += 1;
        Ok(fp)
    }

    // ----- typed blocking API -------------------------------------------------------------

    /// Every rank's `buf` becomes the reduction of all ranks' `buf`.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.collective(Collective::AllReduce {
            buf: BufMut::new(buf),
            op,
        })
    }

    /// Every rank's `buf` becomes `root`'s.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.collective(Collective::Broadcast {
            buf: BufMut::new(buf),
            root,
        })
    }

    /// `root`'s `buf` becomes the reduction of all ranks' `buf`; others' stay unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.collective(Collective::Reduce {
            buf: BufMut::new(buf),
            op,
            root,
        })
    }

    /// `recv` (of `size() × send.len()` elements) becomes every rank's `send`, in rank order.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.collective(Collective::AllGather {
            send: BufRef::new(send),
            recv: BufMut::new(recv),
            counts: None,
        })
    }

    /// Uneven all-gather: rank r contributes `counts[r]` elements (`send.len()` on rank r);
    /// `recv` holds `sum(counts)` elements.
    pub fn all_gather_uneven<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        self.collective(Collective::AllGather {
            send: BufRef::new(send),
            recv: BufMut::new(recv),
            counts: Some(counts),
        })
    }

    /// `send` (of `size() × recv.len()` elements) is split in rank order; rank r's `recv`
    /// becomes the reduction of every rank's r-th piece.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.collective(Collective::ReduceScatter {
            send: BufRef::new(send),
            recv: BufMut::new(recv),
            op,
            counts: None,
        })
    }

    /// Uneven reduce-scatter: piece r has `counts[r]` elements.
    pub fn reduce_scatter_uneven<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.collective(Collective::ReduceScatter {
            send: BufRef::new(send),
            recv: BufMut::new(recv),
            op,
            counts: Some(counts),
        })
    }

    /// Piece j of `send` goes to rank j; `recv`'s piece j comes from rank j (equal pieces).
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.collective(Collective::AllToAll {
            send: BufRef::new(send),
            recv: BufMut::new(recv),
            counts: None,
        })
    }

    /// Uneven all-to-all: `send_counts[j]` elements go to rank j, `recv_counts[j]` come from
    /// it; rank i's `send_counts[j]` must equal rank j's `recv_counts[i]`.
    pub fn all_to_all_uneven<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.collective(Collective::AllToAll {
            send: BufRef::new(send),
            recv: BufMut::new(recv),
            counts: Some(AllToAllCounts {
                send: send_counts,
                recv: recv_counts,
            }),
        })
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.collective(Collective::Barrier)
    }

    /// Sends `buf` to rank `dst` with `tag`. Messages on one (source, destination, tag)
    /// channel arrive in order; the receiver's buffer must have the same length and dtype.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u64) -> Result<()> {
        self.send_raw(BufRef::new(buf), dst, tag)
    }

    /// Receives into `buf` the next message from rank `src` with `tag`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u64) -> Result<()> {
        self.recv_raw(BufMut::new(buf), src, tag)
    }

    /// Type-erased [`ProcessGroup::send`].
    pub fn send_raw(&self, buf: BufRef<'_>, dst: usize, tag: u64) -> Result<()> {
        let fp = self.p2p_fingerprint(OpKind::Send, dst, tag, buf.dtype(), buf.len())?;
        self.record(fp, |ctx| self.inner.backend.send(buf, dst, ctx))
    }

    /// Type-erased [`ProcessGroup::recv`].
    pub fn recv_raw(&self, buf: BufMut<'_>, src: usize, tag: u64) -> Result<()> {
        let fp = self.p2p_fingerprint(OpKind::Recv, src, tag, buf.dtype(), buf.len())?;
        self.record(fp, |ctx| self.inner.backend.recv(buf, src, ctx))
    }

    // ----- device buffers ----------------------------------------------------------------------

    /// Whether this group's backend moves device buffers itself (NCCL); when it does not,
    /// the device-buffer calls below return [`CommError::Unsupported`] and callers stage
    /// through host memory.
    pub fn takes_device_buffers(&self) -> bool {
        self.inner.backend.takes_device_buffers()
    }

    /// Runs `call` on device buffers, with the checks, fingerprint, timeout and flight
    /// record of a host collective (see [`crate::device`]).
    ///
    /// # Safety
    /// Every buffer of `call` is an allocation of the backend's device holding its `len`
    /// elements, written before the call and not touched by anything else until it returns.
    pub unsafe fn device_collective(&self, call: DeviceCollective<'_>) -> Result<()> {
        let kind = call.shape().kind;
        call.validate(self.rank(), self.size())
            .map_err(|m| self.invalid(kind, m))?;
        self.inner.collectives.drain();
        let seq = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        let fingerprint = call.shape().fingerprint(seq, self.size());
        // SAFETY: forwarded from the caller.
        self.record(fingerprint, |ctx| unsafe {
            self.inner.backend.device_collective(call, ctx)
        })
    }

    /// [`send`](Self::send) of a device buffer.
    ///
    /// # Safety
    /// As [`device_collective`](Self::device_collective).
    pub unsafe fn device_send(&self, buf: DeviceBuf, dst: usize, tag: u64) -> Result<()> {
        let fp = self.p2p_fingerprint(OpKind::Send, dst, tag, buf.dtype, buf.len)?;
        // SAFETY: forwarded from the caller.
        self.record(fp, |ctx| unsafe {
            self.inner.backend.device_send(buf, dst, ctx)
        })
    }

    /// [`recv`](Self::recv) into a device buffer.
    ///
    /// # Safety
    /// As [`device_collective`](Self::device_collective).
    pub unsafe fn device_recv(&self, buf: DeviceBuf, src: usize, tag: u64) -> Result<()> {
        let fp = self.p2p_fingerprint(OpKind::Recv, src, tag, buf.dtype, buf.len)?;
        // SAFETY: forwarded from the caller.
        self.record(fp, |ctx| unsafe {
            self.inner.backend.device_recv(buf, src, ctx)
        })
    }

    // ----- asynchronous API ------------------------------------------------------------------

    /// Queues `f` on this group's communication thread, after every collective queued before
    /// it, and returns a handle to its result. `f` receives this group; the collectives it
    /// issues keep their place in the group's order. This is how DDP overlaps a gradient
    /// bucket's all-reduce with the rest of backward.
    pub fn run_async<R: Send + 'static>(
        &self,
        f: impl FnOnce(&ProcessGroup) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        let pg = self.clone();
        self.inner.collectives.submit(move || f(&pg))
    }

    /// Asynchronous [`ProcessGroup::all_reduce`]; the handle gives the buffer back.
    pub fn all_reduce_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.run_async(move |pg| pg.all_reduce(&mut buf, op).map(|_| buf))
    }

    /// Asynchronous [`ProcessGroup::broadcast`].
    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        self.run_async(move |pg| pg.broadcast(&mut buf, root).map(|_| buf))
    }

    /// Asynchronous [`ProcessGroup::reduce`].
    pub fn reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
        root: usize,
    ) -> Work<Vec<T>> {
        self.run_async(move |pg| pg.reduce(&mut buf, op, root).map(|_| buf))
    }

    /// Asynchronous [`ProcessGroup::all_gather`]; the handle gives the gathered buffer.
    pub fn all_gather_async<T: Element>(&self, send: Vec<T>) -> Work<Vec<T>> {
        self.run_async(move |pg| {
            let mut recv = vec![T::zeroed(); send.len() * pg.size()];
            pg.all_gather(&send, &mut recv).map(|_| recv)
        })
    }

    /// Asynchronous [`ProcessGroup::reduce_scatter`]; the handle gives this rank's piece.
    pub fn reduce_scatter_async<T: Element>(&self, send: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.run_async(move |pg| {
            if !send.len().is_multiple_of(pg.size()) {
                return Err(pg.invalid(
                    OpKind::ReduceScatter,
                    format!(
                        "send length {} is not divisible by {} ranks",
                        send.len(),
                        pg.size()
                    ),
                ));
            }
            let mut recv = vec![T::zeroed(); send.len() / pg.size()];
            pg.reduce_scatter(&send, &mut recv, op).map(|_| recv)
        })
    }

    /// Asynchronous [`ProcessGroup::all_to_all`]; the handle gives the received buffer.
    pub fn all_to_all_async<T: Element>(&self, send: Vec<T>) -> Work<Vec<T>> {
        self.run_async(move |pg| {
            let mut recv = vec![T::zeroed(); send.len()];
            pg.all_to_all(&send, &mut recv).map(|_| recv)
        })
    }

    /// Asynchronous [`ProcessGroup::barrier`].
    pub fn barrier_async(&self) -> Work<()> {
        self.run_async(|pg| pg.barrier())
    }

    /// Asynchronous [`ProcessGroup::send`]; the handle gives the buffer back. Sends run on
    /// their own thread, so a pending receive never holds them up.
    pub fn send_async<T: Element>(&self, buf: Vec<T>, dst: usize, tag: u64) -> Work<Vec<T>> {
        let pg = self.clone();
        self.inner
            .sends
            .submit(move || pg.send(&buf, dst, tag).map(|_| buf))
    }

    /// Asynchronous [`ProcessGroup::recv`] into `buf`; the handle gives the filled buffer.
    pub fn recv_async<T: Element>(&self, mut buf: Vec<T>, src: usize, tag: u64) -> Work<Vec<T>> {
        let pg = self.clone();
        self.inner
            .recvs
            .submit(move || pg.recv(&mut buf, src, tag).map(|_| buf))
    }
}

/// The outcome of [`ProcessGroup::shrink`]: the survivors' new group and who was left out.
#[derive(Debug, Clone)]
pub struct Shrunk {
    /// The new group: its ranks are the survivors, renumbered `0..survivors.len()` in the old
    /// order.
    pub group: ProcessGroup,
    /// The old group's ranks that survived, in order (`survivors[new_rank] = old_rank`).
    pub survivors: Vec<usize>,
    /// The old group's ranks that failed, each with the reason the backend knows.
    pub failed: Vec<(usize, String)>,
}

impl Shrunk {
    /// Whether any rank was left out (false: everyone was alive and joined).
    pub fn lost_any(&self) -> bool {
        !self.failed.is_empty()
    }
}
