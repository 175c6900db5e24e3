//! The in-process backend: ranks are threads that read each other's buffers directly.
//!
//! Every collective is two barriers around direct copies. At the entry barrier each rank
//! publishes its fingerprint and buffer addresses; then every rank checks all fingerprints
//! (so a mismatch is seen by everyone), moves the part of the data it owns, and waits at the
//! completion barrier before returning, so no peer can still be reading its buffers.
//!
//! All-reduce is one pass: rank r reduces the r-th chunk across all buffers and writes the
//! result into that chunk of every buffer. Each rank thus reads and writes exactly one
//! buffer's worth of memory — the same traffic as a memcpy — and the ranks share the work.
//! No call allocates in steady state: scratch space lives in the backend and is reused.

use super::shared::{GroupShared, Message, POOL_LIMIT, Slot};
use crate::backend::{Backend, CallContext};
use crate::collective::{AllToAllCounts, Collective, Counts, offsets_into};
use crate::memops::{copy_bytes, fence, stream_threshold};
use crate::reduce::{Operands, reduce_raw};
use crate::{BufMut, BufRef, DType, ReduceOp, Result};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Chunks handed to different ranks start on separate cache lines.
const CACHE_LINE: usize = 64;

pub(crate) struct ThreadBackend {
    pub(crate) shared: Arc<GroupShared>,
    /// This rank's index in the group.
    pub(crate) me: usize,
    scratch: Mutex<Scratch>,
}

#[derive(Default)]
struct Scratch {
    slots: Vec<Slot>,
    offsets: Vec<usize>,
}

impl ThreadBackend {
    pub(crate) fn new(shared: Arc<GroupShared>, me: usize) -> Self {
        Self {
            shared,
            me,
            scratch: Mutex::new(Scratch::default()),
        }
    }

    fn publish(&self, slot: Slot) {
        *self.shared.slots[self.me]
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = slot;
    }

    /// Counts this call for the world's injected failure (which it may be).
    fn enter_call(&self) -> Result<()> {
        let world_rank = self.shared.members[self.me];
        self.shared.world.enter_call(world_rank)
    }

    /// Copies every member's slot into `out` (after the entry barrier).
    fn snapshot(&self, out: &mut Vec<Slot>) {
        out.clear();
        out.extend(
            self.shared
                .slots
                .iter()
                .map(|s| *s.lock().unwrap_or_else(|e| e.into_inner())),
        );
    }
}

/// Splits `len` elements of `dtype` into `n` cache-line-aligned chunks; returns chunk `r`.
fn chunk(len: usize, n: usize, r: usize, dtype: DType) -> std::ops::Range<usize> {
    let align = (CACHE_LINE / dtype.size()).max(1);
    let per = len.div_ceil(n).div_ceil(align) * align;
    (r * per).min(len)..((r + 1) * per).min(len)
}

/// Copies `len` elements of `size` bytes from `src[src_off..]` to `dst[dst_off..]`.
///
/// # Safety
/// Both ranges must be valid and not overlap, and no other thread may write them meanwhile.
unsafe fn copy(
    (src, src_off): (*const u8, usize),
    (dst, dst_off): (*mut u8, usize),
    len: usize,
    size: usize,
    stream: bool,
) {
    if len > 0 {
        // SAFETY: forwarded from the caller.
        unsafe {
            copy_bytes(
                dst.add(dst_off * size),
                src.add(src_off * size),
                len * size,
                stream,
            )
        }
    }
}

