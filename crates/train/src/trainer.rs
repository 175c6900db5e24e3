//! [`Trainer`]: validates a layout against the world, the model and a batch — every check
//! before anything is built — then parallelizes the model in torchtitan's order (tensor
//! parallelism over tp, the pipeline split over pp, DDP or ZeRO over dp) and returns this
//! rank's [`Engine`].

use crate::engine::Engine;
use crate::engine::export::ModelLayout;
use crate::engine::pipeline::{BuildEngine, PipelineContext, split_points};
use crate::engine::recompute::{self, Names};
use crate::engine::replica::ReplicaEngine;
use crate::error::TrainError;
use crate::mesh::RankMesh;
use crate::optim::OptimizerSpec;
use crate::wrapper::{DpSpec, OptimizerFactory};
use bonfire_comm::ProcessGroup;
use bonfire_cp::ContextSplit;
use bonfire_ddp::DdpConfig;
use bonfire_dtensor::DeviceMesh;
use bonfire_layout::LayoutError;
use bonfire_layout::ZeroStage;
use bonfire_layout::{Axis, ParallelDims};
use bonfire_module::params;
use bonfire_parallel::{ParallelModel, Rows};
use bonfire_tp::parallelize_module;
use bonfire_zero::ZeroConfig;
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Device;
use std::sync::Arc;

/// A layout, Burn's optimizer and the wrappers' options: everything needed to turn a model
/// into an engine on each rank.
#[derive(Clone)]
pub struct Trainer {
    dims: ParallelDims,
    dp: DpSpec,
}

impl Trainer {
    /// Training under `dims` with the optimizer `optimizer` builds on each rank (e.g.
    /// `|| AdamWConfig::new().init()`).
    pub fn new(
        dims: ParallelDims,
        optimizer: impl Fn() -> ModuleOptimizer + Send + Sync + 'static,
    ) -> Self {
        let optimizer: OptimizerFactory = Arc::new(optimizer);
        Self {
            dp: DpSpec::new(optimizer),
            dims,
        }
    }
    /// Training under `dims` with the optimizer `spec` names, its settings included (AdamW's
    /// weight decay kept off 1-d parameters is applied by the dp wrapper, in every layout).
    pub fn with_optimizer(dims: ParallelDims, spec: impl Into<OptimizerSpec>) -> Self {
        let spec = spec.into();
        let mut trainer = Self::new(dims, move || spec.build());
        trainer.dp.decay = spec.decay_split();
        trainer
    }
    /// DDP's options (bucket size, overlap, compression) for stage 0.
    pub fn with_ddp(mut self, config: DdpConfig) -> Self {
        self.dp.ddp = config.with_report_no_layers(false);
        self
    }
    /// ZeRO's options (bucket size, prefetch, recompute) for stages 1–3. The stage, offload
    /// and precision are the layout's: a config that says others is refused by
    /// [`check`](Self::check) (and so by [`build`](Self::build)), not silently overridden.
    pub fn with_zero(mut self, config: ZeroConfig) -> Self {
        self.dp.zero = Some(config.with_report_no_layers(false));
        self
    }
    /// The layout it trains under.
    pub fn dims(&self) -> &ParallelDims {
        &self.dims
    }
    /// The same training on `dp` data-parallel ranks, every other option kept: what the
    /// survivors of a failure continue with ([`crate::fault`]).
    pub(crate) fn with_dp(&self, dp: usize) -> Self {
        Self {
            dims: self.dims.clone().with_degree(Axis::Dp, dp),
            dp: self.dp.clone(),
        }
    }

    /// Checks the layout against a world of `world` ranks, the model and a batch (one the
    /// data source produces, on any device): degrees, options, divisibility, stages and
    /// micro-batches. Makes no collective and builds nothing.
    pub fn check<M: ParallelModel>(
        &self,
        model: &M,
        world: usize,
        batch: &M::Batch,
    ) -> Result<(), LayoutError> {
        let dims = &self.dims;
        dims.validate(world)?;
        self.dp.check(dims)?;
        let rows = batch.rows();
        if dims.dp_replicate() > 1 && rows % dims.data_replicas() != 0 {
            return Err(LayoutError::axis(
                Axis::DpReplicate,
                dims.dp_replicate(),
                format!(
                    "the batch's {rows} rows do not split over dp_replicate × dp = {} \
                     data-parallel replicas",
                    dims.data_replicas()
                ),
            ));
        }
        if rows % dims.dp() != 0 {
            return Err(LayoutError::NotDivisible {
                axis: Axis::Dp,
                degree: dims.dp(),
                what: "the batch's row count".into(),
                value: rows,
            });
        }
        if dims.tp() > 1 && model.tensor_parallel_plan(dims).is_none() {
            return Err(LayoutError::axis(
                Axis::Tp,
                dims.tp(),
                "the model has no tensor-parallel plan",
            ));
        }
        model.check_layout(dims)?;
        check_experts(model, dims)?;
        if dims.cp() > 1 {
            let seq = M::sequence_length(batch).ok_or_else(|| {
                LayoutError::axis(
                    Axis::Cp,
                    dims.cp(),
                    "the model's batches have no sequences to split",
                )
            })?;
            ContextSplit::for_training(seq, dims.cp())
                .map_err(|e| LayoutError::axis(Axis::Cp, dims.cp(), e))?;
        }
        model.check_batch(dims, batch)?;
        if dims.recompute.is_on() {
            recompute::check(model.clone().pipeline(Names), dims)?;
        }
        if dims.pp() > 1 {
            let per_replica = rows / dims.data_replicas();
            let m = dims.microbatches();
            if m > per_replica {
                return Err(LayoutError::axis(
                    Axis::Pp,
                    dims.pp(),
                    format!(
                        "{m} micro-batches need at least {m} rows per replica, there are {per_replica}"
                    ),
                ));
            }
            let (names, _) = model.clone().pipeline(Names).ok_or_else(|| {
                LayoutError::axis(Axis::Pp, dims.pp(), "the model has no pipeline pieces")
            })?;
            split_points(&names, dims)?;
        }
        Ok(())
    }

