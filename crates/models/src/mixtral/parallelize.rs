//! How the Mixtral is parallelized, from outside its code: its [`ParallelModel`].
//!
//! - Data parallelism and ZeRO: the balance term is a mean over sequences, so the mean over
//!   replicas of each replica's loss is the global loss.
//! - Context parallelism: a rank holds chunks of every sequence; [`super::balance`] sums the
//!   counts and the probability sums over the scope's cp group.
//! - Tensor parallelism: the attention's plan is the Llama's ([`attention_tp_plan`]: heads
//!   split — latent attention's too —, the embedding vocab-parallel, the head column-wise,
//!   loss parallelism); the router and the routed experts stay whole (replicated) on every tp
//!   rank, each computing the same routing from the same replicated input; dense layers' MLPs
//!   and DeepSeek's shared experts split as the Llama's MLP. Sequence parallelism is refused (it would hand
//!   each tp rank a part of the sequence for the replicated experts).
//! - Expert parallelism: [`ParallelModel::experts`] names each layer's fused experts; a rank
//!   keeps its `E/ep` of them and its [`super::moe::SparseMoe`] exchanges the grouped tokens
//!   over the ep group (`bonfire_ep::run_experts`). The router stays whole.
//! - Pipeline parallelism (every schedule) and activation checkpointing: [`super::pipeline`]'s
//!   pieces carry each token's routing with the activations, so the balance term over all
//!   layers is exact on the last stage.

use super::model::Mixtral;
use super::pipeline;
use crate::data::TokenBatch;
use crate::decoder::{divisible, fuse_head, token_input};
use crate::llama::parallelize::{attention_tp_plan, check_attention_tp, replicates_kv};
use bonfire_layout::{Axis, LayoutError, ParallelDims};
use bonfire_parallel::{ParallelModel, Pipeline, PipelineVisitor};
use bonfire_tp::ParallelPlan;
use burn::tensor::Tensor;

impl Mixtral {
    /// The layers whose feed-forward is a dense MLP.
    fn dense_layers(&self) -> impl Iterator<Item = &super::model::DecoderLayer> {
        self.model.layers.iter().filter(|l| !l.mlp.is_sparse())
    }
}

impl ParallelModel for Mixtral {
    type Batch = TokenBatch;

    fn loss(&self, (ids, targets): TokenBatch) -> Tensor<1> {
        Mixtral::loss(self, ids, targets)
    }

    /// Refuses sequence parallelism (see the module docs); query heads, key/value heads and
    /// the vocabulary must split over tp.
    fn check_layout(&self, dims: &ParallelDims) -> Result<(), LayoutError> {
        let tp = dims.tp();
        if tp > 1 && dims.tp_options.sequence_parallel {
            return Err(LayoutError::axis(
                Axis::Tp,
                tp,
                "sequence parallelism is not supported for the Mixtral (its router and \
                 experts are replicated over tp)",
            ));
        }
        if let Some(l) = self.model.layers.first() {
            check_attention_tp(&l.self_attn, tp)?;
        }
        if let Some(p) = self
            .dense_layers()
            .next()
            .and_then(|l| l.mlp.gate_proj.as_ref())
        {
            divisible(Axis::Tp, tp, "intermediate_size", p.weight.dims()[0])?;
        }
        let shared = self
            .model
            .layers
            .iter()
            .find_map(|l| l.mlp.shared_experts.as_ref());
        if let Some(m) = shared {
            let width = m.gate_proj.weight.dims()[0];
            divisible(Axis::Tp, tp, "the shared experts' width", width)?;
        }
        divisible(Axis::Tp, tp, "vocab_size", self.lm_head.weight.dims()[0])
    }

    crate::token_sequence_hooks!();

    /// The Llama's attention plan; the router and experts are in no entry (replicated); a
    /// dense layer's MLP is the Llama's (column-wise in, row-wise out).
    fn tensor_parallel_plan(&self, dims: &ParallelDims) -> Option<ParallelPlan> {
        let o = dims.tp_options;
        let attention = self.model.layers.first().map(|l| &l.self_attn);
        let mut plan = attention_tp_plan(
            o.sequence_parallel,
            o.loss_parallel,
            replicates_kv(attention, dims.tp()),
            attention,
        );
        let st = crate::decoder::DecoderStyles::new(o.sequence_parallel, o.loss_parallel);
        for (i, l) in self.model.layers.iter().enumerate() {
            let mlp = match (l.mlp.is_sparse(), l.mlp.shared_experts.is_some()) {
                (false, _) => format!("model.layers.{i}.mlp"),
                (true, true) => format!("model.layers.{i}.mlp.shared_experts"),
                (true, false) => continue,
            };
            plan = plan
                .add(format!("{mlp}.gate_proj"), st.colwise)
                .add(format!("{mlp}.up_proj"), st.colwise)
                .add(format!("{mlp}.down_proj"), st.rowwise);
        }
        Some(plan)
    }

    /// The embedding, each decoder layer, the final norm with the head; token ids enter as
    /// floats `[B, T, 1]`; activations carry the routing (see [`super::pipeline`]). The decoder
    /// layers are the checkpointable layers.
    fn pipeline<V: PipelineVisitor<TokenBatch>>(self, visitor: V) -> Option<V::Output> {
        let layers = self.model.layers.len();
        let (experts, sparse) = pipeline::routing_shape(&self);
        let names: Vec<String> = (0..layers).map(|i| format!("model.layers.{i}")).collect();
        let alpha = self.aux_loss_coef();
        let loss = pipeline::loss(self.lm_head.output_shard_group(), experts, sparse, alpha);
        let rows = self.fused_loss_rows;
        let pieces = fuse_head(
            Pipeline::new(pipeline::pieces(self), token_input, loss),
            rows,
        );
        Some(visitor.visit(pieces.with_checkpointable(names)))
    }

    /// Each sparse layer's fused experts (`[E, 2F, d]`, `[E, d, F]`): expert parallelism
    /// keeps a rank's `E/ep` of them.
    fn experts(&self) -> Vec<String> {
        let layers = self.model.layers.iter().enumerate();
        layers
            .filter(|(_, l)| l.mlp.is_sparse())
            .map(|(i, _)| format!("model.layers.{i}.mlp.experts"))
            .collect()
    }

    fn layers(&self) -> Vec<String> {
        let mut out = vec!["model.embed_tokens".to_string()];
        for i in 0..self.model.layers.len() {
            for part in [
                "input_layernorm",
                "self_attn",
                "post_attention_layernorm",
                "mlp",
            ] {
                out.push(format!("model.layers.{i}.{part}"));
            }
        }
        out.extend(["model.norm".to_string(), "lm_head".to_string()]);
        out
    }
}
