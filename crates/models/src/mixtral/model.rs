//! [`Mixtral`]: Hugging Face's `MixtralForCausalLM` written the Burn way — the Llama's
//! embedding, attention, norms and head ([`crate::decoder_layer`], [`crate::llama`]) with a
//! sparse mixture of experts ([`SparseMoe`]) as every layer's feed-forward, and the loss of
//! `shared/notes/parity-harness.md`: mean cross-entropy + α · the sequence-wise
//! load-balancing term ([`balance`], [`balance_of`]; under cp its sums cross the cp group in
//! forward only). Module paths are transformers 5's `state_dict()` names
//! (`model.layers.0.mlp.experts.gate_up_proj`).

use super::config::MixtralConfig;
use super::moe::{Routing, SparseMoe};
use crate::decoder_layer;
use crate::gpt::cross_entropy;
use crate::llama::{HeadWeights, embed, head, head_loss};
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_cp::ContextScope;
use bonfire_dtensor::functional::all_reduce;
use bonfire_tp::loss_parallel;
use bonfire_tp::{ParallelEmbedding, ParallelLinear, ParallelRmsNorm};
use burn::module::Module;
use burn::tensor::{DType, Device, Int, Tensor};

/// The Mixtral's decoder layer: the shared layer around its [`SparseMoe`].
pub type DecoderLayer = decoder_layer::DecoderLayer<SparseMoe>;

/// The decoder without its head (transformers' `MixtralModel`, the `model.` prefix).
#[derive(Module, Debug)]
pub struct MixtralModel {
    /// Token embeddings `[V, d]`.
    pub embed_tokens: ParallelEmbedding,
    /// The decoder layers.
    pub layers: Vec<DecoderLayer>,
    /// The final norm.
    pub norm: ParallelRmsNorm,
}

/// A Mixtral causal language model (transformers' `MixtralForCausalLM`).
#[derive(Module, Debug)]
pub struct Mixtral {
    /// The decoder.
    pub model: MixtralModel,
    /// The output projection `[V, d]` (untied).
    pub lm_head: ParallelLinear,
    aux_loss_coef: f64,
    /// Rows a block of the head's fused loss ([`Mixtral::with_fused_loss`]); `None`: the
    /// head's logits whole, then the loss.
    #[module(skip)]
    pub fused_loss_rows: Option<usize>,
}

impl Mixtral {
    /// A freshly initialized model (N(0, 0.02) weights, unit norms).
    pub fn new(cfg: &MixtralConfig, device: &Device) -> Self {
        let b = &cfg.base;
        let (d, e) = (b.hidden_size, cfg.num_local_experts);
        let layer = |i: usize| {
            let (f, k) = (b.intermediate_size, cfg.num_experts_per_tok);
            let mlp = match cfg.is_sparse(i) {
                true => SparseMoe::routed(d, f, (e, k), cfg.scoring(), cfg.shared_width(), device),
                false => SparseMoe::dense(d, cfg.dense_width(), e, device),
            };
            DecoderLayer::with_mlp(b, mlp, device)
        };
        Self {
            model: MixtralModel {
                embed_tokens: ParallelEmbedding::new(b.vocab_size, b.hidden_size, device),
                layers: (0..b.num_hidden_layers).map(layer).collect(),
                norm: ParallelRmsNorm::new(b.hidden_size, device).with_eps(b.rms_norm_eps),
            },
            lm_head: ParallelLinear::new(b.hidden_size, b.vocab_size, false, device),
            aux_loss_coef: cfg.router_aux_loss_coef,
            fused_loss_rows: None,
        }
    }

    /// [`Mixtral::loss`] with the head and its cross-entropy as one node by blocks of `rows`
    /// positions, where the head is not sharded: see [`crate::Gpt::with_fused_loss`].
    pub fn with_fused_loss(mut self, rows: impl Into<Option<usize>>) -> Self {
        self.fused_loss_rows = rows.into().map(|r| r.max(1));
        self
    }

