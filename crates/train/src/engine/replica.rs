//! The engine without a pipeline: every rank holds its replica's model (its tensor-parallel
//! shards under tp), wrapped on the dp axis by DDP or ZeRO, and runs the model's own loss on
//! its replica's rows (through its pipeline pieces, the chosen ones recomputed, under
//! activation checkpointing).

use super::checkpointing;
use super::export::ModelLayout;
use super::{Engine, RankMesh};
use crate::checkpoint::{self, Loaded, RankState, Wants};
use crate::dims::Axis;
use crate::error::TrainError;
use crate::model::{ParallelModel, Rows};
use crate::wrapper::{DpWrapper, WrapperReport};
use bonfire_comm::ReduceOp;
use bonfire_dtensor::DataParallel;
use bonfire_dtensor::params::ParamValues;
use bonfire_dtensor::plane::{self, ledger::Reason};

pub(crate) struct ReplicaEngine<M: ParallelModel> {
    at: RankMesh,
    wrapper: DpWrapper<M>,
    layout: ModelLayout,
    /// Every model parameter, in order (the wrapper holds them all).
    indices: Vec<usize>,
}

impl<M: ParallelModel> ReplicaEngine<M> {
    pub fn new(at: RankMesh, wrapper: DpWrapper<M>, layout: ModelLayout) -> Self {
        let indices = (0..layout.infos.len()).collect();
        Self {
            at,
            wrapper,
            layout,
            indices,
        }
    }
}

impl<M: ParallelModel> Engine<M::Batch> for ReplicaEngine<M> {
    fn place(&self) -> &RankMesh {
        &self.at
    }

    fn forward_backward(&mut self, batch: &M::Batch) -> Result<f32, TrainError> {
        let rows = self.at.replica_rows(batch.rows());
        let local = batch.narrow_rows(rows.start, rows.len());
        let ac = self.at.dims.activation_checkpointing;
        let loss = self.wrapper.forward(|m| checkpointing::loss(m, local, ac));
        let mut value = [plane::to_host(loss.clone().detach(), Reason::Report)[0]];
        let scale = self.at.loss_scale;
        self.wrapper
            .backward(if scale == 1.0 { loss } else { loss * scale })?;
        // Every tp rank of a replica holds the same loss: the mean over replicas is global.
        self.at
            .group(Axis::Dp)
            .all_reduce(&mut value, ReduceOp::Avg)?;
        Ok(value[0])
    }

    fn step(&mut self, lr: f64) -> Result<(), TrainError> {
        self.wrapper.step(lr)
    }

    fn set_loss_scale(&mut self, scale: f32) {
        self.at.loss_scale = scale;
    }

    fn unscale(&mut self, scale: f32) -> Result<bool, TrainError> {
        let finite = self.wrapper.unscale_gradients(1.0 / scale)?;
        self.at.all_finite(finite)
    }

    fn gradients(&mut self) -> Result<Vec<ParamValues>, TrainError> {
        let local = self.wrapper.gradients()?;
        if local.is_empty() {
            return Ok(local);
        }
        self.layout.whole_all(local, self.at.group(Axis::Tp))
    }

    fn wrapper_report(&self) -> WrapperReport {
        self.wrapper.report()
    }

    fn parameters(&mut self) -> Result<Vec<ParamValues>, TrainError> {
        let local = self.wrapper.parameters()?;
        self.layout.whole_all(local, self.at.group(Axis::Tp))
    }

    fn save_state(&mut self) -> Result<RankState, TrainError> {
        let holding = self.at.holding(&self.layout, &self.indices);
        checkpoint::rank_state(&self.wrapper, &holding)
    }

    fn state_wants(&self) -> Wants {
        checkpoint::wants(&self.wrapper, &self.at.holding(&self.layout, &self.indices))
    }

    fn load_state(&mut self, loaded: Loaded) -> Result<(), TrainError> {
        checkpoint::load_wrapper(&mut self.wrapper, loaded)
    }
}
