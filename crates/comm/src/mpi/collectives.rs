//! Phase 2 of every collective (see `backend.rs`): moving the data of a call every rank
//! agreed on with the MPI library's own collectives (`MPI_Allreduce`, `MPI_Bcast`,
//! `MPI_Reduce`, `MPI_Allgather(v)`, `MPI_Reduce_scatter`, `MPI_Alltoall(v)`) through
//! `mpi-sys`, widening 16-bit floats to `f32` and handing large all-reduces to the ring path.

use super::backend::MpiBackend;
use super::scratch::{Scratch, grow};
use super::types::{check, cint, cptr, move_type, mpi_op, mptr, narrow, reduce_type, widen};
use crate::backend::CallContext;
use crate::collective::{AllToAllCounts, Counts, MoveData, offsets_into};
use crate::reduce::finish_avg;
use crate::{BufMut, BufRef, DType, ReduceOp, Result};
use mpi::ffi;
use std::os::raw::{c_int, c_void};

impl MoveData for MpiBackend {
    type Scratch = Scratch;
    type Ctx<'c> = &'c CallContext<'c>;

    /// All-reduce: `MPI_Allreduce` (the ring path for large f32/f64 buffers), 16-bit floats
    /// widened to f32.
    fn all_reduce(
        &self,
        mut buf: BufMut<'_>,
        op: ReduceOp,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let n = self.size;
        let dtype = buf.dtype();
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
                // SAFETY: reads a datatype constant the MPI bindings export (an immutable extern
                // static).
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

    /// Broadcast from `root`: `MPI_Bcast`.
    fn broadcast(
        &self,
        mut buf: BufMut<'_>,
        root: usize,
        _s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let (comm, mt) = (self.comm(), move_type(buf.dtype()));
        let count = cint(buf.len(), ctx)?;
        let p = mptr(buf.bytes_mut());
        check(
            self.rt
                // SAFETY: `p` is the caller's buffer of `count` elements of `mt`, live for the
                // call; every rank agreed on this broadcast (its root, count and type) in phase
                // 1.
                .call(|| unsafe { ffi::MPI_Bcast(p, count, mt, root as c_int, comm) }),
            "MPI_Bcast",
        )
    }

    /// Reduce to `root`: `MPI_Reduce`, 16-bit floats widened to f32.
    fn reduce(
        &self,
        mut buf: BufMut<'_>,
        op: ReduceOp,
        root: usize,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let (n, comm, dtype) = (self.size, self.comm(), buf.dtype());
        let count = cint(buf.len(), ctx)?;
        let is_root = self.rank == root;
        let avg = (op == ReduceOp::Avg).then_some(n);
        let (wide_type, len) = match reduce_type(dtype) {
            Some(t) => (t, 0),
            None => (
                // SAFETY: reads a datatype constant the MPI bindings export (an immutable extern
                // static).
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
                // SAFETY: `p` holds `count` elements of `wide_type` (the caller's buffer or the
                // widened scratch grown to fit); a non-root passes no receive buffer, which MPI
                // ignores there.
                self.rt.call(|| unsafe {
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

    /// All-gather: `MPI_Allgather`, or `MPI_Allgatherv` with per-rank `counts`.
    fn all_gather(
        &self,
        send: BufRef<'_>,
        mut recv: BufMut<'_>,
        counts: Counts<'_>,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let (comm, mt, rt) = (self.comm(), move_type(send.dtype()), &self.rt);
        let sp = cptr(send.bytes());
        let rp = mptr(recv.bytes_mut());
        match counts {
            None => {
                let c = cint(send.len(), ctx)?;
                check(
                    // SAFETY: `sp` holds `c` elements and `rp` `c` per rank (the call's validated
                    // counts); every rank agreed on the call in phase 1.
                    rt.call(|| unsafe { ffi::MPI_Allgather(sp, c, mt, rp, c, mt, comm) }),
                    "MPI_Allgather",
                )
            }
            Some(counts) => {
                let (cs, ds) = self.counts_displs(counts, s, ctx)?;
                let c = cint(send.len(), ctx)?;
                check(
                    // SAFETY: `sp` holds `c` elements; `rp` holds the sum of `cs`, placed at
                    // `ds`, both built from the call's validated counts; every rank agreed on the
                    // call in phase 1.
                    rt.call(|| unsafe { ffi::MPI_Allgatherv(sp, c, mt, rp, cs, ds, mt, comm) }),
                    "MPI_Allgatherv",
                )
            }
        }
    }

    /// Reduce-scatter: `MPI_Reduce_scatter` (even `counts` when `None`), 16-bit floats widened
    /// to f32.
    fn reduce_scatter(
        &self,
        send: BufRef<'_>,
        mut recv: BufMut<'_>,
        op: ReduceOp,
        counts: Counts<'_>,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let (n, comm, dtype, rt) = (self.size, self.comm(), send.dtype(), &self.rt);
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
                    // SAFETY: `sp` holds the sum of `cs` elements of `t` and `rp` this rank's
                    // `cs` entry (the call's validated counts); every rank agreed on the call in
                    // phase 1.
                    rt.call(|| unsafe { ffi::MPI_Reduce_scatter(sp, rp, cs, t, mpi_op(op), comm) }),
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
                // SAFETY: reads a datatype constant the MPI bindings export (an immutable extern
                // static).
                let ft = unsafe { ffi::RSMPI_FLOAT };
                check(
                    // SAFETY: the widened scratch buffers were grown to `total` and `mine` f32
                    // values, what `cs` describes; every rank agreed on the call in phase 1.
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

    /// All-to-all: `MPI_Alltoall`, or `MPI_Alltoallv` with per-peer `counts` (checked across
    /// ranks first).
    fn all_to_all(
        &self,
        send: BufRef<'_>,
        mut recv: BufMut<'_>,
        counts: Option<AllToAllCounts<'_>>,
        s: &mut Scratch,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let (n, comm, mt, rt) = (self.size, self.comm(), move_type(send.dtype()), &self.rt);
        let sp = cptr(send.bytes());
        let rp = mptr(recv.bytes_mut());
        match counts {
            None => {
                let piece = cint(send.len() / n, ctx)?;
                check(
                    // SAFETY: `sp` and `rp` hold `piece` elements per rank (the call's validated
                    // counts); every rank agreed on the call in phase 1.
                    rt.call(|| unsafe { ffi::MPI_Alltoall(sp, piece, mt, rp, piece, mt, comm) }),
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
                    // SAFETY: `ints` holds the 4 n send/receive counts and displacements built
                    // from the call's validated counts, which `sp` and `rp` cover; every rank
                    // agreed on the call in phase 1.
                    rt.call(|| unsafe { ffi::MPI_Alltoallv(sp, sc, sd, mt, rp, rc, rd, mt, comm) }),
                    "MPI_Alltoallv",
                );
                s.ints = ints;
                r
            }
        }
    }
}

impl MpiBackend {
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
            // SAFETY: `rp` points to 2 n u64 counts and `mp` to the 2 n × n matrix resized above;
            // every rank sends the same 2 n.
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
                    // SAFETY: `p` holds `count` elements of `t` (the caller's buffer or the
                    // widened scratch); in place, MPI reads and writes only it; every rank agreed
                    // on the call in phase 1.
                    .call(|| unsafe { ffi::MPI_Allreduce(inplace, p, count, t, mpi_op(op), comm) }),
                "MPI_Allreduce",
            ),
            None => {
                let copy = grow(tmp, data.len());
                copy.copy_from_slice(data);
                let cp = cptr(copy);
                check(
                    self.rt
                        // SAFETY: `cp` is a copy of `p`'s `count` elements in scratch sized to
                        // match, so send and receive buffers do not overlap; every rank agreed on
                        // the call in phase 1.
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
            // SAFETY: `send` is `p` in place or a same-sized copy in scratch; `p` holds `count`
            // elements of `t`; every rank agreed on the call (its root) in phase 1.
            self.rt.call(|| unsafe {
                ffi::MPI_Reduce(send, p, count, t, mpi_op(op), root as c_int, comm)
            }),
            "MPI_Reduce",
        )
    }
}
