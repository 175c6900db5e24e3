//! # bonfire-recompute
//!
//! Activation checkpointing of one region (a layer, a transformer block): [`recompute()`]
//! runs `f(module, x)` without keeping its intermediate activations and, in backward, runs it
//! again with autodiff and back-propagates through the recomputation.
//!
//! Burn's own recompute (the Balanced strategy, `.memory_bound().retro_forward()`) is chosen
//! per device and per operation, and two strategies in one operation panic, so it cannot
//! select regions. Here a region is one operation of a backend extension
//! ([`RecomputeBackend::checkpoint`]) with two inputs: the region's input `x`, and a
//! one-element *tie* `P` that has every float parameter value of the module among its
//! ancestors ([`RecomputeBackend::tie`], one per parameter: an operation cannot take a
//! list of tensors).
//!
//! - **Forward** runs `f` on untracked copies of `x` and the parameter values (so that
//!   nothing of the region is recorded for backward, while the kernels are those of a plain
//!   autodiff forward: the concrete backend's fused ones can differ in the last bit), and asks
//!   Burn's checkpointer to keep `x` and each parameter value for backward. A kept value is
//!   the tensor itself (a parameter, or DDP's hooked identity of it: the same buffer) or,
//!   under the Balanced strategy, a recipe (ZeRO-3's gathered parameters are gathered again
//!   in backward, not kept from forward to backward).
//! - **Backward** rebuilds the module on fresh autodiff leaves holding those values and runs
//!   `f` on a fresh leaf holding `x`: a separate graph, since none of its operations has a
//!   parent in the graph being back-propagated (whose lock the outer backward holds). It
//!   back-propagates `sum(y ⊙ dy)` there — whose gradient with respect to `y` is exactly
//!   `dy` — and hands out the gradient of `x`, and each parameter's gradient to its tie,
//!   which registers it for the parameter value: from there it flows on through the
//!   wrappers' hooks and gathers as without checkpointing. A parameter `f` does not use (an
//!   expert that got no row) gets no gradient; a wrapper's node on it (DDP's hook, ZeRO-3's
//!   gather), in the graph through the tie, gets zeros: the wrappers' missing gradient.
//!
//! Data-parallel wrappers see the region as one layer: [`recompute()`] first enters it through
//! [`bonfire_module::layer`] with `x` (DDP hooks its parameters anchored at `x`, ZeRO-3 gathers them),
//! then runs `f` both times with the thread's layer hooks set aside
//! ([`bonfire_module::without_layer_hooks`]), so that the `layer` calls inside `f` are plain clones of
//! parameters already hooked or gathered. The values are the same, and so are the
//! operations: the gradients are those of the plain forward, to the last bit.
//! Collectives inside `f` (tensor parallelism's; the experts' exchanges, whose scope must
//! stay entered through backward) run again in backward, in the same order on every rank.

use bonfire_module::{layer, without_layer_hooks};
use burn::backend::TensorMetadata;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients as AutodiffGradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, Backend, BackendTensor, DispatchAutodiffContext, DispatchKindConversion, Flex,
    backend_extension,
};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{
    DType, DispatchTensor, GradientCheckpointingStrategy, Gradients, Shape, Tensor,
};
use std::cell::Cell;
use std::sync::{Arc, Mutex};

/// Burn backends that can checkpoint a region (`Flex`, `Autodiff<B>`, and `Cube` with the
/// `cuda` or `wgpu` feature). Call it through [`recompute()`].
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait RecomputeBackend: Backend {
    /// `region`'s function on `x`; `ties` is the last of the region's ties (it carries the
    /// parameters' gradients back in backward).
    fn checkpoint(
        x: FloatTensor<Self>,
        ties: FloatTensor<Self>,
        region: RecomputeRegion,
    ) -> FloatTensor<Self>;

    /// `acc` (one element) unchanged, with `value` — a parameter value of a region — as a
    /// second parent: in backward, `value` gets the gradient the region's recomputation left
    /// for it in `tie`.
    fn tie(acc: FloatTensor<Self>, value: FloatTensor<Self>, tie: Tie) -> FloatTensor<Self>;
}

/// Where a region's recomputation leaves each parameter's gradient for its [`Tie`].
type Deposit = Arc<Mutex<Vec<Option<DispatchTensor>>>>;

/// Parameter `slot` of a region and where its gradient will be.
#[derive(Clone)]
pub struct Tie {
    slot: usize,
    deposit: Deposit,
}