    /// The weight α of the balance term.
    pub fn aux_loss_coef(&self) -> f64 {
        self.aux_loss_coef
    }

    /// Logits `[B, T, V]` for token ids `[B, T]` and every layer's [`Routing`].
    pub fn forward_routed(&self, ids: Tensor<2, Int>) -> (Tensor<3>, Vec<Routing>) {
        let (x, routing) = self.body_routed(ids);
        (head(&self.model.norm, &self.lm_head, x), routing)
    }

    /// The decoder layers' output `[B, T, d]` and every layer's [`Routing`].
    fn body_routed(&self, ids: Tensor<2, Int>) -> (Tensor<3>, Vec<Routing>) {
        let mut x = embed(&self.model.embed_tokens, ids);
        let mut routing = Vec::with_capacity(self.model.layers.len());
        for l in &self.model.layers {
            let (y, r) = l.forward_routed(x);
            x = y;
            routing.push(r);
        }
        (x, routing)
    }

    /// Logits `[B, T, V]` (this rank's vocabulary slice under a loss-parallel plan).
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.forward_routed(ids).0
    }

    /// Mean cross-entropy over all `B·T` positions (vocab-parallel on sharded logits) plus α
    /// times the sequence-wise balance ([`balance`]; none when α = 0, DeepSeek's).
    pub fn loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let (ce, routing) = match (self.lm_head.output_shard_group(), self.fused_loss_rows) {
            (_, Some(rows)) => {
                let (x, routing) = self.body_routed(ids);
                let weights = HeadWeights::Untied(&self.lm_head);
                (
                    head_loss(&self.model.norm, weights, x, targets, rows),
                    routing,
                )
            }
            (Some(group), None) => {
                let (logits, routing) = self.forward_routed(ids);
                (loss_parallel(logits, targets, &group), routing)
            }
            (None, None) => {
                let (logits, routing) = self.forward_routed(ids);
                (cross_entropy(logits, targets), routing)
            }
        };
        match self.aux_loss_coef {
            0.0 => ce,
            alpha => ce + balance(&routing).mul_scalar(alpha),
        }
    }
}

/// The load-balancing term of the notes over every sparse layer's [`Routing`]
/// ([`balance_of`] of their sums; dense layers route nothing and count in no L).
pub fn balance(routing: &[Routing]) -> Tensor<1> {
    let sparse: Vec<&Routing> = routing.iter().filter(|r| r.sparse).collect();
    let first = sparse.first().expect("at least one sparse layer");
    let mut probs = first.probs.clone();
    let mut counts = first.counts.clone();
    for r in &sparse[1..] {
        probs = probs + r.probs.clone();
        counts = counts + r.counts.clone();
    }
    balance_of(probs, counts, sparse.len())
}

