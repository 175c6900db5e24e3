//! The Mixtral as pipeline pieces, exact under every schedule: the load-balancing term couples
//! every layer's routing of a sequence, so the routing rides with the activations. Between
//! pieces an activation is `[B, T, d + 2E]`: the residual stream, then each token's router
//! probabilities and top-k indicators summed over the layers so far. The embedding appends
//! zeros, each layer adds its routing, the head appends them to its logits, and the loss
//! splits them off: cross-entropy on the logits + α · [`balance_of`] of the sums (the counts
//! detached). The same pieces serve activation checkpointing without a pipeline.

use super::model::{DecoderLayer, Mixtral, balance_of};
use crate::data::TokenBatch;
use crate::gpt::cross_entropy;
use crate::llama::{embed, head};
use bonfire_comm::ProcessGroup;
use bonfire_pipeline::Block;
use bonfire_tp::loss_parallel;
use bonfire_tp::{ParallelEmbedding, ParallelLinear, ParallelRmsNorm};
use burn::module::Module;
use burn::tensor::Tensor;

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
}

/// One piece of the Mixtral as a pipeline block (see the module docs).
// A handful of pieces per rank: the size difference of the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum MixtralPiece {
    /// `model.embed_tokens`.
    Embed(MixtralEmbed),
    /// `model.layers.i`.
    Layer(DecoderLayer),
    /// `model.norm` and `lm_head`.
    Head(MixtralHead),
}

/// `x` `[B, T, w]` cut into its first `w − 2E` columns and its last `2E`.
fn split(x: Tensor<3>, experts: usize) -> (Tensor<3>, Tensor<3>) {
    let w = x.dims()[2];
    let rest = x.clone().narrow(2, w - 2 * experts, 2 * experts);
    (x.narrow(2, 0, w - 2 * experts), rest)
}

impl Block<3> for MixtralPiece {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        match self {
            MixtralPiece::Embed(p) => {
                let h = embed(&p.embed_tokens, x.squeeze_dim::<2>(2).int());
                let [b, t, _] = h.dims();
                let zeros = Tensor::<3>::zeros([b, t, 2 * p.experts], &h.device()).cast(h.dtype());
                Tensor::cat(vec![h, zeros], 2)
            }
            MixtralPiece::Layer(l) => {
                let (h, stats) = split(x, l.mlp.gate.weight.dims()[0]);
                let (y, r) = l.forward_routed(h);
                let dtype = stats.dtype();
                let routed = Tensor::cat(vec![r.probs, r.counts], 2).cast(dtype);
                Tensor::cat(vec![y, stats + routed], 2)
            }
            MixtralPiece::Head(p) => {
                let (h, stats) = split(x, p.experts);
                let logits = head(&p.norm, &p.lm_head, h);
                let dtype = logits.dtype();
                Tensor::cat(vec![logits, stats.cast(dtype)], 2)
            }
        }
    }
}

/// The Mixtral's pieces in order, named by the module path where each begins:
/// `model.embed_tokens`, `model.layers.0`, …, `model.norm` (parameters in the model's order).
pub fn pieces(model: Mixtral) -> Vec<(String, MixtralPiece)> {
    let experts = model
        .model
        .layers
        .first()
        .map_or(0, |l| l.mlp.gate.weight.dims()[0]);
    let Mixtral { model, lm_head, .. } = model;
    let mut out = vec![(
        "model.embed_tokens".to_string(),
        MixtralPiece::Embed(MixtralEmbed {
            embed_tokens: model.embed_tokens,
            experts,
        }),
    )];
    out.extend(
        model
            .layers
            .into_iter()
            .enumerate()
            .map(|(i, l)| (format!("model.layers.{i}"), MixtralPiece::Layer(l))),
    );
    out.push((
        "model.norm".to_string(),
        MixtralPiece::Head(MixtralHead {
            norm: model.norm,
            lm_head,
            experts,
        }),
    ));
    out
}

/// The pipeline's loss on the head's output `[B, T, V' + 2E]`: cross-entropy on the logits
/// (vocab-parallel over `group` when they stay sharded) + α · the balance of the routing
/// columns summed over `layers` layers.
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
        let probs = stats.clone().narrow(2, 0, experts);
        let counts = stats.narrow(2, experts, experts);
        ce + balance_of(probs, counts, layers).mul_scalar(alpha)
    }
}
