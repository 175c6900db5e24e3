//! ZeRO-3 of expert parallelism's experts ([`ExpertShards`] at stage 3): the own range of the
//! experts' vector is an autodiff leaf, each forward gathers the experts per layer over their
//! replicas through a [`GatherPlan`] of their own (its layer hook beside the wrapper's: each
//! answers for its own parameters), and the gathers' backward reduce-scatters their gradients
//! onto the owned slices, summed over the replicas — scaled here to the mean over the whole
//! dp group. A rank whose experts get no token still runs that reduce-scatter: the model
//! touches its experts anyway (`bonfire_ep::run_experts`).

use crate::error::Result;
use crate::experts::ExpertShards;
use crate::gather::{GatherPlan, ZeroLayerHook, lazy_module};
use bonfire_dtensor::plane;
use bonfire_module::LayerHookGuard;
use bonfire_module::install_layer_hook;
use bonfire_module::params;
use burn::module::Module;
use burn::tensor::{DType, Gradients, Tensor};
use std::rc::Rc;
use std::sync::Arc;

impl ExpertShards {
    /// Stage 3: the experts' whole flat vector (every rank the same slice of the experts)
    /// becomes the own range's leaf.
    pub(crate) fn install_shard(&mut self, flat: Tensor<1>) {
        let own = self.own_range();
        let flat = flat.detach().cast(DType::F32);
        self.set_shard((!own.is_empty()).then(|| flat.narrow(0, own.start, own.len())));
    }

    /// The own range becomes `own` (an autodiff leaf on an autodiff device).
    pub(crate) fn set_shard(&mut self, own: Option<Tensor<1>>) {
        self.shard = own.map(|t| {
            let t = t.detach();
            if t.is_autodiff() { t.require_grad() } else { t }
        });
        self.grads = None;
    }

    /// A forward's gathers of the experts: `module` (the skeleton, the wrapper's lazy
    /// parameters already in) with the experts lazy too, and the hook that gathers them per
    /// layer (dropped after the forward: its guard).
    pub(crate) fn gathering<M: Module>(
        &mut self,
        module: M,
        prefetch: bool,
    ) -> (M, Arc<GatherPlan>, LayerHookGuard) {
        let shard = self
            .shard
            .clone()
            .unwrap_or_else(|| Tensor::zeros([1], &self.device));
        let plan = Arc::new(GatherPlan::new(
            self.params.replicas.clone(),
            self.part.clone(),
            self.infos.clone(),
            shard,
            prefetch,
            std::mem::take(&mut self.last_layers),
            self.config.precision,
        ));
        let module = lazy_module(module, plan.clone());
        let hook = install_layer_hook(Rc::new(ZeroLayerHook::new(plan.clone())));
        (module, plan, hook)
    }

    /// After a forward: the slices its backward will give gradients to, and its layers.
    pub(crate) fn gathered(&mut self, plan: &GatherPlan) {
        self.slices.extend(plan.owned_slices());
        self.last_layers = plan.finish().layers;
    }

    /// Drops the slices recorded after `kept` (a forward without backward).
    pub(crate) fn forget_slices(&mut self, kept: usize) {
        self.slices.truncate(kept);
    }

    /// How many slices are waiting for a backward.
    pub(crate) fn pending_slices(&self) -> usize {
        self.slices.len()
    }

    /// Adds each recorded slice's gradient from `grads` to the own sums.
    pub(crate) fn accumulate_slices(&mut self, grads: &mut Gradients) {
        crate::grads::accumulate_slices(&mut self.slices, &mut self.accumulated_own, grads);
    }

    /// The own gradient from the summed slices (the gathers' backward already summed the
    /// replicas'), scaled to the mean over the whole dp group, averaged across HSDP's
    /// replicas.
    pub(crate) fn reduce_own(&mut self) -> Result<()> {
        let own = self.own_range();
        let scale = self.params.grad_scale / self.params.replicas.size() as f32;
        let sums = &mut std::mem::take(&mut self.accumulated_own);
        let g = crate::grads::own_range(self.optim.slices(), own.start, sums, &self.device, scale);
        self.slices.clear();
        self.set_reduced(g)
    }

    /// Steps the own range in place.
    pub(crate) fn step_shard(&mut self, lr: f64) {
        let grads = self.grads.take().flatten();
        if let (Some(values), Some(g)) = (self.shard.clone(), grads) {
            let updated = self.optim.step(lr, values.detach(), g);
            self.set_shard(Some(updated));
        }
    }

    /// Every rank's own range, concatenated (fp32): the experts' slice whole. A collective
    /// on the replicas.
    pub(crate) fn gathered_shard(&self) -> Result<Tensor<1>> {
        let counts = self.part.counts();
        let mine = self.shard.clone().map(Tensor::detach);
        let replicas = &self.params.replicas;
        Ok(plane::all_gather(
            mine,
            &counts,
            DType::F32,
            replicas,
            &self.device,
        )?)
    }

    /// The experts' whole vector as the model would hold it (stage 3: gathered), for
    /// `Zero::full_model`.
    pub(crate) fn assign_whole<M: Module>(&self, model: M) -> Result<M> {
        let flat = self.gathered_shard()?;
        Ok(params::assign_flat(model, &self.infos, &flat))
    }
}
