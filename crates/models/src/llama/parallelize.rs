//! How the Llama is parallelized, from outside its code: its [`ParallelModel`] description —
//! the tensor-parallel plan (torchtitan's Llama plan), the checks a plan cannot see, the
//! layers it runs through `bonfire_module::layer`, and its pipeline pieces, which run the
//! very functions [`Llama::forward`] runs ([`embed`], `DecoderLayer::forward`, [`head`]),
//! the decoder layers among them checkpointable.
//!
//! | module | without SP | with sequence parallelism |
//! |---|---|---|
//! | `model.embed_tokens` | vocab-parallel (row-wise), output all-reduced | vocab-parallel, output reduce-scattered along the sequence |
//! | `model.layers.*.input_layernorm`, `post_attention_layernorm`, `model.norm` | replicated | `SequenceParallel` |
//! | `self_attn.q_proj`, `k_proj`, `v_proj`, `mlp.gate_proj`, `up_proj` | column-wise | column-wise, input all-gathered along the sequence |
//! | `self_attn.o_proj`, `mlp.down_proj` | row-wise, output all-reduced | row-wise, output reduce-scattered along the sequence |
//! | `lm_head` | column-wise, output gathered (or kept vocab-sharded for `loss_parallel`) | the same, input all-gathered along the sequence |
//!
//! Rank r of tp holds query heads r·h/tp .. (r+1)·h/tp, so tp divides h. When tp also
//! divides the key/value heads h_kv, rank r holds kv heads r·h_kv/tp .. (r+1)·h_kv/tp — the
//! ones its query heads attend with. When tp is a multiple of h_kv (more ranks than kv heads,
//! as in Llama 3 70B's 8 kv heads on tp = 16), the key/value projections stay whole on every
//! rank (`ReplicateParallel`): each rank computes every kv head and attends with the one its
//! query heads need, and the projections' gradients — each rank's from the heads it used —
//! are summed over tp. (That keeps h_kv·hd·d values of each projection per rank where
//! Megatron keeps hd·d; the planner does not search tp above the kv heads yet.)

use super::model::tied_head;
use super::model::{DecoderLayer, HeadWeights, Llama, LlamaAttention, embed, head, head_loss};
use crate::data::TokenBatch;
use crate::decoder::fuse_head;
use crate::decoder::{DecoderStyles, HeadLoss, Piece, PieceStep, decoder_pieces, divisible};
use crate::decoder::{token_input, token_loss};
use bonfire_layout::{Axis, LayoutError, ParallelDims};
use bonfire_module::tied::Borrowed;
use bonfire_parallel::{ParallelModel, Pipeline, PipelineVisitor};
use bonfire_tp::{ParallelEmbedding, ParallelLinear, ParallelRmsNorm};
use bonfire_tp::{ParallelPlan, ParallelStyle, ReplicateParallel};
use burn::module::Module;
use burn::tensor::{Int, Tensor};

/// The Llama's tensor-parallel plan (see the module docs); `replicate_kv`: the key/value
/// projections stay whole on every rank ([`ReplicateParallel`]) — when tp exceeds the
/// key/value heads — instead of column-wise.
pub fn llama_tp_plan(
    sequence_parallel: bool,
    loss_parallel: bool,
    replicate_kv: bool,
    attention: Option<&LlamaAttention>,
) -> ParallelPlan {
    let st = DecoderStyles::new(sequence_parallel, loss_parallel);
    attention_tp_plan(sequence_parallel, loss_parallel, replicate_kv, attention)
        .add("model.layers.*.mlp.gate_proj", st.colwise)
        .add("model.layers.*.mlp.up_proj", st.colwise)
        .add("model.layers.*.mlp.down_proj", st.rowwise)
}

