//! A model's pipeline pieces as it hands them to the trainer: [`Pipeline`] (the pieces in
//! order, named by module path, with how a batch enters the first and how the last one's
//! output becomes the loss) and [`PipelineVisitor`], the trainer's side, which takes a
//! pipeline of any piece type.

use crate::data::Rows;
use bonfire_pipeline::Block;
use burn::module::ParamId;
use burn::tensor::Tensor;
use std::sync::Arc;

/// How a (micro-)batch enters the first piece.
pub type InputFn<B, const D: usize> = Arc<dyn Fn(&B) -> Tensor<D> + Send + Sync>;
/// The mean loss from the last piece's output and the (micro-)batch.
pub type LossFn<B, const D: usize> = Arc<dyn Fn(Tensor<D>, &B) -> Tensor<1> + Send + Sync>;
/// The mean loss from the last piece itself, its input and the (micro-)batch: the piece's
/// forward and the loss as one ([`Pipeline::with_head_loss`]).
pub type HeadLossFn<P, B, const D: usize> =
    Arc<dyn Fn(&P, Tensor<D>, &B) -> Tensor<1> + Send + Sync>;

/// A model cut into pipeline pieces, in order, each named by the module path where it begins
/// (split points name these), with how a batch enters the first piece and how the last
/// piece's output and the batch make the loss. The pieces must hold the model's parameters
/// in the model's order (the trainer checks).
///
/// The same pieces serve activation checkpointing in every layout, pipelined or not: the
/// pieces named [checkpointable](Self::with_checkpointable) are the layers that
/// `ParallelDims::recompute` counts (`Every(k)`: the 0th, k-th, 2k-th, … of
/// them, in model order), each recomputed in backward as one region
/// (`bonfire_recompute::recompute`).
pub struct Pipeline<P, const D: usize, B> {
    /// `(module path, piece)`, in model order.
    pub pieces: Vec<(String, P)>,
    /// How a (micro-)batch enters the first piece.
    pub input: InputFn<B, D>,
    /// The mean loss from the last piece's output.
    pub loss: LossFn<B, D>,
    /// The last piece's forward and the loss as one, where the model fuses them (a head
    /// whose logits never exist whole); `None`: the last piece's forward, then `loss`.
    pub head_loss: Option<HeadLossFn<P, B, D>>,
    /// The pieces that are checkpointable layers (by name).
    pub checkpointable: Vec<String>,
    /// Parameters a later piece uses again without holding them (`(parameter, piece name)`:
    /// a tied head, which holds the embedding's table as a `bonfire_module::tied::Borrowed`);
    /// under a pipeline their owner's values are lent to that piece's stage each step and
    /// its gradient handed back.
    pub borrowed: Vec<(ParamId, String)>,
}

impl<P: Block<D>, const D: usize, B: Rows> Pipeline<P, D, B> {
    /// `pieces` as `(module path, piece)`; `input` makes the first piece's input from a
    /// (micro-)batch; `loss` the mean loss from the last piece's output.
    pub fn new(
        pieces: Vec<(String, P)>,
        input: impl Fn(&B) -> Tensor<D> + Send + Sync + 'static,
        loss: impl Fn(Tensor<D>, &B) -> Tensor<1> + Send + Sync + 'static,
    ) -> Self {
        Self {
            pieces,
            input: Arc::new(input),
            loss: Arc::new(loss),
            head_loss: None,
            checkpointable: Vec::new(),
            borrowed: Vec::new(),
        }
    }

    /// The last piece's forward and the loss as one: `head_loss(last piece, its input,
    /// batch)` is the mean loss in place of the piece's forward and `loss` — on one rank
    /// (activation checkpointing's pieces) and on a pipeline's last stage alike.
    pub fn with_head_loss(
        mut self,
        head_loss: impl Fn(&P, Tensor<D>, &B) -> Tensor<1> + Send + Sync + 'static,
    ) -> Self {
        self.head_loss = Some(Arc::new(head_loss));
        self
    }

    /// The pieces' names, in order.
    pub fn names(&self) -> Vec<String> {
        self.pieces.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Names the pieces (by their names) that are checkpointable layers — typically every
    /// transformer block, not the embedding or the head. With activation checkpointing on,
    /// the layout's choice among them recompute their activations in backward.
    pub fn with_checkpointable<S: Into<String>>(
        mut self,
        names: impl IntoIterator<Item = S>,
    ) -> Self {
        self.checkpointable = names.into_iter().map(Into::into).collect();
        self
    }

    /// Says that piece `piece` (by name) uses parameter `param` of an earlier piece without
    /// holding it (see [`Pipeline::borrowed`]).
    pub fn with_borrowed(mut self, param: ParamId, piece: impl Into<String>) -> Self {
        self.borrowed.push((param, piece.into()));
        self
    }
}

/// What takes a model's [`Pipeline`], whatever its piece type: the trainer's pipeline
/// builder, its checks, activation checkpointing's loss (see
/// [`ParallelModel::pipeline`](crate::ParallelModel::pipeline)).
pub trait PipelineVisitor<B> {
    /// What the visit gives back.
    type Output;
    /// Takes the model's pipeline.
    fn visit<P: Block<D> + 'static, const D: usize>(
        self,
        pipeline: Pipeline<P, D, B>,
    ) -> Self::Output;
}
