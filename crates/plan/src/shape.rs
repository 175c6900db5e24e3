//! What each pipeline rank holds of a model under a layout: its [`RankShape`] (parameters,
//! experts, blocks, FLOPs) and its chunks' [`ChunkShape`]s, which the memory and time
//! models both read.

use crate::layout::PlannedLayout;
use crate::model::ModelSpec;
use bonfire_layout::ParallelDims;

/// One of a pipeline rank's model chunks (its stage of the schedule).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkShape {
    /// Transformer blocks it runs.
    pub blocks: usize,
    /// Whether it runs the head (and the loss).
    pub has_head: bool,
    /// Its parameters (its tp shard of its pieces).
    pub params: usize,
    /// Those of its parameters whose gradients B produces under a zero-bubble schedule
    /// ([`ModelSpec::piece_non_linear_params`]).
    pub non_linear_params: usize,
}

/// One pipeline rank's share of the model under a (tp, pp, schedule, ep).
#[derive(Debug, Clone, PartialEq)]
pub struct RankShape {
    /// Parameters (its tp shard of its pieces; of a mixture of experts' experts its `E/ep`).
    pub params: usize,
    /// Of [`Self::params`], the experts' (`E/ep` of each block's; 0 for a dense model):
    /// data-parallel over the dp·cp/ep ranks holding the same experts, not over dp × cp.
    pub expert_params: usize,
    /// Its blocks with a mixture of experts (each exchanges its tokens under ep).
    pub moe_blocks: usize,
    /// Transformer blocks it runs.
    pub blocks: usize,
    /// Whether it runs piece 0 (the embeddings).
    pub has_embedding: bool,
    /// Its chunks, in local order.
    pub chunks: Vec<ChunkShape>,
    /// Forward FLOPs per token of its pieces.
    pub flops: f64,
    /// Forward FLOPs per token of its blocks alone (what recomputation runs again).
    pub block_flops: f64,
}

/// Every pipeline rank's [`RankShape`] for `layout`'s tp, pp, schedule and ep.
pub fn rank_shapes(model: &ModelSpec, layout: &ParallelDims, seq: usize) -> Vec<RankShape> {
    let ep = layout.ep();
    // A piece's experts on this rank (E/ep of them), and its parameters with only those.
    let experts = |p: usize| model.piece_expert_params(p) / ep;
    let params =
        |p: usize| model.piece_params(layout.tp(), p) - model.piece_expert_params(p) + experts(p);
    (0..layout.pp())
        .map(|r| {
            let chunks = layout.chunk_pieces(model, r);
            let pieces = chunks.concat();
            let is_block = |p: &usize| *p >= 1 && *p <= model.n_layers;
            let flops = |p: &usize| model.piece_flops_per_token(layout.tp(), *p, seq);
            let blocks = pieces.iter().filter(|p| is_block(p)).count();
            RankShape {
                params: pieces.iter().map(|&p| params(p)).sum(),
                expert_params: pieces.iter().map(|&p| experts(p)).sum(),
                moe_blocks: pieces.iter().filter(|&&p| model.is_sparse_block(p)).count(),
                blocks,
                has_embedding: pieces.contains(&0),
                chunks: chunks
                    .iter()
                    .map(|c| ChunkShape {
                        blocks: c.iter().filter(|p| is_block(p)).count(),
                        has_head: c.contains(&(model.n_layers + 1)),
                        params: c.iter().map(|&p| params(p)).sum(),
                        // The experts' gradients come out of B (plain products, not linear
                        // layers).
                        non_linear_params: c
                            .iter()
                            .map(|&p| model.piece_non_linear_params(layout.tp(), p) + experts(p))
                            .sum(),
                    })
                    .collect(),
                flops: pieces.iter().map(flops).sum(),
                block_flops: pieces.iter().filter(|p| is_block(p)).map(flops).sum(),
            }
        })
        .collect()
}
