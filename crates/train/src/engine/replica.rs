//! The engine without a pipeline: every rank holds its replica's model (its tensor-parallel
//! shards under tp), wrapped on the dp axis by DDP or ZeRO, and runs the model's own loss on
//! its replica's rows (through its pipeline pieces, the chosen ones recomputed, under
//! activation checkpointing).

use super::export::ModelLayout;
use super::recompute;
use super::{Engine, state_methods, wrapper_methods};
use crate::checkpoint::Stateful;
use crate::error::TrainError;
use crate::mesh::{ContextCut, RankMesh};
use crate::wrapper::DpWrapper;
use bonfire_comm::ReduceOp;
use bonfire_dtensor::plane::{self, ledger::Reason};
use bonfire_layout::Axis;
use bonfire_module::DataParallel;
use bonfire_module::params::ParamValues;
use bonfire_parallel::{ParallelModel, Rows};

pub(crate) struct ReplicaEngine<M: ParallelModel> {
    at: RankMesh,
    wrapper: DpWrapper<M>,
    layout: ModelLayout,
    /// Every model parameter, in order (the wrapper holds them all).
    indices: Vec<usize>,
    /// Every state tensor, in order (the wrapper holds them all).
    buffer_indices: Vec<usize>,
}

impl<M: ParallelModel> ReplicaEngine<M> {
    pub fn new(at: RankMesh, wrapper: DpWrapper<M>, layout: ModelLayout) -> Self {
        let indices = (0..layout.infos.len()).collect();
        let buffer_indices = (0..layout.buffers.len()).collect();
        Self {
            at,
            wrapper,
            layout,
            indices,
            buffer_indices,
        }
    }

    /// Whether this rank writes the state tensors to a checkpoint (the world's first: every
    /// rank holds them all).
    fn writes_buffers(&self) -> bool {
        self.at.mesh.world().rank() == 0
    }

    /// Every state tensor whole: this rank holds them all.
    fn assemble_buffers(&self, local: Vec<Vec<f32>>) -> Result<Vec<ParamValues>, TrainError> {
        self.layout.whole_buffers(local, &self.buffer_indices, None)
    }

    /// Every parameter whole from this rank's `local` ones (a collective on tp, and on ep
    /// for the experts).
    fn assemble(&self, local: Vec<ParamValues>) -> Result<Vec<ParamValues>, TrainError> {
        let ep = self.at.experts.as_ref().map(|g| &g.ep);
        self.layout.whole_all(local, self.at.group(Axis::Tp), ep)
    }
}

impl<M: ParallelModel> Engine<M::Batch> for ReplicaEngine<M> {
    fn place(&self) -> &RankMesh {
        &self.at
    }

    fn forward_backward(&mut self, batch: &M::Batch) -> Result<f32, TrainError> {
        let (local, _context) = self.at.context(batch, context_cut::<M>());
        let _experts = self.at.expert_scope();
        let ac = self.at.dims.recompute;
        let scale = self.at.loss_scale;
        let parts = self.at.accumulation_parts(local.rows())?;
        let mut value = [0.0f32];
        if let [_] = parts[..] {
            let loss = self.wrapper.forward(|m| recompute::loss(m, local, ac));
            value[0] = plane::to_host(loss.clone().detach(), Reason::Report)[0];
            self.wrapper
                .backward(if scale == 1.0 { loss } else { loss * scale })?;
        } else {
            // One part at a time, each weighted 1/K; nothing reduced before the last.
            let weight = 1.0 / parts.len() as f32;
            for (start, len) in parts {
                let part = local.narrow_rows(start, len);
                let loss = self.wrapper.forward_micro(|m| recompute::loss(m, part, ac));
                value[0] += plane::to_host(loss.clone().detach(), Reason::Report)[0] * weight;
                let mut grads = (loss * (scale * weight)).backward();
                self.wrapper.accumulate(&mut grads)?;
            }
            self.wrapper.reduce()?;
        }
        // Every tp rank of a replica holds the same loss, every cp rank the mean over its
        // tokens (as many on each): the mean over dp × cp is global.
        self.wrapper
            .process_group()
            .all_reduce(&mut value, ReduceOp::Avg)?;
        self.at.average_replicas(&mut value)?;
        Ok(value[0])
    }

    fn evaluate(&mut self, batch: &M::Batch) -> Result<f32, TrainError> {
        let (local, _context) = self.at.context(batch, context_cut::<M>());
        let _experts = self.at.expert_scope();
        let loss = self.wrapper.evaluate(|m| m.loss(local));
        let mut value = [plane::to_host(loss, Reason::Report)[0]];
        self.wrapper
            .process_group()
            .all_reduce(&mut value, ReduceOp::Avg)?;
        self.at.average_replicas(&mut value)?;
        Ok(value[0])
    }

    wrapper_methods!();
}

impl<M: ParallelModel> Stateful for ReplicaEngine<M> {
    state_methods!();
}

/// How `M` cuts its batches for context parallelism.
pub(crate) fn context_cut<M: ParallelModel>() -> ContextCut<M::Batch> {
    ContextCut {
        seq: M::sequence_length,
        cut: M::context_batch,
    }
}
