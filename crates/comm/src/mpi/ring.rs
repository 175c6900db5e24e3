//! The ring all-reduce path for large `f32`/`f64` all-reduces: reduce-scatter then
//! all-gather with `MPI_Sendrecv` over the group's persistent scratch, used instead of the
//! library's own all-reduce above [`RING_THRESHOLD_BYTES`] (see there for why).

use super::backend::MpiBackend;
use super::scratch::{Scratch, grow};
use super::types::{check, cint, reduce_type};
use crate::backend::CallContext;
use crate::{BufMut, BufRef, ReduceOp, Result};
use mpi::ffi;
use std::os::raw::{c_int, c_void};

/// Tags of ring all-reduce steps.
const RING_TAG: c_int = 3;

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
}
