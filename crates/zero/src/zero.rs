//! [`Zero`]: a Burn module and optimizer trained with ZeRO sharded data parallelism — the
//! wrapper's state and construction. Training (the [`bonfire_module::DataParallel`]
//! implementation) is in `train.rs`, the byte accounting in `held.rs`.

use crate::config::ZeroConfig;
use crate::error::{Result, ZeroError};
use crate::experts::ExpertShards;
use crate::gather::GatherSummary;
use crate::optim::ShardOptimizer;
use crate::partition::Partition;
use crate::reduce::GradBuckets;
use bonfire_comm::ProcessGroup;
use bonfire_dtensor::DeviceMesh;
use bonfire_dtensor::plane::{self, ledger::Reason};
use bonfire_dtensor::timing::StepTiming;
use bonfire_layout::ZeroStage;
use bonfire_module::PrecisionDTypes;
use bonfire_module::Subgroup;
use bonfire_module::graph::SharedSink;
use bonfire_module::params::{self, ParamInfo};
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::ModuleOptimizer;
use burn::tensor::{DType, Device, Tensor};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

/// One rank's part of a model trained with ZeRO.
///
/// It implements [`DataParallel`](bonfire_module::DataParallel) (import the trait to call
/// it): a step is `forward` → `backward` → `step` (or `train_step`). All calls are
/// collectives: make them on every rank, in the same order. With ranks as threads give each
/// rank its own parameters (`model.fork(&device)`).
pub struct Zero<M: Module> {
    pub(crate) pg: ProcessGroup,
    /// HSDP: the ranks that hold the same shards as this one (same place in `pg`, another
    /// replica); each shard's gradient is averaged across them after the reduction in `pg`.
    pub(crate) replicas: Option<ProcessGroup>,
    pub(crate) config: ZeroConfig,
    /// The parameters this partition holds: every parameter, or under expert parallelism
    /// every one but the experts ([`ExpertShards`]).
    pub(crate) infos: Arc<Vec<ParamInfo>>,
    /// Expert parallelism: the experts' own shards over their replicas.
    pub(crate) experts: Option<ExpertShards>,
    /// Every parameter in module order (the experts' among them), for whole exports.
    pub(crate) all_infos: Arc<Vec<ParamInfo>>,
    pub(crate) part: Arc<Partition>,
    /// Stages 0–2: the full replica. Stage 3: a skeleton whose parameters hold no values.
    pub(crate) model: Option<M>,
    /// Stage 3: this rank's range of the flat parameter vector (an autodiff leaf).
    pub(crate) shard: Option<Tensor<1>>,
    pub(crate) device: Device,
    pub(crate) optim: ShardOptimizer,
    /// The averaged gradient after a reduction, flat, on the device: the full vector (stages
    /// 0–1) or the own range (2–3; `None` when the rank owns nothing).
    pub(crate) grads: Option<Option<Tensor<1>>>,
    /// Stages 0–2: micro-batch gradients summed since the last reduction, per parameter.
    pub(crate) accumulated: Vec<Option<Tensor<1>>>,
    /// Stage 3: micro-batch gradients of the own slices, by offset in the own range.
    pub(crate) accumulated_own: std::collections::BTreeMap<usize, Tensor<1>>,
    /// Stage 2: the gradient buckets of the forward in flight.
    pub(crate) buckets: SharedSink<GradBuckets>,
    /// Stage 3: the slices (autodiff leaves) of the forwards whose gradients have not been
    /// collected yet, with their place in the own range.
    pub(crate) slices: Vec<(Range<usize>, Tensor<1>)>,
    /// Stage 3: what the last forward gathered (its layer order drives the next prefetch).
    pub(crate) last_gather: GatherSummary,
    /// Layers entered with a float input (stage 2's hooks count them).
    pub(crate) layers: Arc<AtomicUsize>,
    pub(crate) told_no_layers: AtomicBool,
    pub(crate) steps: u64,
    /// This step's timings so far, and those of the steps done (with
    /// [`ZeroConfig::record_timings`]).
    pub(crate) timing: StepTiming,
    pub(crate) timings: Vec<StepTiming>,
}

