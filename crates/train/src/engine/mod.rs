//! [`Engine`]: one rank's trainable state under a layout, as the training loop drives it.
//!
//! Two engines implement it: [`replica`] (data parallelism, with tensor parallelism inside
//! each replica) and [`pipeline`] (stages on the pp axis, each stage's chunks wrapped on dp
//! and tensor-parallel on tp). Both hand back whole parameters and gradients, named as in the
//! model, whatever the layout ([`export`]).

pub(crate) mod export;
pub(crate) mod pipeline;
pub(crate) mod recompute;
pub(crate) mod replica;
pub(crate) mod state;
pub(crate) mod tie;

use crate::checkpoint::Stateful;
use crate::error::TrainError;
use crate::mesh::RankMesh;
use crate::wrapper::WrapperReport;
use bonfire_module::params::ParamValues;
use bonfire_parallel::Replica;
use burn::tensor::Device;

/// One rank's training state under a layout (built by [`crate::Trainer::build`]); what the
/// checkpoint asks of it (its layout and world, its parameters, its state to save and load)
/// is [`Stateful`]. Every method that says "collective" must be called on every rank, in the
/// same order.
pub trait Engine<B>: Stateful {
    /// This rank's place: the layout, its mesh, the device.
    fn place(&self) -> &RankMesh;
    /// The device this rank computes on: create batches here.
    fn device(&self) -> &Device {
        &self.place().device
    }
    /// This rank's data-parallel replica: which rows of a global batch it trains on.
    fn replica(&self) -> Replica {
        self.place().data_replica()
    }
    /// Forward and backward of this replica's rows of a global batch (see
    /// [`replica`](Self::replica); its micro-batches under a pipeline), with the gradients
    /// reduced over dp. Returns the global mean loss, the same on every rank. A collective.
    fn forward_backward(&mut self, batch: &B) -> Result<f32, TrainError>;
    /// The mean loss of this replica's rows of a global batch, averaged over the replicas —
    /// forward only: no gradient is kept or reduced, the parameters do not change. The same
    /// on every rank. A collective.
    fn evaluate(&mut self, batch: &B) -> Result<f32, TrainError>;
    /// Burn's optimizer step on what this rank owns. A collective where the dp wrapper
    /// gathers updated parameters.
    fn step(&mut self, lr: f64) -> Result<(), TrainError>;
    /// The loss scale the next [`forward_backward`](Self::forward_backward) multiplies its
    /// loss by before backward (dynamic loss scaling; 1 by default). The loss it returns is
    /// unscaled.
    fn set_loss_scale(&mut self, scale: f32);
    /// Gradient accumulation: the next [`forward_backward`](Self::forward_backward)s cut
    /// each replica's rows into `parts` equal consecutive parts, forward and backward one at
    /// a time (each part's loss weighted 1/`parts`), and reduce the gradients once, after the
    /// last (1: no accumulation).
    fn set_grad_accum(&mut self, parts: usize);
    /// Divides the reduced gradients by the loss scale and says whether they are finite on
    /// every rank (a collective: one flag all-reduced over the world).
    fn unscale(&mut self, scale: f32) -> Result<bool, TrainError>;
    /// The global L2 norm of the reduced gradients — every element of the whole model counted
    /// once, whatever tp, pp, ZeRO, ep or cp holds it — and, with `max_norm`, every gradient
    /// multiplied by min(1, max_norm / (norm + 1e-6)) (PyTorch's `clip_grad_norm_`). Each
    /// rank's part is summed on its device; one scalar is all-reduced over the world. A
    /// collective.
    fn clip_gradients(&mut self, max_norm: Option<f64>) -> Result<f64, TrainError>;
    /// The averaged gradient of every parameter from the last backward, whole (gathered over
    /// shards and stages), in the model's order. A collective.
    fn gradients(&mut self) -> Result<Vec<ParamValues>, TrainError>;
    /// What this rank's dp wrapper measured (timings, bytes held), for benches and reports.
    fn wrapper_report(&self) -> WrapperReport;
    /// After the optimizer step: auxiliary-loss-free balancing of every state tensor this
    /// rank's forwards recorded loads for (`bonfire_module::state`), the loads summed over
    /// the ranks that saw other rows of the step (dp, cp, HSDP's replicas) — each moves by
    /// `rate` · sign(mean load − load). A collective on those groups.
    fn update_buffers(&mut self, rate: f64) -> Result<(), TrainError>;
}

