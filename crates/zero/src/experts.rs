//! ZeRO under expert parallelism: [`ExpertShards`], the expert parameters' own flat vector.
//!
//! A rank's expert parameters hold its ep rank's slice of the experts, which the other ep
//! ranks of its dp group do not have; the ranks holding the same slice are the experts'
//! replicas ([`Subgroup::replicas`], `dp·cp/ep` of them). So the experts get a flat
//! vector and a [`Partition`] of their own, over the replicas — stage 1 shards their
//! optimizer state there, stages 2 and 3 their gradients too — while every other parameter
//! keeps the wrapper's partition over the whole dp group. Their gradient is reduced over the
//! replicas and scaled by [`Subgroup::grad_scale`] (the mean over the whole dp group).
//! Stages 1–2 hold the slice whole in the model between steps; stage 3 shards it too and
//! gathers it per layer over the replicas (`experts3.rs`).

use crate::config::ZeroConfig;
use crate::error::Result;
use crate::optim::ShardOptimizer;
use crate::partition::Partition;
use bonfire_comm::ReduceOp;
use bonfire_dtensor::plane::{self, ledger::Reason};
use bonfire_layout::ZeroStage;
use bonfire_module::PrecisionDTypes;
use bonfire_module::Subgroup;
use bonfire_module::params::{self, ParamInfo, ParamValues};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::{DType, Device, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// The expert parameters' shards on one rank (see the module docs).
pub(crate) struct ExpertShards {
    pub params: Subgroup,
    /// The expert parameters, in module order.
    pub infos: Arc<Vec<ParamInfo>>,
    pub(crate) part: Arc<Partition>,
    pub optim: ShardOptimizer,
    pub(crate) stage: ZeroStage,
    /// The averaged gradient after a reduction: the whole expert vector (stage 1) or the own
    /// range (stages 2–3; `None` when this rank owns nothing).
    pub(crate) grads: Option<Option<Tensor<1>>>,
    /// Micro-batch gradients summed since the last reduction, per expert parameter.
    pub(crate) accumulated: Vec<Option<Tensor<1>>>,
    pub(crate) device: Device,
    pub(crate) config: ZeroConfig,
    /// HSDP: the ranks holding the same shards in the other replicas; the reduced gradient
    /// is averaged across them too.
    pub outer: Option<bonfire_comm::ProcessGroup>,
    /// Stage 3 (`experts3.rs`): the own range of the experts' vector, its forwards' slices,
    /// their summed gradients by offset, and the last forward's layers (prefetch order).
    pub(crate) shard: Option<Tensor<1>>,
    pub(crate) slices: Vec<(Range<usize>, Tensor<1>)>,
    pub(crate) accumulated_own: std::collections::BTreeMap<usize, Tensor<1>>,
    pub(crate) last_layers: Vec<Vec<usize>>,
}

impl ExpertShards {
    /// The shards of `infos` (the expert parameters of `params`) for `config`'s stage (1–3),
    /// stepped by a copy of `optim` on `device`.
    pub fn new(
        params: Subgroup,
        infos: Vec<ParamInfo>,
        optim: ModuleOptimizer,
        config: &ZeroConfig,
        device: &Device,
    ) -> Result<Self> {
        let part = Arc::new(Partition::balanced(&infos, params.replicas.size()));
        let optim =
            ShardOptimizer::for_rank(optim, &part, params.replicas.rank(), device, config, &infos)?;
        Ok(Self {
            accumulated: vec![None; infos.len()],
            params,
            infos: Arc::new(infos),
            part,
            optim,
            stage: config.stage,
            grads: None,
            device: device.clone(),
            config: config.clone(),
            outer: None,
            shard: None,
            slices: Vec::new(),
            accumulated_own: Default::default(),
            last_layers: Vec::new(),
        })
    }

    /// This rank's range of the expert vector.
    pub fn own_range(&self) -> Range<usize> {
        self.part.ranges[self.params.replicas.rank()].clone()
    }

    /// Takes the model's expert values as they are (each rank its slice): under mixed
    /// precision the own range becomes the optimizer's fp32 master and the model holds the
    /// experts in the param dtype.
    pub fn install<M: Module>(&mut self, model: M) -> M {
        let precision = self.config.precision;
        if !precision.is_mixed() {
            return model;
        }
        let flat = params::flat(&model, &self.infos).detach().cast(DType::F32);
        let own = self.own_range();
        let mine = (!own.is_empty()).then(|| flat.clone().narrow(0, own.start, own.len()));
        self.optim.set_master(mine);
        let half = flat.cast(precision.param_dtype());
        params::assign_flat(model, &self.infos, &half)
    }

    /// Adds per-parameter flat gradients to the micro-batch sum.
    pub fn accumulate(&mut self, per_param: Vec<Option<Tensor<1>>>) {
        crate::grads::sum_into(&mut self.accumulated, per_param);
    }

    /// Reduces the accumulated gradients plus `per_param` over the replicas, scaled to the
    /// mean over the whole dp group: the whole vector (stage 1) or the own range (stages
    /// 2–3); under HSDP then averaged across the [`outer`](Self::outer) replicas.
    pub fn reduce(&mut self, per_param: Vec<Option<Tensor<1>>>) -> Result<()> {
        self.accumulate(per_param);
        let dtype = self.config.precision.reduce_dtype();
        let sums = std::mem::replace(&mut self.accumulated, vec![None; self.infos.len()]);
        let scale = self.params.grad_scale;
        let flat = crate::grads::pack(sums, &self.infos, &self.device, dtype, scale);
        let replicas = &self.params.replicas;
        let reduced = match self.stage {
            ZeroStage::Zero2 | ZeroStage::Zero3 => {
                plane::reduce_scatter(flat, &self.part.counts(), ReduceOp::Avg, replicas)?
            }
            _ => Some(plane::all_reduce(flat, ReduceOp::Avg, replicas)?),
        };
        self.set_reduced(reduced)
    }

    /// Keeps a reduced gradient, averaged across HSDP's replicas first where there are some.
    pub(crate) fn set_reduced(&mut self, reduced: Option<Tensor<1>>) -> Result<()> {
        self.grads = Some(match (reduced, &self.outer) {
            (Some(g), Some(outer)) => Some(plane::all_reduce(g, ReduceOp::Avg, outer)?),
            (g, _) => g,
        });
        Ok(())
    }

    /// Steps the own range and brings the replicas' updated ranges back into `model`.
    pub fn step<M: Module>(&mut self, lr: f64, model: M) -> Result<M> {
        if self.stage == ZeroStage::Zero3 {
            self.step_shard(lr);
            return Ok(model);
        }
        let grads = self.grads.take().flatten();
        let own = self.own_range();
        let updated = match grads {
            Some(g) if !own.is_empty() => {
                let g = match self.stage {
                    ZeroStage::Zero2 => g,
                    _ => g.narrow(0, own.start, own.len()),
                };
                let values = params::flat(&model, &self.infos).narrow(0, own.start, own.len());
                Some(self.optim.step(lr, values, g))
            }
            _ => None,
        };
        let dtype = self.config.precision.param_dtype();
        let counts = self.part.counts();
        let replicas = &self.params.replicas;
        let flat = plane::all_gather(updated, &counts, dtype, replicas, &self.device)?;
        Ok(params::assign_flat(model, &self.infos, &flat))
    }

    /// Replaces the held gradient (if any) by `f` of it.
    pub fn map_gradients(&mut self, f: &mut dyn FnMut(Tensor<1>) -> Tensor<1>) {
        if let Some(g) = self.grads.as_mut().and_then(Option::take) {
            self.grads = Some(Some(f(g)));
        }
    }

    /// Σ `weights[p]`·|g_p|² over the held expert gradient (`weights` per expert parameter),
    /// each term divided by the ranks holding the same elements: the replicas at stage 1
    /// (every one holds the whole vector), and HSDP's replicas. `None` without a gradient.
    pub fn square_sum(&self, weights: &[f32]) -> Option<Tensor<1>> {
        let g = self.grads.as_ref()?.as_ref()?;
        let outer = self
            .outer
            .as_ref()
            .map_or(1, bonfire_comm::ProcessGroup::size);
        let (own, copies) = match self.stage {
            ZeroStage::Zero2 | ZeroStage::Zero3 => (Some(self.params.replicas.rank()), outer),
            _ => (None, self.params.replicas.size() * outer),
        };
        let w: Vec<f32> = weights.iter().map(|w| w / copies as f32).collect();
        crate::grads::held_square_sum(g, &self.part, own, &w)
    }

    /// The averaged gradient of every expert parameter (this rank's slice), named; empty
    /// before a reduction. A collective on the replicas at stage 2.
    pub fn gradients(&self) -> Result<Vec<ParamValues>> {
        let Some(g) = &self.grads else {
            return Ok(Vec::new());
        };
        let flat = match self.stage {
            ZeroStage::Zero2 | ZeroStage::Zero3 => {
                let dtype = self.config.precision.reduce_dtype();
                let counts = self.part.counts();
                let replicas = &self.params.replicas;
                plane::all_gather(g.clone(), &counts, dtype, replicas, &self.device)?
            }
            _ => g.clone().expect("stage 1 holds the whole vector"),
        };
        Ok(params::named(
            &self.infos,
            &plane::to_host(flat, Reason::Export),
        ))
    }

    /// Every expert parameter (this rank's slice), named, in fp32: the masters all-gathered
    /// over the replicas under mixed precision (a collective there), else the model's values.
    pub fn values<M: Module>(&self, model: &M) -> Result<Vec<ParamValues>> {
        let flat = if self.stage == ZeroStage::Zero3 {
            self.gathered_shard()?
        } else if self.config.precision.is_mixed() {
            let home = self.device.clone().inner();
            let master = self.optim.master().map(|m| {
                let m = plane::to_device(m.clone(), &home, Reason::Offload);
                bonfire_dtensor::autodiff::with_context_of(m, &self.device)
            });
            let counts = self.part.counts();
            let replicas = &self.params.replicas;
            plane::all_gather(master, &counts, DType::F32, replicas, &self.device)?
        } else {
            params::flat(model, &self.infos).cast(DType::F32)
        };
        Ok(params::named(
            &self.infos,
            &plane::to_host(flat, Reason::Export),
        ))
    }

    /// The own range's values in fp32 (the master under mixed precision), on the host.
    pub fn own_values<M: Module>(&self, model: &M) -> Vec<f32> {
        let own = self.own_range();
        if own.is_empty() {
            return Vec::new();
        }
        let t = match (self.optim.master(), &self.shard) {
            (_, Some(shard)) => shard.clone().detach(),
            (Some(m), None) => m.clone(),
            (None, None) => params::flat(model, &self.infos).narrow(0, own.start, own.len()),
        };
        plane::to_host(t.cast(DType::F32), Reason::Checkpoint)
    }

    /// Installs the experts' values (`values`: this rank's whole slice, fp32, in module order;
    /// at stage 3 its own range) and the optimizer state of each slice, into `model`. No
    /// communication.
    pub fn load<M: Module>(
        &mut self,
        model: M,
        values: Vec<f32>,
        states: Vec<Option<crate::FlatState>>,
    ) -> Result<M> {
        let n = values.len();
        let t = plane::from_host(values, [n], &self.device, Reason::Checkpoint);
        let model = match self.stage {
            // Stage 3: `values` are the own range.
            ZeroStage::Zero3 => {
                self.set_shard(Some(t));
                model
            }
            _ => self.install(params::assign_flat(model, &self.infos, &t)),
        };
        self.optim.import(states)?;
        self.grads = None;
        self.accumulated = vec![None; self.infos.len()];
        Ok(model)
    }

    /// Bytes of gradients this rank holds for the experts.
    pub fn grad_bytes(&self) -> usize {
        self.grads
            .as_ref()
            .and_then(Option::as_ref)
            .map_or(0, |g| g.shape().num_elements() * 4)
    }
}
