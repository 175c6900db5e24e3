//! Deferred weight gradients: the zero-bubble pipeline's "B/W" split of a linear layer's
//! backward (Qi et al., *Zero Bubble Pipeline Parallelism*, 2023).
//!
//! A linear layer `y = x Wᵀ` has two gradients: the input's, `dx = dy W` (what the previous
//! pipeline stage waits for: "B"), and the weight's, `dW = dyᵀ x` (needed only by the
//! optimizer: "W"). Burn's autodiff computes both in one `backward()`. Inside
//! [`deferring`], every [`linear_matmul`] whose weight is a parameter leaf (`require_grad`) and
//! whose input is tracked instead:
//!
//! - multiplies by the weight as a **constant** (an untracked copy of the same buffer), so
//!   autodiff's matmul computes only `dx` — the same kernel on the same operands as without
//!   deferral — and no weight-gradient matmul;
//! - passes its output through [`WeightGradBackend::keep_grad`], an identity whose backward
//!   also keeps the output gradient `dy` (one more reference to the buffer autodiff made);
//! - records `x` (the buffer autodiff's matmul would have kept for `dW`) and the weight.
//!
//! The backward then yields input gradients and the gradients of everything else (biases,
//! norms, embeddings: cheap element-wise and reduction ops, left in B). [`WeightGrads::apply`]
//! later computes each `dW` from `(x, dy)` with plain tensor ops — no autodiff, no second
//! backward — in exactly the order of autodiff's own matmul backward (`xᵀ·dy` over the
//! flattened rows, transposed back to `[out, in]`), so the values are
//! bitwise those of the undivided backward; and adds it to the `Gradients` under the weight,
//! where `GradientsParams::from_module` (and every data-parallel wrapper's `accumulate`)
//! finds it.
//!
//! Weights that are not leaves — ZeRO-3's gathered values, DDP's hooked identities, the fresh
//! leaves of an activation-checkpointed recomputation (which runs in backward, outside
//! `deferring`) — are multiplied as usual: their gradients come out of the backward itself.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients as AutodiffGradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, Backend, BackendTensor, DispatchKindConversion, Flex, backend_extension,
};
use burn::tensor::{DispatchTensor, Gradients, Tensor};
use std::cell::{Cell, RefCell};
use std::sync::{Arc, Mutex};

/// Burn backends that can keep a gradient for a deferred weight gradient (`Flex`,
/// `Autodiff<B>`, and `Cube` with the `cuda` or `wgpu` feature). Call it through
/// [`linear_matmul`].
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait WeightGradBackend: Backend {
    /// `y` unchanged; in backward its gradient passes through unchanged and is also kept in
    /// `slot`.
    fn keep_grad(y: FloatTensor<Self>, slot: GradSlot) -> FloatTensor<Self>;
}

/// Where [`WeightGradBackend::keep_grad`] leaves the gradient it saw in backward.
#[derive(Clone, Default)]
pub struct GradSlot(Arc<Mutex<Option<DispatchTensor>>>);

impl GradSlot {
    fn take(&self) -> Option<DispatchTensor> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl std::fmt::Debug for GradSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let filled = self.0.lock().map(|s| s.is_some()).unwrap_or(false);
        f.debug_struct("GradSlot").field("filled", &filled).finish()
    }
}

/// A backend primitive as a dispatch tensor (no autodiff).
fn to_dispatch<B: Backend>(t: FloatTensor<B>) -> DispatchTensor
where
    DispatchTensor: DispatchKindConversion<B>,
{
    <DispatchTensor as DispatchKindConversion<B>>::from_backend(BackendTensor::Float(t))
}

macro_rules! concrete {
    ($backend:ty) => {
        impl WeightGradBackend for $backend {
            fn keep_grad(y: FloatTensor<Self>, _slot: GradSlot) -> FloatTensor<Self> {
                y
            }
        }
    };
}

concrete!(Flex);
#[cfg(any(feature = "cuda", feature = "wgpu"))]
concrete!(burn::backend::Cube);

