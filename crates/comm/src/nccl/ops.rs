//! The NCCL backend's data movement on device buffers: one [`DeviceCollective`] enqueued on
//! the communicator's stream (the host collectives stage into scratch and call it; the
//! device collectives call it on the caller's buffers), and point-to-point on device
//! buffers, the fingerprint first.
//!
//! Point-to-point semantics differ from the host backends': an NCCL send completes only when
//! the peer's matching receive runs (no buffering, no tags on the wire). Bonfire sends the
//! 64-byte fingerprint (tag, channel sequence, dtype, count) ahead of the data, so a receive
//! that does not match fails with both views, and every wait is bounded by the group's
//! timeout, so a schedule whose two peers both send before receiving fails with a timeout
//! instead of hanging.

use super::backend::{NcclBackend, Scratch, check_peer, encoded};
use super::{DevicePtr, error};
use crate::backend::CallContext;
use crate::collective::offsets_into;
use crate::{DType, DeviceBuf, DeviceCollective, Result, wire};
use cudarc::nccl::result as nccl;
use std::time::Instant;

impl NcclBackend {
    /// Enqueues `call` on the communicator's stream (returns before it runs: wait on the
    /// stream before reading outputs). Uneven all-gather is a grouped broadcast per rank;
    /// uneven reduce-scatter a grouped reduce per root.
    ///
    /// # Safety
    /// The buffers are allocations of this device holding their `len` elements.
    pub(super) unsafe fn enqueue(&self, call: DeviceCollective<'_>, s: &mut Scratch) -> Result<()> {
        let (me, stream) = (self.comm().rank(), self.comm().stream());
        let comm = self.comm();
        // SAFETY: (all arms) forwarded from the caller; offsets follow validated counts.
        unsafe {
            match call {
                DeviceCollective::AllReduce { send, recv, op } => {
                    comm.all_reduce_device(send.ptr, recv.ptr, send.len, send.dtype, op, stream)
                }
                DeviceCollective::Broadcast { send, recv, root } => {
                    comm.broadcast_device(send.ptr, recv.ptr, send.len, send.dtype, root, stream)
                }
                DeviceCollective::AllGather {
                    send,
                    recv,
                    counts: None,
                } => comm.all_gather_device(send.ptr, recv.ptr, send.len, send.dtype, stream),
                DeviceCollective::AllGather {
                    send,
                    recv,
                    counts: Some(counts),
                } => {
                    offsets_into(counts, &mut s.offsets);
                    grouped(
                        counts.iter().zip(&s.offsets).enumerate(),
                        |(root, (&c, &off))| {
                            let dst = at(recv.ptr, off, send.dtype);
                            let src = if root == me { send.ptr } else { dst };
                            comm.broadcast_device(src, dst, c, send.dtype, root, stream)
                        },
                    )
                }
                DeviceCollective::ReduceScatter {
                    send,
                    recv,
                    op,
                    counts: None,
                } => {
                    comm.reduce_scatter_device(send.ptr, recv.ptr, recv.len, send.dtype, op, stream)
                }
                DeviceCollective::ReduceScatter {
                    send,
                    recv,
                    op,
                    counts: Some(counts),
                } => {
                    offsets_into(counts, &mut s.offsets);
                    grouped(
                        counts.iter().zip(&s.offsets).enumerate(),
                        |(root, (&c, &off))| {
                            let src = at(send.ptr, off, send.dtype);
                            comm.reduce_device(src, recv.ptr, c, send.dtype, op, root, stream)
                        },
                    )
                }
            }
        }
    }

    /// A device collective: fingerprints compared, the call enqueued, the stream waited on.
    pub(super) fn run_device(
        &self,
        call: DeviceCollective<'_>,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        self.comm().ensure_usable()?;
        let started = Instant::now();
        let mut guard = self.lock_scratch();
        self.handshake(&mut guard, ctx, started)?;
        // SAFETY: the caller of `device_collective` vouches for the buffers.
        unsafe { self.enqueue(call, &mut guard)? };
        self.wait(ctx, started)
    }

    /// Sends `buf` (device memory, or host scratch staged by the caller) to `dst`: the
    /// fingerprint, then the data, each waited on within the group's timeout.
    pub(super) fn send_device(
        &self,
        buf: DeviceBuf,
        dst: usize,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        self.comm().ensure_usable()?;
        let started = Instant::now();
        let fp = s.fps.ensure(wire::BYTES)?;
        self.h2d(fp, &encoded(ctx))?;
        self.exchange(&[(fp, wire::BYTES, dst)], &[], DType::U8)?;
        self.wait(ctx, started)?;
        self.exchange(&[(buf.ptr, buf.len, dst)], &[], buf.dtype)?;
        self.wait(ctx, started)
    }

    /// Receives into `buf` from `src`: the sender's fingerprint, compared with this call's
    /// (a mismatch fails with both views), then the data.
    pub(super) fn recv_device(
        &self,
        buf: DeviceBuf,
        src: usize,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        self.comm().ensure_usable()?;
        let started = Instant::now();
        let fp = s.fps.ensure(wire::BYTES)?;
        self.exchange(&[], &[(fp, wire::BYTES, src)], DType::U8)?;
        let mut theirs = [0u8; wire::BYTES];
        self.d2h(&mut theirs, fp)?;
        self.wait(ctx, started)?;
        check_peer(&theirs, src, ctx)?;
        self.exchange(&[], &[(buf.ptr, buf.len, src)], buf.dtype)?;
        self.wait(ctx, started)
    }

    /// Grouped sends and receives of `(pointer, count, peer)` on the stream.
    fn exchange(
        &self,
        sends: &[(DevicePtr, usize, usize)],
        recvs: &[(DevicePtr, usize, usize)],
        dtype: DType,
    ) -> Result<()> {
        // SAFETY: the pointers are scratch of this device or the caller's vouched buffers.
        unsafe {
            self.comm()
                .exchange_device(sends, recvs, dtype, self.comm().stream())
        }
    }
}

/// The address of element `offset` of a buffer of `dtype` at `base`.
fn at(base: DevicePtr, offset: usize, dtype: DType) -> DevicePtr {
    base + (offset * dtype.size()) as u64
}

/// `op` on each item inside one NCCL group (one fused launch); the first error wins, and
/// the group is always closed.
fn grouped<I>(items: impl Iterator<Item = I>, mut op: impl FnMut(I) -> Result<()>) -> Result<()> {
    nccl::group_start().map_err(|e| error(format!("ncclGroupStart: {e:?}")))?;
    let mut result = Ok(());
    for item in items {
        if result.is_ok() {
            result = op(item);
        }
    }
    let end = nccl::group_end()
        .map(|_| ())
        .map_err(|e| error(format!("ncclGroupEnd: {e:?}")));
    result.and(end)
}
