//! What the decoders (the GPT, the Llama family, the mixtures of experts) share when they are
//! parallelized: the styles of a Megatron-style tensor-parallel plan ([`DecoderStyles`]), the
//! divisibility checks, the trainer's token-sequence hooks ([`token_sequence_hooks!`]), the
//! pipeline pieces ([`Piece`]: an embedding, a layer or a head, each a [`PieceStep`]; named
//! by [`decoder_pieces`]), a pipeline's token input and (vocab-parallel) loss. A family writes
//! only its three steps.

use crate::cross_entropy;
use crate::data::TokenBatch;
use bonfire_comm::ProcessGroup;
use bonfire_cp::ContextSplit;
use bonfire_layout::{Axis, LayoutError, ParallelDims};
use bonfire_parallel::Pipeline;
use bonfire_pipeline::Block;
use bonfire_tp::{
    ColwiseParallel, RowwiseParallel, SequenceParallel, StylePlacement, loss_parallel,
};
use burn::module::{Module, ModuleDisplay};
use burn::tensor::{Int, Tensor};

/// The styles of a decoder's tensor-parallel plan: column-wise projections, row-wise ones, a
/// vocab-parallel embedding, the head, and the norms' style under sequence parallelism.
#[derive(Debug, Clone, Copy)]
pub struct DecoderStyles {
    /// Projections into the heads or the MLP (input all-gathered along the sequence under
    /// sequence parallelism).
    pub colwise: ColwiseParallel,
    /// Projections out of them (output reduce-scattered along the sequence under sequence
    /// parallelism, else all-reduced).
    pub rowwise: RowwiseParallel,
    /// The token embedding, vocab-parallel.
    pub embedding: RowwiseParallel,
    /// The head: column-wise, its logits kept vocab-sharded under loss parallelism.
    pub head: ColwiseParallel,
    /// The norms' style: `SequenceParallel` under sequence parallelism, else replicated.
    pub norm: Option<SequenceParallel>,
}

impl DecoderStyles {
    /// The styles with or without sequence and loss parallelism.
    pub fn new(sequence_parallel: bool, loss_parallel: bool) -> Self {
        let head_out = match loss_parallel {
            true => StylePlacement::Shard(-1),
            false => StylePlacement::Replicate,
        };
        let seq = StylePlacement::Shard(1);
        let (colwise, rowwise, embedding) = match sequence_parallel {
            true => (
                ColwiseParallel::default().input_layout(seq),
                RowwiseParallel::default().output_layout(seq),
                RowwiseParallel::vocab_embedding(seq),
            ),
            false => (
                ColwiseParallel::default(),
                RowwiseParallel::default(),
                RowwiseParallel::vocab_embedding(StylePlacement::Replicate),
            ),
        };
        Self {
            colwise,
            rowwise,
            // A tied head's logits as an untied head's.
            embedding: embedding.logits_layout(head_out),
            head: colwise.output_layout(head_out),
            norm: sequence_parallel.then(SequenceParallel::default),
        }
    }
}

/// `Ok` when `degree` of `axis` divides `value` (`what`, named in the error).
pub fn divisible(axis: Axis, degree: usize, what: &str, value: usize) -> Result<(), LayoutError> {
    if value.is_multiple_of(degree) {
        return Ok(());
    }
    Err(LayoutError::NotDivisible {
        axis,
        degree,
        what: what.into(),
        value,
    })
}

/// Sequence parallelism shards a rank's sequence over tp (its chunks' tokens, `T/cp`, under
/// context parallelism): it must divide its length.
pub fn check_sequence(dims: &ParallelDims, (ids, _): &TokenBatch) -> Result<(), LayoutError> {
    if dims.tp_options.sequence_parallel {
        let local = ids.dims()[1] / dims.cp();
        let what = match dims.cp() {
            1 => "the sequence length".to_string(),
            cp => format!("the sequence length over cp={cp}"),
        };
        divisible(Axis::Tp, dims.tp(), &what, local)?;
    }
    Ok(())
}

/// The length of a token batch's sequences (context parallelism cuts them).
pub fn sequence_length((ids, _): &TokenBatch) -> Option<usize> {
    Some(ids.dims()[1])
}

/// A cp rank's tokens of a token batch: its chunks of every sequence, inputs and targets.
pub fn context_batch((ids, targets): &TokenBatch, split: &ContextSplit, rank: usize) -> TokenBatch {
    (
        split.local(ids.clone(), 1, rank),
        split.local(targets.clone(), 1, rank),
    )
}

/// A pipeline's input: the batch's token ids as floats `[B, T, 1]`.
pub fn token_input((ids, _): &TokenBatch) -> Tensor<3> {
    ids.clone().float().unsqueeze_dim::<3>(2)
}

/// A pipeline's loss on the head's logits: cross-entropy, vocab-parallel over `group` when
/// the logits stay sharded.
pub fn token_loss(group: Option<ProcessGroup>) -> impl Fn(Tensor<3>, &TokenBatch) -> Tensor<1> {
    move |logits: Tensor<3>, (_, targets): &TokenBatch| match &group {
        Some(g) => loss_parallel(logits, targets.clone(), g),
        None => cross_entropy(logits, targets.clone()),
    }
}

