//! [`matmul`]: the models' 2-d matrix product (their linear layers' `x Wᵀ` and its two
//! backward products), in bf16 on Flex through a kernel of the CPU's bf16 instructions where
//! it has them ([`bf16_kernel`]: Intel AMX, `amx.rs`; on request AVX-512 BF16's dot products,
//! `dot.rs`; both over the operand layout of `pack.rs`), in f32 on Flex through Flex's own
//! `gemm` call written straight into its output, and Burn's `matmul` everywhere else.
//!
//! Flex multiplies bf16 by converting both operands to f32, running its f32 `gemm` and
//! converting back: the f32 rate (~100–150 GFLOP/s on one core) where oneDNN's AMX kernels
//! reach 600–1,500 on the bench models' shapes (`cargo xtask bench gemm`). The op is one
//! autodiff node ([`ProductBackend::product`]) whose backward runs the same product for
//! `dlhs = grad · rhsᵀ` and `drhs = lhsᵀ · grad` (transposes are views), keeping what Burn's
//! matmul keeps (the left operand only when the right one is tracked, and the converse).
//! f32 on Flex is Burn's product bit for bit (the same `gemm` call with the same arguments)
//! without Flex's zero-filled output and its copy into an aligned buffer; every other dtype or
//! device, and bf16 on a CPU without a kernel, takes `lhs.matmul(rhs)` itself.

#[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
mod amx;
#[cfg(target_arch = "x86_64")]
mod dot;
mod linear;
#[cfg(target_arch = "x86_64")]
mod pack;
#[cfg(target_arch = "x86_64")]
mod transpose;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, Tensor};

/// A kernel of the CPU's bf16 instructions for [`matmul`] on Flex.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// Intel AMX's tiles (`TDPBF16PS`): Sapphire Rapids and later.
    Amx,
    /// AVX-512 BF16's dot products (`VDPBF16PS`): AMD Zen 4 and later, Intel Cooper Lake.
    Avx512Bf16,
}

impl Bf16Kernel {
    /// `amx` or `avx512bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Amx => "amx",
            Self::Avx512Bf16 => "avx512bf16",
        }
    }

    /// Whether this process can run the kernel (the CPU has it; for AMX, Linux granted it).
    pub fn available(self) -> bool {
        #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
        if self == Self::Amx {
            return amx::ready();
        }
        #[cfg(target_arch = "x86_64")]
        if self == Self::Avx512Bf16 {
            return dot::ready();
        }
        false
    }
}

/// The kernel bf16 products on Flex take in this process: AMX where the CPU has it, or the one
/// `BONFIRE_BF16_MATMUL` names (`amx`, `avx512bf16`) where the CPU has it; `None` — Burn's
/// product — otherwise or with `BONFIRE_BF16_MATMUL=burn` (to reproduce a run made on another
/// CPU). AVX-512 BF16 is not the default: on the one core measured (an Intel Xeon, whose
/// `VDPBF16PS` runs at its f32 FMA rate) it ran at 0.70–1.00 of Burn's product; the CPUs
/// where it should win (AMD Zen 4: dot products at twice the FMA rate) are not yet measured.
/// Asked once a process.
pub fn bf16_kernel() -> Option<Bf16Kernel> {
    static KERNEL: std::sync::OnceLock<Option<Bf16Kernel>> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        let wanted = std::env::var("BONFIRE_BF16_MATMUL").unwrap_or_default();
        let kernels = [Bf16Kernel::Amx, Bf16Kernel::Avx512Bf16];
        let named = kernels.into_iter().find(|k| k.name() == wanted);
        match wanted.as_str() {
            "burn" => None,
            _ => named
                .into_iter()
                .chain([Bf16Kernel::Amx])
                .find(|k| k.available()),
        }
    })
}

/// `lhs · rhs` for `[m, k] × [k, n]`: on Flex in f32, or in bf16 with a [`bf16_kernel`]
/// (f32 sums, rounded once to bf16), one autodiff node over it; otherwise `lhs.matmul(rhs)`.
pub fn matmul(lhs: Tensor<2>, rhs: Tensor<2>) -> Tensor<2> {
    let ours = lhs.dtype() == rhs.dtype() && is_ours(lhs.dtype());
    if !(ours && crate::device::is_flex(&lhs.device())) {
        return lhs.matmul(rhs);
    }
    Tensor::from_dispatch(<Dispatch as ProductBackend>::product(
        lhs.into_dispatch(),
        rhs.into_dispatch(),
    ))
}

