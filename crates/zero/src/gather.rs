//! Stage 3's parameter gathering.
//!
//! A forward sees a module whose parameters hold no value. Each is all-gathered from every
//! rank's shard through the differentiable, recomputable all-gather of bonfire-dtensor — so
//! under Balanced checkpointing backward re-gathers it instead of keeping it, and its
//! gradient goes back reduce-scattered onto the shard — at one of two moments:
//!
//! - **Per layer** (models that run their layers through [`bonfire_module::layer`]): when a
//!   layer is entered, all its parameters are gathered into the layer's copy
//!   ([`ZeroLayerHook`]); they are freed when the model drops that copy. The next layer's
//!   gather runs meanwhile on a helper thread: the order of layers is recorded in each forward
//!   ([`GatherSummary::layers`]) and the next forward prefetches by it (the first one
//!   prefetches the next parameter in module order).
//! - **Lazily** (parameters used outside any layer): the root module's lazy parameter cell
//!   gathers on first use ([`lazy_module`]), with the next parameter prefetched; such values
//!   live until the forward returns.
//!
//! Gradients: each parameter's slice is its own autodiff leaf for the forward, and the
//! gather's backward reduce-scatters the full gradient onto it.
//!
//! Every rank makes the same calls in the same order, so the gathers — on the rank thread or
//! on the helper, never both at once — line up across ranks.

use crate::partition::Partition;
use bonfire_comm::ProcessGroup;
use bonfire_layout::MixedPrecision;
use bonfire_module::LayerHook;
use bonfire_module::PrecisionDTypes;
use bonfire_module::params::ParamInfo;
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{DispatchTensor, Tensor};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// What one stage-3 forward gathered.
#[derive(Debug, Clone, Default)]
pub struct GatherSummary {
    /// The most bytes of gathered parameters alive at once: the parameters gathered lazily
    /// so far, plus the layer being computed, plus what is prefetched. A layer's parameters
    /// count as freed when the next layer is entered (the model has dropped its copy).
    pub peak_live_bytes: usize,
    /// Everything gathered in forward, in bytes.
    pub total_bytes: usize,
    /// The layers entered, in order, as parameter indices (the prefetch order of the next
    /// forward).
    pub layers: Vec<Vec<usize>>,
}

#[derive(Default)]
struct Live {
    lazy: usize,
    layer: usize,
    prefetched: usize,
}

impl Live {
    fn total(&self) -> usize {
        self.lazy + self.layer + self.prefetched
    }
}

struct PlanState {
    /// Gathered, or being gathered, at least once in this forward.
    started: Vec<bool>,
    /// Prefetched and not used yet.
    ready: HashMap<usize, Tensor<1>>,
    inflight: Option<(Vec<usize>, JoinHandle<Vec<Tensor<1>>>)>,
    /// Gathered for the layer being entered, until handed to its copy.
    entering: HashMap<usize, Tensor<1>>,
    live: Live,
    summary: GatherSummary,
}

/// One forward's gathers.
pub(crate) struct GatherPlan {
    pg: ProcessGroup,
    part: Arc<Partition>,
    infos: Arc<Vec<ParamInfo>>,
    /// This rank's slice of each parameter, a separate autodiff leaf per forward (a view of
    /// the shard, no copy): each slice's gradient is exactly its size, so backward never
    /// materializes a shard-sized gradient per parameter. A rank owning nothing of a
    /// parameter has a one-element leaf there (Burn has no zero-length tensors), which the
    /// gather does not send.
    slices: Vec<Tensor<1>>,
    /// Where each owned slice sits in the own range.
    slots: Vec<Option<Range<usize>>>,
    prefetch: bool,
    /// The previous forward's layers.
    previous: Vec<Vec<usize>>,
    /// Mixed precision: gathered parameters are cast to the param dtype — after the gather
    /// when gradients are reduced in fp32 (the gather moves fp32 and its backward
    /// reduce-scatters fp32), before it when they are reduced in the param dtype.
    precision: MixedPrecision,
    state: Mutex<PlanState>,
}

