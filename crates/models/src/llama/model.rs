//! [`Llama`]: Hugging Face's `LlamaForCausalLM` written the Burn way — RMSNorm, rotary
//! embeddings (rotate-half), grouped-query attention, a SwiGLU MLP, an untied head, no biases
//! (the math of `shared/notes/parity-harness.md`, "Llama-family models"). Module paths are
//! transformers' `state_dict()` names (`model.layers.0.self_attn.q_proj.weight`), weights in
//! PyTorch layout (`[out, in]`), so Hugging Face safetensors load with no renaming.

use super::config::LlamaConfig;
use crate::gpt::attention::{causal_attention, merge_heads, split_heads};
use crate::gpt::cross_entropy;
use crate::layers::{Embedding, Linear, RmsNorm};
use bonfire_dtensor::layer;
use bonfire_dtensor::parallel::loss_parallel;
use burn::module::Module;
use burn::tensor::activation::silu;
use burn::tensor::{Device, Int, Tensor, TensorData};

/// Self-attention with rotary positions and `h / h_kv` query heads per key/value head.
#[derive(Module, Debug)]
pub struct Attention {
    /// Queries: `[h·hd, d]`.
    pub q_proj: Linear,
    /// Keys: `[h_kv·hd, d]`.
    pub k_proj: Linear,
    /// Values: `[h_kv·hd, d]`.
    pub v_proj: Linear,
    /// Output: `[d, h·hd]`.
    pub o_proj: Linear,
    head_dim: usize,
    rope_theta: f64,
}

impl Attention {
    /// Normal(0, 0.02) projections for `cfg`.
    pub fn new(cfg: &LlamaConfig, device: &Device) -> Self {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        Self {
            q_proj: Linear::new(d, q, false, device),
            k_proj: Linear::new(d, kv, false, device),
            v_proj: Linear::new(d, kv, false, device),
            o_proj: Linear::new(q, d, false, device),
            head_dim: hd,
            rope_theta: cfg.rope_theta,
        }
    }

    /// Features per head (hd).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The key/value heads of the whole layer.
    pub fn kv_heads(&self) -> usize {
        self.k_proj.weight.dims()[0] / self.head_dim
    }

    /// `x` `[B, T, d]` → `[B, T, d]`. Query head `j` attends with kv head `⌊j·h_kv/h⌋`; the
    /// head counts and this rank's heads are read from the projections: under tensor
    /// parallelism `q_proj` holds this rank's query heads, and `k_proj`/`v_proj` either the
    /// kv heads they attend with (column-wise) or every kv head (kept whole). Under a
    /// context-parallel scope the sequence is this rank's chunks (RoPE at their positions) and
    /// attention is ring attention over the whole sequence.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let hd = self.head_dim;
        let q = split_heads(self.q_proj.forward(x.clone()), hd);
        let k = split_heads(self.k_proj.forward(x.clone()), hd);
        let v = split_heads(self.v_proj.forward(x), hd);
        let positions = bonfire_dtensor::context::positions(q.dims()[2]);
        let (cos, sin) = rope_tables(&positions, hd, self.rope_theta, &q.device());
        let q = rotate(q, &cos, &sin);
        let k = rotate(k, &cos, &sin);
        let heads = self.kv_of_queries(q.dims()[1], k.dims()[1], &q.device());
        // Query head j attends with local kv head ⌊j·h_kv/h⌋ unless tp replicated the kv
        // heads: then they are repeated here, and travel repeated under context parallelism.
        let grouped =
            self.q_proj.colwise_shard().is_none() || self.k_proj.colwise_shard().is_some();
        let (k, v) = match grouped {
            true => (k, v),
            false => (k.select(1, heads.clone()), v.select(1, heads.clone())),
        };
        let y = bonfire_dtensor::context::attention(q, k, v, |q, k, v| {
            match k.dims()[1] == q.dims()[1] {
                true => causal_attention(q, k, v),
                false => causal_attention(q, k.select(1, heads.clone()), v.select(1, heads)),
            }
        });
        self.o_proj.forward(merge_heads(y))
    }

    /// For each of this rank's `local_q` query heads, the index among its `local_kv`
    /// key/value heads of the one it attends with.
    fn kv_of_queries(&self, local_q: usize, local_kv: usize, device: &Device) -> Tensor<1, Int> {
        let (rank, tp) = self.q_proj.colwise_shard().unwrap_or((0, 1));
        let (kv_start, h_kv) = match self.k_proj.colwise_shard() {
            Some((r, n)) => (r * local_kv, local_kv * n),
            None => (0, local_kv),
        };
        let h = local_q * tp;
        let heads: Vec<i64> = (0..local_q)
            .map(|j| ((rank * local_q + j) * h_kv / h - kv_start) as i64)
            .collect();
        Tensor::from_data(TensorData::new(heads, [local_q]), device)
    }
}

/// RoPE's `cos` and `sin` `[T, hd]` at `positions` (`0..T`, or a context-parallel rank's
/// chunks'): angle `p·θ^(−2j/hd)` for pair `j < hd/2`, the half repeated twice (computed in
/// f64, stored in f32).
pub fn rope_tables(
    positions: &[usize],
    hd: usize,
    theta: f64,
    device: &Device,
) -> (Tensor<2>, Tensor<2>) {
    let (t, half) = (positions.len(), hd / 2);
    let angle = |i: usize| {
        let (p, j) = (positions[i / hd], i % hd % half);
        p as f64 * theta.powf(-2.0 * j as f64 / hd as f64)
    };
    let table = |f: fn(f64) -> f64| {
        let values: Vec<f32> = (0..t * hd).map(|i| f(angle(i)) as f32).collect();
        Tensor::<2>::from_data(TensorData::new(values, [t, hd]), device)
    };
    (table(f64::cos), table(f64::sin))
}