/// The load-balancing term of the notes, sequence-wise, from each token's probabilities and
/// top-k indicators summed over the model's `layers` layers (`[B, T, E]` each): for each
/// sequence b, over its T tokens of all L layers, f_e = (times e is among a token's top k) /
/// (L·T) (no gradient), P_e = mean of p_e over the same rows, balance_b = E · Σ_e f_e·P_e; the
/// mean over the sequences, `[1]`. Under a context-parallel scope a rank holds chunks of each
/// sequence: the counts and the probability sums are summed over the scope's group first (the
/// sums with a gradient that takes no collective: [`sum_over_cp`]), and T is the whole
/// sequence's length.
pub fn balance_of(probs: Tensor<3>, counts: Tensor<3>, layers: usize) -> Tensor<1> {
    let [b, t, e] = probs.dims();
    let mut probs = probs.cast(DType::F32).sum_dim(1).reshape([b, e]);
    let mut counts = counts.detach().cast(DType::F32).sum_dim(1).reshape([b, e]);
    let mut t = t;
    if let Some(scope) = ContextScope::current() {
        probs = sum_over_cp(probs, &scope.group);
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

/// `sums` summed over the cp `group` (an all-reduce of the values), with a gradient that
/// takes no collective in backward: every rank of the group computes the same balance term
/// from the same totals, so the all-reduce's backward would add up `cp` equal gradients —
/// here each rank's own sums get `cp` times its gradient, the same value (the trainer's mean
/// over cp then leaves each rank its share).
///
/// Why no collective: this branch of the graph leaves the residual stream, along which the
/// ring attention's shifts and the experts' exchanges lie one after the other; Burn runs
/// backward by graph depth, so a collective here takes its place among those by depth, and
/// depths along the stream depend on the routing (a rank none of whose experts gets a row has
/// a shallower combine). With ep borrowed from cp two cp ranks met this all-reduce and an
/// expert exchange in opposite orders and deadlocked.
fn sum_over_cp(sums: Tensor<2>, group: &ProcessGroup) -> Tensor<2> {
    let total = all_reduce(sums.clone().detach(), group, ReduceOp::Sum);
    // The total's value (sums − sums is 0), cp times the identity's gradient.
    total + (sums.clone() - sums.detach()).mul_scalar(group.size() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bonfire_comm::ThreadWorld;
    use bonfire_cp::ContextSplit;
    use burn::tensor::TensorData;
    use std::time::Duration;

    fn values(t: Tensor<3>) -> Vec<f32> {
        t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
    }

    /// Under a cp scope the balance term equals one device's over the whole sequences, and its
    /// backward runs no collective: rank 0 back-propagates alone (its cp peer has left after
    /// forward), and its probabilities' gradient is cp times one device's for its tokens.
    #[test]
    fn balance_under_cp_equals_one_device_and_takes_no_collective_in_backward() {
        let (b, t, e, cp) = (2, 8, 4, 2);
        let probs: Vec<f32> = (0..b * t * e)
            .map(|i| (i * 7 % 11 + 1) as f32 / 16.0)
            .collect();
        let counts: Vec<f32> = (0..b * t * e).map(|i| (i % 3 == 0) as u8 as f32).collect();
        let make = |v: &[f32], device: &Device| {
            Tensor::<3>::from_data(TensorData::new(v.to_vec(), [b, t, e]), device)
        };
        let device = Device::flex().autodiff();
        let p = make(&probs, &device).require_grad();
        let whole = balance_of(p.clone(), make(&counts, &device), 1);
        let want_grad = p.grad(&whole.clone().backward()).unwrap();
        let want = whole.into_data().try_to_vec::<f32>().unwrap()[0];
        let split = ContextSplit::new(t, cp, true).unwrap();
        let ranks = ThreadWorld::new(cp)
            .timeout(Duration::from_secs(20))
            .launch(|group| {
                let (r, device) = (group.rank(), Device::flex().autodiff());
                let local = |v: &[f32]| split.local(make(v, &device), 1, r);
                let p = local(&probs).detach().require_grad();
                let _scope = ContextScope { group, split }.enter();
                let bal = balance_of(p.clone(), local(&counts), 1);
                let value = bal.clone().into_data().try_to_vec::<f32>().unwrap()[0];
                let grad = (r == 0).then(|| values(p.grad(&bal.backward()).unwrap()));
                (value, grad)
            })
            .unwrap_or_else(|err| panic!("{err}"));
        let want_local = values(split.local(want_grad, 1, 0).mul_scalar(cp as f64));
        for (r, (value, _)) in ranks.iter().enumerate() {
            assert!(
                (value - want).abs() <= 1e-6 * want.abs(),
                "rank {r}: {value} vs {want}"
            );
        }
        let got = ranks[0].1.as_ref().unwrap();
        for (g, w) in got.iter().zip(&want_local) {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                "{got:?} vs {want_local:?}"
            );
        }
    }
}