/// The trainer's hooks of a model trained on [`TokenBatch`]es, the same for every decoder:
/// `check_batch` ([`check_sequence`]), `sequence_length` and `context_batch` (context
/// parallelism cuts the sequences). Written inside an `impl ParallelModel for …` with
/// `type Batch = TokenBatch`.
#[macro_export]
macro_rules! token_sequence_hooks {
    () => {
        /// Sequence parallelism shards the sequence over tp.
        fn check_batch(
            &self,
            dims: &bonfire_layout::ParallelDims,
            batch: &$crate::data::TokenBatch,
        ) -> Result<(), bonfire_layout::LayoutError> {
            $crate::decoder::check_sequence(dims, batch)
        }

        fn sequence_length(batch: &$crate::data::TokenBatch) -> Option<usize> {
            $crate::decoder::sequence_length(batch)
        }

        fn context_batch(
            batch: &$crate::data::TokenBatch,
            split: &bonfire_cp::ContextSplit,
            rank: usize,
        ) -> $crate::data::TokenBatch {
            $crate::decoder::context_batch(batch, split, rank)
        }
    };
}

/// One part of a decoder a pipeline piece runs, `[B, T, w]` → `[B, T, w′]`: its embedding
/// (token ids as floats `[B, T, 1]` in), one of its layers, its head (logits out). A family
/// whose pieces carry more than the residual stream (the Mixtral's routing sums) widens `w`.
pub trait PieceStep {
    /// The step on `x`.
    fn step(&self, x: Tensor<3>) -> Tensor<3>;
}

/// A head piece that can make the loss itself, the head fused with it by blocks of rows
/// ([`crate::gpt::fused_head_loss`]) — a pipeline's last stage then never holds its logits whole.
pub trait HeadLoss {
    /// The mean loss on the last layer's output `x` `[B, T, w]` against `targets` `[B, T]`,
    /// by blocks of `rows` positions where the head is not sharded (else its logits and the
    /// loss the pipeline's loss function would take on them).
    fn loss(&self, x: Tensor<3>, targets: Tensor<2, Int>, rows: usize) -> Tensor<1>;
}

/// `pipeline` with its head fused with the loss by blocks of `rows` positions
/// ([`Pipeline::with_head_loss`], [`HeadLoss`]) where `rows` is `Some` (a model's
/// `with_fused_loss`); `None`: as it is. A last piece that is not the head keeps the
/// pipeline's loss on its output.
pub fn fuse_head<E, L, H>(
    pipeline: Pipeline<Piece<E, L, H>, 3, TokenBatch>,
    rows: Option<usize>,
) -> Pipeline<Piece<E, L, H>, 3, TokenBatch>
where
    E: Module + ModuleDisplay + PieceStep + 'static,
    L: Module + ModuleDisplay + PieceStep + 'static,
    H: Module + ModuleDisplay + PieceStep + HeadLoss + 'static,
{
    let Some(rows) = rows else {
        return pipeline;
    };
    let loss = pipeline.loss.clone();
    pipeline.with_head_loss(move |piece, x, batch: &TokenBatch| match piece {
        Piece::Head(head) => head.loss(x, batch.1.clone(), rows),
        other => loss(other.forward(x), batch),
    })
}

/// One piece of a decoder as a pipeline block: its embedding, one layer, or its head.
// A handful of pieces per rank: the size difference of the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Piece<E: Module, L: Module, H: Module> {
    /// The embedding: token ids `[B, T, 1]` as floats → activations.
    Embed(E),
    /// One decoder layer.
    Layer(L),
    /// The final norm and the head → logits.
    Head(H),
}

impl<E, L, H> Block<3> for Piece<E, L, H>
where
    E: Module + ModuleDisplay + PieceStep,
    L: Module + ModuleDisplay + PieceStep,
    H: Module + ModuleDisplay + PieceStep,
{
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        match self {
            Piece::Embed(e) => e.step(x),
            Piece::Layer(l) => l.step(x),
            Piece::Head(h) => h.step(x),
        }
    }
}

/// A decoder's pieces in order, each named by the module path where it begins (parameters in
/// the model's order): `embed` `(path, part)`, the `layers` `(prefix, parts)` as
/// `prefix.0`, `prefix.1`, …, then `head`.
pub fn decoder_pieces<E: Module, L: Module, H: Module>(
    (embed_path, embed): (&str, E),
    (prefix, layers): (&str, Vec<L>),
    (head_path, head): (&str, H),
) -> Vec<(String, Piece<E, L, H>)> {
    let mut out = vec![(embed_path.to_string(), Piece::Embed(embed))];
    out.extend(
        layers
            .into_iter()
            .enumerate()
            .map(|(i, l)| (format!("{prefix}.{i}"), Piece::Layer(l))),
    );
    out.push((head_path.to_string(), Piece::Head(head)));
    out
}