/// The plan of every Llama-family decoder without its feed-forward: the embedding, the
/// attention projections (and, when `attention` — a layer's — has them, its q/k norms), the
/// norms under sequence parallelism and the head (the Llama adds its MLP; the Mixtral keeps
/// its router and experts whole on every rank).
pub fn attention_tp_plan(
    sequence_parallel: bool,
    loss_parallel: bool,
    replicate_kv: bool,
    attention: Option<&LlamaAttention>,
) -> ParallelPlan {
    let st = DecoderStyles::new(sequence_parallel, loss_parallel);
    let kv: ParallelStyle = match replicate_kv {
        true => ReplicateParallel::default()
            .input_layout(st.colwise.input_layout)
            .into(),
        false => st.colwise.into(),
    };
    let mut plan = ParallelPlan::new().add("model.embed_tokens", st.embedding);
    let parts = match attention.and_then(LlamaAttention::mla) {
        // Latent attention splits its heads: the query's last projection and the latent's
        // up-projection; the down-projections and their norms stay whole.
        Some(m) => vec![
            (m.query_projection(), st.colwise.into()),
            ("kv_b_proj", st.colwise.into()),
        ],
        None => vec![
            ("q_proj", st.colwise.into()),
            ("k_proj", kv),
            ("v_proj", kv),
        ],
    };
    for (part, style) in parts {
        plan = plan.add(format!("model.layers.*.self_attn.{part}"), style);
    }
    plan = plan
        .add("model.layers.*.self_attn.o_proj", st.rowwise)
        .add("lm_head", st.head);
    if attention.is_some_and(|a| a.q_norm.is_some()) {
        // Each rank normalizes its own heads with the one replicated weight: its gradient is
        // partial per rank and summed over tp (the norm style of sequence parallelism).
        for part in ["q_norm", "k_norm"] {
            plan = plan.add(
                format!("model.layers.*.self_attn.{part}"),
                bonfire_tp::SequenceParallel::default(),
            );
        }
    }
    if let Some(sp) = st.norm {
        for path in [
            "model.layers.*.input_layernorm",
            "model.layers.*.post_attention_layernorm",
            "model.norm",
        ] {
            plan = plan.add(path, sp);
        }
    }
    plan
}

/// Query heads and key/value heads of `a` must split over tp (the kv heads evenly, or tp a
/// multiple of them: then they stay whole on every rank); latent attention's heads evenly.
pub fn check_attention_tp(a: &LlamaAttention, tp: usize) -> Result<(), LayoutError> {
    if let Some(m) = a.mla() {
        return divisible_tp(tp, "num_attention_heads", m.heads(a));
    }
    let (q, kv) = (a.queries().weight.dims()[0], a.keys().weight.dims()[0]);
    let hd = a.head_dim();
    divisible_tp(tp, "num_attention_heads", q / hd)?;
    if kv / hd < tp && !tp.is_multiple_of(kv / hd) {
        return Err(LayoutError::axis(
            Axis::Tp,
            tp,
            format!(
                "tp is neither a divisor nor a multiple of num_key_value_heads {}",
                kv / hd
            ),
        ));
    }
    if kv / hd >= tp {
        divisible_tp(tp, "num_key_value_heads", kv / hd)?;
    }
    Ok(())
}

/// Whether `tp` exceeds the kv heads of `attention` (a decoder's first layer's; none: 1):
/// each kv head is then whole on several tp ranks rather than split
/// ([`attention_tp_plan`]'s `replicate_kv`).
pub fn replicates_kv(attention: Option<&LlamaAttention>, tp: usize) -> bool {
    tp > attention.map_or(1, LlamaAttention::kv_heads)
}

/// `Ok` when tp divides `value` (`what`).
fn divisible_tp(degree: usize, what: &str, value: usize) -> Result<(), LayoutError> {
    divisible(Axis::Tp, degree, what, value)
}

impl ParallelModel for Llama {
    type Batch = TokenBatch;

    fn loss(&self, (ids, targets): TokenBatch) -> Tensor<1> {
        Llama::loss(self, ids, targets)
    }

    /// Query heads, key/value heads, the vocabulary and the MLP width must split evenly
    /// over tp.
    fn check_layout(&self, dims: &ParallelDims) -> Result<(), LayoutError> {
        let tp = dims.tp();
        if let Some(l) = self.model.layers.first() {
            check_attention_tp(&l.self_attn, tp)?;
            divisible_tp(tp, "intermediate_size", l.mlp.gate_proj.weight.dims()[0])?;
        }
        let Some(lm_head) = &self.lm_head else {
            // Tied: the head is the embedding — under tp its vocab-parallel shard serves as the
            // column-parallel head (the logits gathered, or kept sharded under loss
            // parallelism); under pp the first stage owns it and lends it to the last.
            let vocab = self.model.embed_tokens.weight.dims()[0];
            return divisible_tp(tp, "vocab_size", vocab);
        };
        divisible_tp(tp, "vocab_size", lm_head.weight.dims()[0])
    }

    crate::token_sequence_hooks!();

