//! Training with [`Zero`]: its [`DataParallel`] implementation.
//!
//! - Stages 0–1 all-reduce the full gradient and step the own range of the optimizer state.
//! - Stage 2 reduce-scatters gradient buckets, during backward for layers entered through
//!   [`bonfire_module::layer`] (the shared [`SinkHook`]), after it for the rest.
//! - Stage 3 gathers parameters for each forward (`gather.rs`); their gradients come back
//!   reduce-scattered onto the owned slices through the gathers' backward.
//!
//! Micro-batches (pipelines, accumulation) use the same paths without hooks: their gradients
//! are summed into a flat buffer (the own range at stage 3) and reduced once.

use crate::error::{Result, ZeroError};
use crate::gather::{GatherPlan, ZeroLayerHook, lazy_module};
use crate::grads;
use crate::reduce::GradBuckets;
use crate::zero::Zero;
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::plane::{self, ledger::Reason};
use bonfire_dtensor::timing;
use bonfire_layout::ZeroStage;
use bonfire_module::PrecisionDTypes;
use bonfire_module::graph::SinkHook;
use bonfire_module::params::{self, ParamInfo, ParamValues};
use bonfire_module::{DataParallel, install_layer_hook};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Gradients, Tensor};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl<M: Module> Zero<M> {
    /// Stage 3's forward: `f` sees a module whose parameters hold no value; each layer the
    /// model enters through [`bonfire_module::layer`] gets its parameters all-gathered into
    /// its copy (freed when the model drops it), the next layer's gather prefetched
    /// meanwhile; a parameter used outside any layer is gathered on first use and kept until
    /// `f` returns. The gather is recomputable: under Balanced checkpointing backward
    /// re-gathers parameters instead of keeping them, and their gradients come back
    /// reduce-scattered onto the owned slices.
    fn gathered_forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        let shard = self.shard.clone().expect("stage 3 keeps a shard");
        let plan = Arc::new(GatherPlan::new(
            self.pg.clone(),
            self.part.clone(),
            self.infos.clone(),
            shard,
            self.config.prefetch,
            std::mem::take(&mut self.last_gather.layers),
            self.config.precision,
        ));
        let module = lazy_module(self.model().clone(), plan.clone());
        let hook = install_layer_hook(Rc::new(ZeroLayerHook::new(plan.clone())));
        let prefetch = self.config.prefetch;
        let (module, experts) = match self.experts.as_mut() {
            Some(side) => {
                let (module, plan, hook) = side.gathering(module, prefetch);
                (module, Some((plan, hook)))
            }
            None => (module, None),
        };
        let out = catch_unwind(AssertUnwindSafe(|| f(&module)));
        drop(module);
        if let Some((expert_plan, expert_hook)) = experts {
            drop(expert_hook);
            self.experts
                .as_mut()
                .expect("experts")
                .gathered(&expert_plan);
        }
        drop(hook);
        let out = out.unwrap_or_else(|panic| resume_unwind(explain_strategy(panic, self)));
        self.slices.extend(plan.owned_slices());
        self.last_gather = plan.finish();
        if self.last_gather.layers.is_empty() {
            self.note_no_layers("gathers every parameter for the whole forward");
        }
        out
    }

    /// Says once that the model showed no layers, and what that costs.
    fn note_no_layers(&self, consequence: &str) {
        if self.config.report_no_layers
            && self.pg.rank() == 0
            && !self.told_no_layers.swap(true, Ordering::Relaxed)
        {
            tracing::info!(
                "bonfire-zero: stage {} {consequence}: the model entered no layer through \
                 `bonfire_module::layer` with a float input (see docs/zero.md, \"Layers\")",
                self.config.stage.index()
            );
        }
    }

    /// Averages per-parameter flat gradients (stages 0–2; `None` for a parameter without
    /// one) over the group and keeps what this stage holds: the full vector (0–1, one
    /// all-reduce of the packed vector) or the own range (2, through the buckets of the
    /// forward in flight, if any).
    fn reduce_parts(&mut self, per_param: Vec<Option<Tensor<1>>>) -> Result<()> {
        match self.config.stage {
            ZeroStage::Zero0 | ZeroStage::Zero1 => {
                let dtype = self.config.precision.reduce_dtype();
                let mut flat = grads::pack(per_param, &self.infos, &self.device, dtype, 1.0);
                if self.pg.size() > 1 {
                    flat = plane::all_reduce(flat, ReduceOp::Avg, &self.pg)?;
                }
                self.grads = Some(Some(flat));
            }
            ZeroStage::Zero2 => {
                let pending = self.buckets.lock().unwrap().take();
                let buckets = pending.unwrap_or_else(|| self.new_buckets());
                let reduced = buckets.finish(per_param)?;
                self.timing.buckets = reduced.spans;
                self.timing.launches = reduced.launches;
                self.timing.collective = "reduce_scatter";
                self.grads = Some(reduced.own);
            }
            ZeroStage::Zero3 => unreachable!("stage 3 keeps a shard"),
        }
        self.reduce_replicas()
    }

    /// Expert parallelism: the experts' flat gradients out of `gp` (`None` without experts).
    fn take_expert_grads(&self, gp: &mut GradientsParams) -> Option<Vec<Option<Tensor<1>>>> {
        let side = self.experts.as_ref()?;
        Some(params::take_flat_grads(self.model(), &side.infos, gp))
    }

    /// Expert parallelism: reduces the experts' gradients over their replicas (nothing
    /// without experts).
    fn reduce_experts(&mut self, per_param: Option<Vec<Option<Tensor<1>>>>) -> Result<()> {
        match (self.experts.as_mut(), per_param) {
            (Some(side), Some(g)) => side.reduce(g),
            _ => Ok(()),
        }
    }

    /// `dense` and `experts` (named values of each part) in module order.
    fn in_module_order(
        &self,
        dense: Vec<ParamValues>,
        experts: Vec<ParamValues>,
    ) -> Vec<ParamValues> {
        let mut by_path: std::collections::HashMap<String, ParamValues> = dense
            .into_iter()
            .chain(experts)
            .map(|p| (p.path.clone(), p))
            .collect();
        self.all_infos
            .iter()
            .filter_map(|info| by_path.remove(&info.path))
            .collect()
    }

    /// HSDP: averages this rank's reduced gradient (the full vector at stages 0–1, the own
    /// range at 2–3) across the replicas of its shards ([`Zero::with_replicas`]), so that it
    /// is the mean over the shard group × the replicas.
    fn reduce_replicas(&mut self) -> Result<()> {
        let Some(replicas) = self.replicas.clone() else {
            return Ok(());
        };
        if let Some(Some(g)) = self.grads.take() {
            self.grads = Some(Some(plane::all_reduce(g, ReduceOp::Avg, &replicas)?));
        } else {
            self.grads = Some(None);
        }
        Ok(())
    }

    /// The forward of [`DataParallel::forward`]: stage 2 with its gradient hooks, stage 3
    /// gathering.
    fn forward_hooked<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        match self.config.stage {
            ZeroStage::Zero3 => self.gathered_forward(f),
            ZeroStage::Zero2 => {
                if self.buckets.lock().unwrap().is_none() {
                    let buckets = self.new_buckets();
                    *self.buckets.lock().unwrap() = Some(buckets);
                }
                let index = Arc::new(params::index_of(&self.infos));
                let hook = SinkHook::new(self.buckets.clone(), index, self.layers.clone());
                let guard = install_layer_hook(Rc::new(hook));
                let out = f(self.model());
                drop(guard);
                if self.layers.load(Ordering::Relaxed) == 0 {
                    self.note_no_layers("reduce-scatters every bucket after backward");
                }
                out
            }
            ZeroStage::Zero0 | ZeroStage::Zero1 => f(self.model()),
        }
    }

    fn new_buckets(&self) -> GradBuckets {
        GradBuckets::new(
            self.pg.clone(),
            self.part.clone(),
            self.infos.clone(),
            self.config.bucket_bytes,
            self.config.precision.reduce_dtype(),
        )
    }

    /// The averaged gradient of every parameter from the last backward, in module order, on
    /// the device (all-gathered from the owners at stages 2–3).
    fn full_gradient(&self) -> Result<Option<Tensor<1>>> {
        let Some(g) = &self.grads else {
            return Ok(None);
        };
        if self.config.stage <= ZeroStage::Zero1 {
            return Ok(g.clone());
        }
        let counts = self.part.counts();
        // Stage 3's gradients land on its fp32 shard; stage 2's are in the reduce dtype.
        let dtype = match self.config.stage {
            ZeroStage::Zero3 => DType::F32,
            _ => self.config.precision.reduce_dtype(),
        };
        let flat = plane::all_gather(g.clone(), &counts, dtype, &self.pg, &self.device)?;
        Ok(Some(flat))
    }
}

