//! The data plane's CUDA path (feature `cuda`): a Burn tensor on a CubeCL CUDA device, on a
//! group whose backend takes device buffers (NCCL), is never staged. Its buffer is made
//! contiguous, the compute stream is synchronised (`client.sync()`), the buffer's device
//! pointer is taken from CubeCL (`client.get_resource`, which pins the allocation while it is
//! held), and the collective runs on it through [`ProcessGroup::device_collective`] (checked
//! and fingerprinted like any collective), writing a fresh output tensor on the same device.
//!
//! Each function returns `None` where the path does not apply (another device, a host
//! backend, a non-float dtype), and the caller stages through the host instead. Type-checked
//! by `cargo xtask check-gpu`; run by `cargo xtask test-multi-gpu` on a GPU machine.

use crate::autodiff::with_context_of;
use crate::{DTensorError, Result};
use bonfire_comm::{DeviceBuf, DeviceCollective, ProcessGroup, ReduceOp};
use bonfire_kernels::cube::{empty, from_cube, to_cube};
use burn::backend::DispatchDevice;
use burn::tensor::{DType, Device, Shape, Tensor};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;

use super::ledger;

/// The comm dtype of a float dtype the device path carries.
fn comm_dtype(dtype: DType) -> Option<bonfire_comm::DType> {
    Some(match dtype {
        DType::F32 => bonfire_comm::DType::F32,
        DType::F64 => bonfire_comm::DType::F64,
        DType::F16 => bonfire_comm::DType::F16,
        DType::BF16 => bonfire_comm::DType::BF16,
        _ => return None,
    })
}

