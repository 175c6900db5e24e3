//! [`Zero`]: a Burn module and optimizer trained with ZeRO sharded data parallelism.

use crate::config::{Stage, ZeroConfig};
use crate::error::{Result, ZeroError};
use crate::gather::{GatherPlan, GatherSummary, ZeroLayerHook, lazy_module, param_index};
use crate::optim::ShardOptimizer;
use crate::params::{self, ParamInfo};
use crate::partition::Partition;
use crate::reduce::{BucketHook, GradBuckets, SharedBuckets};
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::{DeviceMesh, install_layer_hook};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::{Device, Tensor, TensorData};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::ops::Range;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

/// Bytes one rank holds, measured (element counts of the tensors and buffers actually held,
/// × 4 for f32).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Parameters held between steps (the full model for stages 0–2, the own shard for 3).
    pub params: usize,
    /// Gradients held for the step (full for stages 0–1, the own range for 2–3).
    pub grads: usize,
    /// Optimizer state on the device.
    pub optim_device: usize,
    /// Optimizer state in the host store (offload).
    pub optim_host: usize,
    /// Stage 3: the most bytes of gathered parameters alive at once in the last forward —
    /// the transient "live gathered layer" term of the formula (with layers entered through
    /// [`bonfire_dtensor::layer`]: about one layer plus the prefetched next one; without:
    /// everything gathered).
    pub gathered_peak: usize,
    /// Stage 3: everything gathered in the last forward.
    pub gathered_total: usize,
}

impl MemoryReport {
    /// Parameters + gradients + optimizer state, wherever it lives.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optim_device + self.optim_host
    }
}

/// The ZeRO formula for fp32 parameters, gradients and an optimizer keeping `k` f32 values
/// per parameter (Adam: 2), for `psi` parameters on `n` ranks, in bytes.
pub fn formula_bytes(stage: Stage, psi: usize, n: usize, k: usize) -> f64 {
    let psi = psi as f64;
    let n = n as f64;
    let (p, g, o) = (4.0 * psi, 4.0 * psi, 4.0 * k as f64 * psi);
    match stage {
        Stage::Zero0 => p + g + o,
        Stage::Zero1 => p + g + o / n,
        Stage::Zero2 => p + (g + o) / n,
        Stage::Zero3 => (p + g + o) / n,
    }
}

/// One rank's part of a model trained with ZeRO.
///
/// A step is [`forward`](Self::forward) → [`backward`](Self::backward) →
/// [`step`](Self::step) (or [`train_step`](Self::train_step)). All calls are collectives:
/// make them on every rank, in the same order. With ranks as threads give each rank its own
/// parameters (`model.fork(&device)`).
pub struct Zero<M: Module, O: Optimizer> {
    pub(crate) pg: ProcessGroup,
    pub(crate) config: ZeroConfig,
    pub(crate) infos: Arc<Vec<ParamInfo>>,
    pub(crate) part: Arc<Partition>,
    /// Stages 0–2: the full replica. Stage 3: a skeleton whose parameters hold no values.
    pub(crate) model: Option<M>,
    /// Stage 3: this rank's range of the flat parameter vector (an autodiff leaf).
    pub(crate) shard: Option<Tensor<1>>,
    pub(crate) device: Device,
    pub(crate) optim: ShardOptimizer<O>,
    /// Stages 0–1: the averaged full gradient. Stages 2–3: the averaged own range.
    grads: Option<Vec<f32>>,
    /// Stage 2: the gradient buckets of the forwards since the last backward.
    buckets: SharedBuckets,
    /// Stage 3: the pieces (autodiff leaves) of the forwards since the last backward, with
    /// their place in the own range.
    pieces: Vec<(Range<usize>, Tensor<1>)>,
    /// Stage 3: what the last forward gathered (its layer order drives the next prefetch).
    last_gather: GatherSummary,
    pub(crate) steps: u64,
}