impl std::fmt::Debug for Tie {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tie").field("slot", &self.slot).finish()
    }
}

/// One [`recompute()`] call as the operation sees it: the function and module, type-erased,
/// and the region's parameter values (handed to the checkpointer in forward, never kept
/// here).
#[derive(Clone)]
pub struct RecomputeRegion {
    run: Arc<dyn Recompute>,
    values: Vec<DispatchTensor>,
    deposit: Deposit,
}

impl std::fmt::Debug for RecomputeRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecomputeRegion")
            .field("values", &self.values.len())
            .finish()
    }
}

/// A region with its module type and rank erased; tensors cross as dispatch tensors of the
/// concrete backend (no autodiff).
trait Recompute: Send + Sync {
    /// `f` on `x` with parameter `values`, recording nothing; with `autodiff`, through the
    /// autodiff backend on untracked tensors (the kernels of a plain autodiff forward, which
    /// may differ from the concrete backend's fused ones in the last bit).
    fn forward(
        &self,
        x: DispatchTensor,
        values: Vec<DispatchTensor>,
        autodiff: bool,
    ) -> DispatchTensor;
    /// `f` again, with autodiff, back-propagating `grad`: the gradient of `x` and each
    /// parameter's (`None` where it gets none).
    fn backward(
        &self,
        x: DispatchTensor,
        values: Vec<DispatchTensor>,
        grad: DispatchTensor,
    ) -> (DispatchTensor, Vec<Option<DispatchTensor>>);
}

impl std::fmt::Debug for dyn Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Recompute")
    }
}

thread_local! {
    static RECOMPUTATIONS: Cell<u64> = const { Cell::new(0) };
}

/// How many regions have been recomputed in backward **on this thread** so far: tests use
/// it to see that checkpointing is on. The recomputation runs inside backward, on the thread
/// that called `backward()` (a rank's thread), so a test reads it on its rank threads — the
/// difference between a read before and one after its own work — and sums over them; tests
/// running beside it on other threads cannot add to it.
pub fn recomputations() -> u64 {
    RECOMPUTATIONS.with(Cell::get)
}

/// `f(module, x)`, with its activations recomputed in backward instead of kept (see the
/// module docs). `module` is entered through [`bonfire_module::layer`] with `x`, so data-parallel
/// wrappers see it as one layer; the `layer` calls inside `f` are plain clones.
///
/// Outside autodiff, or when neither `x` nor any parameter is tracked, this is just
/// `f(layer(module, x), x)`.
pub fn recompute<M, const D: usize>(
    module: &M,
    x: Tensor<D>,
    f: impl Fn(&M, Tensor<D>) -> Tensor<D> + Send + Sync + 'static,
) -> Tensor<D>
where
    M: Module + 'static,
{
    let block = layer(module, &x);
    let mut collect = Collect::default();
    block.visit(&mut collect);
    let Collect { slots, values } = collect;
    if !x.is_tracked() && slots.iter().all(|s| !s.tracked) {
        return without_layer_hooks(|| f(&block, x));
    }
    drop(block);
    let strategy = x.gradient_checkpointing_strategy().or_else(|| {
        values.iter().find_map(|v| match v.autodiff {
            DispatchAutodiffContext::Enabled(s) => Some(s),
            DispatchAutodiffContext::Disabled => None,
        })
    });
    let deposit: Deposit = Arc::new(Mutex::new(vec![None; slots.len()]));
    let mut ties = Tensor::<1>::zeros([1], &x.device()).into_dispatch();
    for (slot, value) in values.iter().enumerate() {
        let tie = Tie {
            slot,
            deposit: deposit.clone(),
        };
        ties = <burn::backend::Dispatch as RecomputeBackend>::tie(ties, value.clone(), tie);
    }
    let run = Arc::new(Region {
        skeleton: Mutex::new(module.clone()),
        f: Arc::new(f),
        slots,
        strategy,
    });
    let region = RecomputeRegion {
        run,
        values,
        deposit,
    };
    Tensor::from_dispatch(<burn::backend::Dispatch as RecomputeBackend>::checkpoint(
        x.into_dispatch(),
        ties,
        region,
    ))
}

/// One float parameter of the region, in module order.
#[derive(Debug, Clone)]
struct Slot {
    id: ParamId,
    /// Whether its value (in the layer's copy) is tracked: only those get a gradient.
    tracked: bool,
}

