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
use crate::wrapper::WrapperReport;
use bonfire_comm::ProcessGroup;
use bonfire_cp::{ContextScope, ContextSplit};
use bonfire_layout::ParallelDims;
use bonfire_module::params::ParamValues;
use bonfire_parallel::Replica;
use burn::tensor::Device;
use state::Holding;

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
            let holding = self.at.holding(&self.layout, &self.indices);
            $crate::engine::state::rank_state(&self.wrapper, &holding)
        }

        fn state_wants(&self) -> $crate::checkpoint::Wants {
            let holding = self.at.holding(&self.layout, &self.indices);
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

/// How a model's batches are cut for context parallelism (its
/// `ParallelModel::{sequence_length, context_batch}`).
pub(crate) struct ContextCut<B> {
    pub seq: fn(&B) -> Option<usize>,
    pub cut: fn(&B, &ContextSplit, usize) -> B,
}

impl<B> Clone for ContextCut<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for ContextCut<B> {}

/// A rank's place in a layout: the layout, its mesh `[pp, dp_replicate, dp, cp, tp]`, and the device it
/// computes on.
pub struct RankMesh {
    pub(crate) dims: ParallelDims,
    pub(crate) mesh: bonfire_dtensor::DeviceMesh,
    pub(crate) device: Device,
    /// The loss scale of the next forward/backward (dynamic loss scaling).
    pub(crate) loss_scale: f32,
    /// Under expert parallelism: the ep group (consecutive ranks of dp × cp splitting the
    /// experts) and the ranks holding the same experts.
    pub(crate) experts: Option<ExpertGroups>,
}

/// Expert parallelism's two groups, carved from the flattened dp × cp group as
/// `[dp·cp/ep, ep]`, ep innermost.
#[derive(Debug, Clone)]
pub(crate) struct ExpertGroups {
    /// The ranks that split the experts and exchange tokens.
    pub ep: ProcessGroup,
    /// The ranks that hold the same experts (their gradients are reduced together).
    pub replicas: ProcessGroup,
}

impl RankMesh {
    /// The mesh `[pp, dp_replicate, dp, cp, tp]`.
    pub fn mesh(&self) -> &bonfire_dtensor::DeviceMesh {
        &self.mesh
    }
    /// The group of this rank's slice along `axis`.
    pub fn group(&self, axis: crate::Axis) -> &ProcessGroup {
        self.mesh
            .group(axis.name())
            .expect("every axis is on the mesh")
    }
    /// This rank's coordinate on `axis`.
    pub fn coord(&self, axis: crate::Axis) -> usize {
        self.mesh
            .coord(axis.name())
            .expect("every axis is on the mesh")
    }
    /// This rank's data-parallel replica: which rows of a global batch it trains on
    /// (dp_replicate × dp replicas, dp_replicate outermost; cp ranks share their replica's
    /// rows).
    pub fn data_replica(&self) -> Replica {
        Replica {
            index: self.coord(crate::Axis::DpReplicate) * self.dims.dp()
                + self.coord(crate::Axis::Dp),
            count: self.dims.data_replicas(),
        }
    }

    /// The mesh the dp wrapper averages gradients over, one axis named `dp`: dp alone, or
    /// the data-parallel axes flattened (context-parallel ranks hold the same parameters and
    /// see different tokens, so they reduce gradients together): dp × cp under ZeRO — HSDP's
    /// shard group, its replicas reduced apart ([`replicate_group`](Self::replicate_group)) —
    /// and dp_replicate × dp × cp under DDP.
    pub(crate) fn replica_mesh(&self) -> Result<bonfire_dtensor::DeviceMesh, TrainError> {
        use crate::Axis;
        let axes: &[Axis] = if self.dims.is_hsdp() {
            &[Axis::Dp, Axis::Cp]
        } else {
            &[Axis::DpReplicate, Axis::Dp, Axis::Cp]
        };
        let names: Vec<&str> = axes
            .iter()
            .filter(|&&a| self.dims.degree(a) > 1)
            .map(|a| a.name())
            .collect();
        if names.is_empty() || names == [Axis::Dp.name()] {
            return Ok(self.mesh.clone());
        }
        let flat = self.mesh.submesh(&names)?;
        Ok(bonfire_dtensor::DeviceMesh::one_d(
            flat.world(),
            Axis::Dp.name(),
        )?)
    }

    /// Expert parallelism's groups of `dims` (`None` at ep = 1). A collective on the world.
    pub(crate) fn expert_groups(&self) -> Result<Option<ExpertGroups>, TrainError> {
        let ep = self.dims.ep();
        if ep == 1 {
            return Ok(None);
        }
        let flat = self.replica_mesh()?;
        let flat = flat.group(crate::Axis::Dp.name())?;
        let (me, n) = (flat.rank(), flat.size());
        // Fresh groups even where one has the dp wrapper's members (ep = dp·cp): the
        // exchanges in backward must not share a sequence with the wrapper's bucket
        // all-reduces, which start whenever a bucket is ready.
        let first = me / ep * ep;
        let ep_ranks: Vec<usize> = (first..first + ep).collect();
        let replica_ranks: Vec<usize> = (me % ep..n).step_by(ep).collect();
        Ok(Some(ExpertGroups {
            ep: flat.new_group(&ep_ranks)?,
            replicas: flat.new_group(&replica_ranks)?,
        }))
    }

    /// The expert-parallel scope a forward and backward run in (`None` at ep = 1).
    pub(crate) fn expert_scope(&self) -> Option<bonfire_ep::ExpertGuard> {
        let groups = self.experts.as_ref()?;
        Some(
            bonfire_ep::ExpertScope {
                group: groups.ep.clone(),
            }
            .enter(),
        )
    }

    /// HSDP's replica group: the ranks holding this rank's ZeRO shards (its dp_replicate
    /// slice); `None` without HSDP.
    pub(crate) fn replicate_group(&self) -> Option<&ProcessGroup> {
        self.dims
            .is_hsdp()
            .then(|| self.group(crate::Axis::DpReplicate))
    }

    /// Averages `value` (a loss already averaged over the dp wrapper's group) over HSDP's
    /// replicas too, so that it is the mean over the whole global batch. A collective on the
    /// replica group (nothing without HSDP).
    pub(crate) fn average_replicas(&self, value: &mut [f32]) -> Result<(), TrainError> {
        if let Some(g) = self.replicate_group() {
            g.all_reduce(value, bonfire_comm::ReduceOp::Avg)?;
        }
        Ok(())
    }

    /// With a cp axis: this rank's chunks of every sequence of `batch` and the context scope
    /// its forward and backward must run in (ring attention, the chunks' positions); without
    /// one, the batch itself.
    pub(crate) fn context<B: Clone>(
        &self,
        batch: &B,
        cut: ContextCut<B>,
    ) -> (B, Option<bonfire_cp::ScopeGuard>) {
        let cp = self.dims.cp();
        if cp == 1 {
            return (batch.clone(), None);
        }
        let seq = (cut.seq)(batch).expect("checked: the batch has sequences");
        let split = ContextSplit::new(seq, cp, true).expect("checked: the sequence cuts");
        let local = (cut.cut)(batch, &split, self.coord(crate::Axis::Cp));
        let group = self.group(crate::Axis::Cp).clone();
        (local, Some(ContextScope { group, split }.enter()))
    }

    /// Whether `local_finite` holds on every rank of the world (a collective).
    pub(crate) fn all_finite(&self, local_finite: bool) -> Result<bool, TrainError> {
        let mut bad = [u8::from(!local_finite)];
        self.mesh
            .world()
            .all_reduce(&mut bad, bonfire_comm::ReduceOp::Max)?;
        Ok(bad[0] == 0)
    }

    /// Where a dp wrapper holding model parameters `indices` sits, for checkpoints.
    pub(crate) fn holding<'a>(
        &self,
        layout: &'a export::ModelLayout,
        indices: &'a [usize],
    ) -> Holding<'a> {
        Holding {
            layout,
            indices,
            tp_rank: self.coord(crate::Axis::Tp),
            tp_size: self.dims.tp(),
            // The rank in the dp wrapper's group (dp × cp, row-major; dp_replicate outside
            // them under DDP).
            dp_rank: self.wrapper_rank(),
            ep: self.dims.ep(),
            replica: match self.dims.is_hsdp() {
                true => self.coord(crate::Axis::DpReplicate),
                false => 0,
            },
        }
    }

    /// This rank's place in the dp wrapper's group (see [`replica_mesh`](Self::replica_mesh)).
    fn wrapper_rank(&self) -> usize {
        use crate::Axis;
        let shard = self.coord(Axis::Dp) * self.dims.cp() + self.coord(Axis::Cp);
        match self.dims.is_hsdp() {
            true => shard,
            false => self.coord(Axis::DpReplicate) * self.dims.dp() * self.dims.cp() + shard,
        }
    }
}
