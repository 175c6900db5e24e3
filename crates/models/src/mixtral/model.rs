//! [`Mixtral`]: Hugging Face's `MixtralForCausalLM` written the Burn way — the Llama's
//! embedding, attention, norms and head ([`crate::decoder_layer`], [`crate::llama`]) with a
//! sparse mixture of experts ([`SparseMoe`]) as every layer's feed-forward, and the loss of
//! `shared/notes/parity-harness.md`: mean cross-entropy + α · the sequence-wise
//! load-balancing term ([`balance`], [`balance_of`]). Module paths are transformers 5's `state_dict()` names
//! (`model.layers.0.mlp.experts.gate_up_proj`).

use super::config::MixtralConfig;
use super::moe::{Routing, SparseMoe};
use crate::decoder_layer;
use crate::gpt::cross_entropy;
use crate::layers::{Embedding, Linear, RmsNorm};
use crate::llama::{embed, head};
use bonfire_comm::ReduceOp;
use bonfire_dtensor::context::ContextScope;
use bonfire_dtensor::functional::all_reduce;
use bonfire_dtensor::parallel::loss_parallel;
use burn::module::Module;
use burn::tensor::{DType, Device, Int, Tensor};

/// The Mixtral's decoder layer: the shared layer around its [`SparseMoe`].
pub type DecoderLayer = decoder_layer::DecoderLayer<SparseMoe>;

/// The decoder without its head (transformers' `MixtralModel`, the `model.` prefix).
#[derive(Module, Debug)]
pub struct MixtralModel {
    /// Token embeddings `[V, d]`.
    pub embed_tokens: Embedding,
    /// The decoder layers.
    pub layers: Vec<DecoderLayer>,
    /// The final norm.
    pub norm: RmsNorm,
}

/// A Mixtral causal language model (transformers' `MixtralForCausalLM`).
#[derive(Module, Debug)]
pub struct Mixtral {
    /// The decoder.
    pub model: MixtralModel,
    /// The output projection `[V, d]` (untied).
    pub lm_head: Linear,
    aux_loss_coef: f64,
}

impl Mixtral {
    /// A freshly initialized model (N(0, 0.02) weights, unit norms).
    pub fn new(cfg: &MixtralConfig, device: &Device) -> Self {
        let b = &cfg.base;
        let layer = || {
            let moe = SparseMoe::new(
                b.hidden_size,
                b.intermediate_size,
                cfg.num_local_experts,
                cfg.num_experts_per_tok,
                device,
            );
            DecoderLayer::with_mlp(b, moe, device)
        };
        Self {
            model: MixtralModel {
                embed_tokens: Embedding::new(b.vocab_size, b.hidden_size, device),
                layers: (0..b.num_hidden_layers).map(|_| layer()).collect(),
                norm: RmsNorm::new(b.hidden_size, device).with_eps(b.rms_norm_eps),
            },
            lm_head: Linear::new(b.hidden_size, b.vocab_size, false, device),
            aux_loss_coef: cfg.router_aux_loss_coef,
        }
    }

    /// The weight α of the balance term.
    pub fn aux_loss_coef(&self) -> f64 {
        self.aux_loss_coef
    }

    /// Logits `[B, T, V]` for token ids `[B, T]` and every layer's [`Routing`].
    pub fn forward_routed(&self, ids: Tensor<2, Int>) -> (Tensor<3>, Vec<Routing>) {
        let mut x = embed(&self.model.embed_tokens, ids);
        let mut routing = Vec::with_capacity(self.model.layers.len());
        for l in &self.model.layers {
            let (y, r) = l.forward_routed(x);
            x = y;
            routing.push(r);
        }
        (head(&self.model.norm, &self.lm_head, x), routing)
    }

    /// Logits `[B, T, V]` (this rank's vocabulary slice under a loss-parallel plan).
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.forward_routed(ids).0
    }

    /// Mean cross-entropy over all `B·T` positions (vocab-parallel on sharded logits) plus α
    /// times the sequence-wise balance ([`balance`]).
    pub fn loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let (logits, routing) = self.forward_routed(ids);
        let ce = match self.lm_head.output_shard_group() {
            Some(group) => loss_parallel(logits, targets, &group),
            None => cross_entropy(logits, targets),
        };
        ce + balance(&routing).mul_scalar(self.aux_loss_coef)
    }
}

/// The load-balancing term of the notes over every layer's [`Routing`] ([`balance_of`] of
/// their sums).
pub fn balance(routing: &[Routing]) -> Tensor<1> {
    let first = routing.first().expect("at least one layer");
    let mut probs = first.probs.clone();
    let mut counts = first.counts.clone();
    for r in &routing[1..] {
        probs = probs + r.probs.clone();
        counts = counts + r.counts.clone();
    }
    balance_of(probs, counts, routing.len())
}

/// The load-balancing term of the notes, sequence-wise, from each token's probabilities and
/// top-k indicators summed over the model's `layers` layers (`[B, T, E]` each): for each
/// sequence b, over its T tokens of all L layers, f_e = (times e is among a token's top k) /
/// (L·T) (no gradient), P_e = mean of p_e over the same rows, balance_b = E · Σ_e f_e·P_e; the
/// mean over the sequences, `[1]`. Under a context-parallel scope a rank holds chunks of each
/// sequence: the counts and the probability sums are summed over the scope's group first (the
/// sums differentiably: the all-reduce's backward sums each rank's gradient back, and the
/// trainer's mean over cp leaves each rank's share), and T is the whole sequence's length.
pub fn balance_of(probs: Tensor<3>, counts: Tensor<3>, layers: usize) -> Tensor<1> {
    let [b, t, e] = probs.dims();
    let mut probs = probs.cast(DType::F32).sum_dim(1).reshape([b, e]);
    let mut counts = counts.detach().cast(DType::F32).sum_dim(1).reshape([b, e]);
    let mut t = t;
    if let Some(scope) = ContextScope::current() {
        probs = all_reduce(probs, &scope.group, ReduceOp::Sum);
        counts = all_reduce(counts, &scope.group, ReduceOp::Sum);
        t = scope.split.seq();
    }
    let rows = (layers * t) as f64;
    let per_sequence = (counts * probs).sum_dim(1).reshape([b]);
    per_sequence
        .mul_scalar(e as f64 / (rows * rows))
        .mean()
        .reshape([1])
}