/// The float parameters of a layer's copy: their slots and values.
#[derive(Default)]
struct Collect {
    slots: Vec<Slot>,
    values: Vec<DispatchTensor>,
}

impl ModuleVisitor for Collect {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value: Tensor<D> = (**param).clone();
        self.slots.push(Slot {
            id: param.id,
            tracked: value.is_tracked(),
        });
        self.values.push(value.into_dispatch());
    }
}

/// What a region computes from its module and input.
type RegionFn<M, const D: usize> = Arc<dyn Fn(&M, Tensor<D>) -> Tensor<D> + Send + Sync>;

/// The region of one [`recompute()`] call.
struct Region<M, const D: usize> {
    /// The module as given (not the layer's copy: under ZeRO-3 it holds no gathered value);
    /// its float parameters are replaced on each run.
    skeleton: Mutex<M>,
    f: RegionFn<M, D>,
    slots: Vec<Slot>,
    /// The autodiff strategy of the region's tensors, given to the recomputation's leaves.
    strategy: Option<GradientCheckpointingStrategy>,
}

/// A tracked parameter leaf of the recomputation: its gradient once backward has run.
type Tap = Box<dyn Fn(&Gradients) -> Option<DispatchTensor>>;

/// Fills a module's float parameters, in order, with given values (see [`Leaves`]).
struct Fill<'a> {
    slots: &'a [Slot],
    values: std::vec::IntoIter<DispatchTensor>,
    at: usize,
    leaves: Leaves,
    strategy: Option<GradientCheckpointingStrategy>,
    taps: Vec<Option<Tap>>,
}

/// What [`Fill`] makes of the values.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Leaves {
    /// The values as they are (the concrete backend).
    Plain,
    /// Fresh autodiff leaves that require no gradient.
    Untracked,
    /// Fresh autodiff leaves, the tracked parameters' requiring a gradient, with a tap.
    Tracked,
}

impl ModuleMapper for Fill<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let slot = &self.slots[self.at];
        self.at += 1;
        assert_eq!(
            param.id, slot.id,
            "bonfire-dtensor: a checkpointed module changed its parameters"
        );
        let id = param.id;
        // Not `consume`: that would initialize a lazy (ZeRO-3) parameter.
        drop(param);
        let value = self.values.next().expect("one value per parameter");
        let mut value = Tensor::<D>::from_dispatch(value);
        if self.leaves != Leaves::Plain {
            value = with_autodiff(value, self.strategy);
        }
        if self.leaves == Leaves::Tracked {
            let mut tap: Option<Tap> = None;
            if slot.tracked {
                value = value.require_grad();
                let leaf = value.clone();
                tap = Some(Box::new(move |g| leaf.grad(g).map(Tensor::into_dispatch)));
            }
            self.taps.push(tap);
        }
        Param::initialized(id, value)
    }
}

/// `t` (on the concrete backend) as a fresh autodiff leaf with `strategy`.
fn with_autodiff<const D: usize>(
    t: Tensor<D>,
    strategy: Option<GradientCheckpointingStrategy>,
) -> Tensor<D> {
    let t = t.autodiff();
    match strategy {
        Some(s) => t.with_gradient_checkpointing_strategy(s),
        None => t,
    }
}

impl<M: Module + 'static, const D: usize> Region<M, D> {
    /// The module with `values` as its float parameters (autodiff leaves, with taps for the
    /// tracked ones when `leaves` is [`Leaves::Tracked`]).
    fn filled(&self, values: Vec<DispatchTensor>, leaves: Leaves) -> (M, Vec<Option<Tap>>) {
        let skeleton = self.skeleton.lock().unwrap().clone();
        let mut fill = Fill {
            slots: &self.slots,
            values: values.into_iter(),
            at: 0,
            leaves,
            strategy: self.strategy,
            taps: Vec::new(),
        };
        let module = skeleton.map(&mut fill);
        assert_eq!(fill.at, self.slots.len(), "one value per parameter");
        (module, fill.taps)
    }
}

