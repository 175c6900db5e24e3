//! The ring all-reduce path for large `f32`/`f64` all-reduces: reduce-scatter then
//! all-gather with `MPI_Sendrecv` over the group's persistent scratch, used instead of the
//! library's own all-reduce above [`RING_THRESHOLD_BYTES`](super::RING_THRESHOLD_BYTES) (see there
//! for why).

use super::backend::MpiBackend;
use super::scratch::{Scratch, grow};
use super::types::{check, cint, reduce_type};
use crate::backend::CallContext;
use crate::{BufMut, BufRef, DType, ReduceOp, Result};
use mpi::ffi;
use std::ops::Range;
use std::os::raw::{c_int, c_void};

/// Tags of ring all-reduce steps.
const RING_TAG: c_int = 3;

impl MpiBackend {
    /// Ring all-reduce (reduce-scatter then all-gather) with `MPI_Sendrecv` and scratch that
    /// persists across calls, so large messages never page-fault a fresh temporary.
    /// Each rank sends and receives 2·(n−1)/n of the buffer, as in OpenMPI's ring.
    pub(super) fn ring_all_reduce(
        &self,
        mut buf: BufMut<'_>,
        op: ReduceOp,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let n = self.size;
        let dtype = buf.dtype();
        let len = buf.len();
        let t = reduce_type(dtype).expect("ring path is for f32/f64");
        let piece = len.div_ceil(n);
        let scratch = grow(&mut s.a, piece * dtype.size()).as_mut_ptr();
        let op_sum = if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        let ring = Ring {
            backend: self,
            ctx,
            dtype,
            t,
            len,
            piece,
            base: buf.bytes_mut().as_mut_ptr(),
            scratch,
        };
        // Reduce-scatter: after step k, rank r holds the partial reduction of piece
        // (r − k − 1) mod n over k + 2 ranks; at the end, piece (r + 1) mod n is complete.
        for step in 0..n - 1 {
            ring.reduce_scatter_step(step, op_sum)?;
        }
        // All-gather: circulate the completed pieces.
        for step in 0..n - 1 {
            ring.all_gather_step(step)?;
        }
        Ok(())
    }
}

/// One ring all-reduce under way over a caller's buffer, split in one piece per rank.
struct Ring<'a> {
    backend: &'a MpiBackend,
    ctx: &'a CallContext<'a>,
    dtype: DType,
    /// The MPI datatype of the elements.
    t: ffi::MPI_Datatype,
    /// Elements in the buffer.
    len: usize,
    /// Elements per piece (the last pieces may be shorter or empty).
    piece: usize,
    /// The caller's buffer, exclusively borrowed by the call.
    base: *mut u8,
    /// The scratch, which holds one piece.
    scratch: *mut u8,
}

impl Ring<'_> {
    /// The elements of piece `k`.
    fn range(&self, k: usize) -> Range<usize> {
        (k * self.piece).min(self.len)..((k + 1) * self.piece).min(self.len)
    }

    /// Piece `(me + offset − step) mod n`, as the steps walk the ring backwards.
    fn piece_at(&self, offset: usize, step: usize) -> Range<usize> {
        let n = self.backend.size;
        self.range((self.backend.rank + offset + n - step) % n)
    }

    /// Sends `sc` elements at `sbuf` to the right neighbour while receiving `rc` elements into
    /// `rbuf` from the left one; MPI's return code.
    ///
    /// # Safety
    /// `sbuf` must be readable for `sc` elements and `rbuf` writable for `rc`, not
    /// overlapping, until the call returns.
    unsafe fn sendrecv(
        &self,
        sbuf: *const c_void,
        sc: c_int,
        rbuf: *mut c_void,
        rc: c_int,
    ) -> c_int {
        let (n, me) = (self.backend.size, self.backend.rank);
        let right = ((me + 1) % n) as c_int;
        let left = ((me + n - 1) % n) as c_int;
        let (t, comm) = (self.t, self.backend.comm());
        // SAFETY: forwarded from the caller.
        self.backend.rt.call(|| unsafe {
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
    }

    /// Reduce-scatter step `step`: sends one partially reduced piece right, receives the
    /// next from the left and reduces it into the buffer with `op`.
    fn reduce_scatter_step(&self, step: usize, op: ReduceOp) -> Result<()> {
        let esize = self.dtype.size();
        let send_piece = self.piece_at(0, step);
        let recv_piece = self.piece_at(self.backend.size - 1, step);
        let sc = cint(send_piece.len(), self.ctx)?;
        let rc = cint(recv_piece.len(), self.ctx)?;
        // SAFETY: disjoint pieces of the caller's buffer and the scratch, sized by `piece`.
        let rc_ = unsafe {
            let sbuf = self.base.add(send_piece.start * esize) as *const c_void;
            self.sendrecv(sbuf, sc, self.scratch as *mut c_void, rc)
        };
        check(rc_, "MPI_Sendrecv (ring reduce-scatter)")?;
        // SAFETY: `recv_piece` lies inside the caller's buffer, which `base` points to and this
        // call borrows exclusively.
        let dst = unsafe { self.base.add(recv_piece.start * esize) };
        let m = recv_piece.len();
        // SAFETY: `dst` and the scratch hold `m` elements each and do not overlap; the
        // caller's buffer is exclusively borrowed by this call.
        let (acc, other) = unsafe {
            (
                std::slice::from_raw_parts_mut(dst, m * esize),
                std::slice::from_raw_parts(self.scratch as *const u8, m * esize),
            )
        };
        crate::reduce::reduce_into(
            op,
            &mut BufMut::from_bytes(self.dtype, acc),
            BufRef::from_bytes(self.dtype, other),
        );
        Ok(())
    }

    /// All-gather step `step`: sends one completed piece right, receives the next from the
    /// left in place.
    fn all_gather_step(&self, step: usize) -> Result<()> {
        let esize = self.dtype.size();
        let send_piece = self.piece_at(1, step);
        let recv_piece = self.piece_at(0, step);
        let sc = cint(send_piece.len(), self.ctx)?;
        let rc = cint(recv_piece.len(), self.ctx)?;
        // SAFETY: disjoint pieces of the caller's buffer.
        let rc_ = unsafe {
            let sbuf = self.base.add(send_piece.start * esize) as *const c_void;
            let rbuf = self.base.add(recv_piece.start * esize) as *mut c_void;
            self.sendrecv(sbuf, sc, rbuf, rc)
        };
        check(rc_, "MPI_Sendrecv (ring all-gather)")
    }
}