/// Whether [`matmul`] runs its own product on Flex for operands of `dtype`: f32, and bf16
/// with a [`bf16_kernel`].
fn is_ours(dtype: DType) -> bool {
    dtype == DType::F32 || (dtype == DType::BF16 && bf16_kernel().is_some())
}

/// `t` laid out row-major: itself when it already is, otherwise a copy ([`row_major`] on Flex,
/// a reshape's copy elsewhere).
pub fn contiguous(t: Tensor<2>) -> Tensor<2> {
    match t.clone().try_into_primitive::<Flex>() {
        Ok(p) if !p.is_contiguous() => Tensor::from_primitive::<Flex>(row_major(p)),
        Ok(_) => t,
        Err(_) => {
            let dims = t.dims();
            t.reshape([dims[0] * dims[1]]).reshape(dims)
        }
    }
}

/// A Flex tensor that is not contiguous, copied row-major: where it is an f32 column-major view
/// (a transposed contiguous matrix, the layout of the weight gradients
/// [`ProductBackend::product`]'s backward leaves transposed), by blocks transposed in
/// registers — 16 × 16 where the CPU has AVX-512, 8 × 8 where it has AVX2 only; otherwise, and
/// for every other layout, Flex's tiled copy (3.5 GB/s on the bench GPT's weight gradients
/// inside the step, `perf`). The one copy the host kernels make of a strided input
/// (`fused::host::contiguous`).
pub(crate) fn row_major(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    #[cfg(target_arch = "x86_64")]
    if t.dtype() == DType::F32
        && Flex::is_column_major(&t)
        && let Some(width) = transpose::Width::widest()
    {
        return transposed_back(&t, width);
    }
    t.to_contiguous()
}

/// A column-major Flex f32 `[m, n]` view ([`ProductLayout::is_column_major`]) copied row-major
/// by blocks of `width`.
#[cfg(target_arch = "x86_64")]
fn transposed_back(t: &FloatTensor<Flex>, width: transpose::Width) -> FloatTensor<Flex> {
    use burn::tensor::TensorData;
    let layout = t.layout();
    let (m, n) = (layout.shape()[0], layout.shape()[1]);
    // The view's values, contiguous as the `[n, m]` it transposes.
    let src = &t.storage::<f32>()[layout.start_offset()..][..m * n];
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    transpose::transpose_f32(width, src, n, m, &mut out.spare_capacity_mut()[..m * n]);
    // SAFETY: `transpose_f32` wrote every one of the `m · n` values.
    unsafe { out.set_len(m * n) };
    FloatTensor::<Flex>::from_data(TensorData::new(out, [m, n]))
}

