//! The data plane: collectives on Burn tensors, returning tensors on the same device — what
//! the data-parallel wrappers, the pipeline and the trainer move between ranks — and the one
//! counted way to bring a tensor to the host and back ([`to_host`], [`from_host`]).
//!
//! These are not differentiable (the functional collectives of [`crate::functional`] are):
//! they carry gradients, shards and activations outside the autodiff graph.
//!
//! Each backend does what its device allows:
//!
//! - **Host devices** (Burn's `Flex`): a tensor's buffer is host memory. The host backends
//!   (threads, MPI) work on it in place: the tensor's data is taken out (no copy when the
//!   tensor is not shared), reduced, and put back.
//! - **Other devices** (wgpu, CUDA without NCCL): the buffer is staged through the host, and
//!   every staged byte is counted in the [`ledger`] (device→host, host→device, reason
//!   `Collective`).
//! - **CUDA with NCCL** (feature `cuda`): runs on the device buffers, nothing staged (see
//!   `cuda.rs`).
//!
//! Every collective also records the bytes it carries (`payload`).

#[cfg(feature = "cuda")]
mod cuda;
mod index;
pub mod ledger;
pub mod testing;

use crate::{DTensorError, Result};
use bonfire_comm::{CommError, ProcessGroup, ReduceOp, Work};
use burn::tensor::{DType, Device, Tensor, TensorData};
use ledger::{Direction, Reason};

pub use index::{counts_to_host, indices_from_host};
pub use ledger::{TransferLedger, Transfers};

/// Whether `device`'s tensors live in host memory (Burn's CPU backends), so that reading them
/// moves nothing.
pub fn is_host(device: &Device) -> bool {
    bonfire_kernels::is_flex(device)
}

/// `tensor`'s data on the host (its dtype kept), for `reason`: the tensor's own buffer on a
/// host device, a counted device→host copy on any other.
pub fn to_data<const D: usize>(tensor: Tensor<D>, reason: Reason) -> TensorData {
    let device = tensor.device();
    let data = tensor.into_data();
    if !is_host(&device) {
        ledger::record(Direction::DeviceToHost, reason, data.bytes().len());
    }
    data
}

/// A tensor on `device` from host `data`, for `reason` (a counted host→device copy unless
/// `device` is a host device).
pub fn from_data<const D: usize>(data: TensorData, device: &Device, reason: Reason) -> Tensor<D> {
    if !is_host(device) {
        ledger::record(Direction::HostToDevice, reason, data.bytes().len());
    }
    let dtype = data.dtype();
    Tensor::from_data(data, (device, dtype))
}

/// `tensor` moved to `device` (another Burn device: an offload device, another backend), for
/// `reason`: through its data, counted device→host and host→device where a side is not host
/// memory (between two host devices nothing is copied or counted).
pub fn to_device<const D: usize>(tensor: Tensor<D>, device: &Device, reason: Reason) -> Tensor<D> {
    from_data(to_data(tensor, reason), device, reason)
}

/// `tensor`'s values as f32 on the host, for `reason` (see [`to_data`]).
pub fn to_host<const D: usize>(tensor: Tensor<D>, reason: Reason) -> Vec<f32> {
    let data = to_data(tensor, reason);
    let data = if data.dtype() == DType::F32 {
        data
    } else {
        data.convert::<f32>()
    };
    data.try_into_vec::<f32>().expect("f32 data")
}

/// A tensor of `shape` on `device` from f32 host `values`, for `reason` (see [`from_data`]).
pub fn from_host<const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &Device,
    reason: Reason,
) -> Tensor<D> {
    from_data(TensorData::new(values, shape), device, reason)
}