impl<M: Module> Zero<M> {
    /// Wraps `model` and Burn's optimizer (`AdamWConfig::new().init()`, or a per-tensor
    /// optimizer such as `SgdConfig::new().build()`) on rank `pg.rank()`. Checks that all
    /// ranks hold the same parameters, copies rank 0's values everywhere, partitions them, and
    /// (stage 3) drops every value outside this rank's range. A collective.
    ///
    /// Stage 3 computes on [`device`](Self::device): the model's device with Burn's Balanced
    /// gradient checkpointing (unless [`ZeroConfig::recompute`] is off), so that backward
    /// re-gathers parameters instead of keeping them. Its parameters are put there whatever
    /// strategy the model was built with; create the inputs on that device too.
    pub fn new(
        model: M,
        optim: impl Into<ModuleOptimizer>,
        pg: ProcessGroup,
        config: ZeroConfig,
    ) -> Result<Self> {
        Self::build(model, optim.into(), pg, config, None)
    }

    /// [`new`](Self::new) on the group of this rank's slice along the mesh axis `axis` (on a
    /// `dp × tp` mesh: `"dp"`, with the model already parallelized over `"tp"`). An axis the
    /// mesh does not have is an error naming the mesh's axes.
    pub fn on_mesh(
        model: M,
        optim: impl Into<ModuleOptimizer>,
        mesh: &DeviceMesh,
        axis: &str,
        config: ZeroConfig,
    ) -> Result<Self> {
        let pg = mesh.group(axis)?.clone();
        Self::build(model, optim.into(), pg, config, None)
    }

    /// [`on_mesh`](Self::on_mesh) under expert parallelism: the parameters of `experts` hold
    /// this rank's slice of the experts and get shards of their own over their replicas: their
    /// optimizer state (stages 1–3), gradients (2–3) and values (3, gathered per layer over
    /// the replicas). A collective on the axis's group, then on the replicas.
    pub fn on_mesh_with_experts(
        model: M,
        optim: impl Into<ModuleOptimizer>,
        mesh: &DeviceMesh,
        axis: &str,
        config: ZeroConfig,
        experts: Subgroup,
    ) -> Result<Self> {
        let pg = mesh.group(axis)?.clone();
        Self::build(model, optim.into(), pg, config, Some(experts))
    }

    fn build(
        model: M,
        optim: ModuleOptimizer,
        pg: ProcessGroup,
        config: ZeroConfig,
        experts: Option<Subgroup>,
    ) -> Result<Self> {
        if experts.is_some() && config.stage == ZeroStage::Zero0 {
            return Err(ZeroError::Usage(
                "expert parallelism needs ZeRO stage 1, 2 or 3 here (stage 0 is DDP's)".into(),
            ));
        }
        let (model, all) = params::sync_from_root_with(model, &pg, experts.as_ref())?;
        let (expert_infos, infos): (Vec<ParamInfo>, Vec<ParamInfo>) = all
            .iter()
            .cloned()
            .partition(|p| experts.as_ref().is_some_and(|x| x.contains(&p.id)));
        let device = compute_device(&model, &config);
        let flat = plane::to_device(params::flat(&model, &infos), &device, Reason::Collective);
        let total: usize = infos.iter().map(ParamInfo::numel).sum();
        if config.stage == ZeroStage::Zero3 && total.div_ceil(pg.size()) * (pg.size() - 1) >= total
        {
            return Err(ZeroError::Usage(format!(
                "stage 3 needs every rank to own at least one element: {total} parameters on {} ranks",
                pg.size()
            )));
        }
        let side = match experts {
            Some(x) => Some(ExpertShards::new(
                x,
                expert_infos,
                optim.clone(),
                &config,
                &device,
            )?),
            None => None,
        };
        // Stage 3 hollows the experts too: their values first.
        let expert_flat = side.as_ref().map(|x| {
            let flat = params::flat(&model, &x.infos);
            plane::to_device(flat, &device, Reason::Collective)
        });
        let mut zero = Self::empty(model, optim, pg, config, infos, device)?;
        zero.all_infos = Arc::new(all);
        zero.set_full_values(flat);
        if let (Some(mut side), Some(expert_flat)) = (side, expert_flat) {
            if zero.config.stage == ZeroStage::Zero3 {
                side.install_shard(expert_flat);
            } else {
                let model = zero.model.take().expect("model");
                zero.model = Some(side.install(model));
            }
            zero.experts = Some(side);
        }
        Ok(zero)
    }

