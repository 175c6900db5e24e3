//! The dp axis's wrapper, chosen at run time: [`DpWrapper`] is DDP or ZeRO stage 1–3 behind
//! the one [`DataParallel`] interface, built by [`DpSpec`] from the layout, Burn's optimizer
//! and the wrappers' configs. [`Staged`] lends a wrapper to a pipeline stage.

use crate::error::TrainError;
use bonfire_comm::ProcessGroup;
use bonfire_ddp::{DdpConfig, DistributedDataParallel};
use bonfire_dtensor::DeviceMesh;
use bonfire_dtensor::timing::StepTiming;
use bonfire_layout::LayoutError;
use bonfire_layout::ZeroStage;
use bonfire_layout::{Axis, ParallelDims};
use bonfire_module::Subgroup;
use bonfire_module::params::ParamValues;
use bonfire_module::{DataParallel, DecaySplit};
use bonfire_pipeline::{PipelineError, StageParams};
use bonfire_zero::{MemoryReport, Zero, ZeroConfig};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::{Gradients, Tensor};
use std::sync::Arc;

/// Builds a fresh Burn optimizer for one rank (each rank owns its optimizer state).
pub type OptimizerFactory = Arc<dyn Fn() -> ModuleOptimizer + Send + Sync>;

/// How the dp axis is wrapped besides the layout: Burn's optimizer and the wrappers' own
/// options (bucket sizes, overlap, prefetch). The ZeRO stage, offload and precision are the
/// layout's ([`ParallelDims`], their one holder), read when a wrapper is built.
#[derive(Clone)]
pub struct DpSpec {
    /// Builds each rank's Burn optimizer.
    pub optimizer: OptimizerFactory,
    /// DDP's options (buckets, overlap, compression, timings) for stage 0; a mixed precision
    /// set here must be the layout's ([`DpSpec::check`]).
    pub ddp: DdpConfig,
    /// ZeRO's options; `None`: the defaults. A config's own stage, offload and precision
    /// must be the layout's ([`DpSpec::check`]).
    pub zero: Option<ZeroConfig>,
    /// Weight decay kept off 1-d parameters, applied by whichever wrapper is built (the
    /// optimizer then decays nothing itself): set with the optimizer by
    /// [`crate::Trainer::with_optimizer`].
    pub decay: Option<DecaySplit>,
}

impl DpSpec {
    /// Burn's `optimizer` with the wrappers' default options.
    pub fn new(optimizer: OptimizerFactory) -> Self {
        Self {
            optimizer,
            ddp: DdpConfig::new().with_report_no_layers(false),
            zero: None,
            decay: None,
        }
    }

    /// Refuses a DDP or ZeRO config that says something else than `dims` — another ZeRO
    /// stage, offload where the layout has none, or another mixed precision — which the
    /// layout's would otherwise silently override. (A config left at its defaults for offload
    /// and precision takes the layout's.)
    pub fn check(&self, dims: &ParallelDims) -> Result<(), LayoutError> {
        let ddp = &self.ddp.precision;
        let conflict = if ddp.is_mixed() && *ddp != dims.precision {
            Some(format!(
                "the DDP config says precision {ddp}, the layout {}",
                dims.precision
            ))
        } else if let Some(z) = &self.zero {
            Self::zero_conflict(z, dims)
        } else {
            None
        };
        match conflict {
            Some(what) => Err(LayoutError::axis(
                Axis::Dp,
                dims.dp(),
                format!("{what}: set it on the layout (ParallelDims), its one holder"),
            )),
            None => Ok(()),
        }
    }

    /// What `z` says that `dims` does not, if anything.
    fn zero_conflict(z: &ZeroConfig, dims: &ParallelDims) -> Option<String> {
        if z.stage != dims.zero {
            Some(format!(
                "the ZeRO config says stage {}, the layout stage {}",
                z.stage.index(),
                dims.zero.index()
            ))
        } else if z.offload && !dims.offload {
            Some("the ZeRO config says offload, the layout does not".to_string())
        } else if z.precision.is_mixed() && z.precision != dims.precision {
            Some(format!(
                "the ZeRO config says precision {}, the layout {}",
                z.precision, dims.precision
            ))
        } else {
            None
        }
    }