/// `x·cos + rotate_half(x)·sin` on `[B, h, T, hd]`, `rotate_half(x) = [−x₂, x₁]`.
pub fn rotate(x: Tensor<4>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<4> {
    let hd = x.dims()[3];
    let cos = cos.clone().cast(x.dtype()).unsqueeze::<4>();
    let sin = sin.clone().cast(x.dtype()).unsqueeze::<4>();
    let x1 = x.clone().narrow(3, 0, hd / 2);
    let x2 = x.clone().narrow(3, hd / 2, hd / 2);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos + rotated * sin
}

/// `down(SiLU(gate(x)) ⊙ up(x))`.
#[derive(Module, Debug)]
pub struct Mlp {
    /// `[F, d]`.
    pub gate_proj: Linear,
    /// `[F, d]`.
    pub up_proj: Linear,
    /// `[d, F]`.
    pub down_proj: Linear,
}

impl Mlp {
    /// Normal(0, 0.02) projections.
    pub fn new(d: usize, f: usize, device: &Device) -> Self {
        Self {
            gate_proj: Linear::new(d, f, false, device),
            up_proj: Linear::new(d, f, false, device),
            down_proj: Linear::new(f, d, false, device),
        }
    }

    /// The MLP on `[B, T, d]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let gate = silu(self.gate_proj.forward(x.clone()));
        self.down_proj.forward(gate * self.up_proj.forward(x))
    }
}

/// A decoder layer: `x + Attn(RMSNorm₁(x))`, then `x + MLP(RMSNorm₂(x))`.
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// The norm before attention.
    pub input_layernorm: RmsNorm,
    /// Attention.
    pub self_attn: Attention,
    /// The norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// The MLP.
    pub mlp: Mlp,
}

impl DecoderLayer {
    /// A fresh layer of `cfg`.
    pub fn new(cfg: &LlamaConfig, device: &Device) -> Self {
        let norm = || RmsNorm::new(cfg.hidden_size, device).with_eps(cfg.rms_norm_eps);
        Self {
            input_layernorm: norm(),
            self_attn: Attention::new(cfg, device),
            post_attention_layernorm: norm(),
            mlp: Mlp::new(cfg.hidden_size, cfg.intermediate_size, device),
        }
    }

    /// The layer; each of its four parts runs through [`bonfire_dtensor::layer`], anchored
    /// at the input of its half (as the GPT's block does).
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let h = layer(&self.input_layernorm, &x).forward(x.clone());
        let x = x.clone() + layer(&self.self_attn, &x).forward(h);
        let h = layer(&self.post_attention_layernorm, &x).forward(x.clone());
        x.clone() + layer(&self.mlp, &x).forward(h)
    }
}

/// The decoder without its head (transformers' `LlamaModel`, the `model.` prefix).
#[derive(Module, Debug)]
pub struct LlamaModel {
    /// Token embeddings `[V, d]`.
    pub embed_tokens: Embedding,
    /// The decoder layers.
    pub layers: Vec<DecoderLayer>,
    /// The final norm.
    pub norm: RmsNorm,
}

/// A Llama causal language model (transformers' `LlamaForCausalLM`).
#[derive(Module, Debug)]
pub struct Llama {
    /// The decoder.
    pub model: LlamaModel,
    /// The output projection `[V, d]` (untied).
    pub lm_head: Linear,
}

impl Llama {
    /// A freshly initialized model (transformers' init: N(0, 0.02) weights, unit norms).
    pub fn new(cfg: &LlamaConfig, device: &Device) -> Self {
        Self {
            model: LlamaModel {
                embed_tokens: Embedding::new(cfg.vocab_size, cfg.hidden_size, device),
                layers: (0..cfg.num_hidden_layers)
                    .map(|_| DecoderLayer::new(cfg, device))
                    .collect(),
                norm: RmsNorm::new(cfg.hidden_size, device).with_eps(cfg.rms_norm_eps),
            },
            lm_head: Linear::new(cfg.hidden_size, cfg.vocab_size, false, device),
        }
    }

    /// Logits `[B, T, V]` for token ids `[B, T]` (this rank's vocabulary slice under a
    /// loss-parallel plan). The same steps are the pipeline's pieces: [`embed`], the
    /// layers, [`head`].
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let mut x = embed(&self.model.embed_tokens, ids);
        for l in &self.model.layers {
            x = l.forward(x);
        }
        head(&self.model.norm, &self.lm_head, x)
    }

    /// Mean cross-entropy over all `B·T` positions (vocab-parallel on sharded logits).
    pub fn loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        match self.lm_head.output_shard_group() {
            Some(group) => loss_parallel(self.forward(ids), targets, &group),
            None => cross_entropy(self.forward(ids), targets),
        }
    }
}

/// `embed_tokens[ids]`: `[B, T]` ids to `[B, T, d]`.
pub fn embed(embed_tokens: &Embedding, ids: Tensor<2, Int>) -> Tensor<3> {
    layer(embed_tokens, &ids).forward(ids.clone())
}

/// `lm_head(RMSNorm(x))`: `[B, T, d]` to logits.
pub fn head(norm: &RmsNorm, lm_head: &Linear, x: Tensor<3>) -> Tensor<3> {
    let h = layer(norm, &x).forward(x.clone());
    layer(lm_head, &x).forward(h)
}
