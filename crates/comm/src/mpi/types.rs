//! How Bonfire's dtypes and reduce ops map onto MPI datatypes and ops, the f16/bf16
//! widen-to-f32 / narrow-back helpers (MPI has no 16-bit float type), and the small
//! pointer, count and return-code helpers that every raw `mpi-sys` call of the backend goes
//! through. Kept apart from the backend logic because they are pure conversions.

use super::scratch::grow;
use crate::backend::CallContext;
use crate::{CommError, DType, ReduceOp, Result};
use half::{bf16, f16};
use mpi::ffi;
use std::os::raw::{c_int, c_void};

/// MPI datatype moving elements of `size` bytes.
pub(super) fn move_type(dtype: DType) -> ffi::MPI_Datatype {
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
pub(super) fn reduce_type(dtype: DType) -> Option<ffi::MPI_Datatype> {
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

pub(super) fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
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
pub(super) fn widen(dtype: DType, src: &[u8], out: &mut Vec<u64>) -> usize {
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
pub(super) fn narrow(dtype: DType, src: &[f32], dst: &mut [u8], avg: Option<usize>) {
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

pub(super) fn cptr(bytes: &[u8]) -> *const c_void {
    if bytes.is_empty() {
        EMPTY.as_ptr() as *const c_void
    } else {
        bytes.as_ptr() as *const c_void
    }
}

pub(super) fn mptr(bytes: &mut [u8]) -> *mut c_void {
    if bytes.is_empty() {
        // Never written through: MPI moves zero bytes into an empty buffer.
        EMPTY.as_ptr() as *mut c_void
    } else {
        bytes.as_mut_ptr() as *mut c_void
    }
}

pub(super) fn cint(n: usize, ctx: &CallContext<'_>) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| CommError::Unsupported {
        backend: "mpi",
        what: format!(
            "{} with {n} elements (MPI counts are C ints; split the call) in {}",
            ctx.fingerprint.op, ctx.fingerprint
        ),
    })
}

pub(super) fn check(rc: c_int, what: &str) -> Result<()> {
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
