//! What a model implements to be trained by the trainer: [`ParallelModel`].
//!
//! Data parallelism (DDP, ZeRO 1–3) needs nothing but the loss: any Burn module trains. Each
//! further axis needs one more piece of description, given from outside the model's code (the
//! model stays a Burn model):
//!
//! - tensor parallelism: [`ParallelModel::tensor_parallel_plan`], module paths to styles (its
//!   layers must be `bonfire_tp`'s parallel-aware ones where the plan shards
//!   them), and [`ParallelModel::check_layout`] for what a plan cannot see (heads divisible);
//! - pipeline parallelism: [`ParallelModel::pipeline`], the model cut into pieces named by
//!   module path, with how a batch enters the first piece and how the last one's output
//!   becomes the loss ([`Pipeline`], which the trainer takes through a [`PipelineVisitor`]);
//! - expert parallelism: [`ParallelModel::experts`], the module paths of its stacked
//!   experts;
//! - activation checkpointing (any layout): the pipeline pieces that are checkpointable
//!   layers, [`Pipeline::with_checkpointable`](crate::Pipeline::with_checkpointable) (e.g. the transformer blocks); the layout's
//!   `recompute` picks which of them recompute.

use crate::data::Rows;
use crate::pipeline::PipelineVisitor;
use bonfire_cp::ContextSplit;
use bonfire_layout::{LayoutError, ParallelDims};
use bonfire_tp::ParallelPlan;
use burn::module::Module;
use burn::tensor::Tensor;

/// A Burn model the trainer can parallelize (see the module docs). Only
/// [`loss`](Self::loss) is required; every other method describes one more axis.
pub trait ParallelModel: Module + Sized + 'static {
    /// One batch: inputs and targets, cut by rows.
    type Batch: Rows;

    /// The mean loss over the batch's rows.
    fn loss(&self, batch: Self::Batch) -> Tensor<1>;

    /// Checks what the layout needs of the model beyond what a plan can see (attention heads
    /// divisible by tp, …), before anything is built.
    fn check_layout(&self, dims: &ParallelDims) -> Result<(), LayoutError> {
        let _ = dims;
        Ok(())
    }

    /// Checks what the layout needs of a batch (a sequence length divisible by tp under
    /// sequence parallelism, …).
    fn check_batch(&self, dims: &ParallelDims, batch: &Self::Batch) -> Result<(), LayoutError> {
        let _ = (dims, batch);
        Ok(())
    }

    /// The tensor-parallel plan over the tp axis of `dims` (its degree and options; `None`:
    /// the model has none, and a layout with tp > 1 is refused).
    fn tensor_parallel_plan(&self, dims: &ParallelDims) -> Option<ParallelPlan> {
        let _ = dims;
        None
    }

    /// The module paths of the model's mixture-of-experts expert modules: every parameter
    /// under them is stacked by expert along dimension 0, and the model runs its experts
    /// through `bonfire_ep::run_experts`. Expert parallelism (ep > 1) keeps a
    /// rank's `E/ep` experts of each and exchanges tokens; empty (the default): the model has
    /// no experts, and a layout with ep > 1 is refused.
    fn experts(&self) -> Vec<String> {
        Vec::new()
    }

    /// The module paths of the layers the model runs through `bonfire_module::layer` (what
    /// DDP and ZeRO-2 overlap with backward and ZeRO-3 gathers one at a time). Empty: the
    /// wrappers reduce after backward and ZeRO-3 gathers for the whole forward; the trainer
    /// says so when it builds.
    fn layers(&self) -> Vec<String> {
        Vec::new()
    }

    /// The length of the sequences of `batch` (`None`: its rows are no sequences, and a
    /// layout with cp > 1 is refused). Context parallelism cuts them.
    fn sequence_length(batch: &Self::Batch) -> Option<usize> {
        let _ = batch;
        None
    }

    /// This cp rank's tokens of every sequence of `batch`, cut as `split` says (rank `rank`'s
    /// chunks). Called only when [`sequence_length`](Self::sequence_length) is `Some`; the
    /// model's attention and positions follow the chunks through
    /// `bonfire_cp::{attention, positions}`.
    fn context_batch(batch: &Self::Batch, split: &ContextSplit, rank: usize) -> Self::Batch {
        let _ = (split, rank);
        batch.clone()
    }

    /// The model cut into pipeline pieces, handed to `visitor` (`None`: the model has none,
    /// and a layout with pp > 1 is refused). Called after tensor parallelism is applied. The
    /// pieces named [checkpointable](crate::Pipeline::with_checkpointable) are what
    /// activation checkpointing recomputes, in any layout (without a pipeline too).
    ///
    /// The pieces' type is the model's own, so the trainer takes them through a
    /// [`PipelineVisitor`] (to build an engine of that type): a model with pieces writes
    /// `Some(visitor.visit(Pipeline::new(pieces, input, loss)))`.
    fn pipeline<V: PipelineVisitor<Self::Batch>>(self, visitor: V) -> Option<V::Output> {
        let _ = visitor;
        None
    }
}
