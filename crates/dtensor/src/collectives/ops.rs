//! The backend extension: one operation, [`CollectiveBackend::collective`], whose forward the
//! concrete backends implement here and whose backward lives in `autodiff.rs`.

use super::{CollectiveKind, CollectiveSpec, host};
use burn::backend::TensorMetadata;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Flex, backend_extension};
use burn::tensor::{Scalar, Shape, Slice};

/// Burn backends that can run Bonfire's collectives.
///
/// Implemented for `Flex`, `Autodiff<B>` (with the dual collectives in backward) and, with
/// the `cuda` feature, `Cube` (staging through host memory for now; the NCCL device path is
/// future work). Call it through the functions of [`crate::functional`], or directly:
/// `Tensor::from_dispatch(<Dispatch as CollectiveBackend>::collective(t.into_dispatch(), spec))`.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait CollectiveBackend: Backend {
    /// Runs the collective described by `spec` on `tensor` (see [`CollectiveKind`]).
    ///
    /// # Panics
    /// If the communicator fails (timeout, a peer that died): Burn's tensor operations are
    /// infallible. Arguments are validated by [`crate::functional`] before this is called.
    fn collective(tensor: FloatTensor<Self>, spec: CollectiveSpec) -> FloatTensor<Self>;
}

/// The forward of `spec` on any concrete backend: local kinds with the backend's own ops,
/// communicating kinds through host memory — the buffer itself on a host backend (`host`),
/// a copy each way, counted in the transfer ledger, on any other.
pub(crate) fn forward<B: Backend>(
    tensor: FloatTensor<B>,
    spec: &CollectiveSpec,
    host: bool,
) -> FloatTensor<B> {
    let output = forward_kind::<B>(tensor, spec, host);
    match spec.output_dtype {
        Some(dtype) if output.dtype() != dtype => B::float_cast(output, dtype.into()),
        _ => output,
    }
}

/// The collective itself, in the input's dtype.
fn forward_kind<B: Backend>(
    tensor: FloatTensor<B>,
    spec: &CollectiveSpec,
    host: bool,
) -> FloatTensor<B> {
    let me = spec.group.rank();
    match &spec.kind {
        CollectiveKind::CopyToGroup => tensor,
        CollectiveKind::Split { dim, sizes } => {
            let start: usize = sizes[..me].iter().sum();
            narrow::<B>(tensor, *dim, start, sizes[me])
        }
        CollectiveKind::Pad { dim, offset, len } => {
            let shape: Vec<usize> = tensor.shape().iter().copied().collect();
            let mut out_shape = shape.clone();
            out_shape[*dim] = *len;
            let zeros = zeros_like::<B>(&tensor, &out_shape);
            if shape[*dim] == 0 {
                return zeros;
            }
            let slices = slices_along(&out_shape, *dim, *offset, shape[*dim]);
            B::float_slice_assign(zeros, &slices, tensor)
        }
        CollectiveKind::Partition { op, keep } => {
            if *op == bonfire_comm::ReduceOp::Sum && !keep {
                let shape: Vec<usize> = tensor.shape().iter().copied().collect();
                zeros_like::<B>(&tensor, &shape)
            } else {
                tensor
            }
        }
        _ => {
            use crate::plane::ledger::{self, Direction, Reason};
            let device = tensor.device();
            let data = burn::tensor::read_sync(B::float_into_data(tensor))
                .expect("bonfire-dtensor: could not read the tensor to communicate it");
            let sent = data.bytes().len();
            if !host {
                ledger::record(Direction::DeviceToHost, Reason::Collective, sent);
            }
            let out = host::execute(data, spec);
            let received = out.bytes().len();
            ledger::record_carried(spec.kind.op_kind(), sent.max(received));
            if !host {
                ledger::record(Direction::HostToDevice, Reason::Collective, received);
            }
            B::float_from_data(out, &device)
        }
    }
}

fn slices_along(shape: &[usize], dim: usize, start: usize, len: usize) -> Vec<Slice> {
    (0..shape.len())
        .map(|d| {
            if d == dim {
                Slice::from(start..start + len)
            } else {
                Slice::from(0..shape[d])
            }
        })
        .collect()
}

/// The `len` elements of `tensor` from `start` along `dim`.
pub(crate) fn narrow<B: Backend>(
    tensor: FloatTensor<B>,
    dim: usize,
    start: usize,
    len: usize,
) -> FloatTensor<B> {
    let shape: Vec<usize> = tensor.shape().iter().copied().collect();
    B::float_slice(tensor, &slices_along(&shape, dim, start, len))
}

/// `tensor × factor`, skipping the multiplication when `factor` is 1.
pub(crate) fn scale<B: Backend>(tensor: FloatTensor<B>, factor: f64) -> FloatTensor<B> {
    if factor == 1.0 {
        tensor
    } else {
        B::float_mul_scalar(tensor, Scalar::Float(factor))
    }
}

/// A zero tensor shaped and typed like `like`'s input of shape `shape`.
pub(crate) fn zeros_like<B: Backend>(like: &FloatTensor<B>, shape: &[usize]) -> FloatTensor<B> {
    let device = like.device();
    let dtype = like.dtype().into();
    B::float_zeros(Shape::from(shape.to_vec()), &device, dtype)
}

impl CollectiveBackend for Flex {
    fn collective(tensor: FloatTensor<Self>, spec: CollectiveSpec) -> FloatTensor<Self> {
        forward::<Self>(tensor, &spec, true)
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl CollectiveBackend for burn::backend::Cube {
    fn collective(tensor: FloatTensor<Self>, spec: CollectiveSpec) -> FloatTensor<Self> {
        // Staged through host memory (counted); CUDA tensors on a group with NCCL run on the
        // device buffers instead (`crate::plane` with the `cuda` feature).
        forward::<Self>(tensor, &spec, false)
    }
}