impl Backend for ThreadBackend {
    fn name(&self) -> &'static str {
        "threads"
    }

    fn rank(&self) -> usize {
        self.me
    }

    fn size(&self) -> usize {
        self.shared.size()
    }

    fn world_ranks(&self) -> Vec<usize> {
        self.shared.members.clone()
    }

    fn collective(&self, call: Collective<'_>, ctx: &CallContext<'_>) -> Result<()> {
        self.enter_call()?;
        let n = self.size();
        let me = self.me;
        let dtype = call.dtype();
        let size = dtype.size();
        let null_counts = (std::ptr::null(), std::ptr::null());
        // The raw pointers below outlive the borrows only inside this function, while this
        // rank is blocked between the two barriers.
        let (send, recv, (send_counts, recv_counts)): (*const u8, *mut u8, _) = match &call {
            Collective::AllReduce { buf, .. }
            | Collective::Broadcast { buf, .. }
            | Collective::Reduce { buf, .. } => (
                buf.bytes().as_ptr(),
                buf.bytes().as_ptr() as *mut u8,
                null_counts,
            ),
            Collective::AllGather { send, recv, .. }
            | Collective::ReduceScatter { send, recv, .. } => (
                send.bytes().as_ptr(),
                recv.bytes().as_ptr() as *mut u8,
                null_counts,
            ),
            Collective::AllToAll { send, recv, counts } => (
                send.bytes().as_ptr(),
                recv.bytes().as_ptr() as *mut u8,
                counts.map_or(null_counts, |c| (c.send.as_ptr(), c.recv.as_ptr())),
            ),
            Collective::Barrier => (std::ptr::null(), std::ptr::null_mut(), null_counts),
        };
        // Buffers are written through `recv` only; the exclusive borrows in `call` are held
        // (not used) until the completion barrier.
        self.publish(Slot {
            fp: ctx.fingerprint,
            send,
            recv,
            send_counts,
            recv_counts,
        });
        self.shared.enter(me, ctx)?;

        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Scratch { slots, offsets } = &mut *scratch;
        self.snapshot(slots);

        let mut outcome = match slots
            .iter()
            .enumerate()
            .find(|(_, s)| s.fp != ctx.fingerprint)
        {
            Some((peer, s)) => Err(ctx.mismatch(peer, s.fp)),
            None => Ok(()),
        };
        if outcome.is_ok()
            && let Collective::AllToAll {
                counts: Some(_), ..
            } = &call
        {
            outcome = check_all_to_all_counts(slots, ctx);
        }
        if outcome.is_ok() {
            // SAFETY: every slot's buffers stay valid until the completion barrier; each rank
            // writes disjoint ranges (its chunk, or its own receive buffer).
            unsafe { self.move_data(&call, slots, offsets, n, me, size) };
        }
        drop(scratch);
        self.shared.complete(me, ctx)?;
        outcome
    }

    fn send(&self, buf: BufRef<'_>, dst: usize, ctx: &CallContext<'_>) -> Result<()> {
        self.enter_call()?;
        if let Some(reason) = self.shared.aborted() {
            return Err(ctx.aborted(reason));
        }
        let mut mailbox = self
            .shared
            .mailbox
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut data = mailbox.pool.pop().unwrap_or_default();
        data.clear();
        data.extend_from_slice(buf.bytes());
        mailbox
            .queues
            .entry((self.me, dst, ctx.fingerprint.tag.unwrap_or(0)))
            .or_default()
            .push_back(Message {
                fp: ctx.fingerprint,
                data,
            });
        drop(mailbox);
        self.shared.mail.notify_all();
        Ok(())
    }

    fn recv(&self, mut buf: BufMut<'_>, src: usize, ctx: &CallContext<'_>) -> Result<()> {
        self.enter_call()?;
        let key = (src, self.me, ctx.fingerprint.tag.unwrap_or(0));
        let started = Instant::now();
        let deadline = started + ctx.timeout;
        let mut mailbox = self
            .shared
            .mailbox
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let message = loop {
            if let Some(m) = mailbox.queues.get_mut(&key).and_then(|q| q.pop_front()) {
                break m;
            }
            if let Some(reason) = self.shared.aborted() {
                return Err(ctx.aborted(reason));
            }
            if let Some(e) = self.shared.failed_peer(std::iter::once(src), ctx) {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                drop(mailbox);
                let e = ctx.timeout_error(vec![src], started.elapsed());
                self.shared.abort(format!(
                    "rank {} timed out in {} waiting for rank {src}",
                    self.me, ctx.fingerprint
                ));
                return Err(e);
            }
            let nap = GroupShared::MAIL_POLL.min(deadline - now);
            mailbox = self
                .shared
                .mail
                .wait_timeout(mailbox, nap)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        let result = if message.fp.matches(&ctx.fingerprint) {
            buf.bytes_mut().copy_from_slice(&message.data);
            Ok(())
        } else {
            Err(ctx.mismatch(src, message.fp))
        };
        if mailbox.pool.len() < POOL_LIMIT {
            mailbox.pool.push(message.data);
        }
        result
    }

    fn new_group(&self, ranks: &[usize], _timeout: Duration) -> Result<Box<dyn Backend>> {
        let members: Vec<usize> = ranks.iter().map(|&r| self.shared.members[r]).collect();
        let me = ranks
            .iter()
            .position(|&r| r == self.me)
            .expect("validated by ProcessGroup::new_group");
        let world_rank = self.shared.members[self.me];
        let shared = self.shared.world.join_group(world_rank, members);
        Ok(Box::new(ThreadBackend::new(shared, me)))
    }

    fn shrink(&self, group: &str, timeout: Duration) -> Result<crate::backend::Shrink> {
        let (shared, survivors, failed) = self.shared.shrink(self.me, group, timeout)?;
        let me = survivors
            .iter()
            .position(|&r| r == self.me)
            .expect("the agreement includes the caller");
        Ok(crate::backend::Shrink {
            backend: Box::new(ThreadBackend::new(shared, me)),
            survivors,
            failed,
        })
    }
}