impl GatherPlan {
    pub(crate) fn new(
        pg: ProcessGroup,
        part: Arc<Partition>,
        infos: Arc<Vec<ParamInfo>>,
        shard: Tensor<1>,
        prefetch: bool,
        previous: Vec<Vec<usize>>,
        precision: MixedPrecision,
    ) -> Self {
        let n = infos.len();
        let rank = pg.rank();
        let own = part.ranges[rank].clone();
        let device = shard.device();
        let autodiff = device.is_autodiff();
        let slots: Vec<Option<Range<usize>>> = (0..n)
            .map(|i| {
                let start = part.offsets[i].max(own.start);
                let end = part.offsets[i + 1].min(own.end);
                (start < end).then(|| start - own.start..end - own.start)
            })
            .collect();
        let slices = slots
            .iter()
            .map(|slot| match slot {
                Some(r) => shard.clone().narrow(0, r.start, r.len()).detach(),
                None => Tensor::zeros([1], &device),
            })
            .map(|leaf| if autodiff { leaf.require_grad() } else { leaf })
            .collect();
        Self {
            pg,
            part,
            infos,
            slices,
            slots,
            prefetch,
            previous,
            precision,
            state: Mutex::new(PlanState {
                started: vec![false; n],
                ready: HashMap::new(),
                inflight: None,
                entering: HashMap::new(),
                live: Live::default(),
                summary: GatherSummary::default(),
            }),
        }
    }

    fn bytes(&self, i: usize) -> usize {
        self.infos[i].numel() * 4
    }

    /// The differentiable gather of parameter `i` (flat, `numel` elements) from every rank's
    /// slice.
    ///
    /// With an `anchor` (the input of the layer being entered) the slice is placed below it
    /// in the graph, so that the gather's backward — the reduce-scatter of the parameter's
    /// full gradient — runs right after that layer's backward instead of at the very end.
    fn gather_op(
        &self,
        i: usize,
        anchor: Option<&DispatchTensor>,
    ) -> impl FnOnce() -> Tensor<1> + Send + 'static {
        let counts = self.part.param_counts(i);
        let slice = self.slices[i].clone();
        let slice = match anchor {
            Some(anchor) => bonfire_module::graph::anchored(slice, anchor),
            None => slice,
        };
        let pg = self.pg.clone();
        let (param_dtype, reduce_dtype) =
            (self.precision.param_dtype(), self.precision.reduce_dtype());
        // This rank's record, also when a helper thread prefetches.
        let record = bonfire_module::precision::observe::observer();
        move || {
            // Cast to the param dtype inside the recomputable gather: a cast after it would
            // be a compute-bound op whose half-precision output Burn keeps until backward.
            let slice = slice.cast(reduce_dtype);
            // The backward reduce-scatters the gradient in the gather's input dtype.
            record.reduced(slice.dtype());
            let out = (param_dtype != reduce_dtype).then_some(param_dtype);
            // A rank owning none of it passes its one-element leaf, which is not sent: the
            // gathered value is the parameter exactly (no cut, whose backward would fill a
            // zeroed copy of the full gradient).
            bonfire_dtensor::functional::all_gather_recomputable_as(slice, &pg, 0, &counts, out)
                .unwrap_or_else(|e| panic!("bonfire-zero: stage-3 all-gather failed: {e}"))
        }
    }

    /// Parameter `i`, gathered: taken from the prefetched ones, or from the helper (waiting
    /// for it), or gathered here (after the helper is done, to keep the collective order).
    fn fetch(&self, st: &mut PlanState, i: usize, anchor: Option<&DispatchTensor>) -> Tensor<1> {
        if !st.ready.contains_key(&i)
            && let Some((set, handle)) = st.inflight.take()
        {
            // A panic there (a collective that failed) is this thread's, with its message.
            let values = handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            st.ready.extend(set.into_iter().zip(values));
        }
        st.summary.total_bytes += self.bytes(i);
        if let Some(t) = st.ready.remove(&i) {
            st.live.prefetched -= self.bytes(i);
            return t;
        }
        st.started[i] = true;
        (self.gather_op(i, anchor))()
    }

    /// Starts gathering `set` on the helper thread (when nothing else is in flight).
    fn prefetch_set(&self, st: &mut PlanState, set: Vec<usize>, anchor: Option<&DispatchTensor>) {
        if !self.prefetch || st.inflight.is_some() || set.is_empty() {
            return;
        }
        let ops: Vec<_> = set.iter().map(|&k| self.gather_op(k, anchor)).collect();
        for &k in &set {
            st.started[k] = true;
            st.live.prefetched += self.bytes(k);
        }
        // The helper counts its transfers into the rank thread's ledgers.
        let ledger = bonfire_dtensor::plane::ledger::current();
        let handle = std::thread::spawn(move || {
            let _counting = ledger.enter();
            bonfire_comm::overlapping(|| ops.into_iter().map(|op| op()).collect())
        });
        st.inflight = Some((set, handle));
    }

    /// The first parameter after `i` in module order not gathered yet in this forward.
    fn next_unstarted(st: &PlanState, i: usize) -> Vec<usize> {
        (i + 1..st.started.len())
            .find(|&k| !st.started[k])
            .into_iter()
            .collect()
    }

    fn note_peak(st: &mut PlanState) {
        st.summary.peak_live_bytes = st.summary.peak_live_bytes.max(st.live.total());
    }

    /// Parameter `i` for the root module's lazy cell (held until forward returns).
    pub(crate) fn get(&self, i: usize) -> Tensor<1> {
        let mut st = self.state.lock().unwrap();
        let t = self.fetch(&mut st, i, None);
        st.live.lazy += self.bytes(i);
        Self::note_peak(&mut st);
        let next = Self::next_unstarted(&st, i);
        self.prefetch_set(&mut st, next, None);
        Self::note_peak(&mut st);
        t
    }

    /// A layer whose parameters are `layer` is entered with input `anchor`: gathers them all
    /// (the previous layer's are freed by now) and prefetches the next layer's, both anchored
    /// at this layer's input (a prefetched layer's gradients thus leave one layer late).
    pub(crate) fn enter(&self, layer: Vec<usize>, anchor: Option<&DispatchTensor>) {
        if layer.is_empty() {
            return;
        }
        let mut st = self.state.lock().unwrap();
        st.live.layer = 0;
        for &i in &layer {
            let t = self.fetch(&mut st, i, anchor);
            st.live.layer += self.bytes(i);
            st.entering.insert(i, t);
        }
        Self::note_peak(&mut st);
        let k = st.summary.layers.len();
        let next = match self.previous.get(k) {
            Some(seen) if *seen == layer => self.previous.get(k + 1).cloned().unwrap_or_default(),
            _ => Self::next_unstarted(&st, *layer.iter().max().expect("non-empty")),
        };
        st.summary.layers.push(layer);
        self.prefetch_set(&mut st, next, anchor);
        Self::note_peak(&mut st);
    }

    /// The gathered value of parameter `i` for the layer being entered.
    pub(crate) fn take_entering(&self, i: usize) -> Option<Tensor<1>> {
        self.state.lock().unwrap().entering.remove(&i)
    }

    /// Waits for a prefetch still running, drops what forward did not use, and says what
    /// this forward gathered.
    pub(crate) fn finish(&self) -> GatherSummary {
        let mut st = self.state.lock().unwrap();
        if let Some((_, h)) = st.inflight.take() {
            let _ = h.join();
        }
        st.ready.clear();
        st.entering.clear();
        std::mem::take(&mut st.summary)
    }
}

