//! What the decoders (the GPT, the Llama) share when they are parallelized: the styles of a
//! Megatron-style tensor-parallel plan ([`DecoderStyles`]), the divisibility checks, and a
//! pipeline's token input and (vocab-parallel) loss.

use crate::cross_entropy;
use crate::data::TokenBatch;
use bonfire_comm::ProcessGroup;
use bonfire_cp::ContextSplit;
use bonfire_layout::{Axis, LayoutError, ParallelDims};
use bonfire_tp::{
    ColwiseParallel, RowwiseParallel, SequenceParallel, StylePlacement, loss_parallel,
};
use burn::tensor::Tensor;

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
            embedding,
            head: colwise.output_layout(head_out),
            norm: sequence_parallel.then(SequenceParallel::default),
        }
    }
}

/// `Ok` when `degree` of `axis` divides `value` (`what`, named in the error).
pub fn divisible(axis: Axis, degree: usize, what: &str, value: usize) -> Result<(), LayoutError> {
    if value % degree == 0 {
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