/// Every (sender, receiver) pair of an uneven all-to-all agrees on the piece's length.
fn check_all_to_all_counts(slots: &[Slot], ctx: &CallContext<'_>) -> Result<()> {
    // SAFETY: each count array has `n` entries and lives until the completion barrier (both
    // sides are uneven calls: the form is part of the fingerprint checked before this).
    let count = |counts: *const usize, k: usize| unsafe { *counts.add(k) };
    ctx.check_all_to_all_counts(
        slots.len(),
        |i, j| count(slots[i].send_counts, j),
        |i, j| count(slots[j].recv_counts, i),
    )
}

impl ThreadBackend {
    /// Moves this rank's share of the data.
    ///
    /// # Safety
    /// Called between the barriers with a snapshot of validated, matching slots.
    unsafe fn move_data(
        &self,
        call: &Collective<'_>,
        slots: &[Slot],
        offsets: &mut Vec<usize>,
        n: usize,
        me: usize,
        size: usize,
    ) {
        let x = Exchange {
            slots,
            n,
            me,
            size,
            dtype: call.dtype(),
        };
        // SAFETY: (every arm) forwarded from this function's contract, which is each
        // `Exchange` method's.
        unsafe {
            match call {
                Collective::AllReduce { buf, op } => x.all_reduce(buf, *op),
                Collective::Reduce { buf, op, root } => x.reduce(buf, *op, *root),
                Collective::Broadcast { buf, root } => x.broadcast(buf, *root),
                Collective::AllGather { send, recv, counts } => {
                    x.all_gather(send, recv, *counts, offsets)
                }
                Collective::ReduceScatter {
                    send,
                    recv,
                    op,
                    counts,
                } => x.reduce_scatter(send, recv, *op, *counts),
                Collective::AllToAll { send, counts, .. } => x.all_to_all(send, *counts, offsets),
                Collective::Barrier => {}
            }
        }
        fence();
    }
}

/// One rank's view of a matched collective between the barriers: every rank's slot. Each
/// `unsafe` method moves this rank's share of the data of one kind of collective.
struct Exchange<'a> {
    /// Every rank's published call, in rank order.
    slots: &'a [Slot],
    /// The group size.
    n: usize,
    /// This rank.
    me: usize,
    /// Bytes per element.
    size: usize,
    dtype: DType,
}

