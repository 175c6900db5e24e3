//! How the GPT is parallelized, from outside its code: its [`ParallelModel`] description —
//! the tensor-parallel plan (like torchtitan's Llama plan), the checks a plan cannot see, the
//! layers it runs through `bonfire_module::layer`, and its pipeline pieces, which run the
//! very functions [`Gpt::forward`] runs ([`embed`], `GptBlock::forward`, [`head`]), the
//! transformer blocks among them checkpointable (activation checkpointing).
//!
//! | module | without SP | with sequence parallelism |
//! |---|---|---|
//! | `tok_emb` | vocab-parallel (row-wise), output all-reduced | vocab-parallel, output reduce-scattered along the sequence |
//! | `pos_emb` | replicated | `SequenceParallel` (each rank its positions) |
//! | `blocks.*.ln1`, `ln2`, `ln_f` | replicated | `SequenceParallel` |
//! | `blocks.*.attn.q`, `k`, `v`, `mlp.fc1` | column-wise | column-wise, input all-gathered along the sequence |
//! | `blocks.*.attn.o`, `mlp.fc2` | row-wise, output all-reduced | row-wise, output reduce-scattered along the sequence |
//! | `head` | column-wise, output gathered (or kept vocab-sharded for `loss_parallel`) | the same, input all-gathered along the sequence |
//!
//! Attention heads are split across the tensor-parallel ranks (rank r holds heads
//! r·h/tp .. (r+1)·h/tp), so `n_heads` must be divisible by the tensor-parallel size.

use super::block::GptBlock;
use super::model::{Gpt, embed, head, head_loss};
use crate::data::TokenBatch;
use crate::decoder::fuse_head;
use crate::decoder::{DecoderStyles, HeadLoss, Piece, PieceStep, decoder_pieces, divisible};
use crate::decoder::{token_input, token_loss};
use bonfire_layout::{Axis, LayoutError, ParallelDims};
use bonfire_parallel::{ParallelModel, Pipeline, PipelineVisitor};
use bonfire_tp::ParallelPlan;
use bonfire_tp::{ParallelEmbedding, ParallelLayerNorm, ParallelLinear};
use burn::module::Module;
use burn::tensor::{Int, Tensor};

/// The GPT's tensor-parallel plan (see the module docs).
pub fn gpt_tp_plan(sequence_parallel: bool, loss_parallel: bool) -> ParallelPlan {
    let st = DecoderStyles::new(sequence_parallel, loss_parallel);
    let mut plan = ParallelPlan::new()
        .add("tok_emb", st.embedding)
        .add("blocks.*.attn.q", st.colwise)
        .add("blocks.*.attn.k", st.colwise)
        .add("blocks.*.attn.v", st.colwise)
        .add("blocks.*.attn.o", st.rowwise)
        .add("blocks.*.mlp.fc1", st.colwise)
        .add("blocks.*.mlp.fc2", st.rowwise)
        .add("head", st.head);
    if let Some(sp) = st.norm {
        for path in ["pos_emb", "blocks.*.ln1", "blocks.*.ln2", "ln_f"] {
            plan = plan.add(path, sp);
        }
    }
    plan
}

impl ParallelModel for Gpt {
    type Batch = TokenBatch;

    fn loss(&self, (ids, targets): TokenBatch) -> Tensor<1> {
        Gpt::loss(self, ids, targets)
    }

    /// Heads, the vocabulary (sharded by the embedding and the head) and the MLP width must
    /// split evenly over tp.
    fn check_layout(&self, dims: &ParallelDims) -> Result<(), LayoutError> {
        let tp = dims.tp();
        let n_heads = self.blocks.first().map_or(tp, |b| b.attn.n_heads());
        divisible(Axis::Tp, tp, "n_heads", n_heads)?;
        divisible(Axis::Tp, tp, "vocab_size", self.tok_emb.weight.dims()[0])?;
        if let Some(b) = self.blocks.first() {
            divisible(Axis::Tp, tp, "d_ff", b.mlp.fc1.weight.dims()[0])?;
        }
        Ok(())
    }

