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
//!   becomes the loss;
//! - expert parallelism: [`ParallelModel::experts`], the module paths of its stacked
//!   experts;
//! - activation checkpointing (any layout): the pipeline pieces that are checkpointable
//!   layers, [`Pipeline::with_checkpointable`] (e.g. the transformer blocks); the layout's
//!   `activation_checkpointing` picks which of them recompute.

use crate::engine::pipeline::{Pieces, PipelineContext};
use crate::engine::{ContextCut, Engine};
use crate::error::{LayoutError, TrainError};
use bonfire_cp::ContextSplit;
use bonfire_layout::ParallelDims;
use bonfire_pipeline::Block;
use bonfire_tp::ParallelPlan;
use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::kind::Basic;

/// A batch that can be cut by rows (dimension 0): each data-parallel replica takes its rows,
/// each pipeline micro-batch a part of those.
pub trait Rows: Clone + Send + 'static {
    /// Number of rows.
    fn rows(&self) -> usize;
    /// Rows `start .. start + len`.
    fn narrow_rows(&self, start: usize, len: usize) -> Self;
}

impl<const D: usize, K: Basic + 'static> Rows for Tensor<D, K>
where
    Tensor<D, K>: Send,
{
    fn rows(&self) -> usize {
        self.dims()[0]
    }
    fn narrow_rows(&self, start: usize, len: usize) -> Self {
        self.clone().narrow(0, start, len)
    }
}

impl<A: Rows, B: Rows> Rows for (A, B) {
    fn rows(&self) -> usize {
        self.0.rows()
    }
    fn narrow_rows(&self, start: usize, len: usize) -> Self {
        (
            self.0.narrow_rows(start, len),
            self.1.narrow_rows(start, len),
        )
    }
}

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

    /// The model cut into pipeline pieces (`None`: the model has none, and a layout with
    /// pp > 1 is refused). Called after tensor parallelism is applied. The pieces named
    /// [checkpointable](Pipeline::with_checkpointable) are what activation checkpointing
    /// recomputes, in any layout (without a pipeline too).
    fn pipeline(self) -> Option<Pipeline<Self::Batch>> {
        None
    }
}

/// A model cut into pipeline pieces, in order, each named by the module path where it begins
/// (split points name these), with how a batch enters the first piece and how the last
/// piece's output and the batch make the loss. The pieces must hold the model's parameters
/// in the model's order (the trainer checks).
///
/// The same pieces serve activation checkpointing in every layout, pipelined or not: the
/// pieces named [checkpointable](Self::with_checkpointable) are the layers that
/// `ParallelDims::activation_checkpointing` counts (`Every(k)`: the 0th, k-th, 2k-th, … of
/// them, in model order), each recomputed in backward as one region
/// (`bonfire_recompute::recompute`).
pub struct Pipeline<B> {
    pub(crate) inner: Box<dyn BuildPipeline<B>>,
}

impl<B: Rows> Pipeline<B> {
    /// `pieces` as `(module path, piece)`; `input` makes the first piece's input from a
    /// (micro-)batch; `loss` the mean loss from the last piece's output.
    pub fn new<P: Block<D> + 'static, const D: usize>(
        pieces: Vec<(String, P)>,
        input: impl Fn(&B) -> Tensor<D> + Send + Sync + 'static,
        loss: impl Fn(Tensor<D>, &B) -> Tensor<1> + Send + Sync + 'static,
    ) -> Self {
        Self {
            inner: Box::new(Pieces::new(pieces, input, loss)),
        }
    }

    /// The pieces' names, in order.
    pub fn names(&self) -> Vec<String> {
        self.inner.names()
    }

    /// Names the pieces (by their names) that are checkpointable layers — typically every
    /// transformer block, not the embedding or the head. With activation checkpointing on,
    /// the layout's choice among them recompute their activations in backward.
    pub fn with_checkpointable<S: Into<String>>(
        mut self,
        names: impl IntoIterator<Item = S>,
    ) -> Self {
        self.inner
            .set_checkpointable(names.into_iter().map(Into::into).collect());
        self
    }

    /// The checkpointable pieces' names, in the order given.
    pub fn checkpointable(&self) -> Vec<String> {
        self.inner.checkpointable().to_vec()
    }
}

/// A pipeline description with its piece type erased: it builds its rank's engine, or runs
/// the whole loss through its pieces (activation checkpointing without a pipeline).
pub(crate) trait BuildPipeline<B> {
    fn names(&self) -> Vec<String>;
    fn checkpointable(&self) -> &[String];
    fn set_checkpointable(&mut self, names: Vec<String>);
    fn build(
        self: Box<Self>,
        ctx: PipelineContext,
        context: ContextCut<B>,
    ) -> Result<Box<dyn Engine<B>>, TrainError>;
    /// The loss of `batch` through every piece in order, piece `i` recomputed in backward
    /// where `recompute[i]`.
    fn loss(self: Box<Self>, batch: &B, recompute: &[bool]) -> Tensor<1>;
}
