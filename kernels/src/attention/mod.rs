//! Fused scaled dot-product attention, GQA-aware and optionally causal: [`attention`].
//!
//! One autodiff node whose state is `(q, k, v, out, lse)` (`lse`: each query's log-sum-exp
//! of its scaled scores); its backward recomputes the probabilities from `lse`
//! (flash-attention-2: `D = rowsum(dO ⊙ O)`, `dS = P ⊙ (dP − D)`, then `dQ`, `dK`, `dV`, the
//! latter two summed over the query heads that share a kv head).
//!
//! On Flex in f32 both directions are host kernels ([`flex`]) over tiles of 64 keys with an
//! online softmax — no `Tq × Tk` matrix, the kv heads never repeated, keys past a causal
//! query's last one never touched. Every other case runs plain Burn ([`fallback`]): a 16-bit
//! dtype (the whole op, on Burn's own autodiff, as the models ran before), a CubeCL device
//! (the extension's forward and backward as whole-tensor Burn ops).

pub mod fallback;
mod flex;

use crate::fused::host::all_f32;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape, Tensor, TensorData};

/// Backends that run the fused attention; call it through [`attention`].
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait AttentionBackend: Backend {
    /// `softmax(q kᵀ · scale + mask) v` for `q` `[B, h, Tq, dh]`, `k`, `v` `[B, h_kv, Tk, dh]`
    /// (see [`attention`]): the output `[B, h, Tq, dh]` and each query's log-sum-exp of its
    /// scaled, masked scores `[B, h, Tq]` (not differentiable).
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients `(dq, dk, dv)` of [`AttentionBackend::attention_forward`] given its
    /// inputs, output `out`, log-sum-exp `lse` and the output's gradient `grad` (not
    /// differentiable itself).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// Scaled dot-product attention `softmax(q kᵀ · scale + mask) v`, fused (see the module docs).
///
/// `q` is `[B, h, Tq, dh]`, `k` and `v` `[B, h_kv, Tk, dh]` with `h % h_kv == 0`: query head
/// `j` attends with kv head `j / (h / h_kv)` (grouped-query attention; the kv heads are not
/// copied). With `causal`, the queries are the last `Tq` of the `Tk` positions: query `i`
/// attends to keys `0 ..= i + (Tk − Tq)` (the convention of [`crate::causal_softmax`]).
/// Returns `[B, h, Tq, dh]`. f32 runs the fused op; other dtypes [`fallback::attention`].
pub fn attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, scale: f64, causal: bool) -> Tensor<4> {
    let ([b, h, _, dh], [bk, h_kv, tk, dhk]) = (q.dims(), k.dims());
    assert!(
        b == bk && dh == dhk && h_kv > 0 && h % h_kv == 0 && v.dims() == [b, h_kv, tk, dh],
        "attention: q {:?}, k {:?}, v {:?} do not fit [B, h, Tq, dh], [B, h_kv, Tk, dh]",
        q.dims(),
        k.dims(),
        v.dims()
    );
    if [q.dtype(), k.dtype(), v.dtype()] != [DType::F32; 3] {
        return fallback::attention(q, k, v, scale, causal);
    }
    let (out, _lse) = <Dispatch as AttentionBackend>::attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        scale,
        causal,
    );
    Tensor::from_dispatch(out)
}

// ---------------------------------------------------------------------------------------
// Concrete backends
// ---------------------------------------------------------------------------------------

/// The sizes of a call from its inputs' shapes.
fn dims(q: &Shape, k: &Shape, scale: f64, causal: bool) -> flex::Dims {
    flex::Dims {
        b: q[0],
        h: q[1],
        h_kv: k[1],
        tq: q[2],
        tk: k[2],
        dh: q[3],
        scale: scale as f32,
        causal,
    }
}

/// A contiguous f32 tensor's values.
fn slice(t: &FloatTensor<Flex>) -> &[f32] {
    t.as_slice::<f32>().expect("a contiguous f32 tensor")
}

/// A new Flex f32 tensor of `shape` holding `values`.
fn flex_tensor(values: Vec<f32>, shape: Shape) -> FloatTensor<Flex> {
    <Flex as burn::backend::ops::FloatTensorOps<Flex>>::float_from_data(
        TensorData::new(values, shape),
        &Default::default(),
    )
}

impl AttentionBackend for Flex {
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[&q, &k, &v]) {
            return fallback::forward::<Self>(q, k, v, scale, causal);
        }
        let d = dims(&q.shape(), &k.shape(), scale, causal);
        let [q, k, v] = [q, k, v].map(|t| t.to_contiguous());
        let (out, lse) = flex::forward(&d, slice(&q), slice(&k), slice(&v));
        (
            flex_tensor(out, q.shape()),
            flex_tensor(lse, Shape::new([d.b, d.h, d.tq])),
        )
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[&q, &k, &v, &out, &lse, &grad]) {
            return fallback::backward::<Self>(q, k, v, out, lse, grad, scale, causal);
        }
        let d = dims(&q.shape(), &k.shape(), scale, causal);
        let [q, k, v, out, lse, grad] = [q, k, v, out, lse, grad].map(|t| t.to_contiguous());
        let x = flex::BackwardIn {
            q: slice(&q),
            k: slice(&k),
            v: slice(&v),
            o: slice(&out),
            lse: slice(&lse),
            grad: slice(&grad),
        };
        let (dq, dk, dv) = flex::backward(&d, &x);
        (
            flex_tensor(dq, q.shape()),
            flex_tensor(dk, k.shape()),
            flex_tensor(dv, v.shape()),
        )
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl AttentionBackend for burn::backend::Cube {
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        fallback::forward::<Self>(q, k, v, scale, causal)
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        fallback::backward::<Self>(q, k, v, out, lse, grad, scale, causal)
    }
}

// ---------------------------------------------------------------------------------------
// Autodiff: one node
// ---------------------------------------------------------------------------------------

#[derive(Debug)]
struct AttentionStep {
    scale: f64,
    causal: bool,
}

/// The inputs `q`, `k`, `v`, the output and the log-sum-exp.
type State<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
);

impl<B: AttentionBackend> Backward<B, 3> for AttentionStep {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse) = ops.state;
        let (dq, dk, dv) = B::attention_backward(q, k, v, out, lse, grad, self.scale, self.causal);
        for (parent, g) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(parent) = parent {
                grads.register::<B>(parent.id, g);
            }
        }
    }
}

impl<B: AttentionBackend, C: CheckpointStrategy> AttentionBackend for Autodiff<B, C> {
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let step = AttentionStep { scale, causal };
        let prep = step
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful();
        let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
        let (out, lse) = B::attention_forward(q.clone(), k.clone(), v.clone(), scale, causal);
        let out = match prep {
            OpsKind::Tracked(prep) => prep.finish((q, k, v, out.clone(), lse.clone()), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (out, FloatTensor::<Self>::new(lse))
    }

    fn attention_backward(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _out: FloatTensor<Self>,
        _lse: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _scale: f64,
        _causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        panic!("bonfire-kernels: attention_backward is not differentiable");
    }
}