/// A clearer panic for Burn's strategy mismatch inside a stage-3 forward: the inputs were
/// created on a device whose gradient-checkpointing strategy differs from the wrapper's.
fn explain_strategy<M: Module>(
    panic: Box<dyn std::any::Any + Send>,
    zero: &Zero<M>,
) -> Box<dyn std::any::Any + Send> {
    let text = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied());
    match text {
        Some(t) if t.contains("checkpointing strategy mismatch") => Box::new(format!(
            "bonfire-zero: stage 3 computes on a device with {:?} gradient checkpointing (its \
             parameters are there), but this forward's inputs use another strategy: create them \
             on `Zero::device()`; Burn said: {t}",
            zero.device.gradient_checkpointing_strategy()
        )),
        _ => panic,
    }
}

impl<M: Module> DataParallel<M> for Zero<M> {
    type Error = ZeroError;

    fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// At stage 2, each layer the model enters through [`bonfire_module::layer`] gets
    /// gradient hooks so that its gradient buckets are reduce-scattered while backward runs.
    /// At stage 3 parameters are gathered (see `gathered_forward` in the source).
    fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        let start = timing::now();
        let out = self.forward_hooked(f);
        self.timing.forward = timing::span_since(start);
        out
    }

    /// Leaves this stage's averaged gradients for `step`: all-reduced in full (stages 0–1),
    /// reduce-scattered in buckets into the own range (stage 2, waiting here for the buckets
    /// launched during backward), or reduce-scattered onto the shard by the gathers' backward
    /// (stage 3).
    fn backward(&mut self, loss: Tensor<1>) -> Result<()> {
        let start = timing::now();
        let mut grads = loss.backward();
        self.timing.backward = timing::span_since(start);
        let wait_start = timing::now();
        let out = if self.config.stage == ZeroStage::Zero3 {
            self.accumulate(&mut grads).and_then(|_| self.reduce())
        } else {
            let mut gp = GradientsParams::from_grads(grads, self.model());
            let per_param = params::take_flat_grads(self.model(), &self.infos, &mut gp);
            let experts = self.take_expert_grads(&mut gp);
            drop(gp);
            self.reduce_parts(per_param)
                .and_then(|_| self.reduce_experts(experts))
        };
        self.timing.wait = timing::span_since(wait_start);
        out
    }

    fn forward_micro<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        match self.config.stage {
            ZeroStage::Zero3 => self.gathered_forward(f),
            _ => f(self.model()),
        }
    }

    /// At stage 3 the parameters are gathered as for a forward, and the owned slices that
    /// forward recorded for its backward are dropped again.
    fn evaluate<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        let kept = self.slices.len();
        let kept_experts = self.experts.as_ref().map_or(0, |x| x.pending_slices());
        let out = self.forward_micro(f);
        self.slices.truncate(kept);
        if let Some(side) = self.experts.as_mut() {
            side.forget_slices(kept_experts);
        }
        out
    }

    fn accumulate(&mut self, grads: &mut Gradients) -> Result<()> {
        if self.config.stage != ZeroStage::Zero3 {
            let mut gp = GradientsParams::from_module(grads, self.model());
            let per_param = params::take_flat_grads(self.model(), &self.infos, &mut gp);
            let experts = self.take_expert_grads(&mut gp);
            grads::sum_into(&mut self.accumulated, per_param);
            if let (Some(side), Some(g)) = (self.experts.as_mut(), experts) {
                side.accumulate(g);
            }
            return Ok(());
        }
        if let Some(side) = self.experts.as_mut() {
            side.accumulate_slices(grads);
        }
        grads::accumulate_slices(&mut self.slices, &mut self.accumulated_own, grads);
        Ok(())
    }

    fn reduce(&mut self) -> Result<()> {
        if self.config.stage == ZeroStage::Zero3 {
            // The gathers' backward already summed every rank's gradient onto the owners.
            let (own, scale) = (self.own_range(), 1.0 / self.pg.size() as f32);
            let slices = &self.optim.slices;
            debug_assert_eq!(slices.iter().map(|p| p.len()).sum::<usize>(), own.len());
            let sums = &mut std::mem::take(&mut self.accumulated_own);
            let g = grads::own_range(slices, own.start, sums, &self.device, scale);
            self.grads = Some(g);
            self.slices.clear();
            if let Some(side) = self.experts.as_mut() {
                side.reduce_own()?;
            }
            return self.reduce_replicas();
        }
        let per_param = std::mem::replace(&mut self.accumulated, vec![None; self.infos.len()]);
        let experts = self.experts.as_ref().map(|x| vec![None; x.infos.len()]);
        self.reduce_parts(per_param)?;
        self.reduce_experts(experts)
    }

    /// Steps the optimizer on this rank's range and brings every rank's updated range back
    /// where parameters are replicated (all-gather at stages 1–2), all on the device.
    fn step(&mut self, lr: f64) -> Result<()> {
        let grads = self
            .grads
            .take()
            .ok_or_else(|| ZeroError::Usage("step needs gradients: call backward first".into()))?;
        let own = self.own_range();
        let updated = match (self.own_tensor(), grads) {
            (Some(values), Some(g)) => {
                let g = if self.config.stage <= ZeroStage::Zero1 {
                    g.narrow(0, own.start, own.len())
                } else {
                    g
                };
                Some(self.optim.step(lr, values, g))
            }
            _ => None,
        };
        match self.config.stage {
            ZeroStage::Zero3 => self.set_shard(updated),
            ZeroStage::Zero0 => {
                let model = self.model.take().expect("model");
                let flat = updated.expect("stage 0 owns everything");
                self.model = Some(params::assign_flat(model, &self.infos, &flat));
            }
            _ => {
                let counts = self.part.counts();
                let dtype = self.config.precision.param_dtype();
                let flat = plane::all_gather(updated, &counts, dtype, &self.pg, &self.device)?;
                let model = self.model.take().expect("model");
                self.model = Some(params::assign_flat(model, &self.infos, &flat));
            }
        }
        if let Some(side) = self.experts.as_mut() {
            let model = self.model.take().expect("model");
            self.model = Some(side.step(lr, model)?);
        }
        self.steps += 1;
        if self.config.record_timings {
            let mut t = std::mem::take(&mut self.timing);
            t.rank = self.pg.rank();
            t.step = self.steps - 1;
            self.timings.push(t);
        }
        Ok(())
    }

    fn map_gradients(&mut self, f: &mut dyn FnMut(Tensor<1>) -> Tensor<1>) -> Result<()> {
        if let Some(x) = self.experts.as_mut() {
            x.map_gradients(f);
        }
        if let Some(g) = self.grads.as_mut().and_then(Option::take) {
            self.grads = Some(Some(f(g)));
        }
        Ok(())
    }

    /// Stages 0–1 hold the whole averaged vector on every rank of the group, 2–3 each rank its
    /// own range; under HSDP every replica the same; an expert's terms are the experts' own
    /// ([`ExpertShards::square_sum`](crate::experts::ExpertShards::square_sum)).
    fn gradient_square_sum(&self, weights: &[f32]) -> Result<Option<Tensor<1>>> {
        let at = |infos: &[ParamInfo], copies: usize| -> Vec<f32> {
            infos
                .iter()
                .map(|p| {
                    let k = self.all_infos.iter().position(|a| a.id == p.id);
                    weights[k.expect("a partition holds the wrapper's parameters")] / copies as f32
                })
                .collect()
        };
        let outer = self.replicas.as_ref().map_or(1, ProcessGroup::size);
        let dense = match &self.grads {
            Some(Some(g)) if self.config.stage <= ZeroStage::Zero1 => {
                let w = at(&self.infos, self.pg.size() * outer);
                grads::held_square_sum(g, &self.part, None, &w)
            }
            Some(Some(g)) => {
                let me = self.pg.rank();
                grads::held_square_sum(g, &self.part, Some(me), &at(&self.infos, outer))
            }
            _ => None,
        };
        let experts = self
            .experts
            .as_ref()
            .and_then(|x| x.square_sum(&at(&x.infos, 1)));
        Ok(match (dense, experts) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        })
    }

    /// The averaged gradient of every parameter from the last backward, whole (all-gathered
    /// from the owners at stages 2–3: a collective there). Empty before the first backward or
    /// after the step.
    fn gradients(&self) -> Result<Vec<ParamValues>> {
        let dense = match self.full_gradient()? {
            Some(flat) => params::named(&self.infos, &plane::to_host(flat, Reason::Export)),
            None => Vec::new(),
        };
        match &self.experts {
            Some(x) if !dense.is_empty() => Ok(self.in_module_order(dense, x.gradients()?)),
            _ => Ok(dense),
        }
    }

    /// Every parameter, whole (all-gathered from the owners at stage 3: a collective there;
    /// under expert parallelism the experts are this rank's slice).
    fn parameters(&self) -> Result<Vec<ParamValues>> {
        let dense = params::named(&self.infos, &self.full_values()?);
        match &self.experts {
            Some(x) => Ok(self.in_module_order(dense, x.values(self.model())?)),
            None => Ok(dense),
        }
    }

    fn into_model(self) -> Result<M> {
        self.full_model()
    }

    /// The state tensors are no part of the shards: the replica (or stage 3's skeleton)
    /// holds them whole.
    fn buffers(&self) -> Vec<(params::ParamInfo, Vec<f32>)> {
        params::buffer_values(self.model())
    }

    fn set_buffers(&mut self, values: &[Vec<f32>]) {
        let model = self
            .model
            .take()
            .expect("the model is present between calls");
        self.model = Some(params::assign_buffers(model, values));
    }
}