    crate::token_sequence_hooks!();

    fn tensor_parallel_plan(&self, dims: &ParallelDims) -> Option<ParallelPlan> {
        let o = dims.tp_options;
        Some(gpt_tp_plan(o.sequence_parallel, o.loss_parallel))
    }

    fn layers(&self) -> Vec<String> {
        let mut out = vec!["tok_emb".to_string(), "pos_emb".to_string()];
        for i in 0..self.blocks.len() {
            for part in ["ln1", "attn", "ln2", "mlp"] {
                out.push(format!("blocks.{i}.{part}"));
            }
        }
        out.extend(["ln_f".to_string(), "head".to_string()]);
        out
    }

    /// The embeddings, each block, the final norm with the head; token ids enter as floats
    /// `[B, T, 1]`; the loss is cross-entropy, vocab-parallel when the head's logits stay
    /// sharded. The transformer blocks are the checkpointable layers.
    fn pipeline<V: PipelineVisitor<TokenBatch>>(self, visitor: V) -> Option<V::Output> {
        let blocks: Vec<String> = (0..self.blocks.len())
            .map(|i| format!("blocks.{i}"))
            .collect();
        let loss = token_loss(self.head.output_shard_group());
        let rows = self.fused_loss_rows;
        let pipeline = fuse_head(Pipeline::new(pieces(self), token_input, loss), rows);
        Some(visitor.visit(pipeline.with_checkpointable(blocks)))
    }
}

/// The token and position embeddings (the first piece).
#[derive(Module, Debug)]
pub struct GptEmbed {
    /// The GPT's token embedding ([`Gpt::tok_emb`]).
    pub tok_emb: ParallelEmbedding,
    /// The GPT's position embedding ([`Gpt::pos_emb`]).
    pub pos_emb: ParallelEmbedding,
}

/// The final LayerNorm and the output projection (the last piece).
#[derive(Module, Debug)]
pub struct GptHead {
    /// The GPT's final LayerNorm ([`Gpt::ln_f`]).
    pub ln_f: ParallelLayerNorm,
    /// The GPT's output projection ([`Gpt::head`]).
    pub head: ParallelLinear,
}

/// One piece of the GPT as a pipeline block: activations are `[B, T, d]`; the embedding
/// reads token ids as floats `[B, T, 1]`, the head writes logits `[B, T, V]`.
pub type GptPiece = Piece<GptEmbed, GptBlock, GptHead>;

impl PieceStep for GptEmbed {
    fn step(&self, x: Tensor<3>) -> Tensor<3> {
        embed(&self.tok_emb, &self.pos_emb, x.squeeze_dim::<2>(2).int())
    }
}

impl PieceStep for GptBlock {
    fn step(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward(x)
    }
}

impl PieceStep for GptHead {
    fn step(&self, x: Tensor<3>) -> Tensor<3> {
        head(&self.ln_f, &self.head, x)
    }
}

impl HeadLoss for GptHead {
    fn loss(&self, x: Tensor<3>, targets: Tensor<2, Int>, rows: usize) -> Tensor<1> {
        head_loss(&self.ln_f, &self.head, x, targets, rows)
    }
}

/// The GPT's pieces in order, named by the module path where each begins: `tok_emb`,
/// `blocks.0`, …, `ln_f` (parameters in the model's order).
pub fn pieces(model: Gpt) -> Vec<(String, GptPiece)> {
    let Gpt {
        tok_emb,
        pos_emb,
        blocks,
        ln_f,
        head,
        fused_loss_rows: _,
    } = model;
    decoder_pieces(
        ("tok_emb", GptEmbed { tok_emb, pos_emb }),
        ("blocks", blocks),
        ("ln_f", GptHead { ln_f, head }),
    )
}