    /// Checks everything ([`check`](Self::check)), then builds this rank's engine for
    /// `model` on `world`: the mesh `[pp, dp_replicate, dp, cp, tp]`, the model forked onto this rank's device
    /// (with Balanced gradient checkpointing for ZeRO-3), every rank given world rank 0's
    /// values, tensor parallelism applied, the pipeline split and the dp wrapper built. A
    /// collective on `world`.
    pub fn build<M: ParallelModel>(
        &self,
        model: M,
        world: &ProcessGroup,
        batch: &M::Batch,
    ) -> Result<Box<dyn Engine<M::Batch>>, TrainError> {
        self.check(&model, world.size(), batch)?;
        let dims = self.dims.clone();
        let mesh = build_mesh(&dims, world)?;
        let device = self.device_for(&model);
        let model = params::fork(model, &device);
        let (mut model, _) = params::sync_from_root(model, world)?;
        let model_experts = model.experts();
        if dims.tp() > 1 {
            let plan = model.tensor_parallel_plan(&dims).expect("checked");
            model = parallelize_module(model, &mesh, Axis::Tp.name(), &plan)?;
        }
        if model.layers().is_empty() && dims.data_replicas() * dims.cp() > 1 && world.rank() == 0 {
            tracing::info!(
                "bonfire-train: the model names no layers, so {} (run layers through \
                 `bonfire_module::layer` and list them in `ParallelModel::layers`)",
                match dims.zero {
                    ZeroStage::Zero3 => "ZeRO-3 gathers every parameter for the whole forward",
                    ZeroStage::Zero0 | ZeroStage::Zero2 =>
                        "gradients are reduced after backward, not during it",
                    ZeroStage::Zero1 => "gradients are all-reduced after backward",
                }
            );
        }
        let mut at = RankMesh {
            dims,
            mesh,
            device,
            loss_scale: 1.0,
            grad_accum: 1,
            experts: None,
        };
        at.experts = at.expert_groups()?;
        let (model, experts) = match &at.experts {
            Some(groups) => {
                let ep = at.dims.ep();
                let (model, ids) =
                    bonfire_ep::shard_experts(model, &model_experts, groups.ep.rank(), ep);
                let params = bonfire_ep::expert_subgroup(ids, groups.replicas.clone(), ep);
                (model, Some(params))
            }
            None => (model, None),
        };
        let layout = match &experts {
            Some(x) => ModelLayout::of(&model).with_experts(&x.ids, at.dims.ep()),
            None => ModelLayout::of(&model),
        };
        if at.dims.pp() == 1 {
            let wrapper = self.dp.build_at(model, &at, experts)?;
            return Ok(Box::new(ReplicaEngine::new(at, wrapper, layout)));
        }
        let ctx = PipelineContext {
            at,
            dp: self.dp.clone(),
            layout,
            experts,
        };
        let context = crate::engine::replica::context_cut::<M>();
        model
            .pipeline(BuildEngine { ctx, context })
            .expect("checked: the model has pipeline pieces")
    }

    /// The device a rank computes on: the model's, with Balanced gradient checkpointing under
    /// ZeRO-3 (so backward re-gathers parameters; see `ZeroConfig::recompute`).
    fn device_for<M: Module>(&self, model: &M) -> Device {
        let device = params::model_device(model).unwrap_or_else(|| Device::flex().autodiff());
        if self.dims.zero == ZeroStage::Zero3
            && self.dp.zero_config(&self.dims).recompute
            && device.is_autodiff()
        {
            device.inner().autodiff().gradient_checkpointing()
        } else {
            device
        }
    }
}

/// Expert parallelism's checks: a model with experts that split over ep.
fn check_experts<M: ParallelModel>(model: &M, dims: &ParallelDims) -> Result<(), LayoutError> {
    let ep = dims.ep();
    if ep == 1 {
        return Ok(());
    }
    let refuse = |reason: String| Err(LayoutError::axis(Axis::Ep, ep, reason));
    let experts = model.experts();
    if experts.is_empty() {
        return refuse("the model has no experts to split (ParallelModel::experts)".into());
    }
    if let Err(e) = bonfire_ep::check_experts(model, &experts, ep) {
        return refuse(e.to_string());
    }
    Ok(())
}

/// The mesh of `world` with `dims`' axes in [`Axis::ALL`] order (every axis present, size 1
/// or not). A collective: every rank of `world` makes it.
fn build_mesh(dims: &ParallelDims, world: &ProcessGroup) -> Result<DeviceMesh, LayoutError> {
    dims.validate(world.size())?;
    let shape: Vec<usize> = Axis::ALL.iter().map(|&a| dims.degree(a)).collect();
    let names: Vec<&str> = Axis::ALL.iter().map(|a| a.name()).collect();
    DeviceMesh::new(world, &shape, &names).map_err(|e| LayoutError::Parse {
        spec: dims.to_string(),
        reason: e.to_string(),
    })
}
