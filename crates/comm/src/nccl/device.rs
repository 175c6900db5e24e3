//! The device-pointer API of [`NcclComm`]: collectives on raw CUDA device pointers and a
//! caller's stream, with no host staging (the path Burn CUDA tensors take), plus the
//! mapping of Bonfire dtypes and reduce ops onto NCCL's.

use super::comm::{DevicePtr, NcclComm, Stream, check_nccl};
use super::error;
use crate::{DType, ReduceOp, Result};
use cudarc::nccl::{result as nccl, sys as nsys};
use std::ffi::c_void;

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

fn stream_cast(s: Stream) -> nsys::cudaStream_t {
    s as nsys::cudaStream_t
}

impl NcclComm {
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