/// The [`Engine`] methods every engine implements alike on its fields `at` ([`RankMesh`]),
/// `wrapper` (the dp wrapper), `layout` and `indices` (the model parameters the wrapper
/// holds) and its `assemble` (whole parameters from this rank's local ones): the optimizer
/// step, loss scaling, whole gradients and the report. Expanded inside each engine's
/// `impl Engine`, so the logic is written once; [`state_methods`] is its [`Stateful`] half.
macro_rules! wrapper_methods {
    () => {
        fn step(&mut self, lr: f64) -> Result<(), $crate::TrainError> {
            self.wrapper.step(lr)
        }

        fn set_loss_scale(&mut self, scale: f32) {
            self.at.loss_scale = scale;
        }

        fn set_grad_accum(&mut self, parts: usize) {
            self.at.grad_accum = parts.max(1);
        }

        fn unscale(&mut self, scale: f32) -> Result<bool, $crate::TrainError> {
            let finite = self.wrapper.unscale_gradients(1.0 / scale)?;
            self.at.all_finite(finite)
        }

        fn clip_gradients(&mut self, max_norm: Option<f64>) -> Result<f64, $crate::TrainError> {
            let weights = $crate::engine::norm_weights(&self.at, &self.layout, &self.indices);
            let local = self.wrapper.gradient_square_sum(&weights)?;
            $crate::engine::clip_by_global_norm(&mut self.wrapper, &self.at, local, max_norm)
        }

        fn gradients(
            &mut self,
        ) -> Result<Vec<bonfire_module::params::ParamValues>, $crate::TrainError> {
            let local = self.wrapper.gradients()?;
            if local.is_empty() {
                return Ok(local);
            }
            self.assemble(local)
        }

        fn wrapper_report(&self) -> $crate::wrapper::WrapperReport {
            self.wrapper.report()
        }

        fn update_buffers(&mut self, rate: f64) -> Result<(), $crate::TrainError> {
            $crate::engine::balance_buffers(&mut self.wrapper, &self.at, rate)
        }
    };
}
pub(crate) use wrapper_methods;

/// What each of a dp wrapper's parameters (model parameters `indices`) weighs in the global
/// gradient norm on this rank: 1, or 1/tp for a parameter every tp rank holds whole (its tp
/// ranks hold the same gradient). The wrapper divides by its own copies (dp, cp, HSDP,
/// an expert's replicas); pipeline stages hold different parameters.
pub(crate) fn norm_weights(
    at: &RankMesh,
    layout: &export::ModelLayout,
    indices: &[usize],
) -> Vec<f32> {
    let tp = at.dims.tp();
    indices
        .iter()
        .map(|&i| match tp > 1 && layout.shard_dim(i).is_none() {
            true => 1.0 / tp as f32,
            false => 1.0,
        })
        .collect()
}

/// The global norm from each rank's weighted square sum `local` (one scalar all-reduced over
/// the world, in f64) and, with `max_norm`, the wrapper's gradients clipped to it.
pub(crate) fn clip_by_global_norm<M: burn::module::Module>(
    wrapper: &mut crate::wrapper::DpWrapper<M>,
    at: &RankMesh,
    local: Option<burn::tensor::Tensor<1>>,
    max_norm: Option<f64>,
) -> Result<f64, TrainError> {
    use bonfire_dtensor::plane::{self, ledger::Reason};
    use bonfire_module::DataParallel;
    let mut sum = [local.map_or(0.0, |t| plane::to_host(t, Reason::Report)[0] as f64)];
    at.mesh
        .world()
        .all_reduce(&mut sum, bonfire_comm::ReduceOp::Sum)?;
    let norm = sum[0].sqrt();
    if let Some(max) = max_norm {
        let coef = max / (norm + 1e-6);
        if coef < 1.0 {
            wrapper.scale_gradients(coef as f32)?;
        }
    }
    Ok(norm)
}