impl GatherPlan {
    /// The owned slices (autodiff leaves) with their place in the own range: their
    /// gradients are this rank's gradient after backward.
    pub(crate) fn owned_slices(&self) -> Vec<(Range<usize>, Tensor<1>)> {
        self.slots
            .iter()
            .zip(&self.slices)
            .filter_map(|(slot, slice)| Some((slot.clone()?, slice.clone())))
            .collect()
    }
}

/// The [`LayerHook`] of a stage-3 forward: each layer's copy gets its parameters gathered.
pub(crate) struct ZeroLayerHook {
    pub(crate) plan: Arc<GatherPlan>,
    pub(crate) index: HashMap<ParamId, usize>,
}

impl ZeroLayerHook {
    pub(crate) fn new(plan: Arc<GatherPlan>) -> Self {
        let index = bonfire_module::params::index_of(&plan.infos);
        Self { plan, index }
    }
}

impl LayerHook for ZeroLayerHook {
    fn enter(&self, ids: &[ParamId], input: Option<&DispatchTensor>) {
        let layer = ids
            .iter()
            .filter_map(|id| self.index.get(id).copied())
            .collect();
        self.plan.enter(layer, input);
    }

    fn supply(&self, id: ParamId) -> Option<Tensor<1>> {
        self.plan.take_entering(*self.index.get(&id)?)
    }
}

/// `skeleton` (a hollow module) with every parameter gathered lazily through `plan`.
pub(crate) fn lazy_module<M: Module>(skeleton: M, plan: Arc<GatherPlan>) -> M {
    struct Lazy {
        plan: Arc<GatherPlan>,
        index: HashMap<ParamId, usize>,
    }
    impl ModuleMapper for Lazy {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&i) = self.index.get(&param.id) else {
                return param;
            };
            let id = param.id;
            let device = param.lazy_device();
            let shape = param.lazy_shape();
            drop(param);
            let dims: [usize; D] = shape.to_vec().try_into().expect("rank");
            let plan = self.plan.clone();
            Param::uninitialized(
                id,
                move |_, _| plan.get(i).reshape(dims),
                device,
                true,
                shape,
            )
        }
    }
    let index = bonfire_module::params::index_of(&plan.infos);
    skeleton.map(&mut Lazy { plan, index })
}