impl Exchange<'_> {
    /// This rank's receive buffer (its only buffer for in-place calls).
    fn mine(&self) -> *mut u8 {
        self.slots[self.me].recv
    }

    /// Whether the buffers of all ranks together, `bytes` each, call for streaming writes:
    /// only once they overflow the last-level cache (see `memops`).
    fn stream(&self, bytes: usize) -> bool {
        bytes.saturating_mul(self.n) > stream_threshold()
    }

    /// All-reduce: this rank reduces its chunk across all buffers into every buffer.
    ///
    /// # Safety
    /// Called between the barriers with a snapshot of validated, matching slots; the buffers
    /// passed are this rank's own, as published in its slot.
    unsafe fn all_reduce(&self, buf: &BufMut<'_>, op: ReduceOp) {
        let (slots, n, size) = (self.slots, self.n, self.size);
        // SAFETY: see the function contract; ranges come from validated lengths.
        unsafe {
            let r = chunk(buf.len(), n, self.me, self.dtype);
            let at = |k: usize| slots[k].recv.add(r.start * size);
            let io = Operands {
                n_src: n,
                src: &|k| at(k),
                n_dst: n,
                dst: &at,
                stream: self.stream(buf.bytes().len()),
            };
            reduce_raw(self.dtype, op, n, r.len(), &io);
        }
    }

    /// Reduce: this rank reduces its chunk across all buffers into `root`'s.
    ///
    /// # Safety
    /// Called between the barriers with a snapshot of validated, matching slots; the buffers
    /// passed are this rank's own, as published in its slot.
    unsafe fn reduce(&self, buf: &BufMut<'_>, op: ReduceOp, root: usize) {
        let (slots, n, size) = (self.slots, self.n, self.size);
        // SAFETY: see the function contract; ranges come from validated lengths.
        unsafe {
            let r = chunk(buf.len(), n, self.me, self.dtype);
            let at = |k: usize| slots[k].recv.add(r.start * size);
            let io = Operands {
                n_src: n,
                src: &|k| at(k),
                n_dst: 1,
                dst: &|_| at(root),
                stream: self.stream(buf.bytes().len()),
            };
            reduce_raw(self.dtype, op, n, r.len(), &io);
        }
    }

    /// Broadcast: every rank but `root` copies `root`'s buffer into its own.
    ///
    /// # Safety
    /// Called between the barriers with a snapshot of validated, matching slots; the buffers
    /// passed are this rank's own, as published in its slot.
    unsafe fn broadcast(&self, buf: &BufMut<'_>, root: usize) {
        if self.me != root {
            let stream = self.stream(buf.bytes().len());
            let from = self.slots[root].recv;
            // SAFETY: see the function contract; both buffers hold `buf.len()` elements.
            unsafe { copy((from, 0), (self.mine(), 0), buf.len(), self.size, stream) };
        }
    }

    /// All-gather: this rank copies every rank's send buffer into its place in its own receive
    /// buffer (`counts[k]` elements from rank k when uneven).
    ///
    /// # Safety
    /// Called between the barriers with a snapshot of validated, matching slots; the buffers
    /// passed are this rank's own, as published in its slot.
    unsafe fn all_gather(
        &self,
        send: &BufRef<'_>,
        recv: &BufMut<'_>,
        counts: Counts<'_>,
        offsets: &mut Vec<usize>,
    ) {
        let (mine, size) = (self.mine(), self.size);
        let stream = self.stream(recv.bytes().len());
        // SAFETY: see the function contract; ranges come from validated lengths.
        unsafe {
            match counts {
                None => {
                    for (k, slot) in self.slots.iter().enumerate() {
                        let len = send.len();
                        copy((slot.send, 0), (mine, k * len), len, size, stream);
                    }
                }
                Some(counts) => {
                    offsets_into(counts, offsets);
                    for (k, slot) in self.slots.iter().enumerate() {
                        copy((slot.send, 0), (mine, offsets[k]), counts[k], size, stream);
                    }
                }
            }
        }
    }

    /// Reduce-scatter: this rank reduces its piece of every rank's send buffer into its own
    /// receive buffer.
    ///
    /// # Safety
    /// Called between the barriers with a snapshot of validated, matching slots; the buffers
    /// passed are this rank's own, as published in its slot.
    unsafe fn reduce_scatter(
        &self,
        send: &BufRef<'_>,
        recv: &BufMut<'_>,
        op: ReduceOp,
        counts: Counts<'_>,
    ) {
        let (slots, me, size) = (self.slots, self.me, self.size);
        let mine = self.mine();
        // SAFETY: see the function contract; ranges come from validated lengths.
        unsafe {
            let start = match counts {
                None => me * recv.len(),
                Some(counts) => counts[..me].iter().sum(),
            };
            let src = |k: usize| slots[k].send.add(start * size);
            let io = Operands {
                n_src: self.n,
                src: &src,
                n_dst: 1,
                dst: &|_| mine,
                stream: self.stream(send.bytes().len()),
            };
            reduce_raw(self.dtype, op, self.n, recv.len(), &io);
        }
    }

    /// All-to-all: this rank copies its piece of every rank's send buffer into its own
    /// receive buffer, in rank order (per-peer `counts` when uneven).
    ///
    /// # Safety
    /// Called between the barriers with a snapshot of validated, matching slots; the buffers
    /// passed are this rank's own, as published in its slot.
    unsafe fn all_to_all(
        &self,
        send: &BufRef<'_>,
        counts: Option<AllToAllCounts<'_>>,
        offsets: &mut Vec<usize>,
    ) {
        let (n, me, size, mine) = (self.n, self.me, self.size, self.mine());
        let stream = self.stream(send.bytes().len());
        // SAFETY: see the function contract; ranges come from validated lengths, and each
        // sender's count array has `n` entries (checked before data moves).
        unsafe {
            match counts {
                None => {
                    let piece = send.len() / n;
                    for (k, slot) in self.slots.iter().enumerate() {
                        copy(
                            (slot.send, me * piece),
                            (mine, k * piece),
                            piece,
                            size,
                            stream,
                        );
                    }
                }
                Some(c) => {
                    offsets_into(c.recv, offsets);
                    for (k, slot) in self.slots.iter().enumerate() {
                        let sender_counts = std::slice::from_raw_parts(slot.send_counts, n);
                        let from: usize = sender_counts[..me].iter().sum();
                        copy(
                            (slot.send, from),
                            (mine, offsets[k]),
                            c.recv[k],
                            size,
                            stream,
                        );
                    }
                }
            }
        }
    }
}