impl<M: Module, O: Optimizer> Zero<M, O> {
    /// Wraps `model` and `optim` on rank `pg.rank()`. Checks that all ranks hold the same
    /// parameters, copies rank 0's values everywhere, partitions them, and (stage 3) drops
    /// every value outside this rank's range. A collective.
    pub fn new(model: M, optim: O, pg: ProcessGroup, config: ZeroConfig) -> Result<Self> {
        Self::build(model, optim, pg, config)
    }

    /// [`new`](Self::new) on the group of this rank's slice along the mesh axis `axis` (on a
    /// `dp × tp` mesh: `"dp"`, with the model already parallelized over `"tp"`). An axis the
    /// mesh does not have is an error naming the mesh's axes.
    pub fn on_mesh(
        model: M,
        optim: O,
        mesh: &DeviceMesh,
        axis: &str,
        config: ZeroConfig,
    ) -> Result<Self> {
        let pg = mesh.group(axis)?.clone();
        Self::build(model, optim, pg, config)
    }

    fn build(model: M, optim: O, pg: ProcessGroup, config: ZeroConfig) -> Result<Self> {
        let infos = params::inventory(&model);
        check_same(&pg, &infos)?;
        let mut flat = params::flatten_values(&model, &infos);
        pg.broadcast(&mut flat, 0)?;
        let device = model_device(&model);
        let total: usize = infos.iter().map(ParamInfo::numel).sum();
        if config.stage == Stage::Zero3 && total.div_ceil(pg.size()) * (pg.size() - 1) >= total {
            return Err(ZeroError::Usage(format!(
                "stage 3 needs every rank to own at least one element: {total} parameters on {} ranks",
                pg.size()
            )));
        }
        let mut zero = Self::empty(model, optim, pg, config, infos, device);
        zero.set_full_values(flat);
        Ok(zero)
    }

    pub(crate) fn empty(
        model: M,
        optim: O,
        pg: ProcessGroup,
        config: ZeroConfig,
        infos: Vec<ParamInfo>,
        device: Device,
    ) -> Self {
        let n = pg.size();
        let rank = pg.rank();
        let owners = if config.stage == Stage::Zero0 { 1 } else { n };
        let part = if owners == 1 {
            Partition::balanced(&infos, 1)
        } else {
            Partition::balanced(&infos, n)
        };
        let me = if owners == 1 { 0 } else { rank };
        let optim = ShardOptimizer::new(
            optim,
            part.pieces(me),
            part.ranges[me].start,
            device.clone(),
            config.offload,
        );
        let model = if config.stage == Stage::Zero3 {
            hollow(model)
        } else {
            model
        };
        Self {
            pg,
            config,
            infos: Arc::new(infos),
            part: Arc::new(part),
            model: Some(model),
            shard: None,
            device,
            optim,
            grads: None,
            buckets: Arc::new(Mutex::new(None)),
            pieces: Vec::new(),
            last_gather: GatherSummary::default(),
            steps: 0,
        }
    }

