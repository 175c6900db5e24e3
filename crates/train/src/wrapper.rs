//! The dp axis's wrapper, chosen at run time: [`DpWrapper`] is DDP or ZeRO stage 1–3 behind
//! the one [`DataParallel`] interface, built by [`DpSpec`] from the layout, Burn's optimizer
//! and the wrappers' configs. [`Staged`] lends a wrapper to a pipeline stage.

use crate::dims::ParallelDims;
use crate::error::TrainError;
use bonfire_comm::ProcessGroup;
use bonfire_ddp::{DdpConfig, DistributedDataParallel, StepTiming};
use bonfire_dtensor::params::ParamValues;
use bonfire_dtensor::{DataParallel, DeviceMesh};
use bonfire_pipeline::{PipelineError, StageParams};
use bonfire_zero::{MemoryReport, Zero, ZeroConfig, ZeroStage};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::{Gradients, Tensor};
use std::sync::Arc;

/// Builds a fresh Burn optimizer for one rank (each rank owns its optimizer state).
pub type OptimizerFactory = Arc<dyn Fn() -> ModuleOptimizer + Send + Sync>;

/// How the dp axis is wrapped: the layout's ZeRO stage and offload, Burn's optimizer, and the
/// wrappers' own options (bucket sizes, overlap, prefetch).
#[derive(Clone)]
pub struct DpSpec {
    pub stage: ZeroStage,
    pub offload: bool,
    /// Mixed precision (the layout's), given to DDP and ZeRO.
    pub precision: bonfire_dtensor::MixedPrecision,
    pub optimizer: OptimizerFactory,
    pub ddp: DdpConfig,
    pub zero: ZeroConfig,
}

impl DpSpec {
    /// The wrapper of `dims` with `optimizer` and default options.
    pub fn new(dims: &ParallelDims, optimizer: OptimizerFactory) -> Self {
        Self {
            stage: dims.zero,
            offload: dims.offload,
            precision: dims.precision,
            optimizer,
            ddp: DdpConfig::new().with_report_no_layers(false),
            zero: ZeroConfig::new(dims.zero).with_report_no_layers(false),
        }
    }

    /// This rank's wrapper of `model` on the mesh axis `axis`. A collective on that axis.
    pub fn build<M: Module>(
        &self,
        model: M,
        mesh: &DeviceMesh,
        axis: &str,
    ) -> Result<DpWrapper<M>, TrainError> {
        let optim = (self.optimizer)();
        Ok(match self.stage {
            ZeroStage::Zero0 => DpWrapper::Ddp(Box::new(DistributedDataParallel::on_mesh(
                model,
                optim,
                mesh,
                axis,
                self.ddp.clone().with_precision(self.precision),
            )?)),
            stage => {
                let mut config = self
                    .zero
                    .clone()
                    .with_offload(self.offload)
                    .with_precision(self.precision);
                config.stage = stage;
                DpWrapper::Zero(Box::new(Zero::on_mesh(model, optim, mesh, axis, config)?))
            }
        })
    }
}

/// DDP or ZeRO, chosen at run time.
pub enum DpWrapper<M: Module> {
    Ddp(Box<DistributedDataParallel<M>>),
    Zero(Box<Zero<M>>),
}

/// What a rank's dp wrapper measured: DDP's recorded step timings (with
/// `DdpConfig::record_timings`), ZeRO's account of the bytes it holds.
#[derive(Debug, Clone, Default)]
pub struct WrapperReport {
    pub timings: Vec<StepTiming>,
    pub memory: Option<MemoryReport>,
}

impl<M: Module> DpWrapper<M> {
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
    fn accumulate(&mut self, grads: &mut Gradients) -> Result<(), TrainError> {
        each!(self, w => w.accumulate(grads))
    }
    fn reduce(&mut self) -> Result<(), TrainError> {
        each!(self, w => w.reduce())
    }
    fn step(&mut self, lr: f64) -> Result<(), TrainError> {
        each!(self, w => w.step(lr))
    }
    fn unscale_gradients(&mut self, factor: f32) -> Result<bool, TrainError> {
        each!(self, w => w.unscale_gradients(factor))
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
}

/// A data-parallel wrapper lent to a pipeline stage: each micro-batch's forward runs through
/// [`DataParallel::forward_micro`] and its gradients go to [`DataParallel::accumulate`].
pub struct Staged<'a, W>(pub &'a mut W);

impl<M: Module, W: DataParallel<M>> StageParams<M> for Staged<'_, W> {
    fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        self.0.forward_micro(f)
    }
    fn accumulate(&mut self, grads: &mut Gradients) -> Result<(), PipelineError> {
        self.0
            .accumulate(grads)
            .map_err(|e| PipelineError::Invalid(e.to_string()))
    }
}