    /// The ZeRO config of `dims`: the given options (or the defaults) with the layout's
    /// offload and precision (its stage is the layout's once [`check`](Self::check) passed).
    pub fn zero_config(&self, dims: &ParallelDims) -> ZeroConfig {
        self.zero
            .clone()
            .unwrap_or_else(|| ZeroConfig::new(dims.zero).with_report_no_layers(false))
            .with_offload(dims.offload)
            .with_precision(dims.precision)
            .with_decay(self.decay)
    }

    /// This rank's wrapper of `model` on the mesh axis `axis` under `dims` (after
    /// [`check`](Self::check), so a contradicting ZeRO config is refused here too). A
    /// collective on that axis.
    pub fn build<M: Module>(
        &self,
        model: M,
        mesh: &DeviceMesh,
        axis: &str,
        dims: &ParallelDims,
    ) -> Result<DpWrapper<M>, TrainError> {
        self.build_with(model, mesh, axis, dims, None)
    }

    /// [`build`](Self::build), with expert parallelism's parameters reduced apart.
    fn build_with<M: Module>(
        &self,
        model: M,
        mesh: &DeviceMesh,
        axis: &str,
        dims: &ParallelDims,
        experts: Option<Subgroup>,
    ) -> Result<DpWrapper<M>, TrainError> {
        self.check(dims)?;
        let optim = (self.optimizer)();
        Ok(match dims.zero {
            ZeroStage::Zero0 => DpWrapper::Ddp(Box::new(DistributedDataParallel::with_experts(
                model,
                optim,
                mesh.group(axis)?.clone(),
                self.ddp
                    .clone()
                    .with_precision(dims.precision)
                    .with_decay(self.decay),
                experts,
            )?)),
            _ => {
                let config = self.zero_config(dims);
                let zero = match experts {
                    Some(x) => Zero::on_mesh_with_experts(model, optim, mesh, axis, config, x)?,
                    None => Zero::on_mesh(model, optim, mesh, axis, config)?,
                };
                DpWrapper::Zero(Box::new(zero))
            }
        })
    }
}

impl DpSpec {
    /// This rank's wrapper of `model` at its place `at` in the layout: on the dp wrapper's
    /// group ([`RankMesh::replica_mesh`](crate::RankMesh)), and under HSDP with ZeRO's
    /// replica group (dp_replicate), across which each shard's gradient is averaged; under
    /// expert parallelism with `experts`, the expert parameters reduced over their replicas.
    /// A collective on the wrapper's group.
    pub(crate) fn build_at<M: Module>(
        &self,
        model: M,
        at: &crate::RankMesh,
        experts: Option<Subgroup>,
    ) -> Result<DpWrapper<M>, TrainError> {
        let mesh = at.replica_mesh()?;
        let built = self.build_with(model, &mesh, Axis::Dp.name(), &at.dims, experts)?;
        Ok(match (built, at.replicate_group()) {
            (DpWrapper::Zero(z), Some(g)) => DpWrapper::Zero(Box::new(z.with_replicas(g.clone()))),
            (w, _) => w,
        })
    }
}

/// DDP or ZeRO, chosen at run time.
pub enum DpWrapper<M: Module> {
    /// DDP (ZeRO stage 0): every dp rank holds the whole state and gradients are all-reduced.
    Ddp(Box<DistributedDataParallel<M>>),
    /// ZeRO stage 1, 2 or 3: optimizer state, then gradients, then parameters sharded over
    /// the dp ranks.
    Zero(Box<Zero<M>>),
}

/// What a rank's dp wrapper measured: DDP's recorded step timings (with
/// `DdpConfig::record_timings`), ZeRO's account of the bytes it holds.
#[derive(Debug, Clone, Default)]
pub struct WrapperReport {
    /// Each step's timings, in order (empty unless the wrapper's config records them).
    pub timings: Vec<StepTiming>,
    /// ZeRO's account of the bytes this rank holds; `None` under DDP.
    pub memory: Option<MemoryReport>,
}

impl<M: Module> DpWrapper<M> {
    /// What this rank's wrapper has measured so far.
    pub fn report(&self) -> WrapperReport {
        match self {
            DpWrapper::Ddp(d) => WrapperReport {
                timings: d.timings().to_vec(),
                memory: None,
            },
            DpWrapper::Zero(z) => WrapperReport {
                timings: z.timings().to_vec(),
                memory: Some(z.memory()),
            },
        }
    }
}