    /// The flat range this rank owns (all of it at stage 0).
    pub fn own_range(&self) -> Range<usize> {
        let r = if self.config.stage == Stage::Zero0 {
            0
        } else {
            self.pg.rank()
        };
        self.part.ranges[r].clone()
    }
    pub fn partition(&self) -> &Partition {
        &self.part
    }
    pub fn params(&self) -> &[ParamInfo] {
        &self.infos
    }
    pub fn config(&self) -> &ZeroConfig {
        &self.config
    }
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }
    pub fn steps(&self) -> u64 {
        self.steps
    }
    /// The optimizer over this rank's pieces (state, host store).
    pub fn optimizer(&self) -> &ShardOptimizer<O> {
        &self.optim
    }

    /// Installs the full flat parameter vector (every rank passes the same values).
    pub(crate) fn set_full_values(&mut self, flat: Vec<f32>) {
        let own = self.own_range();
        if self.config.stage == Stage::Zero3 {
            self.set_shard(flat[own].to_vec());
        } else {
            let model = self.model.take().expect("model");
            self.model = Some(params::assign_values(model, &self.infos, &flat));
        }
    }

    pub(crate) fn set_shard(&mut self, own: Vec<f32>) {
        let n = own.len();
        let t = Tensor::<1>::from_data(TensorData::new(own, [n]), &self.device);
        // Kept an autodiff leaf although each forward's pieces (views of it, detached) are the
        // leaves that get gradients: measured, an untracked shard makes backward hold one
        // more shard-sized buffer (tests/layer_release.rs).
        self.shard = Some(if self.device.is_autodiff() {
            t.require_grad()
        } else {
            t
        });
    }

    /// This rank's range of the flat parameter vector.
    pub fn own_values(&self) -> Vec<f32> {
        match &self.shard {
            Some(s) => params::to_host(s.clone().detach()),
            None => {
                let own = self.own_range();
                params::flatten_values(self.model(), &self.infos)[own].to_vec()
            }
        }
    }

    /// Every parameter, concatenated in module order (a collective at stage 3).
    pub fn full_values(&self) -> Result<Vec<f32>> {
        match &self.shard {
            Some(_) => {
                let own = self.own_values();
                let mut flat = vec![0.0; self.part.total()];
                self.pg
                    .all_gather_uneven(&own, &mut flat, &self.part.counts())?;
                Ok(flat)
            }
            None => Ok(params::flatten_values(self.model(), &self.infos)),
        }
    }

    /// The module with every parameter in full, as a plain single-device model would hold
    /// it (a collective at stage 3).
    pub fn full_model(&self) -> Result<M> {
        let flat = self.full_values()?;
        let model = self.model().clone();
        Ok(params::assign_values(model, &self.infos, &flat))
    }

    /// The replica (stages 0–2) or the hollow skeleton (stage 3, parameters without values:
    /// use [`forward`](Self::forward) or [`full_model`](Self::full_model)).
    pub fn model(&self) -> &M {
        self.model
            .as_ref()
            .expect("the model is present between calls")
    }

    /// Runs the forward pass `f`. At stage 2, each layer the model enters through
    /// [`bonfire_dtensor::layer`] gets gradient hooks so that its gradient buckets are
    /// reduce-scattered while backward runs. At stage 3 `f` sees a module whose parameters hold no
    /// value: each layer the model enters through [`bonfire_dtensor::layer`] gets its
    /// parameters all-gathered into its copy (freed when the model drops it), the next
    /// layer's gather prefetched meanwhile; a parameter used outside any layer is gathered on
    /// first use and kept until `f` returns. The gather is recomputable: under Burn's Balanced
    /// checkpointing (`Device::flex().autodiff().gradient_checkpointing()`) backward
    /// re-gathers parameters instead of keeping them, and their gradients come back
    /// reduce-scattered onto the shard.
    pub fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        match &self.shard {
            None if self.config.stage == Stage::Zero2 => {
                let mut pending = self.buckets.lock().unwrap();
                if pending.is_none() {
                    *pending = Some(self.new_buckets());
                }
                drop(pending);
                let hook = install_layer_hook(Rc::new(BucketHook {
                    buckets: self.buckets.clone(),
                    index: param_index(&self.infos),
                }));
                let out = f(self.model());
                drop(hook);
                out
            }
            None => f(self.model()),
            Some(shard) => {
                let plan = Arc::new(GatherPlan::new(
                    self.pg.clone(),
                    self.part.clone(),
                    self.infos.clone(),
                    shard.clone(),
                    self.config.prefetch,
                    std::mem::take(&mut self.last_gather.layers),
                ));
                let module = lazy_module(self.model().clone(), plan.clone());
                let hook = install_layer_hook(Rc::new(ZeroLayerHook::new(plan.clone())));
                let out = f(&module);
                drop(hook);
                drop(module);
                self.pieces.extend(plan.owned_pieces());
                self.last_gather = plan.finish();
                out
            }
        }
    }

    fn new_buckets(&self) -> GradBuckets {
        GradBuckets::new(
            self.pg.clone(),
            self.part.clone(),
            self.infos.clone(),
            self.config.bucket_bytes,
        )
    }

    /// Backpropagates `loss` and leaves this stage's averaged gradients for [`step`](Self::step):
    /// all-reduced in full (stages 0–1), reduce-scattered in buckets into the own range
    /// (stage 2), or reduce-scattered onto the shard by the gathers' backward (stage 3).
    pub fn backward<const D: usize>(&mut self, loss: Tensor<D>) -> Result<()> {
        let grads = loss.backward();
        let n = self.pg.size();
        if self.shard.is_some() {
            let mut g = vec![0.0; self.own_range().len()];
            for (slot, piece) in std::mem::take(&mut self.pieces) {
                if let Some(grad) = piece.grad(&grads) {
                    let grad = params::to_host(grad);
                    g[slot].iter_mut().zip(grad).for_each(|(acc, x)| *acc += x);
                }
            }
            let scale = 1.0 / n as f32;
            g.iter_mut().for_each(|x| *x *= scale);
            self.grads = Some(g);
            return Ok(());
        }
        let gp = GradientsParams::from_grads(grads, self.model());
        self.reduce_gradients(gp)
    }

    /// Leaves this stage's averaged gradients for [`step`](Self::step) from gradients computed
    /// elsewhere — e.g. accumulated over micro-batches by a pipeline schedule — for the
    /// parameters of [`model`](Self::model) (same `ParamId`s): all-reduced in full (stages
    /// 0–1) or reduce-scattered in buckets into the own range (stage 2). Stage 3 cannot take
    /// them: its parameters only exist gathered inside [`forward`](Self::forward), and their
    /// gradients arrive through the gathers' backward. A collective.
    pub fn reduce_gradients(&mut self, mut gp: GradientsParams) -> Result<()> {
        if self.shard.is_some() {
            return Err(ZeroError::Usage(
                "stage 3 takes its gradients from backward (its gathers), not from outside".into(),
            ));
        }
        let n = self.pg.size();
        let per_param = params::take_grads(self.model(), &self.infos, &mut gp);
        drop(gp);
        match self.config.stage {
            Stage::Zero0 | Stage::Zero1 => {
                let mut flat = vec![0.0; self.part.total()];
                for (p, g) in per_param.iter().enumerate() {
                    if let Some(g) = g {
                        flat[self.part.offsets[p]..self.part.offsets[p + 1]].copy_from_slice(g);
                    }
                }
                drop(per_param);
                if n > 1 {
                    self.pg.all_reduce(&mut flat, ReduceOp::Avg)?;
                }
                self.grads = Some(flat);
            }
            Stage::Zero2 => {
                let pending = self.buckets.lock().unwrap().take();
                let buckets = pending.unwrap_or_else(|| self.new_buckets());
                self.grads = Some(buckets.finish(per_param)?);
            }
            Stage::Zero3 => unreachable!("stage 3 keeps a shard"),
        }
        Ok(())
    }

    /// Steps the optimizer on this rank's range and brings every rank's updated range back
    /// where parameters are replicated (all-gather at stages 1–2).
    pub fn step(&mut self, lr: f64) -> Result<()> {
        let grads = self
            .grads
            .take()
            .ok_or_else(|| ZeroError::Usage("step needs gradients: call backward first".into()))?;
        let own = self.own_range();
        match self.config.stage {
            Stage::Zero3 => {
                let mut values = self.own_values();
                self.optim.step(lr, &mut values, &grads);
                self.set_shard(values);
            }
            stage => {
                let mut flat = params::flatten_values(self.model(), &self.infos);
                let own_grads = if stage == Stage::Zero2 {
                    &grads[..]
                } else {
                    &grads[own.clone()]
                };
                let mut mine = flat[own.clone()].to_vec();
                self.optim.step(lr, &mut mine, own_grads);
                drop(grads);
                if stage == Stage::Zero0 {
                    flat[own].copy_from_slice(&mine);
                } else {
                    self.pg
                        .all_gather_uneven(&mine, &mut flat, &self.part.counts())?;
                }
                let model = self.model.take().expect("model");
                self.model = Some(params::assign_values(model, &self.infos, &flat));
            }
        }
        self.steps += 1;
        Ok(())
    }

    /// One training step; returns this rank's loss.
    pub fn train_step(&mut self, lr: f64, loss_fn: impl FnOnce(&M) -> Tensor<1>) -> Result<f32> {
        let loss = self.forward(loss_fn);
        let value = params::to_host(loss.clone().detach())[0];
        self.backward(loss)?;
        self.step(lr)?;
        Ok(value)
    }

    /// The averaged gradient this rank holds after [`backward`](Self::backward): the full
    /// flat vector (stages 0–1) or the own range (2–3).
    pub fn held_gradients(&self) -> Option<&[f32]> {
        self.grads.as_deref()
    }

    /// The averaged gradient of every parameter from the last backward, by path, in full
    /// (all-gathered from the owners at stages 2–3: a collective there). Empty before the
    /// first backward or after the step.
    pub fn full_gradients(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let Some(g) = &self.grads else {
            return Ok(Vec::new());
        };
        let flat = if g.len() == self.part.total() {
            g.clone()
        } else {
            let mut flat = vec![0.0; self.part.total()];
            self.pg
                .all_gather_uneven(g, &mut flat, &self.part.counts())?;
            flat
        };
        Ok(self
            .infos
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let r = self.part.offsets[i]..self.part.offsets[i + 1];
                (p.path.clone(), flat[r].to_vec())
            })
            .collect())
    }

    /// Bytes held by this rank, measured now (call between backward and step to include
    /// gradients).
    pub fn memory(&self) -> MemoryReport {
        let params = match &self.shard {
            Some(s) => s.shape().num_elements() * 4 + held_param_bytes(self.model()),
            None => held_param_bytes(self.model()),
        };
        MemoryReport {
            params,
            grads: self.grads.as_ref().map_or(0, |g| g.len() * 4),
            optim_device: self.optim.device_bytes(),
            optim_host: self.optim.host_bytes(),
            gathered_peak: self.last_gather.peak_live_bytes,
            gathered_total: self.last_gather.total_bytes,
        }
    }
}

