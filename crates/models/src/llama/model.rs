//! [`Llama`]: Hugging Face's `LlamaForCausalLM` written the Burn way — RMSNorm, rotary
//! embeddings (rotate-half), grouped-query attention, a SwiGLU MLP, an untied head, no biases
//! (the math of `shared/notes/parity-harness.md`, "Llama-family models"). Module paths are
//! transformers' `state_dict()` names (`model.layers.0.self_attn.q_proj.weight`), weights in
//! PyTorch layout (`[out, in]`), so Hugging Face safetensors load with no renaming. Attention
//! and the decoder layer are [`crate::decoder_layer`]'s, shared with the Mixtral.

use super::config::LlamaConfig;
use crate::decoder_layer::{self, FeedForward};
use crate::gpt::{cross_entropy, fused_head_loss, head_loss_by_blocks};
use bonfire_comm::ProcessGroup;
use bonfire_module::layer;
use bonfire_tp::loss_parallel;
use bonfire_tp::{ParallelEmbedding, ParallelLinear, ParallelRmsNorm};
use burn::module::Module;
use burn::tensor::activation::silu;
use burn::tensor::{Device, Int, Tensor};

pub use crate::decoder_layer::{LlamaAttention, rope_tables, rotate};

/// `down(SiLU(gate(x)) ⊙ up(x))`.
#[derive(Module, Debug)]
pub struct Mlp {
    /// `[F, d]`.
    pub gate_proj: ParallelLinear,
    /// `[F, d]`.
    pub up_proj: ParallelLinear,
    /// `[d, F]`.
    pub down_proj: ParallelLinear,
}

impl Mlp {
    /// Normal(0, 0.02) projections.
    pub fn new(d: usize, f: usize, device: &Device) -> Self {
        Self {
            gate_proj: ParallelLinear::new(d, f, false, device),
            up_proj: ParallelLinear::new(d, f, false, device),
            down_proj: ParallelLinear::new(f, d, false, device),
        }
    }

    /// The MLP on `[B, T, d]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        swiglu_mlp([&self.gate_proj, &self.up_proj, &self.down_proj], x)
    }
}

/// `down(SiLU(gate(x)) ⊙ up(x))` on `[B, T, d]` for the projections `[gate, up, down]`: the
/// [`Mlp`]'s math, and a mixture of experts' dense layers'.
pub fn swiglu_mlp([gate, up, down]: [&ParallelLinear; 3], x: Tensor<3>) -> Tensor<3> {
    let (g, u) = (gate.forward(x.clone()), up.forward(x));
    down.forward(swiglu(g, u))
}

/// `silu(gate) ⊙ up`: one fused node where bonfire-kernels fuses the type on the device (f32;
/// 16-bit on CubeCL: [`bonfire_kernels::fuses`]), else Burn's ops.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    match gate.dtype() == up.dtype() && bonfire_kernels::fused::takes(&gate) {
        true => bonfire_kernels::silu_mul(gate, up),
        false => silu(gate) * up,
    }
}

/// The Llama's decoder layer: the shared layer around its SwiGLU [`Mlp`].
pub type DecoderLayer = decoder_layer::DecoderLayer<Mlp>;

impl FeedForward for Mlp {
    type Routing = ();

    fn forward_routed(&self, x: Tensor<3>) -> (Tensor<3>, ()) {
        (self.forward(x), ())
    }
}

impl DecoderLayer {
    /// A fresh layer of `cfg`.
    pub fn new(cfg: &LlamaConfig, device: &Device) -> Self {
        Self::with_mlp(
            cfg,
            Mlp::new(cfg.hidden_size, cfg.intermediate_size, device),
            device,
        )
    }
}

/// The decoder without its head (transformers' `LlamaModel`, the `model.` prefix).
#[derive(Module, Debug)]
pub struct LlamaModel {
    /// Token embeddings `[V, d]`.
    pub embed_tokens: ParallelEmbedding,
    /// The decoder layers.
    pub layers: Vec<DecoderLayer>,
    /// The final norm.
    pub norm: ParallelRmsNorm,
}

/// A Llama causal language model (transformers' `LlamaForCausalLM`).
#[derive(Module, Debug)]
pub struct Llama {
    /// The decoder.
    pub model: LlamaModel,
    /// The output projection `[V, d]`; `None` when tied: the head is `model.embed_tokens`.
    pub lm_head: Option<ParallelLinear>,
    /// Rows a block of the head's fused loss ([`Llama::with_fused_loss`]); `None`: the head's
    /// logits whole, then the loss.
    #[module(skip)]
    pub fused_loss_rows: Option<usize>,
}

impl Llama {
    /// A freshly initialized model (transformers' init: N(0, 0.02) weights, unit norms).
    pub fn new(cfg: &LlamaConfig, device: &Device) -> Self {
        Self {
            model: LlamaModel {
                embed_tokens: ParallelEmbedding::new(cfg.vocab_size, cfg.hidden_size, device),
                layers: (0..cfg.num_hidden_layers)
                    .map(|_| DecoderLayer::new(cfg, device))
                    .collect(),
                norm: ParallelRmsNorm::new(cfg.hidden_size, device).with_eps(cfg.rms_norm_eps),
            },
            lm_head: (!cfg.variant.tie_word_embeddings)
                .then(|| ParallelLinear::new(cfg.hidden_size, cfg.vocab_size, false, device)),
            fused_loss_rows: None,
        }
    }