    pub(crate) fn empty(
        model: M,
        optim: ModuleOptimizer,
        pg: ProcessGroup,
        config: ZeroConfig,
        infos: Vec<ParamInfo>,
        device: Device,
    ) -> Result<Self> {
        let sharded = config.stage != ZeroStage::Zero0;
        let owners = if sharded { pg.size() } else { 1 };
        let part = Partition::balanced(&infos, owners);
        let me = if sharded { pg.rank() } else { 0 };
        let optim = ShardOptimizer::for_rank(optim, &part, me, &device, &config, &infos)?;
        let model = if config.stage == ZeroStage::Zero3 {
            hollow(model, &device)
        } else {
            model
        };
        Ok(Self {
            accumulated: vec![None; infos.len()],
            accumulated_own: Default::default(),
            pg,
            replicas: None,
            config,
            all_infos: Arc::new(infos.clone()),
            experts: None,
            infos: Arc::new(infos),
            part: Arc::new(part),
            model: Some(model),
            shard: None,
            device,
            optim,
            grads: None,
            buckets: Arc::new(Mutex::new(None)),
            slices: Vec::new(),
            last_gather: GatherSummary::default(),
            layers: Arc::new(AtomicUsize::new(0)),
            told_no_layers: AtomicBool::new(false),
            steps: 0,
            timing: StepTiming::default(),
            timings: Vec::new(),
        })
    }

    /// HSDP (FSDP2's hybrid sharding): `replicas` is the group of ranks that hold this rank's
    /// shards — the same rank of another copy of the shard group, each training on its own
    /// rows. After every reduction within the shard group (stage 1's all-reduce, stages 2–3's
    /// reduce-scatter) this rank's gradient is all-reduced across `replicas` and averaged, so
    /// that the step sees the mean over all of them. Parameters and optimizer state stay
    /// equal on the replicas (same values, same gradients). A group of one rank is no change.
    /// Expert parallelism's shards are averaged across the same replicas.
    pub fn with_replicas(mut self, replicas: ProcessGroup) -> Self {
        self.replicas = (replicas.size() > 1).then_some(replicas);
        if let Some(side) = self.experts.as_mut() {
            side.outer = self.replicas.clone();
        }
        self
    }
    /// Whether expert parallelism's experts have shards of their own here
    /// ([`on_mesh_with_experts`](Self::on_mesh_with_experts)).
    pub fn has_experts(&self) -> bool {
        self.experts.is_some()
    }
    /// The HSDP replica group ([`with_replicas`](Self::with_replicas)), if any.
    pub fn replicas(&self) -> Option<&ProcessGroup> {
        self.replicas.as_ref()
    }

    /// The flat range this rank owns (all of it at stage 0).
    pub fn own_range(&self) -> Range<usize> {
        let r = if self.config.stage == ZeroStage::Zero0 {
            0
        } else {
            self.pg.rank()
        };
        self.part.ranges[r].clone()
    }
    /// How the flat parameter vector is split (over one owner at stage 0, every rank above).
    pub fn partition(&self) -> &Partition {
        &self.part
    }
    /// The parameters ZeRO manages, in module order.
    pub fn params(&self) -> &[ParamInfo] {
        &self.infos
    }
    /// The configuration this wrapper was built with.
    pub fn config(&self) -> &ZeroConfig {
        &self.config
    }
    /// Number of optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }
    /// Each step's timings (with [`ZeroConfig::record_timings`]): forward, backward and, at
    /// stage 2, every bucket's reduce-scatter.
    pub fn timings(&self) -> &[StepTiming] {
        &self.timings
    }
    /// The device this rank computes on; create inputs here (at stage 3 it carries the
    /// gradient-checkpointing strategy the wrapper's parameters use).
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// The optimizer over this rank's range (state, host store).
    pub fn optimizer(&self) -> &ShardOptimizer {
        &self.optim
    }

    /// Installs the full flat parameter vector (every rank passes the same values), a tensor
    /// on the wrapper's device.
    ///
    /// Under mixed precision stages 0–2 hand the own range to the optimizer as its fp32
    /// master and hold the model in the param dtype; stage 3's shard stays fp32 (the master).
    pub(crate) fn set_full_values(&mut self, flat: Tensor<1>) {
        let flat = flat.cast(DType::F32);
        let precision = self.config.precision;
        if precision.is_mixed() && self.config.stage != ZeroStage::Zero3 {
            let own = self.own_range();
            let mine = (!own.is_empty()).then(|| flat.clone().narrow(0, own.start, own.len()));
            self.optim.set_master(mine);
            let model = self.model.take().expect("model");
            let half = flat.cast(precision.param_dtype());
            self.model = Some(params::assign_flat(model, &self.infos, &half));
            return;
        }
        if self.config.stage == ZeroStage::Zero3 {
            let own = self.own_range();
            let mine = (!own.is_empty()).then(|| flat.narrow(0, own.start, own.len()));
            self.set_shard(mine);
        } else {
            let model = self.model.take().expect("model");
            self.model = Some(params::assign_flat(model, &self.infos, &flat));
        }
    }

