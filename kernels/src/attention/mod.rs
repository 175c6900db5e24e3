//! Fused scaled dot-product attention, GQA-aware, masked causally, by a sliding window or not
//! at all ([`Mask`]): [`attention`].
//!
//! One autodiff node whose state is `(q, k, v, out, lse)` (`lse`: each query's log-sum-exp
//! of its scaled scores); its backward recomputes the probabilities from `lse`
//! (flash-attention-2: `D = rowsum(dO ⊙ O)`, `dS = P ⊙ (dP − D)`, then `dQ`, `dK`, `dV`, the
//! latter two summed over the query heads that share a kv head). [`attention_with_lse`]
//! also returns `lse`, differentiable (the node's output packs it beside the output; its
//! gradient shifts `D` by `dlse`): what ring attention merges its blocks with.
//!
//! On Flex in f32 both directions are host kernels ([`flex`]) over tiles of 64 keys with an
//! online softmax — no `Tq × Tk` matrix, no copy of inputs whose rows are contiguous (heads
//! split from a projection are read in place), the output written sequence-major (merging the
//! heads back is a view), the kv heads never repeated, keys a query cannot see
//! (past a causal query's last one, before its window) never touched; a query that sees no
//! key of the call gets output 0 and log-sum-exp −∞. On a CubeCL device (wgpu, CUDA) both
//! directions are kernels of their own ([`cube`]: one unit per query or key row, the same
//! semantics), in f32 and in the 16-bit types the device stores (accumulating in f32). A
//! 16-bit dtype elsewhere, and [`attention_with_lse`] in 16 bits, run plain Burn ([`fallback`]:
//! the whole op, on Burn's own autodiff, as the models ran before).

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
pub mod fallback;
mod flex;
mod mask;

pub use mask::{MASKED, Mask};

use crate::fused::host::all_f32;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape, Slice, Tensor, TensorData};

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
        mask: Mask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`AttentionBackend::attention_forward`]'s output and log-sum-exp as one tensor
    /// `[B, h, Tq, dh + 1]` (the log-sum-exp its last column), differentiable in both: one
    /// autodiff node whatever its consumers use (see [`attention_with_lse`]).
    fn attention_forward_packed(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        mask: Mask,
    ) -> FloatTensor<Self>;

    /// The gradients `(dq, dk, dv)` of [`AttentionBackend::attention_forward`] given its
    /// inputs, output `out`, log-sum-exp `lse`, the output's gradient `grad` and the
    /// log-sum-exp's `dlse` `[B, h, Tq]` (not differentiable itself).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        dlse: FloatTensor<Self>,
        scale: f64,
        mask: Mask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// Scaled dot-product attention `softmax(q kᵀ · scale + mask) v`, fused (see the module docs).
///
/// `q` is `[B, h, Tq, dh]`, `k` and `v` `[B, h_kv, Tk, dh]` with `h % h_kv == 0`: query head
/// `j` attends with kv head `j / (h / h_kv)` (grouped-query attention; the kv heads are not
/// copied). `mask` says which keys each query sees ([`Mask`]; a `bool` is the plain causal or
/// full mask): causal, the queries are the last `Tq` of the `Tk` positions, query `i` attends
/// to keys `0 ..= i + (Tk − Tq)` (the convention of [`crate::causal_softmax`]); with a window
/// `W` only to the last `W` of those.
/// Returns `[B, h, Tq, dh]`. What [`fused_takes`] runs the fused op; the rest
/// [`fallback::attention`].
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    mask: impl Into<Mask>,
) -> Tensor<4> {
    let mask = mask.into();
    check_shapes(&q, &k, &v);
    if !fused_takes(&q, &k, &v) {
        return fallback::attention(q, k, v, scale, mask);
    }
    let (out, _lse) = <Dispatch as AttentionBackend>::attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        scale,
        mask,
    );
    Tensor::from_dispatch(out)
}

/// [`attention`] and each query's log-sum-exp of its scaled, masked scores `[B, h, Tq]`, both
/// differentiable: what merges attention computed over parts of the keys (ring attention's
/// blocks: `lse = log Σᵢ exp(lseᵢ)`, `out = Σᵢ exp(lseᵢ − lse) · outᵢ`). One fused node
/// (its backward takes the log-sum-exp's gradient as a shift of `D`,
/// `dS = P ⊙ (dP − (D − dlse))`); the output is a view of a `[B, h, Tq, dh + 1]` tensor.
/// f32 runs the fused op; other dtypes [`fallback::attention_with_lse`].
pub fn attention_with_lse(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scale: f64,
    mask: impl Into<Mask>,
) -> (Tensor<4>, Tensor<3>) {
    let mask = mask.into();
    check_shapes(&q, &k, &v);
    if [q.dtype(), k.dtype(), v.dtype()] != [DType::F32; 3] {
        return fallback::attention_with_lse(q, k, v, scale, mask);
    }
    let [b, h, tq, dh] = q.dims();
    let packed =
        Tensor::<4>::from_dispatch(<Dispatch as AttentionBackend>::attention_forward_packed(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            scale,
            mask,
        ));
    let lse = packed.clone().narrow(3, dh, 1).reshape([b, h, tq]);
    (packed.narrow(3, 0, dh), lse)
}