/// `$body` with `$v` bound to `$data`'s values as a `Vec` of their element type (f32, f64,
/// f16 or bf16; the tensor's buffer itself when it is not shared); `$body` makes the output
/// `TensorData`.
macro_rules! with_values {
    ($data:expr, $v:ident => $body:expr) => {{
        let data: TensorData = $data;
        let bad = |e: burn::tensor::DataError| {
            DTensorError::InvalidArgument(format!("tensor data of an unexpected type: {e:?}"))
        };
        match data.dtype() {
            DType::F32 => {
                #[allow(unused_mut)]
                let mut $v = data.try_into_vec::<f32>().map_err(bad)?;
                $body
            }
            DType::F64 => {
                #[allow(unused_mut)]
                let mut $v = data.try_into_vec::<f64>().map_err(bad)?;
                $body
            }
            DType::F16 => {
                #[allow(unused_mut)]
                let mut $v = data.try_into_vec::<bonfire_comm::f16>().map_err(bad)?;
                $body
            }
            DType::BF16 => {
                #[allow(unused_mut)]
                let mut $v = data.try_into_vec::<bonfire_comm::bf16>().map_err(bad)?;
                $body
            }
            other => {
                return Err(DTensorError::InvalidArgument(format!(
                    "the data plane carries float tensors, not {other:?}"
                ))
                .into());
            }
        }
    }};
}

/// `reduce(tensor)` over `group`, on every rank: the tensor's own buffer on a host device.
pub fn all_reduce<const D: usize>(
    tensor: Tensor<D>,
    op: ReduceOp,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    if group.size() == 1 {
        return Ok(tensor); // every op of one value is that value
    }
    #[cfg(feature = "cuda")]
    if cuda::applies(&tensor.device(), tensor.dtype(), group) {
        return cuda::all_reduce(tensor, op, group);
    }
    let device = tensor.device();
    let data = to_data(tensor, Reason::Collective);
    ledger::record_carried(bonfire_comm::OpKind::AllReduce, data.bytes().len());
    let shape = data.shape().to_vec();
    let data = with_values!(data, v => {
        group.all_reduce(&mut v, op)?;
        TensorData::new(v, shape)
    });
    Ok(from_data(data, &device, Reason::Collective))
}

/// A collective running on the group's communication thread; [`wait`](Self::wait) returns
/// its tensor on the device it came from.
pub struct PendingTensor<const D: usize> {
    state: Pending<D>,
}

enum Pending<const D: usize> {
    /// On the communication thread.
    Running {
        work: Work<(TensorData, Ran)>,
        device: Device,
    },
    /// A group of one: nothing to communicate.
    Ready(Box<(Tensor<D>, Ran)>),
}

/// When the communication thread started and finished a collective.
#[derive(Debug, Clone, Copy)]
pub struct Ran {
    /// When the communication thread started the collective.
    pub start: std::time::Instant,
    /// When it finished.
    pub end: std::time::Instant,
}

impl<const D: usize> PendingTensor<D> {
    /// The result, on the original device (waits for the communication).
    pub fn wait(self) -> Result<Tensor<D>> {
        Ok(self.wait_timed()?.0)
    }

    /// The result, and when the communication thread ran it.
    pub fn wait_timed(self) -> Result<(Tensor<D>, Ran)> {
        match self.state {
            Pending::Running { work, device } => {
                let (data, ran) = work.wait()?;
                Ok((from_data(data, &device, Reason::Collective), ran))
            }
            Pending::Ready(ready) => Ok(*ready),
        }
    }
}

/// [`all_reduce`] started on `group`'s communication thread, so that the caller goes on
/// (DDP's buckets during backward). The staging down happens here, the staging up in
/// [`PendingTensor::wait`], both on the caller's thread.
pub fn all_reduce_async<const D: usize>(
    tensor: Tensor<D>,
    op: ReduceOp,
    group: &ProcessGroup,
) -> PendingTensor<D> {
    if group.size() == 1 {
        let now = std::time::Instant::now();
        let ran = Ran {
            start: now,
            end: now,
        };
        return PendingTensor {
            state: Pending::Ready(Box::new((tensor, ran))),
        };
    }
    let device = tensor.device();
    let data = to_data(tensor, Reason::Collective);
    ledger::record_carried(bonfire_comm::OpKind::AllReduce, data.bytes().len());
    let work = run_timed(group, move |pg| {
        let shape = data.shape().to_vec();
        Ok(with_values!(data, v => {
            pg.all_reduce(&mut v, op)?;
            TensorData::new(v, shape)
        }))
    });
    PendingTensor {
        state: Pending::Running { work, device },
    }
}