    /// Stage 3: this rank's range becomes `own` (an autodiff leaf; a rank owning nothing is
    /// refused at construction, so `own` is `Some` in practice).
    pub(crate) fn set_shard(&mut self, own: Option<Tensor<1>>) {
        let own = own.expect("every stage-3 rank owns part of the parameters");
        // Kept an autodiff leaf although each forward's slices (views of it, detached) are the
        // leaves that get gradients: measured, an untracked shard makes backward hold one
        // more shard-sized buffer (tests/layer_release.rs).
        let own = own.detach();
        self.shard = Some(if self.device.is_autodiff() {
            own.require_grad()
        } else {
            own
        });
    }

    /// This rank's range of the flat parameter vector, on the device (`None` when it owns
    /// nothing).
    pub fn own_tensor(&self) -> Option<Tensor<1>> {
        let own = self.own_range();
        if own.is_empty() {
            return None;
        }
        Some(match &self.shard {
            Some(s) => s.clone().detach(),
            None => params::flat(self.model(), &self.infos).narrow(0, own.start, own.len()),
        })
    }

    /// This rank's range of the flat parameter vector in fp32, on the device: under mixed
    /// precision the optimizer's master (stages 0–2) rather than the half-precision copy the
    /// model computes with.
    pub fn own_master(&self) -> Option<Tensor<1>> {
        if self.config.precision.is_mixed() && self.config.stage != ZeroStage::Zero3 {
            let home = self.device.clone().inner();
            return self.optim.master().map(|m| {
                let m = plane::to_device(m.clone(), &home, Reason::Offload);
                bonfire_dtensor::autodiff::with_context_of(m, &self.device)
            });
        }
        self.own_tensor().map(|t| t.cast(DType::F32))
    }

    /// This rank's range of the flat parameter vector (fp32: the master), on the host.
    pub fn own_values(&self) -> Vec<f32> {
        self.own_master()
            .map_or_else(Vec::new, |t| plane::to_host(t, Reason::Export))
    }

    /// Every parameter, concatenated in module order, on the device (an all-gather at stage
    /// 3).
    /// In fp32 (under mixed precision, the masters).
    pub fn full_tensor(&self) -> Result<Tensor<1>> {
        let sharded = self.shard.is_some()
            || (self.config.precision.is_mixed() && self.config.stage != ZeroStage::Zero0);
        if !sharded {
            return Ok(match self.config.precision.is_mixed() {
                true => self.own_master().expect("stage 0 owns everything"),
                false => params::flat(self.model(), &self.infos),
            });
        }
        let counts = self.part.counts();
        Ok(plane::all_gather(
            self.own_master(),
            &counts,
            DType::F32,
            &self.pg,
            &self.device,
        )?)
    }

    /// Every parameter, concatenated in module order, on the host (a collective at stage 3).
    pub fn full_values(&self) -> Result<Vec<f32>> {
        Ok(plane::to_host(self.full_tensor()?, Reason::Export))
    }

    /// The module with every parameter in full, as a plain single-device model would hold
    /// it (a collective at stage 3).
    pub fn full_model(&self) -> Result<M> {
        let flat = self.full_tensor()?;
        let model = self.model().clone();
        let model = params::assign_flat(model, &self.infos, &flat);
        match &self.experts {
            Some(side) if self.config.stage == ZeroStage::Zero3 => side.assign_whole(model),
            _ => Ok(model),
        }
    }

    /// The replica (stages 0–2) or the hollow skeleton (stage 3, parameters without values:
    /// use `forward` or [`full_model`](Self::full_model)).
    pub fn model(&self) -> &M {
        self.model
            .as_ref()
            .expect("the model is present between calls")
    }

    /// The averaged gradient this rank holds after `backward`, on the device: the full flat
    /// vector (stages 0–1) or the own range (2–3).
    pub fn held_gradients(&self) -> Option<&Tensor<1>> {
        self.grads.as_ref().and_then(Option::as_ref)
    }
}

/// The device a wrapper computes on: the model's, and at stage 3 (with recompute) with
/// Balanced gradient checkpointing whatever strategy the model's parameters carry —
/// `Module::fork` keeps a parameter's strategy, so a model built on a plain autodiff device and
/// forked onto a checkpointing one still says "plain".
fn compute_device<M: Module>(model: &M, config: &ZeroConfig) -> Device {
    let device = params::model_device(model).unwrap_or_else(|| Device::flex().autodiff());
    if config.stage != ZeroStage::Zero3 || !device.is_autodiff() {
        return device;
    }
    let plain = device.inner().autodiff();
    if config.recompute {
        plain.gradient_checkpointing()
    } else {
        plain
    }
}

