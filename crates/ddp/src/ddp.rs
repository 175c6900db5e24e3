//! [`DistributedDataParallel`]: a Burn module and optimizer trained data-parallel.

use crate::bucket::BucketPlan;
use crate::config::{DdpConfig, SyncMode};
use crate::error::DdpError;
use crate::reducer::Reducer;
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::DeviceMesh;
use bonfire_dtensor::plane::{self, ledger::Reason};
use bonfire_dtensor::timing::{self, StepTiming};
use bonfire_layout::MixedPrecision;
use bonfire_module::PrecisionDTypes;
use bonfire_module::Subgroup;
use bonfire_module::graph::{SharedSink, SinkHook};
use bonfire_module::params::{self, ParamInfo, ParamValues};
use bonfire_module::precision::cast_module;
use bonfire_module::{DataParallel, install_layer_hook};
use burn::module::{Module, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{DType, Device, Gradients, Tensor};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// One rank's replica of a data-parallel model: the module, its optimizer, and the gradient
/// machinery that keeps all replicas identical.
///
/// It implements [`DataParallel`] (import the trait to call it): a step is
/// [`forward`](DataParallel::forward) → [`backward`](DataParallel::backward) →
/// [`step`](DataParallel::step) (or [`train_step`](DataParallel::train_step) for all three).
/// Backward averages the gradients over the group: buckets of gradients are all-reduced in
/// the background as soon as backward has produced them (for models that call
/// [`bonfire_module::layer`]), and `backward` returns once all have arrived.
pub struct DistributedDataParallel<M: Module> {
    /// The replica the forward runs (in the param dtype under mixed precision).
    model: Option<M>,
    /// Mixed precision: the fp32 master the optimizer steps; the replica is cast from it.
    master: Option<M>,
    optim: ModuleOptimizer,
    pg: ProcessGroup,
    /// Expert parallelism's parameters: reduced over their replicas, not over `pg`.
    experts: Option<Subgroup>,
    config: DdpConfig,
    infos: Arc<Vec<ParamInfo>>,
    index: Arc<HashMap<ParamId, usize>>,
    plan: Arc<BucketPlan>,
    /// Error-feedback residual of each bucket (compression), on the device.
    residuals: Vec<Option<Tensor<1>>>,
    /// Gradients summed over `no_sync` backwards and micro-batches, per parameter, flat.
    accumulated: Vec<Option<Tensor<1>>>,
    pending: Option<SharedSink<Reducer>>,
    syncing: bool,
    grads: Option<GradientsParams>,
    /// The gradients of the last backward, per bucket, flat (averaged when synchronized).
    last_buckets: Option<Vec<Tensor<1>>>,
    /// Layers entered with a float input in the forwards since construction.
    layers: Arc<AtomicUsize>,
    told_no_layers: AtomicBool,
    steps: u64,
    timing: StepTiming,
    timings: Vec<StepTiming>,
}

/// The replica a rank computes with and, under mixed precision, its fp32 master: the
/// replica is then the master cast to the param dtype.
fn replica_and_master<M: Module>(model: M, precision: MixedPrecision) -> (M, Option<M>) {
    if precision.is_mixed() {
        (
            cast_module(model.clone(), precision.param_dtype()),
            Some(model),
        )
    } else {
        (model, None)
    }
}

impl<M: Module> DistributedDataParallel<M> {
    /// Wraps `model` and Burn's optimizer (`AdamWConfig::new().init()`, or a per-tensor
    /// optimizer such as `SgdConfig::new().build()`) for rank `pg.rank()` of `pg`. Checks that
    /// every rank has the same parameters (paths and shapes) and copies rank 0's values to
    /// every rank. A collective: call it on every rank. With ranks as threads, give each rank
    /// its own parameters (`model.fork(&device)`), never clones sharing autodiff leaves.
    pub fn new(
        model: M,
        optim: impl Into<ModuleOptimizer>,
        pg: ProcessGroup,
        config: DdpConfig,
    ) -> Result<Self, DdpError> {
        Self::with_experts(model, optim, pg, config, None)
    }

    /// [`new`](Self::new) under expert parallelism: the parameters of `experts` hold this
    /// rank's experts (other ranks of `pg` hold others), take their values from their own
    /// replicas and have their gradients averaged over them (scaled by
    /// [`Subgroup::grad_scale`]: the mean over `pg`), in buckets of their own. Local SGD
    /// (which averages parameters over `pg`) is refused with experts.
    pub fn with_experts(
        model: M,
        optim: impl Into<ModuleOptimizer>,
        pg: ProcessGroup,
        config: DdpConfig,
        experts: Option<Subgroup>,
    ) -> Result<Self, DdpError> {
        config.compression.check_device(&model.devices())?;
        if experts.is_some() && config.sync != SyncMode::EveryStep {
            return Err(DdpError::Usage(
                "local SGD averages every parameter over the group, but expert parameters \
                 differ between expert-parallel ranks: use SyncMode::EveryStep"
                    .to_string(),
            ));
        }
        let (model, infos) = params::sync_from_root_with(model, &pg, experts.as_ref())?;
        let is_expert: Vec<bool> = infos
            .iter()
            .map(|p| experts.as_ref().is_some_and(|x| x.contains(&p.id)))
            .collect();
        let plan = BucketPlan::grouped(&infos, config.bucket_bytes, &is_expert);
        let (model, master) = replica_and_master(model, config.precision);
        Ok(Self {
            model: Some(model),
            master,
            optim: optim.into(),
            index: Arc::new(params::index_of(&infos)),
            accumulated: vec![None; infos.len()],
            infos: Arc::new(infos),
            residuals: vec![None; plan.num_buckets()],
            plan: Arc::new(plan),
            pg,
            experts,
            config,
            pending: None,
            syncing: true,
            grads: None,
            last_buckets: None,
            layers: Arc::new(AtomicUsize::new(0)),
            told_no_layers: AtomicBool::new(false),
            steps: 0,
            timing: StepTiming::default(),
            timings: Vec::new(),
        })
    }

    /// [`new`](Self::new) on the group of this rank's slice along the mesh axis `axis` (on a
    /// `dp × tp` mesh: `"dp"`, with the model already parallelized over `"tp"`). An axis the
    /// mesh does not have is an error naming the mesh's axes.
    pub fn on_mesh(
        model: M,
        optim: impl Into<ModuleOptimizer>,
        mesh: &DeviceMesh,
        axis: &str,
        config: DdpConfig,
    ) -> Result<Self, DdpError> {
        let pg = mesh.group(axis)?.clone();
        Self::new(model, optim, pg, config)
    }

    /// The local replica.
    pub fn model(&self) -> &M {
        self.model
            .as_ref()
            .expect("the model is present between calls")
    }
    /// Unwraps the replica (the fp32 master under mixed precision) and its optimizer.
    pub fn into_parts(mut self) -> (M, ModuleOptimizer) {
        let model = self.model.take().expect("model");
        (self.master.take().unwrap_or(model), self.optim)
    }
    /// The configuration this wrapper was built with.
    pub fn config(&self) -> &DdpConfig {
        &self.config
    }
    /// The parameters DDP synchronizes, in module order.
    pub fn params(&self) -> &[ParamInfo] {
        &self.infos
    }
    /// Burn's optimizer over the replica (its state: every parameter's, keyed by id).
    pub fn optimizer(&self) -> &ModuleOptimizer {
        &self.optim
    }
    /// Replaces every parameter's values — `flat`, fp32, concatenated in
    /// [`params`](Self::params) order — and the optimizer (resuming from a checkpoint); every
    /// rank of the group passes the same. Gradients in flight and compression residuals are
    /// dropped. No communication; call it between steps.
    pub fn load_state(&mut self, flat: &[f32], optim: ModuleOptimizer) {
        let model = self.model.take().expect("model");
        let model = self.master.take().unwrap_or(model);
        let model = params::assign_values(model, &self.infos, flat);
        let (model, master) = replica_and_master(model, self.config.precision);
        self.model = Some(model);
        self.master = master;
        self.optim = optim;
        self.grads = None;
        self.last_buckets = None;
        self.accumulated = vec![None; self.infos.len()];
        self.residuals = vec![None; self.plan.num_buckets()];
    }
    /// Number of gradient buckets.
    pub fn num_buckets(&self) -> usize {
        self.plan.num_buckets()
    }
    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }
    /// The recorded step timings (with [`DdpConfig::record_timings`]).
    pub fn timings(&self) -> &[StepTiming] {
        &self.timings
    }

    fn reduces_this_step(&self) -> bool {
        self.syncing && self.config.sync == SyncMode::EveryStep
    }

    /// A reducer for this step, starting from the accumulated gradients.
    fn new_reducer(&mut self) -> Reducer {
        let accumulated = std::mem::replace(&mut self.accumulated, vec![None; self.infos.len()]);
        Reducer::new(
            self.pg.clone(),
            self.plan.clone(),
            self.infos.clone(),
            &self.config,
            std::mem::take(&mut self.residuals),
            accumulated,
            self.experts
                .as_ref()
                .map(|x| (x.replicas.clone(), x.grad_scale)),
        )
    }

    /// Says once, after the first overlapped forward, that the model showed no layers, so
    /// every bucket waits for the end of backward.
    fn note_layers(&self) {
        if self.config.report_no_layers
            && self.pg.rank() == 0
            && self.layers.load(Ordering::Relaxed) == 0
            && !self.told_no_layers.swap(true, Ordering::Relaxed)
        {
            tracing::info!(
                "bonfire-ddp: the model entered no layer through `bonfire_module::layer` with a \
                 float input, so gradients are all-reduced after backward instead of during it \
                 (see docs/ddp.md, \"Overlap\")"
            );
        }
    }

    /// Runs `f` with gradient synchronization off: backwards inside accumulate locally and
    /// the next synchronized backward reduces the sum (gradient accumulation). Scale each
    /// micro-batch's loss by 1/k yourself, as with PyTorch.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let was = std::mem::replace(&mut self.syncing, false);
        let out = f(self);
        self.syncing = was;
        out
    }

    /// Adds per-parameter flat gradients to the accumulated ones.
    fn add_accumulated(&mut self, grads: Vec<Option<Tensor<1>>>) {
        let dtype = self.config.precision.reduce_dtype();
        for (acc, g) in self.accumulated.iter_mut().zip(grads) {
            if let Some(g) = g {
                let g = g.cast(dtype);
                *acc = Some(match acc.take() {
                    Some(sum) => sum + g,
                    None => g,
                });
            }
        }
    }

    /// The accumulated gradients packed into buckets (zeros for a parameter without one),
    /// for local SGD, which steps on them unreduced.
    fn local_buckets(&mut self) -> Vec<Tensor<1>> {
        let device = self.accumulated.iter().flatten().next().map(Tensor::device);
        let device = device.unwrap_or_else(Device::flex);
        let mut parts = std::mem::replace(&mut self.accumulated, vec![None; self.infos.len()]);
        self.plan
            .buckets
            .iter()
            .map(|members| {
                let pieces: Vec<Tensor<1>> = members
                    .iter()
                    .map(|&i| {
                        parts[i]
                            .take()
                            .unwrap_or_else(|| Tensor::zeros([self.infos[i].numel()], &device))
                    })
                    .collect();
                bonfire_kernels::pack_scaled(&pieces, 1.0)
            })
            .collect()
    }

    /// Finishes a reduction: the reducer's averaged buckets become the optimizer's gradients.
    fn finish(
        &mut self,
        reducer: Reducer,
        leftover: Vec<Option<Tensor<1>>>,
    ) -> Result<(), DdpError> {
        let finished = match reducer.finish(leftover, self.config.unused) {
            Ok(f) => f,
            Err(e) => {
                // Residuals come back only on success; start fresh otherwise.
                self.residuals = vec![None; self.plan.num_buckets()];
                return Err(e);
            }
        };
        self.residuals = finished.residuals;
        self.timing.buckets = finished.spans;
        self.timing.launches = finished.launches;
        self.set_grads(finished.buckets);
        Ok(())
    }

    /// The optimizer's gradients: each parameter's slice of its bucket, on the device.
    fn set_grads(&mut self, buckets: Vec<Tensor<1>>) {
        let plan = &self.plan;
        let infos = &self.infos;
        // The optimizer steps the fp32 master under mixed precision.
        let dtype = self.master.as_ref().map(|_| DType::F32);
        self.grads = Some(params::grads_from_parts(self.model(), infos, |i| {
            let (b, off) = plan.loc[i];
            let g = buckets[b].clone().narrow(0, off, infos[i].numel());
            Some(match dtype {
                Some(d) => g.cast(d),
                None => g,
            })
        }));
        self.last_buckets = Some(buckets);
    }
}