/// [`Engine::update_buffers`] on `wrapper`'s state tensors: this rank's recorded loads
/// (zero for a tensor without any), summed over the wrapper's group and HSDP's replicas in
/// f64, then each tensor moved by `rate` · sign(mean − load).
pub(crate) fn balance_buffers<M: burn::module::Module>(
    wrapper: &mut crate::wrapper::DpWrapper<M>,
    at: &RankMesh,
    rate: f64,
) -> Result<(), TrainError> {
    use bonfire_module::DataParallel;
    let recorded = bonfire_module::state::take();
    let held = wrapper.buffers();
    if held.is_empty() {
        return Ok(());
    }
    let mut loads: Vec<f64> = Vec::new();
    for (info, _) in &held {
        let mut l = recorded.get(&info.id).cloned().unwrap_or_default();
        l.resize(info.numel(), 0.0);
        loads.extend(l);
    }
    wrapper
        .process_group()
        .all_reduce(&mut loads, bonfire_comm::ReduceOp::Sum)?;
    if let Some(replicas) = at.replicate_group() {
        replicas.all_reduce(&mut loads, bonfire_comm::ReduceOp::Sum)?;
    }
    let mut start = 0;
    let values: Vec<Vec<f32>> = held
        .into_iter()
        .map(|(info, mut v)| {
            let n = info.numel();
            bonfire_module::state::balance_step(&mut v, &loads[start..start + n], rate);
            start += n;
            v
        })
        .collect();
    wrapper.set_buffers(&values);
    Ok(())
}

/// The [`Stateful`] methods every engine implements alike on the same fields as
/// [`wrapper_methods`]: its layout and world, whole parameters, and checkpoints.
macro_rules! state_methods {
    () => {
        fn world(&self) -> &bonfire_comm::ProcessGroup {
            self.at.mesh.world()
        }

        fn dims(&self) -> &bonfire_layout::ParallelDims {
            &self.at.dims
        }

        fn parameters(
            &mut self,
        ) -> Result<Vec<bonfire_module::params::ParamValues>, $crate::TrainError> {
            let local = self.wrapper.parameters()?;
            self.assemble(local)
        }

        fn buffers(
            &mut self,
        ) -> Result<Vec<bonfire_module::params::ParamValues>, $crate::TrainError> {
            let local = self.wrapper.buffers().into_iter().map(|(_, v)| v).collect();
            self.assemble_buffers(local)
        }

        fn save_state(&mut self) -> Result<$crate::checkpoint::RankState, $crate::TrainError> {
            use $crate::engine::state;
            let holding = state::Holding::at(&self.at, &self.layout, &self.indices);
            let saved = state::rank_state(&self.wrapper, &holding)?;
            let held = self.wrapper.buffers().into_iter().map(|(_, v)| v).collect();
            let buffers = (&self.layout, self.buffer_indices.as_slice(), held);
            Ok(state::with_buffers(saved, buffers, self.writes_buffers()))
        }

        fn state_wants(&self) -> $crate::checkpoint::Wants {
            use $crate::engine::state;
            let holding = state::Holding::at(&self.at, &self.layout, &self.indices);
            let wants = state::wants(&self.wrapper, &holding);
            state::wanting_buffers(wants, &self.layout, &self.buffer_indices)
        }

        fn load_state(
            &mut self,
            loaded: $crate::checkpoint::Loaded,
        ) -> Result<(), $crate::TrainError> {
            let n = self.buffer_indices.len();
            let (loaded, buffers) = $crate::engine::state::split_buffers(loaded, n);
            $crate::engine::state::load(&mut self.wrapper, loaded)?;
            if n > 0 {
                self.wrapper.set_buffers(&buffers);
            }
            Ok(())
        }
    };
}
pub(crate) use state_methods;