/// Queues `f` on `group`'s communication thread and records when that thread ran it.
fn run_timed(
    group: &ProcessGroup,
    f: impl FnOnce(&ProcessGroup) -> Result<TensorData> + Send + 'static,
) -> Work<(TensorData, Ran)> {
    group.run_async(move |pg| {
        let start = std::time::Instant::now();
        let ran = |data| {
            let end = std::time::Instant::now();
            (data, Ran { start, end })
        };
        f(pg).map(ran).map_err(|e| match e {
            DTensorError::Comm(c) => c,
            other => CommError::Unsupported {
                backend: "bonfire-dtensor data plane",
                what: other.to_string(),
            },
        })
    })
}

/// A [`reduce_scatter_async`] in flight: [`wait`](Self::wait) returns this rank's piece on
/// the device the bucket came from (`None` when its count is 0).
pub struct PendingPiece {
    state: PieceState,
}

enum PieceState {
    /// On the communication thread; `mine` is this rank's count.
    Running {
        work: Work<(TensorData, Ran)>,
        device: Device,
        mine: usize,
    },
    /// Done already (a group of one, or NCCL).
    Ready(Box<(Option<Tensor<1>>, Ran)>),
}

impl PendingPiece {
    /// This rank's piece (waits for the communication).
    pub fn wait(self) -> Result<Option<Tensor<1>>> {
        Ok(self.wait_timed()?.0)
    }

    /// This rank's piece, and when the communication thread ran the reduce-scatter.
    pub fn wait_timed(self) -> Result<(Option<Tensor<1>>, Ran)> {
        match self.state {
            PieceState::Running { work, device, mine } => {
                let (data, ran) = work.wait()?;
                let t = (mine > 0).then(|| from_data(data, &device, Reason::Collective));
                Ok((t, ran))
            }
            PieceState::Ready(ready) => Ok(*ready),
        }
    }
}

/// [`reduce_scatter`] started on `group`'s communication thread, so that the caller goes on
/// (ZeRO-2's buckets during backward). The staging down happens here, the staging up in
/// [`PendingPiece::wait`], both on the caller's thread. On CUDA with NCCL it runs at once.
pub fn reduce_scatter_async(
    tensor: Tensor<1>,
    counts: &[usize],
    op: ReduceOp,
    group: &ProcessGroup,
) -> Result<PendingPiece> {
    let mine = counts[group.rank()];
    let ready = |t: Option<Tensor<1>>, start: std::time::Instant| {
        let end = std::time::Instant::now();
        PendingPiece {
            state: PieceState::Ready(Box::new((t, Ran { start, end }))),
        }
    };
    if group.size() == 1 {
        return Ok(ready(
            (mine > 0).then_some(tensor),
            std::time::Instant::now(),
        ));
    }
    #[cfg(feature = "cuda")]
    if cuda::applies(&tensor.device(), tensor.dtype(), group) {
        let start = std::time::Instant::now();
        return Ok(ready(
            cuda::reduce_scatter(tensor, counts, op, group)?,
            start,
        ));
    }
    let device = tensor.device();
    let data = to_data(tensor, Reason::Collective);
    ledger::record_carried(bonfire_comm::OpKind::ReduceScatter, data.bytes().len());
    let counts = counts.to_vec();
    let work = run_timed(group, move |pg| {
        Ok(with_values!(data, v => {
            let mut recv = vec![Default::default(); mine];
            pg.reduce_scatter_uneven(&v, &mut recv, &counts, op)?;
            drop(v);
            TensorData::new(recv, [mine])
        }))
    });
    Ok(PendingPiece {
        state: PieceState::Running { work, device, mine },
    })
}

/// `root`'s tensor on every rank of `group`.
pub fn broadcast<const D: usize>(
    tensor: Tensor<D>,
    root: usize,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    if group.size() == 1 {
        return Ok(tensor);
    }
    #[cfg(feature = "cuda")]
    if cuda::applies(&tensor.device(), tensor.dtype(), group) {
        return cuda::broadcast(tensor, root, group);
    }
    let device = tensor.device();
    let data = to_data(tensor, Reason::Collective);
    ledger::record_carried(bonfire_comm::OpKind::Broadcast, data.bytes().len());
    let shape = data.shape().to_vec();
    let data = with_values!(data, v => {
        group.broadcast(&mut v, root)?;
        TensorData::new(v, shape)
    });
    Ok(from_data(data, &device, Reason::Collective))
}