/// `model` with every trained float parameter replaced by a value-less placeholder (same id,
/// shape) on `device`; it materializes zeros only if something reads it. State that trains
/// not (a parameter without gradient: DeepSeek's balancing bias) is no part of the shards and
/// keeps its values, whole on every rank.
pub(crate) fn hollow<M: Module>(model: M, device: &Device) -> M {
    struct Hollow<'a>(&'a Device);
    impl ModuleMapper for Hollow<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if !param.is_require_grad() {
                return param;
            }
            let id = param.id;
            let shape = param.lazy_shape();
            let rg = true;
            drop(param);
            let dims = shape.clone();
            Param::uninitialized(
                id,
                move |device, rg| {
                    let t = Tensor::<D>::zeros(dims, device);
                    if rg { t.require_grad() } else { t }
                },
                self.0.clone(),
                rg,
                shape,
            )
        }
    }
    model.map(&mut Hollow(device))
}

impl<M: Module> Zero<M> {
    /// Installs parameter values and optimizer state from outside (a checkpoint): `values`
    /// are fp32, this rank's range of the flat vector at stage 3 and the whole flat vector at
    /// stages 0–2 (every rank of the group passing the same); `states` are the state of each
    /// of the optimizer's slices ([`ShardOptimizer::slices`](crate::ShardOptimizer::slices)),
    /// all `None` for a fresh optimizer. No communication; call it between steps.
    pub fn load_state(
        &mut self,
        values: Vec<f32>,
        states: Vec<Option<crate::FlatState>>,
    ) -> Result<()> {
        let want = if self.config.stage == ZeroStage::Zero3 {
            self.own_range().len()
        } else {
            self.part.total()
        };
        if values.len() != want || states.len() != self.optim.slices.len() {
            return Err(ZeroError::Checkpoint(format!(
                "load_state: {} values and {} slice states for {want} values and {} slices",
                values.len(),
                states.len(),
                self.optim.slices.len()
            )));
        }
        let n = values.len();
        let t = plane::from_host(values, [n], &self.device, Reason::Checkpoint);
        if self.config.stage == ZeroStage::Zero3 {
            self.set_shard(Some(t));
        } else {
            self.set_full_values(t);
        }
        self.optim.import(states)?;
        self.grads = None;
        Ok(())
    }
}

/// Checkpoints of a wrapper with expert shards (for `bonfire-train`'s checkpoints).
impl<M: Module> Zero<M> {
    /// Every parameter in module order, the experts' among them (without experts, the same as
    /// [`params`](Self::params)).
    pub fn all_params(&self) -> &[ParamInfo] {
        &self.all_infos
    }
    /// The expert parameters, in module order (`None` without experts).
    pub fn expert_params(&self) -> Option<&[ParamInfo]> {
        self.experts.as_ref().map(|x| x.infos.as_slice())
    }
    /// The slices of the experts' vector this rank steps (empty without experts).
    pub fn expert_slices(&self) -> &[crate::ParamSlice] {
        self.experts.as_ref().map_or(&[], |x| x.optim.slices())
    }
    /// The experts' own range, fp32, on the host (empty without experts).
    pub fn expert_own_values(&self) -> Vec<f32> {
        let model = self.model.as_ref().expect("model");
        self.experts
            .as_ref()
            .map_or_else(Vec::new, |x| x.own_values(model))
    }
    /// The optimizer state of each expert slice (empty without experts).
    pub fn expert_states(&self) -> Vec<Option<crate::FlatState>> {
        self.experts
            .as_ref()
            .map_or_else(Vec::new, |x| x.optim.export_all())
    }
    /// Installs the experts' values (this rank's whole slice, fp32, module order; at stage 3
    /// its own range) and their slices' optimizer state. No communication; call it between
    /// steps.
    pub fn load_expert_state(
        &mut self,
        values: Vec<f32>,
        states: Vec<Option<crate::FlatState>>,
    ) -> Result<()> {
        let Some(side) = self.experts.as_mut() else {
            return Err(crate::ZeroError::Usage("no expert shards to load".into()));
        };
        let model = self.model.take().expect("model");
        self.model = Some(side.load(model, values, states)?);
        Ok(())
    }
}
