//! [`matmul`]: the models' 2-d matrix product (their linear layers' `x Wᵀ` and its two
//! backward products), in bf16 on Flex through Intel AMX where the CPU has it (`amx.rs`), and
//! Burn's `matmul` everywhere else.
//!
//! Flex multiplies bf16 by converting both operands to f32, running its f32 `gemm` and
//! converting back: the f32 rate (~100–150 GFLOP/s on one core) where oneDNN's AMX kernels
//! reach 600–1,400 on the bench models' shapes (`cargo xtask bench gemm`). The op is one
//! autodiff node ([`ProductBackend::product`]) whose backward runs the same product for
//! `dlhs = grad · rhsᵀ` and `drhs = lhsᵀ · grad` (transposes are views), keeping what Burn's
//! matmul keeps (the left operand only when the right one is tracked, and the converse).
//! Every other dtype, device or CPU takes `lhs.matmul(rhs)` itself, so f32 runs are Burn's,
//! bit for bit.

#[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
mod amx;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::{DType, Tensor};

/// Whether bf16 products on Flex run on AMX in this process (the CPU has it, Linux granted
/// it, `BONFIRE_AMX` is not `0`).
pub fn amx_ready() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
    {
        amx::ready()
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// `lhs · rhs` for `[m, k] × [k, n]`: on Flex in bf16 with AMX ([`amx_ready`]) one autodiff
/// node over the AMX kernel (f32 sums, rounded once to bf16); otherwise `lhs.matmul(rhs)`.
pub fn matmul(lhs: Tensor<2>, rhs: Tensor<2>) -> Tensor<2> {
    let bf16 = lhs.dtype() == DType::BF16 && rhs.dtype() == DType::BF16;
    if !(bf16 && amx_ready() && is_flex(&lhs.device())) {
        return lhs.matmul(rhs);
    }
    Tensor::from_dispatch(<Dispatch as ProductBackend>::product(
        lhs.into_dispatch(),
        rhs.into_dispatch(),
    ))
}

/// Whether `device` is Flex's (under autodiff or not).
fn is_flex(device: &burn::tensor::Device) -> bool {
    use burn::backend::DispatchDevice;
    fn flex(d: &DispatchDevice) -> bool {
        match d {
            DispatchDevice::Flex(_) => true,
            DispatchDevice::Autodiff(inner) => flex(&inner.clone().inner()),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
    flex(device.as_dispatch())
}

/// Backends that run [`matmul`]'s node.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait ProductBackend: Backend {
    /// `lhs · rhs`, `[m, k] × [k, n]`.
    fn product(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl ProductBackend for Flex {
    fn product(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
        if lhs.dtype() == DType::BF16 && rhs.dtype() == DType::BF16 && amx::ready() {
            return flex_amx(&lhs, &rhs);
        }
        Flex::float_matmul(lhs, rhs)
    }
}

/// [`amx::matmul`] on Flex tensors (any strides).
#[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
fn flex_amx(lhs: &FloatTensor<Flex>, rhs: &FloatTensor<Flex>) -> FloatTensor<Flex> {
    use burn::tensor::{TensorData, bf16};
    // An operand with neither stride 1 (no linear layer passes one) is copied contiguous.
    let unit = |t: &FloatTensor<Flex>| match t.layout().strides().contains(&1) {
        true => t.clone(),
        false => t.to_contiguous(),
    };
    let (lhs, rhs) = (unit(lhs), unit(rhs));
    fn operand(t: &FloatTensor<Flex>) -> amx::Operand<'_> {
        let layout = t.layout();
        let (shape, strides) = (layout.shape(), layout.strides());
        assert!(
            shape.num_dims() == 2 && strides.iter().all(|&s| s >= 0),
            "bonfire-kernels: matmul takes 2-d tensors with non-negative strides"
        );
        amx::Operand {
            data: t.storage::<bf16>(),
            offset: layout.start_offset(),
            rows: shape[0],
            cols: shape[1],
            row_stride: strides[0] as usize,
            col_stride: strides[1] as usize,
        }
    }
    let (a, b) = (operand(&lhs), operand(&rhs));
    assert_eq!(
        a.cols, b.rows,
        "bonfire-kernels: matmul's inner dimensions differ"
    );
    let mut out = vec![bf16::ZERO; a.rows * b.cols];
    amx::matmul(&a, &b, &mut out);
    FloatTensor::<Flex>::from_data(TensorData::new(out, [a.rows, b.cols]))
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl ProductBackend for burn::backend::Cube {
    fn product(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }
}

impl<B: ProductBackend, C: CheckpointStrategy> ProductBackend for Autodiff<B, C> {
    fn product(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
        match ProductNode
            .prepare::<C>([lhs.node(), rhs.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let lhs_kept = rhs_tracked.then(|| prep.checkpoint(&lhs));
                let rhs_kept = lhs_tracked.then(|| prep.checkpoint(&rhs));
                let out = B::product(lhs.into_primitive(), rhs.into_primitive());
                prep.finish((lhs_kept, rhs_kept), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::product(lhs.into_primitive(), rhs.into_primitive()))
            }
        }
    }
}

/// The autodiff node of [`ProductBackend::product`].
#[derive(Debug)]
struct ProductNode;

impl<B: ProductBackend> Backward<B, 2> for ProductNode {
    /// The left operand (kept when the right one is tracked) and the right one (kept when
    /// the left one is), as checkpointed nodes.
    type State = (Option<NodeId>, Option<NodeId>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, ckpt: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (lhs, rhs) = ops.state;
        let lhs: Option<FloatTensor<B>> = lhs.map(|id| ckpt.retrieve_node_output(id));
        let rhs: Option<FloatTensor<B>> = rhs.map(|id| ckpt.retrieve_node_output(id));
        let [p_lhs, p_rhs] = ops.parents;
        if let (Some(p), Some(rhs)) = (p_lhs, rhs) {
            let d = B::product(grad.clone(), B::float_transpose(rhs));
            grads.register::<B>(p.id, d);
        }
        if let (Some(p), Some(lhs)) = (p_rhs, lhs) {
            grads.register::<B>(p.id, B::product(B::float_transpose(lhs), grad));
        }
    }
}

#[cfg(test)]
mod tests;
