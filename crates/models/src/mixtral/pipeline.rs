//! The Mixtral as pipeline pieces, exact under every schedule: the load-balancing term couples
//! every layer's routing of a sequence, so the routing rides with the activations. Between
//! pieces an activation is `[B, T, d + 2E]`: the residual stream, then each token's router
//! probabilities and top-k indicators summed over the layers so far. The embedding appends
//! zeros, each layer adds its routing, the head appends them to its logits, and the loss
//! splits them off: cross-entropy on the logits + α · [`balance_of`] of the sums (the counts
//! detached). The same pieces serve activation checkpointing without a pipeline.

use super::model::{DecoderLayer, Mixtral, balance_of};
use crate::data::TokenBatch;
use crate::decoder::{HeadLoss, Piece, PieceStep, decoder_pieces};
use crate::gpt::cross_entropy;
use crate::llama::{HeadWeights, embed, head};
use bonfire_comm::ProcessGroup;
use bonfire_tp::loss_parallel;
use bonfire_tp::{ParallelEmbedding, ParallelLinear, ParallelRmsNorm};
use burn::module::Module;
use burn::tensor::{Int, Tensor};

/// The token embedding, its output widened by `2E` zero routing columns.
#[derive(Module, Debug)]
pub struct MixtralEmbed {
    /// `model.embed_tokens`.
    pub embed_tokens: ParallelEmbedding,
    experts: usize,
}

/// The final norm and the output projection; the routing columns pass on beside the logits.
#[derive(Module, Debug)]
pub struct MixtralHead {
    /// `model.norm`.
    pub norm: ParallelRmsNorm,
    /// `lm_head`.
    pub lm_head: ParallelLinear,
    experts: usize,
    /// The sparse layers the balance term averages over, and its weight α (the head fused
    /// with the loss adds it: [`HeadLoss`]).
    sparse_layers: usize,
    alpha: f64,
}

/// One piece of the Mixtral as a pipeline block: `[B, T, d + 2E]` between pieces (see the
/// module docs); the embedding reads token ids as floats `[B, T, 1]`, the head writes
/// `[B, T, V + 2E]`.
pub type MixtralPiece = Piece<MixtralEmbed, DecoderLayer, MixtralHead>;

fn split(x: Tensor<3>, experts: usize) -> (Tensor<3>, Tensor<3>) {
    let w = x.dims()[2];
    let rest = x.clone().narrow(2, w - 2 * experts, 2 * experts);
    (x.narrow(2, 0, w - 2 * experts), rest)
}

impl PieceStep for MixtralEmbed {
    fn step(&self, x: Tensor<3>) -> Tensor<3> {
        let h = embed(&self.embed_tokens, x.squeeze_dim::<2>(2).int());
        let [b, t, _] = h.dims();
        let zeros = Tensor::<3>::zeros([b, t, 2 * self.experts], &h.device()).cast(h.dtype());
        Tensor::cat(vec![h, zeros], 2)
    }
}

impl PieceStep for DecoderLayer {
    fn step(&self, x: Tensor<3>) -> Tensor<3> {
        let (h, stats) = split(x, self.mlp.num_experts());
        let (y, r) = self.forward_routed(h);
        let dtype = stats.dtype();
        let routed = Tensor::cat(vec![r.probs, r.counts], 2).cast(dtype);
        Tensor::cat(vec![y, stats + routed], 2)
    }
}

impl PieceStep for MixtralHead {
    fn step(&self, x: Tensor<3>) -> Tensor<3> {
        let (h, stats) = split(x, self.experts);
        let logits = head(&self.norm, &self.lm_head, h);
        let dtype = logits.dtype();
        Tensor::cat(vec![logits, stats.cast(dtype)], 2)
    }
}

/// What the routing columns and the balance term are sized by: the experts a layer (its
/// `2E` columns) and the sparse layers the term averages over.
pub fn routing_shape(model: &Mixtral) -> (usize, usize) {
    let layers = &model.model.layers;
    let experts = layers.first().map_or(0, |l| l.mlp.num_experts());
    (experts, layers.iter().filter(|l| l.mlp.is_sparse()).count())
}

/// The Mixtral's pieces in order, named by the module path where each begins:
/// `model.embed_tokens`, `model.layers.0`, …, `model.norm` (parameters in the model's order).
pub fn pieces(model: Mixtral) -> Vec<(String, MixtralPiece)> {
    let (experts, sparse_layers) = routing_shape(&model);
    let alpha = model.aux_loss_coef();
    let Mixtral { model, lm_head, .. } = model;
    let embed_tokens = model.embed_tokens;
    let head = MixtralHead {
        norm: model.norm,
        lm_head,
        experts,
        sparse_layers,
        alpha,
    };
    decoder_pieces(
        (
            "model.embed_tokens",
            MixtralEmbed {
                embed_tokens,
                experts,
            },
        ),
        ("model.layers", model.layers),
        ("model.norm", head),
    )
}

/// The pipeline's loss on the head's output `[B, T, V' + 2E]`: cross-entropy on the logits
/// (vocab-parallel over `group` when they stay sharded) + α · the balance of the routing
/// columns summed over `layers` layers (none when α = 0).
pub fn loss(
    group: Option<ProcessGroup>,
    experts: usize,
    layers: usize,
    alpha: f64,
) -> impl Fn(Tensor<3>, &TokenBatch) -> Tensor<1> {
    move |out: Tensor<3>, (_, targets): &TokenBatch| {
        let (logits, stats) = split(out, experts);
        let ce = match &group {
            Some(g) => loss_parallel(logits, targets.clone(), g),
            None => cross_entropy(logits, targets.clone()),
        };
        with_balance(ce, stats, experts, layers, alpha)
    }
}

/// The head fused with the cross-entropy by blocks of `rows` positions (`llama::head_loss`),
/// the balance term from the routing columns of its input: [`loss`] made with the head.
impl HeadLoss for MixtralHead {
    fn loss(&self, x: Tensor<3>, targets: Tensor<2, Int>, rows: usize) -> Tensor<1> {
        let (h, stats) = split(x, self.experts);
        let weights = HeadWeights::Untied(&self.lm_head);
        let ce = crate::llama::head_loss(&self.norm, weights, h, targets, rows);
        with_balance(ce, stats, self.experts, self.sparse_layers, self.alpha)
    }
}

/// `ce` + α · [`balance_of`] the routing sums `stats` `[B, T, 2E]` over `layers` layers (the
/// probabilities, then the counts); `ce` alone when α = 0.
fn with_balance(
    ce: Tensor<1>,
    stats: Tensor<3>,
    experts: usize,
    layers: usize,
    alpha: f64,
) -> Tensor<1> {
    if alpha == 0.0 {
        return ce;
    }
    let probs = stats.clone().narrow(2, 0, experts);
    let counts = stats.narrow(2, experts, experts);
    ce + balance_of(probs, counts, layers).mul_scalar(alpha)
}