/// Whether [`attention`] runs these inputs fused (else its plain-Burn [`fallback`]): f32
/// everywhere, and on a CubeCL device the 16-bit type it stores (one dtype for the three; the
/// kernels accumulate in f32 and keep the log-sum-exp in f32 — the packed form of
/// [`attention_with_lse`], whose log-sum-exp shares the output's dtype, stays f32-only).
pub fn fused_takes(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>) -> bool {
    let dtype = q.dtype();
    k.dtype() == dtype && v.dtype() == dtype && crate::fuses(&q.device(), dtype)
}

/// Panics naming the shapes unless `q` is `[B, h, Tq, dh]` and `k`, `v` `[B, h_kv, Tk, dh]`
/// with `h_kv` dividing `h`.
fn check_shapes(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>) {
    let ([b, h, _, dh], [bk, h_kv, tk, dhk]) = (q.dims(), k.dims());
    assert!(
        b == bk && dh == dhk && h_kv > 0 && h % h_kv == 0 && v.dims() == [b, h_kv, tk, dh],
        "attention: q {:?}, k {:?}, v {:?} do not fit [B, h, Tq, dh], [B, h_kv, Tk, dh]",
        q.dims(),
        k.dims(),
        v.dims()
    );
}

/// `out` `[B, h, Tq, dh]` and `lse` `[B, h, Tq]` as one `[B, h, Tq, dh + 1]` tensor.
fn pack<B: Backend>(out: FloatTensor<B>, lse: FloatTensor<B>) -> FloatTensor<B> {
    let s = lse.shape();
    let lse = B::float_reshape(lse, Shape::new([s[0], s[1], s[2], 1]));
    B::float_cat(vec![out, lse], 3)
}

/// `packed` `[B, h, Tq, dh + 1]` back into the output's and the log-sum-exp's parts.
fn unpack<B: Backend>(packed: FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let s = packed.shape();
    let (b, h, tq, dh) = (s[0], s[1], s[2], s[3] - 1);
    let part = |a: usize, n: usize| {
        let mut at = [Slice::full(); 4];
        at[3] = Slice::new(a as isize, Some((a + n) as isize), 1);
        B::float_slice(packed.clone(), &at)
    };
    let lse = B::float_reshape(part(dh, 1), Shape::new([b, h, tq]));
    (part(0, dh), lse)
}

// ---------------------------------------------------------------------------------------
// Concrete backends
// ---------------------------------------------------------------------------------------

/// The sizes of a call from its inputs' shapes.
fn dims(q: &Shape, k: &Shape, scale: f64, mask: Mask) -> flex::Dims {
    flex::Dims {
        b: q[0],
        h: q[1],
        h_kv: k[1],
        tq: q[2],
        tk: k[2],
        dh: q[3],
        scale: scale as f32,
        mask,
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

/// `t` (`[B, heads, T, dh]` f32) as the kernels read it in place — where each row's `dh`
/// values are contiguous and no stride is negative — or else copied contiguous first.
fn heads_of(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let layout = t.layout();
    let (shape, strides) = (layout.shape(), layout.strides());
    let fits = (shape[3] == 1 || strides[3] == 1) && strides.iter().all(|&s| s >= 0);
    if fits { t } else { t.to_contiguous() }
}

/// A tensor [`heads_of`] returned, as the kernels' input.
fn input(t: &FloatTensor<Flex>) -> flex::Input<'_> {
    let layout = t.layout();
    let strides = layout.strides();
    flex::Input {
        data: &t.storage::<f32>()[layout.start_offset()..],
        heads: flex::Heads {
            batch: strides[0] as usize,
            head: strides[1] as usize,
            row: strides[2] as usize,
        },
    }
}

/// A kernel's output as a Flex tensor `[B, heads, T, dh]` (`heads` and `t` from its shape):
/// a view of `[B, T, heads, dh]` where it was written sequence-major.
fn output_tensor(out: flex::Output, [b, heads, t, dh]: [usize; 4]) -> FloatTensor<Flex> {
    use burn::backend::ops::FloatTensorOps;
    match out.heads.is_sequence_major() {
        true => Flex::float_swap_dims(flex_tensor(out.data, Shape::new([b, t, heads, dh])), 1, 2),
        false => flex_tensor(out.data, Shape::new([b, heads, t, dh])),
    }
}

impl AttentionBackend for Flex {
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        mask: Mask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[&q, &k, &v]) {
            return fallback::forward::<Self>(q, k, v, scale, mask);
        }
        let d = dims(&q.shape(), &k.shape(), scale, mask);
        let [q, k, v] = [q, k, v].map(heads_of);
        let x = flex::ForwardIn {
            q: input(&q),
            k: input(&k),
            v: input(&v),
        };
        let (out, lse) = flex::forward(&d, &x);
        (
            output_tensor(out, [d.b, d.h, d.tq, d.dh]),
            flex_tensor(lse, Shape::new([d.b, d.h, d.tq])),
        )
    }

    fn attention_forward_packed(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        mask: Mask,
    ) -> FloatTensor<Self> {
        let (out, lse) = Self::attention_forward(q, k, v, scale, mask);
        pack::<Self>(out, lse)
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        dlse: FloatTensor<Self>,
        scale: f64,
        mask: Mask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[&q, &k, &v, &out, &lse, &grad, &dlse]) {
            return fallback::backward::<Self>(q, k, v, out, lse, grad, dlse, scale, mask);
        }
        let d = dims(&q.shape(), &k.shape(), scale, mask);
        let [q, k, v, out, grad] = [q, k, v, out, grad].map(heads_of);
        let [lse, dlse] = [lse, dlse].map(|t| t.to_contiguous());
        let x = flex::BackwardIn {
            q: input(&q),
            k: input(&k),
            v: input(&v),
            o: input(&out),
            grad: input(&grad),
            lse: slice(&lse),
            dlse: slice(&dlse),
        };
        let flex::BackwardOut { dq, dk, dv } = flex::backward(&d, &x);
        let kv = [d.b, d.h_kv, d.tk, d.dh];
        (
            output_tensor(dq, [d.b, d.h, d.tq, d.dh]),
            output_tensor(dk, kv),
            output_tensor(dv, kv),
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
        mask: Mask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cube::attention_forward(q, k, v, scale, mask)
    }

    fn attention_forward_packed(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        mask: Mask,
    ) -> FloatTensor<Self> {
        let (out, lse) = Self::attention_forward(q, k, v, scale, mask);
        pack::<Self>(out, lse)
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        dlse: FloatTensor<Self>,
        scale: f64,
        mask: Mask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        cube::attention_backward(q, k, v, out, lse, grad, dlse, scale, mask)
    }
}