impl<M: Module + 'static, const D: usize> Recompute for Region<M, D> {
    fn forward(
        &self,
        x: DispatchTensor,
        values: Vec<DispatchTensor>,
        autodiff: bool,
    ) -> DispatchTensor {
        let mut x = Tensor::<D>::from_dispatch(x);
        let leaves = match autodiff {
            true => {
                x = with_autodiff(x, self.strategy);
                Leaves::Untracked
            }
            false => Leaves::Plain,
        };
        let (module, _) = self.filled(values, leaves);
        let y = without_layer_hooks(|| (self.f)(&module, x));
        y.inner().into_dispatch()
    }

    fn backward(
        &self,
        x: DispatchTensor,
        values: Vec<DispatchTensor>,
        grad: DispatchTensor,
    ) -> (DispatchTensor, Vec<Option<DispatchTensor>>) {
        RECOMPUTATIONS.with(|n| n.set(n.get() + 1));
        let x = with_autodiff(Tensor::<D>::from_dispatch(x), self.strategy).require_grad();
        let (module, taps) = self.filled(values, Leaves::Tracked);
        // The forward recorded the region's statistics (a router's loads) the first time.
        let replay = bonfire_module::state::replaying();
        let y = without_layer_hooks(|| (self.f)(&module, x.clone()));
        drop(replay);
        drop(module);
        let dy = Tensor::<D>::from_dispatch(grad);
        let grads = y.is_tracked().then(|| (y * dy).sum().backward());
        let dx = grads.as_ref().and_then(|g| x.grad(g));
        let dx = dx.unwrap_or_else(|| x.inner().zeros_like());
        let dparams = taps
            .iter()
            .map(|tap| Some(tap.as_ref()?(grads.as_ref()?)).flatten())
            .collect();
        (dx.into_dispatch(), dparams)
    }
}

/// A backend primitive as a dispatch tensor (no autodiff).
fn to_dispatch<B: Backend>(t: FloatTensor<B>) -> DispatchTensor
where
    DispatchTensor: DispatchKindConversion<B>,
{
    <DispatchTensor as DispatchKindConversion<B>>::from_backend(BackendTensor::Float(t))
}

/// A dispatch tensor (no autodiff) as a backend primitive.
fn from_dispatch<B: Backend>(t: DispatchTensor) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    <DispatchTensor as DispatchKindConversion<B>>::try_into_backend(t)
        .unwrap_or_else(|e| panic!("bonfire-dtensor: checkpoint: {e}"))
        .float()
}

/// The region's forward on backend `B`'s tensors (see [`Recompute::forward`]).
fn forward<B: Backend>(x: FloatTensor<B>, region: RecomputeRegion, autodiff: bool) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    let y = region
        .run
        .forward(to_dispatch::<B>(x), region.values, autodiff);
    from_dispatch::<B>(y)
}

/// The concrete backends: the region's forward; a tie is its accumulator.
macro_rules! concrete {
    ($backend:ty) => {
        impl RecomputeBackend for $backend {
            fn checkpoint(
                x: FloatTensor<Self>,
                _ties: FloatTensor<Self>,
                region: RecomputeRegion,
            ) -> FloatTensor<Self> {
                forward::<Self>(x, region, false)
            }
            fn tie(
                acc: FloatTensor<Self>,
                _value: FloatTensor<Self>,
                _tie: Tie,
            ) -> FloatTensor<Self> {
                acc
            }
        }
    };
}

concrete!(Flex);
#[cfg(any(feature = "cuda", feature = "wgpu"))]
concrete!(burn::backend::Cube);

/// A parameter value the backward needs: kept by the checkpointer (an autodiff tensor), or
/// a constant of the concrete backend.
#[derive(Debug)]
enum Saved<B: Backend> {
    Node(NodeId),
    Constant(FloatTensor<B>),
}

#[derive(Debug)]
struct RecomputeBackward<B: Backend> {
    run: Arc<dyn Recompute>,
    deposit: Deposit,
    x: NodeId,
    values: Vec<Saved<B>>,
}

impl<B: Backend> Backward<B, 2> for RecomputeBackward<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = ();

    fn backward(
        self,
        ops: Ops<(), 2>,
        grads: &mut AutodiffGradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (device, dtype) = (grad.device(), grad.dtype());
        let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(self.x);
        let values = self
            .values
            .into_iter()
            .map(|saved| match saved {
                Saved::Node(id) => checkpointer.retrieve_node_output::<FloatTensor<B>>(id),
                Saved::Constant(t) => t,
            })
            .map(to_dispatch::<B>)
            .collect();
        let (dx, dparams) = self
            .run
            .backward(to_dispatch::<B>(x), values, to_dispatch::<B>(grad));
        let [x_parent, ties_parent] = ops.parents;
        if let Some(node) = x_parent {
            grads.register::<B>(node.id, from_dispatch::<B>(dx));
        }
        if let Some(node) = ties_parent {
            // The ties pass a one-element gradient along; each hands its parameter the
            // gradient deposited here.
            *self.deposit.lock().unwrap() = dparams;
            let token = B::float_zeros(Shape::new([1]), &device, dtype.into());
            grads.register::<B>(node.id, token);
        }
    }
}