/// Bytes of the float parameters of `module` that hold a value (initialized).
pub fn held_param_bytes<M: Module>(module: &M) -> usize {
    struct Count(usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_initialized() {
                self.0 += param.lazy_shape().num_elements() * 4;
            }
        }
    }
    let mut c = Count(0);
    module.visit(&mut c);
    c.0
}

fn model_device<M: Module>(model: &M) -> Device {
    struct First(Option<Device>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.lazy_device());
            }
        }
    }
    let mut f = First(None);
    model.visit(&mut f);
    f.0.unwrap_or_else(|| Device::flex().autodiff())
}

/// `model` with every float parameter replaced by a value-less placeholder (same id, shape,
/// device); it materializes zeros only if something reads it.
pub(crate) fn hollow<M: Module>(model: M) -> M {
    struct Hollow;
    impl ModuleMapper for Hollow {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let id = param.id;
            let device = param.lazy_device();
            let shape = param.lazy_shape();
            let rg = param.is_require_grad();
            drop(param);
            let dims = shape.clone();
            Param::uninitialized(
                id,
                move |device, rg| {
                    let t = Tensor::<D>::zeros(dims, device);
                    if rg { t.require_grad() } else { t }
                },
                device,
                rg,
                shape,
            )
        }
    }
    model.map(&mut Hollow)
}

/// Checks that every rank has the same parameter paths and shapes.
fn check_same(pg: &ProcessGroup, infos: &[ParamInfo]) -> Result<()> {
    let mut h = DefaultHasher::new();
    for p in infos {
        p.path.hash(&mut h);
        p.shape.hash(&mut h);
    }
    let mine = [h.finish() as i64];
    let mut all = vec![0i64; pg.size()];
    pg.all_gather(&mine, &mut all)?;
    if all.iter().any(|&x| x != mine[0]) {
        return Err(ZeroError::Mismatch(format!(
            "rank {} has a different set of parameters (paths/shapes digests {all:?})",
            pg.rank()
        )));
    }
    Ok(())
}