fn is_cuda(device: &Device) -> bool {
    fn cuda(d: &DispatchDevice) -> bool {
        match d {
            DispatchDevice::Cube(cubecl::Device::Cuda(_)) => true,
            DispatchDevice::Autodiff(inner) => cuda(&inner.clone().inner()),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
    cuda(device.as_dispatch())
}

/// Whether a tensor of `dtype` on `device` takes the device path on `group`.
pub(super) fn applies(device: &Device, dtype: DType, group: &ProcessGroup) -> bool {
    group.takes_device_buffers() && is_cuda(device) && comm_dtype(dtype).is_some()
}

/// Waits for the device work queued on `t`'s client (what wrote its buffer).
fn sync(t: &CubeTensor) -> Result<()> {
    cubecl::future::block_on(t.client.sync())
        .map_err(|e| DTensorError::InvalidArgument(format!("CUDA stream sync: {e:?}")))
}

/// `f` with the device pointers of `a` and `b`, each allocation pinned while `f` runs.
fn with_pointers<R>(a: &CubeTensor, b: &CubeTensor, f: impl FnOnce(u64, u64) -> R) -> Result<R> {
    type Server = <CudaRuntime as Runtime>::Server;
    let pin = |t: &CubeTensor| {
        t.client
            .get_resource::<Server>(t.handle.clone())
            .map_err(|e| DTensorError::InvalidArgument(format!("CUDA buffer: {e:?}")))
    };
    let (ra, rb) = (pin(a)?, pin(b)?);
    Ok(f(ra.resource().ptr, rb.resource().ptr))
}

fn buf(ptr: u64, len: usize, dtype: DType) -> DeviceBuf {
    DeviceBuf::new(ptr, len, comm_dtype(dtype).expect("checked by `applies`"))
}

/// Runs `call(send, recv)` on `input`'s buffer (`in_len` elements used) and a fresh output of
/// `out_shape` (`out_len` elements used) on the same device; returns the output.
fn run<'a, const D: usize>(
    input: Tensor<D>,
    in_len: usize,
    out_shape: Shape,
    out_len: usize,
    group: &ProcessGroup,
    call: impl FnOnce(DeviceBuf, DeviceBuf) -> DeviceCollective<'a>,
) -> Result<CubeTensor> {
    let input = to_cube(input);
    let dtype = input.dtype;
    let output = empty(&input, out_shape, dtype);
    sync(&input)?;
    ledger::record_payload(in_len.max(out_len) * dtype.size());
    with_pointers(&input, &output, |src, dst| {
        let call = call(buf(src, in_len, dtype), buf(dst, out_len, dtype));
        // SAFETY: both buffers are pinned allocations of this CUDA device with their stated
        // lengths, synchronised above; nothing else touches `output` until the call returns.
        unsafe { group.device_collective(call) }
    })??;
    Ok(output)
}

/// [`super::all_reduce`] on the device.
pub(super) fn all_reduce<const D: usize>(
    tensor: Tensor<D>,
    op: ReduceOp,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    let (device, shape) = (tensor.device(), tensor.shape());
    let n = shape.num_elements();
    let out = run(tensor, n, shape, n, group, |send, recv| {
        DeviceCollective::AllReduce { send, recv, op }
    })?;
    Ok(with_context_of(from_cube(out), &device))
}

/// [`super::broadcast`] on the device.
pub(super) fn broadcast<const D: usize>(
    tensor: Tensor<D>,
    root: usize,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    let (device, shape) = (tensor.device(), tensor.shape());
    let n = shape.num_elements();
    let out = run(tensor, n, shape, n, group, |send, recv| {
        DeviceCollective::Broadcast { send, recv, root }
    })?;
    Ok(with_context_of(from_cube(out), &device))
}

/// [`super::reduce_scatter`] on the device (uneven `counts`).
pub(super) fn reduce_scatter(
    tensor: Tensor<1>,
    counts: &[usize],
    op: ReduceOp,
    group: &ProcessGroup,
) -> Result<Option<Tensor<1>>> {
    let device = tensor.device();
    let mine = counts[group.rank()];
    let n = tensor.shape().num_elements();
    let out = run(
        tensor,
        n,
        Shape::new([mine.max(1)]),
        mine,
        group,
        |send, recv| DeviceCollective::ReduceScatter {
            send,
            recv,
            op,
            counts: Some(counts),
        },
    )?;
    Ok((mine > 0).then(|| with_context_of(from_cube(out), &device)))
}

/// [`super::all_gather`] on the device: `piece` (this rank's `counts[rank]` elements, `None`
/// for 0) gathered into `sum(counts)` elements of `dtype` on `device`.
pub(super) fn all_gather(
    piece: Option<Tensor<1>>,
    counts: &[usize],
    dtype: DType,
    group: &ProcessGroup,
    device: &Device,
) -> Result<Tensor<1>> {
    let total: usize = counts.iter().sum();
    let mine = counts[group.rank()];
    // A rank contributing nothing still takes part: a one-element stand-in, none of it sent.
    let piece = piece.unwrap_or_else(|| Tensor::zeros([1], (device, dtype)));
    let out = run(
        piece,
        mine,
        Shape::new([total]),
        total,
        group,
        |send, recv| DeviceCollective::AllGather {
            send,
            recv,
            counts: Some(counts),
        },
    )?;
    Ok(with_context_of(from_cube(out), device))
}

/// [`super::send`] on the device.
pub(super) fn send<const D: usize>(
    tensor: Tensor<D>,
    dst: usize,
    tag: u64,
    group: &ProcessGroup,
) -> Result<()> {
    let t = to_cube(tensor);
    sync(&t)?;
    let n = t.meta.num_elements();
    ledger::record_payload(n * t.dtype.size());
    with_pointers(&t, &t, |ptr, _| {
        // SAFETY: a pinned, synchronised allocation of `n` elements of this device.
        unsafe { group.device_send(buf(ptr, n, t.dtype), dst, tag) }
    })??;
    Ok(())
}

/// [`super::recv`] on the device: a fresh tensor of `shape` and `dtype` on `device`.
pub(super) fn recv<const D: usize>(
    shape: [usize; D],
    dtype: DType,
    src: usize,
    tag: u64,
    group: &ProcessGroup,
    device: &Device,
) -> Result<Tensor<D>> {
    let t = to_cube(Tensor::<D>::empty(shape, (device, dtype)));
    let n = t.meta.num_elements();
    sync(&t)?;
    with_pointers(&t, &t, |ptr, _| {
        // SAFETY: a fresh, pinned allocation of `n` elements of this device.
        unsafe { group.device_recv(buf(ptr, n, dtype), src, tag) }
    })??;
    Ok(with_context_of(from_cube(t), device))
}