    /// Key/value projections column-wise when tp divides their heads, whole on every rank
    /// when tp is a multiple of them (see [`llama_tp_plan`]).
    fn tensor_parallel_plan(&self, dims: &ParallelDims) -> Option<ParallelPlan> {
        let o = dims.tp_options;
        let attention = self.model.layers.first().map(|l| &l.self_attn);
        let replicate_kv = replicates_kv(attention, dims.tp());
        let plan = llama_tp_plan(
            o.sequence_parallel,
            o.loss_parallel,
            replicate_kv,
            attention,
        );
        Some(match self.lm_head {
            Some(_) => plan,
            // Tied: the embedding's vocab-parallel shard is the head's (`tied_head`).
            None => plan.without("lm_head"),
        })
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
        out.push("model.norm".to_string());
        if self.lm_head.is_some() {
            out.push("lm_head".to_string());
        }
        out
    }

    /// The embedding, each decoder layer, the final norm with the head; token ids enter as
    /// floats `[B, T, 1]`; the loss is cross-entropy, vocab-parallel when the head's logits
    /// stay sharded. The decoder layers are the checkpointable layers. A tied model's head
    /// piece borrows the embedding's table: on one rank (activation checkpointing) the same
    /// parameter, whose gradient sums both uses; under a pipeline the first stage owns it
    /// and lends it to the last each step (`bonfire_module::tied`).
    fn pipeline<V: PipelineVisitor<TokenBatch>>(self, visitor: V) -> Option<V::Output> {
        let layers: Vec<String> = (0..self.model.layers.len())
            .map(|i| format!("model.layers.{i}"))
            .collect();
        let sharded = match &self.lm_head {
            Some(head) => head.output_shard_group(),
            None => self.model.embed_tokens.logits_shard_group(),
        };
        let loss = token_loss(sharded);
        let tied = self
            .lm_head
            .is_none()
            .then_some(self.model.embed_tokens.weight.id);
        let rows = self.fused_loss_rows;
        let mut pipeline = fuse_head(Pipeline::new(pieces(self), token_input, loss), rows);
        if let Some(table) = tied {
            pipeline = pipeline.with_borrowed(table, "model.norm");
        }
        Some(visitor.visit(pipeline.with_checkpointable(layers)))
    }
}

/// The final norm and the output projection (the last piece): `lm_head`, or a tied model's
/// embedding table (the same parameter as the first piece's).
#[derive(Module, Debug)]
pub struct LlamaHead {
    /// `model.norm`.
    pub norm: ParallelRmsNorm,
    /// `lm_head` (untied).
    pub lm_head: Option<ParallelLinear>,
    /// `model.embed_tokens` (tied), borrowed from the first piece: not a parameter of its
    /// own (`bonfire_module::tied`).
    pub tied: Option<Borrowed<ParallelEmbedding>>,
}

/// One piece of the Llama as a pipeline block: activations are `[B, T, d]`; the embedding
/// reads token ids as floats `[B, T, 1]`, the head writes logits `[B, T, V]`.
pub type LlamaPiece = Piece<ParallelEmbedding, DecoderLayer, LlamaHead>;

/// The Llama family's embedding step (token ids as floats in).
impl PieceStep for ParallelEmbedding {
    fn step(&self, x: Tensor<3>) -> Tensor<3> {
        embed(self, x.squeeze_dim::<2>(2).int())
    }
}

impl PieceStep for DecoderLayer {
    fn step(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward(x)
    }
}

impl PieceStep for LlamaHead {
    fn step(&self, x: Tensor<3>) -> Tensor<3> {
        match (&self.lm_head, &self.tied) {
            (Some(lm_head), _) => head(&self.norm, lm_head, x),
            (None, Some(table)) => tied_head(&self.norm, table.module(), x),
            (None, None) => unreachable!("a head piece has a head"),
        }
    }
}

impl HeadLoss for LlamaHead {
    fn loss(&self, x: Tensor<3>, targets: Tensor<2, Int>, rows: usize) -> Tensor<1> {
        let weights = match (&self.lm_head, &self.tied) {
            (Some(lm_head), _) => HeadWeights::Untied(lm_head),
            (None, Some(table)) => HeadWeights::Tied(table.module()),
            (None, None) => unreachable!("a head piece has a head"),
        };
        head_loss(&self.norm, weights, x, targets, rows)
    }
}

/// The Llama's pieces in order, named by the module path where each begins:
/// `model.embed_tokens`, `model.layers.0`, …, `model.norm` (parameters in the model's order).
pub fn pieces(model: Llama) -> Vec<(String, LlamaPiece)> {
    let Llama { model, lm_head, .. } = model;
    let head = LlamaHead {
        norm: model.norm,
        tied: lm_head
            .is_none()
            .then(|| Borrowed::new(model.embed_tokens.clone())),
        lm_head,
    };
    decoder_pieces(
        ("model.embed_tokens", model.embed_tokens),
        ("model.layers", model.layers),
        ("model.norm", head),
    )
}