#[derive(Debug)]
struct KeepGradBackward {
    slot: GradSlot,
}

impl<B: Backend> Backward<B, 1> for KeepGradBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut AutodiffGradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        *self.slot.0.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(to_dispatch::<B>(grad.clone()));
        let [parent] = ops.parents;
        if let Some(node) = parent {
            grads.register::<B>(node.id, grad);
        }
    }
}

impl<B: WeightGradBackend, C: CheckpointStrategy> WeightGradBackend for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>,
{
    fn keep_grad(y: FloatTensor<Self>, slot: GradSlot) -> FloatTensor<Self> {
        KeepGradBackward { slot }
            .prepare::<C>([y.node()])
            .compute_bound()
            .stateless(y.into_primitive())
    }
}

/// Computes one weight's gradient from the output gradient, kept in backward.
type WeightGradFn = Box<dyn FnOnce(DispatchTensor) -> Tensor<2> + Send>;

/// One deferred weight gradient: the weight (the autodiff leaf), where its layer's output
/// gradient lands, and how `dW` follows from it.
struct Deferred {
    weight: Tensor<2>,
    slot: GradSlot,
    grad: WeightGradFn,
}

thread_local! {
    /// The deferred weight gradients of the [`deferring`] call running on this thread.
    static QUEUE: RefCell<Option<Vec<Deferred>>> = const { RefCell::new(None) };
}

thread_local! {
    /// How many deferred weight gradients [`WeightGrads::apply`] computed on this thread.
    static APPLIED: Cell<u64> = const { Cell::new(0) };
}

/// How many deferred weight gradients [`WeightGrads::apply`] has computed **on this thread**
/// so far: tests use it to see that the split is real. A pipeline stage runs its "W" steps
/// on its rank's thread, so a test reads it there — the difference between a read before and
/// one after its own work — and sums over its ranks; tests running beside it on other
/// threads cannot add to it.
pub fn applied() -> u64 {
    APPLIED.with(Cell::get)
}

/// The weight gradients a forward run in [`deferring`] left for later: each linear layer's
/// input and (once backward has run) output gradient.
#[derive(Default)]
pub struct WeightGrads {
    items: Vec<Deferred>,
}

impl std::fmt::Debug for WeightGrads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightGrads")
            .field("layers", &self.items.len())
            .finish()
    }
}

impl WeightGrads {
    /// The number of deferred weight gradients.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether nothing was deferred.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// "W": computes every deferred weight gradient whose output gradient the backward
    /// produced and adds it to `grads` under its weight; returns how many. A layer whose
    /// output did not reach the backward's root gets none, as without deferral.
    pub fn apply(self, grads: &mut Gradients) -> usize {
        let mut n = 0;
        for Deferred { weight, slot, grad } in self.items {
            let Some(dy) = slot.take() else { continue };
            let dw = grad(dy);
            let dw = match weight.grad_remove(grads) {
                Some(earlier) => earlier + dw,
                None => dw,
            };
            weight.grad_replace(grads, dw);
            n += 1;
        }
        APPLIED.with(|a| a.set(a.get() + n as u64));
        n
    }
}

/// Runs `f` (a forward) deferring the weight gradients of the linear layers it runs (see
/// the module docs), and returns them with `f`'s result. Calls nest: an inner call takes the
/// layers run inside it.
pub fn deferring<R>(f: impl FnOnce() -> R) -> (R, WeightGrads) {
    struct Restore(Option<Option<Vec<Deferred>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(outer) = self.0.take() {
                QUEUE.with(|q| *q.borrow_mut() = outer);
            }
        }
    }
    let mut restore = Restore(Some(QUEUE.with(|q| q.borrow_mut().replace(Vec::new()))));
    let out = f();
    let items = QUEUE.with(|q| q.borrow_mut().take()).unwrap_or_default();
    if let Some(outer) = restore.0.take() {
        QUEUE.with(|q| *q.borrow_mut() = outer);
    }
    (out, WeightGrads { items })
}

/// Whether a [`deferring`] call is running on this thread.
pub fn is_deferring() -> bool {
    QUEUE.with(|q| q.borrow().is_some())
}