// ---------------------------------------------------------------------------------------
// Autodiff: one node
// ---------------------------------------------------------------------------------------

#[derive(Debug)]
struct AttentionStep {
    scale: f64,
    mask: Mask,
    /// The node's output is [`pack`]ed with the log-sum-exp (its gradient then carries
    /// `dlse`), not the output alone.
    packed: bool,
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
        let (grad, dlse) = match self.packed {
            true => unpack::<B>(grad),
            false => {
                let dtype = lse.dtype().into();
                let zeros = B::float_zeros(lse.shape(), &lse.device(), dtype);
                (grad, zeros)
            }
        };
        let (dq, dk, dv) =
            B::attention_backward(q, k, v, out, lse, grad, dlse, self.scale, self.mask);
        for (parent, g) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(parent) = parent {
                grads.register::<B>(parent.id, g);
            }
        }
    }
}

/// The fused op on autodiff tensors: one node over `q`, `k`, `v` whose output is the output
/// (its gradient `dO`) or, `packed`, output and log-sum-exp together; also the untracked
/// log-sum-exp.
fn tracked<B: AttentionBackend, C: CheckpointStrategy>(
    [q, k, v]: [FloatTensor<Autodiff<B, C>>; 3],
    step: AttentionStep,
) -> [FloatTensor<Autodiff<B, C>>; 2] {
    let (scale, mask, packed) = (step.scale, step.mask, step.packed);
    let prep = step
        .prepare::<C>([q.node(), k.node(), v.node()])
        .compute_bound()
        .stateful();
    let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
    let (out, lse) = B::attention_forward(q.clone(), k.clone(), v.clone(), scale, mask);
    let result = match packed {
        true => pack::<B>(out.clone(), lse.clone()),
        false => out.clone(),
    };
    let result = match prep {
        OpsKind::Tracked(prep) => prep.finish((q, k, v, out, lse.clone()), result),
        OpsKind::UnTracked(prep) => prep.finish(result),
    };
    [result, FloatTensor::<Autodiff<B, C>>::new(lse)]
}

impl<B: AttentionBackend, C: CheckpointStrategy> AttentionBackend for Autodiff<B, C> {
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        mask: Mask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let step = AttentionStep {
            scale,
            mask,
            packed: false,
        };
        let [out, lse] = tracked::<B, C>([q, k, v], step);
        (out, lse)
    }

    fn attention_forward_packed(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        mask: Mask,
    ) -> FloatTensor<Self> {
        let step = AttentionStep {
            scale,
            mask,
            packed: true,
        };
        let [packed, _] = tracked::<B, C>([q, k, v], step);
        packed
    }

    fn attention_backward(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _out: FloatTensor<Self>,
        _lse: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _dlse: FloatTensor<Self>,
        _scale: f64,
        _mask: Mask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        panic!("bonfire-kernels: attention_backward is not differentiable");
    }
}