/// Calls `$body` with `$w` bound to the wrapper, whichever it is, converting its error.
macro_rules! each {
    ($self:expr, $w:ident => $body:expr) => {
        match $self {
            DpWrapper::Ddp($w) => $body.map_err(TrainError::from),
            DpWrapper::Zero($w) => $body.map_err(TrainError::from),
        }
    };
}

impl<M: Module> DataParallel<M> for DpWrapper<M> {
    type Error = TrainError;

    fn process_group(&self) -> &ProcessGroup {
        match self {
            DpWrapper::Ddp(w) => w.process_group(),
            DpWrapper::Zero(w) => w.process_group(),
        }
    }
    fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        match self {
            DpWrapper::Ddp(w) => w.forward(f),
            DpWrapper::Zero(w) => w.forward(f),
        }
    }
    fn backward(&mut self, loss: Tensor<1>) -> Result<(), TrainError> {
        each!(self, w => w.backward(loss))
    }
    fn forward_micro<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        match self {
            DpWrapper::Ddp(w) => w.forward_micro(f),
            DpWrapper::Zero(w) => w.forward_micro(f),
        }
    }
    fn evaluate<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        match self {
            DpWrapper::Ddp(w) => w.evaluate(f),
            DpWrapper::Zero(w) => w.evaluate(f),
        }
    }
    fn accumulate(&mut self, grads: &mut Gradients) -> Result<(), TrainError> {
        each!(self, w => w.accumulate(grads))
    }
    fn reduce(&mut self) -> Result<(), TrainError> {
        each!(self, w => w.reduce())
    }
    fn step(&mut self, lr: f64) -> Result<(), TrainError> {
        each!(self, w => w.step(lr))
    }
    fn map_gradients(
        &mut self,
        f: &mut dyn FnMut(Tensor<1>) -> Tensor<1>,
    ) -> Result<(), TrainError> {
        each!(self, w => w.map_gradients(f))
    }
    fn gradient_square_sum(&self, weights: &[f32]) -> Result<Option<Tensor<1>>, TrainError> {
        each!(self, w => w.gradient_square_sum(weights))
    }
    fn gradients(&self) -> Result<Vec<ParamValues>, TrainError> {
        each!(self, w => w.gradients())
    }
    fn parameters(&self) -> Result<Vec<ParamValues>, TrainError> {
        each!(self, w => w.parameters())
    }
    fn into_model(self) -> Result<M, TrainError> {
        each!(self, w => w.into_model())
    }
    fn buffers(&self) -> Vec<(bonfire_module::params::ParamInfo, Vec<f32>)> {
        match self {
            DpWrapper::Ddp(w) => w.buffers(),
            DpWrapper::Zero(w) => w.buffers(),
        }
    }
    fn set_buffers(&mut self, values: &[Vec<f32>]) {
        match self {
            DpWrapper::Ddp(w) => w.set_buffers(values),
            DpWrapper::Zero(w) => w.set_buffers(values),
        }
    }
}

/// A data-parallel wrapper lent to a pipeline stage: each micro-batch's forward runs through
/// [`DataParallel::forward_micro`] and its gradients go to [`DataParallel::accumulate`].
pub struct Staged<'a, W>(pub &'a mut W);

impl<M: Module, W: DataParallel<M>> StageParams<M> for Staged<'_, W> {
    fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        self.0.forward_micro(f)
    }
    fn accumulate(&mut self, grads: &mut Gradients) -> Result<(), PipelineError> {
        // A borrowed parameter's uses (a tied head) go to the engine, not the wrapper.
        bonfire_module::tied::collect(grads);
        self.0
            .accumulate(grads)
            .map_err(|e| PipelineError::Invalid(e.to_string()))
    }
}

/// A data-parallel wrapper lent to a forward-only pipeline run (evaluation): each forward runs
/// through [`DataParallel::evaluate`]; no gradient comes back.
pub struct Evaluating<'a, W>(pub &'a mut W);

impl<M: Module, W: DataParallel<M>> StageParams<M> for Evaluating<'_, W> {
    fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        self.0.evaluate(f)
    }
    fn accumulate(&mut self, _grads: &mut Gradients) -> Result<(), PipelineError> {
        Err(PipelineError::Invalid(
            "an evaluation runs no backward: nothing to accumulate".into(),
        ))
    }
}