/// `x Wᵀ` for `x` `[..., in]` and `weight` `[out, in]` (PyTorch's layout): the linear layer's
/// matmul, run as one `[rows, in] × [in, out]` product over the flattened leading dimensions
/// (as Burn's `module::linear` does), so that backward's weight gradient is one matmul with
/// every row as its inner dimension instead of a batch of small ones summed afterwards.
/// Inside [`deferring`], with a weight that is a parameter leaf and a tracked input, the
/// weight's gradient is deferred to [`WeightGrads::apply`]; the output and the input's
/// gradient are bitwise the same. Every product here is `bonfire_kernels::matmul` (Burn's
/// matmul, but bf16 on Flex through AMX where the CPU has it), the deferred one included.
pub fn linear_matmul<const D: usize>(x: Tensor<D>, weight: Tensor<2>) -> Tensor<D> {
    let (x, out_dims) = rows_of(x, &weight);
    if !defers(&x, &weight) {
        return bonfire_kernels::matmul(x, weight.transpose()).reshape(out_dims);
    }
    let constant = weight.clone().set_require_grad(false);
    let kept = x.clone().inner();
    let y = bonfire_kernels::matmul(x, constant.transpose());
    let slot = GradSlot::default();
    let y = Tensor::<2>::from_dispatch(<burn::backend::Dispatch as WeightGradBackend>::keep_grad(
        y.into_dispatch(),
        slot.clone(),
    ));
    let grad: WeightGradFn = Box::new(move |dy| weight_grad(kept, Tensor::<2>::from_dispatch(dy)));
    QUEUE.with(|q| {
        if let Some(queue) = q.borrow_mut().as_mut() {
            queue.push(Deferred { weight, slot, grad });
        }
    });
    y.reshape(out_dims)
}

/// `x Wᵀ + b` (`b` `[out]`, or none: [`linear_matmul`]): with a bias, outside [`deferring`]'s
/// deferral, one node ([`bonfire_kernels::linear`]: the bias added in place over the
/// product's fresh output, also where Balanced checkpointing keeps that output); otherwise
/// [`linear_matmul`] then [`bonfire_kernels::add_bias`]. The same values either way.
pub fn linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    let Some(bias) = bias else {
        return linear_matmul(x, weight);
    };
    if defers(&x, &weight) {
        return bonfire_kernels::add_bias(linear_matmul(x, weight), bias);
    }
    let (x, out_dims) = rows_of(x, &weight);
    bonfire_kernels::linear(x, weight.transpose(), bias).reshape(out_dims)
}

/// `x` `[..., in]` as `[rows, in]` over its leading dimensions, and the dimensions of the
/// layer's output `[..., out]` for `weight` `[out, in]`.
fn rows_of<const D: usize>(x: Tensor<D>, weight: &Tensor<2>) -> (Tensor<2>, [usize; D]) {
    let dims = x.dims();
    let mut out_dims = dims;
    out_dims[D - 1] = weight.dims()[0];
    (
        x.reshape([dims[..D - 1].iter().product(), dims[D - 1]]),
        out_dims,
    )
}

/// Whether the product of `x` and `weight` defers the weight's gradient: inside
/// [`deferring`], a weight that is a parameter leaf and a tracked input.
fn defers<const D: usize>(x: &Tensor<D>, weight: &Tensor<2>) -> bool {
    weight.is_require_grad() && x.is_tracked() && is_deferring()
}

/// `dW` `[out, in]` of `y = x Wᵀ` from `x` `[rows, in]` and `dy` `[rows, out]`, as autodiff's
/// backward of `x.matmul(W.transpose())` computes it: `xᵀ·dy` `[in, out]`, transposed back (the
/// product's own backward may write it column-major instead, `(dyᵀ·x)ᵀ`: on Flex the same
/// values bit for bit).
fn weight_grad(x: Tensor<2>, dy: Tensor<2>) -> Tensor<2> {
    bonfire_kernels::matmul(x.transpose(), dy).transpose()
}