    /// [`Llama::loss`] with the head (tied or not) and the loss as one node by blocks of
    /// `rows` positions, where the head is not sharded: see [`crate::Gpt::with_fused_loss`].
    pub fn with_fused_loss(mut self, rows: impl Into<Option<usize>>) -> Self {
        self.fused_loss_rows = rows.into().map(|r| r.max(1));
        self
    }

    /// Logits `[B, T, V]` for token ids `[B, T]` (this rank's vocabulary slice under a
    /// loss-parallel plan). The same steps are the pipeline's pieces: [`embed`], the
    /// layers, [`head`].
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let x = self.body(ids);
        match &self.lm_head {
            Some(lm_head) => head(&self.model.norm, lm_head, x),
            None => tied_head(&self.model.norm, &self.model.embed_tokens, x),
        }
    }

    /// Mean cross-entropy over all `B·T` positions (vocab-parallel on sharded logits: an
    /// untied head's, or a tied one's under loss parallelism).
    pub fn loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let weights = match &self.lm_head {
            Some(lm_head) => HeadWeights::Untied(lm_head),
            None => HeadWeights::Tied(&self.model.embed_tokens),
        };
        if let Some(rows) = self.fused_loss_rows {
            return head_loss(&self.model.norm, weights, self.body(ids), targets, rows);
        }
        match weights.shard_group() {
            Some(group) => loss_parallel(self.forward(ids), targets, &group),
            None => cross_entropy(self.forward(ids), targets),
        }
    }

    /// The decoder layers' output `[B, T, d]` for token ids `[B, T]`.
    fn body(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let mut x = embed(&self.model.embed_tokens, ids);
        for l in &self.model.layers {
            x = l.forward(x);
        }
        x
    }
}

/// `embed_tokens[ids]`: `[B, T]` ids to `[B, T, d]`.
pub fn embed(embed_tokens: &ParallelEmbedding, ids: Tensor<2, Int>) -> Tensor<3> {
    layer(embed_tokens, &ids).forward(ids.clone())
}

/// `RMSNorm(x)·Eᵀ` with the embedding table `E` `[V, d]` (tied embeddings): `[B, T, d]` to
/// logits ([`ParallelEmbedding::tied_head`]: under tp each rank multiplies by its vocabulary
/// rows and the logits are gathered). Entered as the embedding's layer a second time, so that
/// a wrapper that gathers parameters layer by layer (ZeRO-3) gathers the table again for it —
/// with no float input, as the embedding itself is entered (its ids): the table's gradient,
/// the sum of both uses, is then collected once backward is over rather than hooked at one
/// use.
pub fn tied_head(
    norm: &ParallelRmsNorm,
    embed_tokens: &ParallelEmbedding,
    x: Tensor<3>,
) -> Tensor<3> {
    let h = layer(norm, &x).forward(x.clone());
    let no_anchor = Tensor::<1, Int>::zeros([1], &h.device());
    layer(embed_tokens, &no_anchor).tied_head(h)
}

/// A Llama's head weights: `lm_head`, or (tied) the embedding's table.
#[derive(Clone, Copy)]
pub enum HeadWeights<'a> {
    /// `lm_head`.
    Untied(&'a ParallelLinear),
    /// `model.embed_tokens`, read as the head.
    Tied(&'a ParallelEmbedding),
}

impl HeadWeights<'_> {
    /// The group the head's logits stay sharded over (loss parallelism), if any.
    pub fn shard_group(&self) -> Option<ProcessGroup> {
        match self {
            HeadWeights::Untied(lm_head) => lm_head.output_shard_group(),
            HeadWeights::Tied(table) => table.logits_shard_group(),
        }
    }
}

/// The mean cross-entropy of the head on `RMSNorm(x)` against `targets`, the head fused with
/// the loss by blocks of `rows` positions ([`fused_head_loss`]; a tied table through
/// `tied_cross_entropy`) — vocab-parallel on its logits where they stay sharded.
/// [`Llama::loss`] and the pipeline's head piece run it.
pub fn head_loss(
    norm: &ParallelRmsNorm,
    weights: HeadWeights,
    x: Tensor<3>,
    targets: Tensor<2, Int>,
    rows: usize,
) -> Tensor<1> {
    if let Some(group) = weights.shard_group() {
        let logits = match weights {
            HeadWeights::Untied(lm_head) => head(norm, lm_head, x),
            HeadWeights::Tied(table) => tied_head(norm, table, x),
        };
        return loss_parallel(logits, targets, &group);
    }
    let h = layer(norm, &x).forward(x.clone());
    match weights {
        HeadWeights::Untied(lm_head) => fused_head_loss(&layer(lm_head, &x), h, targets, rows),
        HeadWeights::Tied(table) => {
            let no_anchor = Tensor::<1, Int>::zeros([1], &h.device());
            let table = layer(table, &no_anchor);
            head_loss_by_blocks(
                h,
                targets,
                |h, t| table.tied_cross_entropy(h, t, rows),
                |h| table.tied_head(h),
            )
        }
    }
}

/// `lm_head(RMSNorm(x))`: `[B, T, d]` to logits.
pub fn head(norm: &ParallelRmsNorm, lm_head: &ParallelLinear, x: Tensor<3>) -> Tensor<3> {
    let h = layer(norm, &x).forward(x.clone());
    layer(lm_head, &x).forward(h)
}