/// The flat `tensor` (of `counts.iter().sum()` elements) split in rank order into pieces of
/// `counts`; returns the reduction of every rank's piece `rank` (`None` when this rank's count
/// is 0: Burn has no empty tensors).
pub fn reduce_scatter(
    tensor: Tensor<1>,
    counts: &[usize],
    op: ReduceOp,
    group: &ProcessGroup,
) -> Result<Option<Tensor<1>>> {
    let mine = counts[group.rank()];
    if group.size() == 1 {
        return Ok((mine > 0).then_some(tensor));
    }
    #[cfg(feature = "cuda")]
    if cuda::applies(&tensor.device(), tensor.dtype(), group) {
        return cuda::reduce_scatter(tensor, counts, op, group);
    }
    let device = tensor.device();
    let data = to_data(tensor, Reason::Collective);
    ledger::record_carried(bonfire_comm::OpKind::ReduceScatter, data.bytes().len());
    let out = with_values!(data, v => {
        let mut recv = vec![Default::default(); mine];
        group.reduce_scatter_uneven(&v, &mut recv, counts, op)?;
        drop(v);
        TensorData::new(recv, [mine])
    });
    Ok((mine > 0).then(|| from_data(out, &device, Reason::Collective)))
}

/// The concatenation, in rank order, of every rank's flat `piece` (`None` for a rank whose
/// count is 0), on `device`: `counts[r]` elements from rank `r`.
pub fn all_gather(
    piece: Option<Tensor<1>>,
    counts: &[usize],
    dtype: DType,
    group: &ProcessGroup,
    device: &Device,
) -> Result<Tensor<1>> {
    let total: usize = counts.iter().sum();
    let piece = match (group.size(), piece) {
        (1, Some(piece)) => {
            let same = piece.device() == *device && piece.is_autodiff() == device.is_autodiff();
            return Ok(if same {
                piece
            } else {
                to_device(piece, device, Reason::Collective)
            });
        }
        (_, piece) => piece,
    };
    #[cfg(feature = "cuda")]
    if cuda::applies(device, dtype, group) {
        return cuda::all_gather(piece, counts, dtype, group, device);
    }
    let data = match piece {
        Some(t) => to_data(t, Reason::Collective),
        None => TensorData::new(Vec::<f32>::new(), [0]).convert_dtype(dtype),
    };
    let out = with_values!(data, v => {
        let mut recv = vec![Default::default(); total];
        group.all_gather_uneven(&v, &mut recv, counts)?;
        TensorData::new(recv, [total])
    });
    ledger::record_carried(bonfire_comm::OpKind::AllGather, out.bytes().len());
    Ok(from_data(out, device, Reason::Collective))
}

/// Sends `tensor` to rank `dst` of `group` (tag `tag`); the receiver must know its shape.
pub fn send<const D: usize>(
    tensor: Tensor<D>,
    dst: usize,
    tag: u64,
    group: &ProcessGroup,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    if cuda::applies(&tensor.device(), tensor.dtype(), group) {
        return cuda::send(tensor, dst, tag, group);
    }
    let data = to_data(tensor, Reason::Activation);
    ledger::record_carried(bonfire_comm::OpKind::Send, data.bytes().len());
    with_values!(data, v => group.send(&v, dst, tag)?);
    Ok(())
}

/// Receives a tensor of `shape` and `dtype` from rank `src` of `group` (tag `tag`) onto
/// `device`.
pub fn recv<const D: usize>(
    shape: [usize; D],
    dtype: DType,
    src: usize,
    tag: u64,
    group: &ProcessGroup,
    device: &Device,
) -> Result<Tensor<D>> {
    #[cfg(feature = "cuda")]
    if cuda::applies(device, dtype, group) {
        return cuda::recv(shape, dtype, src, tag, group, device);
    }
    let n: usize = shape.iter().product();
    let data = TensorData::new(vec![0.0f32; n], shape).convert_dtype(dtype);
    let data = with_values!(data, v => {
        group.recv(&mut v, src, tag)?;
        TensorData::new(v, shape)
    });
    ledger::record_carried(bonfire_comm::OpKind::Recv, data.bytes().len());
    Ok(from_data(data, device, Reason::Activation))
}