impl<M: Module> DataParallel<M> for DistributedDataParallel<M> {
    type Error = DdpError;

    fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// In a synchronized step with overlap, the [`bonfire_module::layer`] calls inside `f`
    /// attach the gradient hooks that start bucket all-reduces during backward.
    fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        let start = timing::now();
        self.pending = None;
        let out = if self.reduces_this_step() {
            let shared: SharedSink<Reducer> = Arc::new(Mutex::new(Some(self.new_reducer())));
            self.pending = Some(shared.clone());
            if self.config.overlap {
                let hook = SinkHook::new(shared, self.index.clone(), self.layers.clone());
                let _guard = install_layer_hook(Rc::new(hook));
                let out = f(self.model());
                self.note_layers();
                out
            } else {
                f(self.model())
            }
        } else {
            f(self.model())
        };
        self.timing.forward = timing::span_since(start);
        out
    }

    /// Makes the gradients ready for [`step`](DataParallel::step): averaged over the group in
    /// a synchronized step, kept and summed locally inside [`no_sync`](Self::no_sync).
    fn backward(&mut self, loss: Tensor<1>) -> Result<(), DdpError> {
        let start = timing::now();
        let grads = loss.backward();
        drop(loss);
        self.timing.backward = timing::span_since(start);
        let wait_start = timing::now();
        let mut gp = GradientsParams::from_grads(grads, self.model());
        let leftover = params::take_flat_grads(self.model(), &self.infos, &mut gp);
        let reducer = self
            .pending
            .take()
            .and_then(|shared| shared.lock().unwrap().take());
        match reducer {
            Some(reducer) => self.finish(reducer, leftover)?,
            None if self.reduces_this_step() => {
                return Err(DdpError::Usage(
                    "backward must follow a forward run through DistributedDataParallel::forward"
                        .into(),
                ));
            }
            None => {
                self.add_accumulated(leftover);
                if self.syncing {
                    // Local SGD: step on the local gradient.
                    let local = self.local_buckets();
                    self.set_grads(local);
                }
            }
        }
        self.timing.wait = timing::span_since(wait_start);
        Ok(())
    }

    fn forward_micro<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        f(self.model())
    }

    fn accumulate(&mut self, grads: &mut Gradients) -> Result<(), DdpError> {
        let mut gp = GradientsParams::from_module(grads, self.model());
        let parts = params::take_flat_grads(self.model(), &self.infos, &mut gp);
        self.add_accumulated(parts);
        Ok(())
    }

    /// One bucketed all-reduce of the accumulated gradients (nothing overlaps: the backwards
    /// are over).
    fn reduce(&mut self) -> Result<(), DdpError> {
        let reducer = self.new_reducer();
        self.finish(reducer, vec![None; self.infos.len()])
    }

    /// Applies the optimizer with the gradients of the last synchronized backward; under
    /// [`SyncMode::Periodic`], averages the parameters over the group every `every` steps.
    fn step(&mut self, lr: f64) -> Result<(), DdpError> {
        let grads = self.grads.take().ok_or_else(|| {
            DdpError::Usage(
                "step needs gradients: call backward first (outside no_sync)".to_string(),
            )
        })?;
        let model = self.model.take().expect("model");
        let model = self.master.take().unwrap_or(model);
        let model = match self.config.decay {
            Some(split) => split.apply_module(lr, model, &self.infos),
            None => model,
        };
        let model = self.optim.step(lr, model, grads);
        self.steps += 1;
        let model = match self.config.sync {
            SyncMode::Periodic { every } if every > 0 && self.steps.is_multiple_of(every) => {
                let flat = params::flat(&model, &self.infos);
                let flat = plane::all_reduce(flat, ReduceOp::Avg, &self.pg)?;
                params::assign_flat(model, &self.infos, &flat)
            }
            _ => model,
        };
        let (model, master) = replica_and_master(model, self.config.precision);
        self.model = Some(model);
        self.master = master;
        if self.config.record_timings {
            let mut t = std::mem::take(&mut self.timing);
            t.rank = self.pg.rank();
            t.step = self.steps - 1;
            self.timings.push(t);
        }
        Ok(())
    }

    fn map_gradients(&mut self, f: &mut dyn FnMut(Tensor<1>) -> Tensor<1>) -> Result<(), DdpError> {
        if let Some(buckets) = self.last_buckets.take() {
            let buckets = buckets.into_iter().map(f).collect();
            self.set_grads(buckets);
        }
        Ok(())
    }

    /// Every rank holds the averaged gradient: a parameter's terms are divided by the group's
    /// size (an expert's by its replicas'). Gradients that are not averaged every step (local
    /// SGD) have no global norm: refused.
    fn gradient_square_sum(&self, weights: &[f32]) -> Result<Option<Tensor<1>>, DdpError> {
        if self.config.sync != SyncMode::EveryStep {
            return Err(DdpError::Usage(
                "local SGD does not average gradients every step: they have no global norm to \
                 clip by"
                    .to_string(),
            ));
        }
        let Some(buckets) = &self.last_buckets else {
            return Ok(None);
        };
        let copies = |i: usize| match &self.experts {
            Some(x) if x.contains(&self.infos[i].id) => x.replicas.size(),
            _ => self.pg.size(),
        };
        // Each bucket's parameters, in bucket order, with their weights.
        let mut pieces = vec![Vec::new(); buckets.len()];
        for (i, &(b, off)) in self.plan.loc.iter().enumerate() {
            let weight = weights[i] / copies(i) as f32;
            pieces[b].push((off..off + self.infos[i].numel(), weight));
        }
        Ok(buckets
            .iter()
            .zip(pieces)
            .filter_map(|(bucket, mut p)| {
                p.sort_by_key(|(r, _)| r.start);
                bonfire_module::weighted_square_sum(bucket, p)
            })
            .reduce(|a, b| a + b))
    }

    /// The gradient of each parameter from the last backward (averaged over the group when
    /// synchronized); empty before the first backward. No communication.
    fn gradients(&self) -> Result<Vec<ParamValues>, DdpError> {
        let Some(buckets) = &self.last_buckets else {
            return Ok(Vec::new());
        };
        let host: Vec<Vec<f32>> = buckets
            .iter()
            .map(|b| plane::to_host(b.clone(), Reason::Export))
            .collect();
        Ok(self
            .infos
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (b, off) = self.plan.loc[i];
                ParamValues {
                    path: p.path.clone(),
                    shape: p.shape.clone(),
                    values: host[b][off..off + p.numel()].to_vec(),
                }
            })
            .collect())
    }

    /// The replica's parameters (every rank holds them whole). No communication.
    fn parameters(&self) -> Result<Vec<ParamValues>, DdpError> {
        let model = self.master.as_ref().unwrap_or(self.model());
        let flat = params::flatten_values(model, &self.infos);
        Ok(params::named(&self.infos, &flat))
    }

    fn into_model(self) -> Result<M, DdpError> {
        Ok(self.into_parts().0)
    }

    fn buffers(&self) -> Vec<(params::ParamInfo, Vec<f32>)> {
        params::buffer_values(self.master.as_ref().unwrap_or(self.model()))
    }

    /// Sets them in the replica and, under mixed precision, in the fp32 master.
    fn set_buffers(&mut self, values: &[Vec<f32>]) {
        if let Some(master) = self.master.take() {
            self.master = Some(params::assign_buffers(master, values));
        }
        let model = self
            .model
            .take()
            .expect("the model is present between calls");
        self.model = Some(params::assign_buffers(model, values));
    }
}