/// Backends that run [`matmul`]'s node.
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait ProductBackend: Backend {
    /// `lhs · rhs`, `[m, k] × [k, n]`.
    fn product(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `acc + lhs · rhs` for `acc` `[m, n]`, not differentiable: a sum of products over blocks
    /// of `k` (the head's weight gradient in [`crate::linear_cross_entropy`]). On Flex in
    /// f32, into `acc`'s own buffer where it can be reused (`gemm` adding to what it reads
    /// there: no second `[m, n]` written, then added); elsewhere the product, then the sum.
    fn product_add(
        acc: FloatTensor<Self>,
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// Whether a backend's tensor is a 2-d column-major view — a transposed contiguous matrix, as
/// a linear layer's `Wᵀ` is. [`ProductBackend::product`]'s backward gives such a right operand,
/// where it is no wider than tall (`W`'s `out ≤ in`), its gradient in the same layout, so that
/// the gradient transposed back is contiguous like `W` (Burn's matmul gives `lhsᵀ · grad`
/// row-major: `W`'s gradient is then a transposed view that every consumer — a data-parallel
/// hook flattening it, the optimizer — copies first).
pub trait ProductLayout: Backend {
    /// `t` is `[k, n]` with strides `[1, k]` (and neither dimension 1).
    fn is_column_major(t: &FloatTensor<Self>) -> bool;
}

impl ProductLayout for Flex {
    fn is_column_major(t: &FloatTensor<Self>) -> bool {
        let layout = t.layout();
        let (shape, strides) = (layout.shape(), layout.strides());
        shape.num_dims() == 2
            && shape[0] > 1
            && shape[1] > 1
            && strides[0] == 1
            && strides[1] == shape[0] as isize
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl ProductLayout for burn::backend::Cube {
    fn is_column_major(_: &FloatTensor<Self>) -> bool {
        false
    }
}

impl ProductBackend for Flex {
    fn product(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        #[cfg(target_arch = "x86_64")]
        if lhs.dtype() == DType::BF16
            && rhs.dtype() == DType::BF16
            && let Some(kernel) = bf16_kernel()
        {
            return flex_bf16(kernel, &lhs, &rhs);
        }
        if lhs.dtype() == DType::F32 && rhs.dtype() == DType::F32 {
            return flex_f32(&lhs, &rhs);
        }
        Flex::float_matmul(lhs, rhs)
    }

    fn product_add(
        mut acc: FloatTensor<Self>,
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let f32s = [&acc, &lhs, &rhs].iter().all(|t| t.dtype() == DType::F32);
        let (m, n) = (lhs.shape()[0], rhs.shape()[1]);
        if f32s
            && acc.shape().dims::<2>() == [m, n]
            && let Some(dst) = crate::flex_buffer::owned(&mut acc)
        {
            // SAFETY: `dst` is `acc`'s `m × n` values, row-major and this tensor's alone.
            unsafe { gemm_f32(dst.as_mut_ptr(), true, &lhs, &rhs) };
            return acc;
        }
        Flex::float_add(acc, Self::product(lhs, rhs))
    }
}

/// Flex's own f32 product — the same `gemm` call with the same arguments, so the same values
/// bit for bit — written into a `Vec<f32>` that is not zero-filled first: Flex allocates its
/// output as a zeroed `Vec<u8>` (a `memset` of every output before `gemm` overwrites it,
/// 2–7 % of the products' time on the bench shapes; `gemm` reads nothing of it with `read_dst`
/// off), which Burn's `Bytes` then copies into an aligned buffer (twice the output, for a
/// moment).
fn flex_f32(lhs: &FloatTensor<Flex>, rhs: &FloatTensor<Flex>) -> FloatTensor<Flex> {
    use burn::tensor::TensorData;
    let (a, b) = (lhs.layout(), rhs.layout());
    assert!(
        a.shape().num_dims() == 2 && b.shape().num_dims() == 2,
        "bonfire-kernels: matmul takes 2-d tensors"
    );
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    assert_eq!(
        k,
        b.shape()[0],
        "bonfire-kernels: matmul's inner dimensions differ"
    );
    if m * n * k == 0 {
        return FloatTensor::<Flex>::from_data(TensorData::new(vec![0f32; m * n], [m, n]));
    }
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    // SAFETY: `out` has room for `m × n` values, which `gemm` writes every one of (`read_dst`
    // off) before the length is set.
    unsafe {
        gemm_f32(out.as_mut_ptr(), false, lhs, rhs);
        out.set_len(m * n);
    }
    FloatTensor::<Flex>::from_data(TensorData::new(out, [m, n]))
}

/// `gemm`'s `dst = lhs · rhs` (`add`: `dst += lhs · rhs`) for f32 Flex operands of any strides,
/// `dst` row-major `[m, n]`.
///
/// # Safety
/// `dst` has room for `m × n` values (initialized where `add`); the operands are 2-d f32 with
/// `lhs`'s columns as many as `rhs`'s rows.
unsafe fn gemm_f32(dst: *mut f32, add: bool, lhs: &FloatTensor<Flex>, rhs: &FloatTensor<Flex>) {
    let (a, b) = (lhs.layout(), rhs.layout());
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let (lhs_data, rhs_data) = (lhs.storage::<f32>(), rhs.storage::<f32>());
    // SAFETY: the operands' elements lie in their buffers at their offsets and strides (their
    // layouts); the caller vouches for `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            add,
            lhs_data.as_ptr().add(a.start_offset()),
            a.strides()[1],
            a.strides()[0],
            rhs_data.as_ptr().add(b.start_offset()),
            b.strides()[1],
            b.strides()[0],
            if add { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `kernel` (available) on Flex tensors (any strides).
#[cfg(target_arch = "x86_64")]
fn flex_bf16(
    kernel: Bf16Kernel,
    lhs: &FloatTensor<Flex>,
    rhs: &FloatTensor<Flex>,
) -> FloatTensor<Flex> {
    use burn::tensor::{TensorData, bf16};
    // An operand with neither stride 1 or with a negative one (a flipped view; no linear
    // layer passes either) is copied contiguous.
    let unit = |t: &FloatTensor<Flex>| {
        let strides = t.layout().strides();
        match strides.contains(&1) && strides.iter().all(|&s| s >= 0) {
            true => t.clone(),
            false => t.to_contiguous(),
        }
    };
    let (lhs, rhs) = (unit(lhs), unit(rhs));
    fn operand(t: &FloatTensor<Flex>) -> pack::Operand<'_> {
        let layout = t.layout();
        let (shape, strides) = (layout.shape(), layout.strides());
        assert_eq!(
            shape.num_dims(),
            2,
            "bonfire-kernels: matmul takes 2-d tensors"
        );
        pack::Operand {
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
    // Not zero-filled first: the kernels write every element (`store_rounded`).
    let mut out: Vec<bf16> = Vec::with_capacity(a.rows * b.cols);
    let spare = &mut out.spare_capacity_mut()[..a.rows * b.cols];
    match kernel {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        Bf16Kernel::Amx => amx::matmul(&a, &b, spare),
        Bf16Kernel::Avx512Bf16 => dot::matmul(&a, &b, spare),
        #[allow(unreachable_patterns)]
        other => unreachable!("{other:?} is not available here"),
    }
    // SAFETY: the kernel wrote all `m × n` elements.
    unsafe { out.set_len(a.rows * b.cols) };
    FloatTensor::<Flex>::from_data(TensorData::new(out, [a.rows, b.cols]))
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl ProductBackend for burn::backend::Cube {
    fn product(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }

    fn product_add(
        acc: FloatTensor<Self>,
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::float_add(acc, Self::float_matmul(lhs, rhs))
    }
}

impl<B: ProductBackend + ProductLayout, C: CheckpointStrategy> ProductBackend for Autodiff<B, C> {
    fn product(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
        let rhs_column_major = B::is_column_major(rhs.primitive());
        match (ProductNode { rhs_column_major })
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

    fn product_add(
        acc: FloatTensor<Self>,
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::float_add(acc, Self::product(lhs, rhs))
    }
}

/// The autodiff node of [`ProductBackend::product`].
#[derive(Debug)]
pub(crate) struct ProductNode {
    /// The right operand's layout ([`ProductLayout`]), which its gradient takes.
    pub(crate) rhs_column_major: bool,
}

impl<B: ProductBackend> Backward<B, 2> for ProductNode {
    /// The left operand (kept when the right one is tracked) and the right one (kept when
    /// the left one is), as checkpointed nodes.
    type State = (Option<NodeId>, Option<NodeId>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, ckpt: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [p_lhs, p_rhs] = ops.parents;
        let parents = [p_lhs.map(|p| p.id), p_rhs.map(|p| p.id)];
        self.operand_grads::<B>(grad, ops.state, parents, grads, ckpt);
    }
}

impl ProductNode {
    /// The operands' gradients from the output's `grad`: `grad · rhsᵀ` for the left one and
    /// `lhsᵀ · grad` for the right one, each registered for its parent (where tracked), from
    /// the operands `kept` (checkpointed nodes).
    pub(crate) fn operand_grads<B: ProductBackend>(
        &self,
        grad: FloatTensor<B>,
        kept: (Option<NodeId>, Option<NodeId>),
        [p_lhs, p_rhs]: [Option<NodeId>; 2],
        grads: &mut Gradients,
        ckpt: &mut Checkpointer,
    ) {
        let (lhs, rhs) = kept;
        let lhs: Option<FloatTensor<B>> = lhs.map(|id| ckpt.retrieve_node_output(id));
        let rhs: Option<FloatTensor<B>> = rhs.map(|id| ckpt.retrieve_node_output(id));
        if let (Some(p), Some(rhs)) = (p_lhs, rhs) {
            let d = B::product(grad.clone(), B::float_transpose(rhs));
            grads.register::<B>(p, d);
        }
        if let (Some(p), Some(lhs)) = (p_rhs, lhs) {
            // Column-major as `(gradᵀ · lhs)ᵀ`: the same sums of the same products as
            // `lhsᵀ · grad` (on Flex bit for bit: `gemm` sums each element over `k` in one
            // order whichever operand is which), written transposed. Only where the gradient
            // `[k, n]` is no wider than tall (`W`'s `out ≤ in`): `gemm`'s workspace grows with
            // the width of what it writes row by row — 8.4 MB for the bench head's `[4096, 256]`
            // written this way against 2.6 MB the other, more than the copy it saves (the
            // planner's test set measured the Llama's peaks 2–6 % higher with every weight
            // column-major).
            let (k, n) = (lhs.shape()[1], grad.shape()[1]);
            let d = match self.rhs_column_major && n <= k {
                true => B::float_transpose(B::product(B::float_transpose(grad), lhs)),
                false => B::product(B::float_transpose(lhs), grad),
            };
            grads.register::<B>(p, d);
        }
    }
}

pub use linear::{LinearBackend, linear};

#[cfg(test)]
mod tests;
