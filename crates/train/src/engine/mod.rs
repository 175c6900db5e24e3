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
    /// Divides the reduced gradients by the loss scale and says whether they are finite on
    /// every rank (a collective: one flag all-reduced over the world).
    fn unscale(&mut self, scale: f32) -> Result<bool, TrainError>;
    /// The averaged gradient of every parameter from the last backward, whole (gathered over
    /// shards and stages), in the model's order. A collective.
    fn gradients(&mut self) -> Result<Vec<ParamValues>, TrainError>;
    /// What this rank's dp wrapper measured (timings, bytes held), for benches and reports.
    fn wrapper_report(&self) -> WrapperReport;
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

        fn unscale(&mut self, scale: f32) -> Result<bool, $crate::TrainError> {
            let finite = self.wrapper.unscale_gradients(1.0 / scale)?;
            self.at.all_finite(finite)
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
    };
}
pub(crate) use wrapper_methods;

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

        fn save_state(&mut self) -> Result<$crate::checkpoint::RankState, $crate::TrainError> {
            let holding = $crate::engine::state::Holding::at(&self.at, &self.layout, &self.indices);
            $crate::engine::state::rank_state(&self.wrapper, &holding)
        }

        fn state_wants(&self) -> $crate::checkpoint::Wants {
            let holding = $crate::engine::state::Holding::at(&self.at, &self.layout, &self.indices);
            $crate::engine::state::wants(&self.wrapper, &holding)
        }

        fn load_state(
            &mut self,
            loaded: $crate::checkpoint::Loaded,
        ) -> Result<(), $crate::TrainError> {
            $crate::engine::state::load(&mut self.wrapper, loaded)
        }
    };
}
pub(crate) use state_methods;