#[derive(Debug)]
struct TieBackward {
    tie: Tie,
    /// The parameter value's shape and dtype, for a zero gradient (see the backward).
    shape: Shape,
    dtype: DType,
}

impl<B: Backend> Backward<B, 2> for TieBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = ();

    fn backward(self, ops: Ops<(), 2>, grads: &mut AutodiffGradients, _: &mut Checkpointer) {
        let token = grads.consume::<B>(&ops.node);
        let device = token.device();
        let [acc, value] = ops.parents;
        if let Some(node) = acc {
            grads.register::<B>(node.id, token);
        }
        let deposited = self.tie.deposit.lock().unwrap()[self.tie.slot].take();
        let Some(node) = value else { return };
        match deposited {
            Some(grad) => grads.register::<B>(node.id, from_dispatch::<B>(grad)),
            // `f` did not use the parameter this time (experts that got no row): a leaf gets
            // none, as without checkpointing; an operation (DDP's hook, a ZeRO-3 gather, a
            // cast), in the graph through the tie, runs its backward all the same and needs
            // a gradient: zeros, which the wrappers add as they add a missing one, and a
            // gather's reduce-scatter runs on every rank, as its peers expect.
            None if !node.parents.is_empty() => {
                let zeros = B::float_zeros(self.shape, &device, self.dtype.into());
                grads.register::<B>(node.id, zeros);
            }
            None => {}
        }
    }
}

impl<B: RecomputeBackend, C: CheckpointStrategy> RecomputeBackend for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>,
{
    fn checkpoint(
        x: FloatTensor<Self>,
        ties: FloatTensor<Self>,
        region: RecomputeRegion,
    ) -> FloatTensor<Self> {
        let RecomputeRegion {
            run,
            values,
            deposit,
        } = region;
        // Each value: an autodiff tensor (a node the checkpointer keeps or recomputes), or a
        // constant of the concrete backend.
        let values: Vec<Result<FloatTensor<Self>, FloatTensor<B>>> = values
            .into_iter()
            .map(|v| {
                match <DispatchTensor as DispatchKindConversion<Self>>::try_into_backend(v.clone())
                {
                    Ok(t) => Ok(t.float()),
                    Err(_) => Err(from_dispatch::<B>(v)),
                }
            })
            .collect();
        let inner = RecomputeRegion {
            run: run.clone(),
            values: values
                .iter()
                .map(|v| match v {
                    Ok(t) => to_dispatch::<B>(t.primitive().clone()),
                    Err(t) => to_dispatch::<B>(t.clone()),
                })
                .collect(),
            deposit: deposit.clone(),
        };
        let step = RecomputeBackward::<B> {
            run,
            deposit,
            x: x.id(),
            values: values
                .iter()
                .map(|v| match v {
                    Ok(t) => Saved::Node(t.id()),
                    Err(t) => Saved::Constant(t.clone()),
                })
                .collect(),
        };
        let prep = step.prepare::<C>([x.node(), ties.node()]).compute_bound();
        match prep.stateful() {
            OpsKind::Tracked(mut prep) => {
                prep.checkpoint(&x);
                for value in values.iter().flatten() {
                    prep.checkpoint(value);
                }
                drop(values);
                drop(ties);
                prep.finish((), forward::<B>(x.into_primitive(), inner, true))
            }
            OpsKind::UnTracked(prep) => {
                drop(values);
                drop(ties);
                prep.finish(forward::<B>(x.into_primitive(), inner, true))
            }
        }
    }

    fn tie(acc: FloatTensor<Self>, value: FloatTensor<Self>, tie: Tie) -> FloatTensor<Self> {
        let (shape, dtype) = (value.shape(), value.dtype());
        let prep = TieBackward { tie, shape, dtype }
            .prepare::<C>([acc.node(), value.node()])
            .compute_bound();
        drop(value);
        prep.stateless(acc.into_primitive())
    }
}
