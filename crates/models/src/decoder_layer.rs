//! What the Llama-family decoders (the Llama, the Mixtral) share: grouped-query
//! [`LlamaAttention`] with rotary positions ([`rope_tables`], [`rotate`]) and the
//! [`DecoderLayer`] around it — `x + Attn(RMSNorm₁(x))`, then `x + FFN(RMSNorm₂(x))` — with a
//! pluggable feed-forward ([`FeedForward`]: the Llama's SwiGLU MLP, the Mixtral's sparse
//! mixture of experts, which also returns what its router chose).

use crate::gpt::attention::{merge_heads, split_heads, windowed_attention};
use crate::llama::{Llama3Rope, LlamaConfig};
use crate::mla::Mla;
use bonfire_module::layer;
use bonfire_tp::{ParallelLinear, ParallelRmsNorm};
use burn::module::Module;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

/// Self-attention with rotary positions: grouped-query attention with `h / h_kv` query heads
/// per key/value head, or DeepSeek's multi-head latent attention ([`crate::mla`]) — the
/// projections a family has are `Some`, under transformers' names.
#[derive(Module, Debug)]
pub struct LlamaAttention {
    /// Queries: `[h·hd, d]` (latent attention without a query rank: `[h·(nope+rope), d]`).
    pub q_proj: Option<ParallelLinear>,
    /// Keys: `[h_kv·hd, d]` (grouped-query attention).
    pub k_proj: Option<ParallelLinear>,
    /// Values: `[h_kv·hd, d]` (grouped-query attention).
    pub v_proj: Option<ParallelLinear>,
    /// Output: `[d, h·hd]` (latent attention: `[d, h·v_head_dim]`).
    pub o_proj: ParallelLinear,
    /// Qwen3: RMSNorm of each query head before RoPE, `[hd]`.
    pub q_norm: Option<ParallelRmsNorm>,
    /// Qwen3: RMSNorm of each key head before RoPE, `[hd]`.
    pub k_norm: Option<ParallelRmsNorm>,
    /// Latent attention: the query's down-projection `[q_lora_rank, d]`.
    pub q_a_proj: Option<ParallelLinear>,
    /// Latent attention: its norm `[q_lora_rank]`.
    pub q_a_layernorm: Option<ParallelRmsNorm>,
    /// Latent attention: the query's up-projection `[h·(nope+rope), q_lora_rank]`.
    pub q_b_proj: Option<ParallelLinear>,
    /// Latent attention: the key/value latent and the shared rotary key
    /// `[kv_lora_rank + rope, d]`.
    pub kv_a_proj_with_mqa: Option<ParallelLinear>,
    /// Latent attention: the latent's norm `[kv_lora_rank]`.
    pub kv_a_layernorm: Option<ParallelRmsNorm>,
    /// Latent attention: the latent's up-projection to each head's key and value
    /// `[h·(nope+v), kv_lora_rank]`.
    pub kv_b_proj: Option<ParallelLinear>,
    head_dim: usize,
    rope_theta: f64,
    /// Llama 3's RoPE scaling.
    #[module(skip)]
    rope_scaling: Option<Llama3Rope>,
    /// Mistral's sliding window: query `i` sees keys `i − W < j ≤ i`.
    #[module(skip)]
    sliding_window: Option<usize>,
    /// Latent attention's sizes.
    #[module(skip)]
    mla: Option<Mla>,
}

impl LlamaAttention {
    /// Normal(0, 0.02) projections for `cfg` (with its family's biases, zero; its q/k
    /// norms, unit).
    pub fn new(cfg: &LlamaConfig, device: &Device) -> Self {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let v = &cfg.variant;
        let norm = || {
            v.qk_norm
                .then(|| ParallelRmsNorm::new(hd, device).with_eps(cfg.rms_norm_eps))
        };
        if let Some(m) = v.mla {
            return m.attention(cfg, device);
        }
        let linear = |i, o| Some(ParallelLinear::new(i, o, v.qkv_bias, device));
        // Drawn in this order: q, k, v, o.
        let (q_proj, k_proj, v_proj) = (linear(d, q), linear(d, kv), linear(d, kv));
        let o_proj = ParallelLinear::new(q, d, false, device);
        Self {
            q_proj,
            k_proj,
            v_proj,
            q_norm: norm(),
            k_norm: norm(),
            ..Self::empty(cfg, o_proj)
        }
    }

    /// An attention of `cfg`'s rotary settings with only its output projection `o_proj` (the
    /// constructors fill in their projections).
    pub(crate) fn empty(cfg: &LlamaConfig, o_proj: ParallelLinear) -> Self {
        let v = &cfg.variant;
        Self {
            q_proj: None,
            k_proj: None,
            v_proj: None,
            o_proj,
            q_norm: None,
            k_norm: None,
            q_a_proj: None,
            q_a_layernorm: None,
            q_b_proj: None,
            kv_a_proj_with_mqa: None,
            kv_a_layernorm: None,
            kv_b_proj: None,
            head_dim: cfg.head_dim,
            rope_theta: cfg.rope_theta,
            rope_scaling: v.rope_scaling,
            sliding_window: v.sliding_window,
            mla: v.mla,
        }
    }

    /// Latent attention's sizes (`None`: grouped-query attention).
    pub fn mla(&self) -> Option<&Mla> {
        self.mla.as_ref()
    }

    /// RoPE's θ and scaling.
    pub(crate) fn rope(&self) -> (f64, Option<Llama3Rope>) {
        (self.rope_theta, self.rope_scaling)
    }

    /// A projection every grouped-query attention has.
    fn gqa(p: &Option<ParallelLinear>) -> &ParallelLinear {
        p.as_ref()
            .expect("grouped-query attention's q/k/v projections")
    }

    /// The query projection (grouped-query attention's).
    pub fn queries(&self) -> &ParallelLinear {
        Self::gqa(&self.q_proj)
    }

    /// The key projection (grouped-query attention's).
    pub fn keys(&self) -> &ParallelLinear {
        Self::gqa(&self.k_proj)
    }

    /// Features per head (hd).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The key/value heads of the whole layer.
    pub fn kv_heads(&self) -> usize {
        match self.mla {
            Some(m) => m.heads(self),
            None => self.keys().weight.dims()[0] / self.head_dim,
        }
    }

    /// `x` `[B, T, d]` → `[B, T, d]`. Query head `j` attends with kv head `⌊j·h_kv/h⌋`; the
    /// head counts and this rank's heads are read from the projections: under tensor
    /// parallelism `q_proj` holds this rank's query heads, and `k_proj`/`v_proj` either the
    /// kv heads they attend with (column-wise) or every kv head (kept whole). Under a
    /// context-parallel scope the sequence is this rank's chunks (RoPE at their positions) and
    /// attention is ring attention over the whole sequence.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        if let Some(m) = &self.mla {
            return m.forward(self, x);
        }
        let hd = self.head_dim;
        let q = head_norm(
            &self.q_norm,
            split_heads(self.queries().forward(x.clone()), hd),
        );
        let k = head_norm(
            &self.k_norm,
            split_heads(self.keys().forward(x.clone()), hd),
        );
        let v = split_heads(Self::gqa(&self.v_proj).forward(x), hd);
        let positions = bonfire_cp::positions(q.dims()[2]);
        let rope = (self.rope_theta, self.rope_scaling);
        let (cos, sin) = rope_tables(&positions, hd, rope, &q.device());
        let q = rotate(q, &cos, &sin);
        let k = rotate(k, &cos, &sin);
        // Query head j attends with local kv head ⌊j·h_kv/h⌋ (`windowed_attention`'s grouping:
        // with both sharded by tp, rank r's local head j is global r·h/tp + j, its kv head
        // r·h_kv/tp + ⌊j·h_kv/h⌋) unless tp replicated the kv heads: then they are repeated
        // here, and travel repeated under context parallelism.
        let grouped =
            self.queries().colwise_shard().is_none() || self.keys().colwise_shard().is_some();
        let (k, v) = match grouped {
            true => (k, v),
            false => {
                let heads = self.kv_of_queries(q.dims()[1], k.dims()[1], &q.device());
                (k.select(1, heads.clone()), v.select(1, heads))
            }
        };
        let window = self.sliding_window;
        let y = bonfire_cp::attention(q, k, v, window, |q, k, v| {
            windowed_attention(q, k, v, window)
        });
        self.o_proj.forward(merge_heads(y))
    }

    /// For each of this rank's `local_q` query heads, the index among its `local_kv`
    /// key/value heads of the one it attends with.
    fn kv_of_queries(&self, local_q: usize, local_kv: usize, device: &Device) -> Tensor<1, Int> {
        let (rank, tp) = self.queries().colwise_shard().unwrap_or((0, 1));
        let (kv_start, h_kv) = match self.keys().colwise_shard() {
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

/// Qwen3's per-head RMSNorm of `x` `[B, h, T, hd]` over `hd` (none: `x`); part of the
/// attention's layer, as its projections are.
fn head_norm(norm: &Option<ParallelRmsNorm>, x: Tensor<4>) -> Tensor<4> {
    match norm {
        Some(n) => n.forward(x),
        None => x,
    }
}

/// RoPE's `cos` and `sin` `[T, hd]` at `positions` (`0..T`, or a context-parallel rank's
/// chunks'): angle `p·f_j` for pair `j < hd/2`, `f_j = θ^(−2j/hd)` (scaled as Llama 3 does
/// with a scaling), the half repeated twice (computed in f64, stored in f32).
pub fn rope_tables(
    positions: &[usize],
    hd: usize,
    (theta, scaling): (f64, Option<Llama3Rope>),
    device: &Device,
) -> (Tensor<2>, Tensor<2>) {
    let freqs: Vec<f64> = default_freqs(theta, hd)
        .into_iter()
        .map(|f| scaling.map_or(f, |s| s.scale(f)))
        .collect();
    rope_tables_of(positions, hd, &freqs, device)
}

/// RoPE's inverse frequencies `θ^(−2j/hd)`, `j < hd/2`.
pub fn default_freqs(theta: f64, hd: usize) -> Vec<f64> {
    (0..hd / 2)
        .map(|j| theta.powf(-2.0 * j as f64 / hd as f64))
        .collect()
}

/// [`rope_tables`] of given inverse frequencies `freqs` (`hd/2` of them).
pub fn rope_tables_of(
    positions: &[usize],
    hd: usize,
    freqs: &[f64],
    device: &Device,
) -> (Tensor<2>, Tensor<2>) {
    let (t, half) = (positions.len(), hd / 2);
    let angle = |i: usize| positions[i / hd] as f64 * freqs[i % hd % half];
    let table = |f: fn(f64) -> f64| {
        let values: Vec<f32> = (0..t * hd).map(|i| f(angle(i)) as f32).collect();
        Tensor::<2>::from_data(TensorData::new(values, [t, hd]), device)
    };
    (table(f64::cos), table(f64::sin))
}

/// `x·cos + rotate_half(x)·sin` on `[B, h, T, hd]`, `rotate_half(x) = [−x₂, x₁]`.
/// One fused node where bonfire-kernels fuses the type on the device (f32; 16-bit on CubeCL,
/// with f32 tables: [`bonfire_kernels::fuses`]), else Burn's ops.
pub fn rotate(x: Tensor<4>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<4> {
    if bonfire_kernels::fused::takes(&x) {
        return bonfire_kernels::rope(
            x,
            cos.clone().cast(DType::F32),
            sin.clone().cast(DType::F32),
        );
    }
    let hd = x.dims()[3];
    let cos = cos.clone().cast(x.dtype()).unsqueeze::<4>();
    let sin = sin.clone().cast(x.dtype()).unsqueeze::<4>();
    let x1 = x.clone().narrow(3, 0, hd / 2);
    let x2 = x.clone().narrow(3, hd / 2, hd / 2);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos + rotated * sin
}

/// A decoder layer's feed-forward half: `[B, T, d]` in and out, plus what it reports
/// (`()` for a dense MLP; a router's choices for a mixture of experts).
pub trait FeedForward: Module {
    /// What the feed-forward reports besides its output.
    type Routing;
    /// The feed-forward on `[B, T, d]`.
    fn forward_routed(&self, x: Tensor<3>) -> (Tensor<3>, Self::Routing);
}

/// A decoder layer: `x + Attn(RMSNorm₁(x))`, then `x + FFN(RMSNorm₂(x))`.
#[derive(Module, Debug)]
pub struct DecoderLayer<F: FeedForward> {
    /// The norm before attention.
    pub input_layernorm: ParallelRmsNorm,
    /// Self-attention.
    pub self_attn: LlamaAttention,
    /// The norm before the feed-forward.
    pub post_attention_layernorm: ParallelRmsNorm,
    /// The feed-forward (transformers' `mlp`).
    pub mlp: F,
}

impl<F: FeedForward> DecoderLayer<F> {
    /// A fresh layer of `cfg` around `mlp` (unit norms, N(0, 0.02) attention).
    pub fn with_mlp(cfg: &LlamaConfig, mlp: F, device: &Device) -> Self {
        let norm = || ParallelRmsNorm::new(cfg.hidden_size, device).with_eps(cfg.rms_norm_eps);
        Self {
            input_layernorm: norm(),
            self_attn: LlamaAttention::new(cfg, device),
            post_attention_layernorm: norm(),
            mlp,
        }
    }

    /// The layer and what its feed-forward reported; each of its four parts runs through
    /// [`bonfire_module::layer`], anchored at the input of its half (as the GPT's block
    /// does).
    pub fn forward_routed(&self, x: Tensor<3>) -> (Tensor<3>, F::Routing) {
        let h = layer(&self.input_layernorm, &x).forward(x.clone());
        let x = x.clone() + layer(&self.self_attn, &x).forward(h);
        let h = layer(&self.post_attention_layernorm, &x).forward(x.clone());
        let (y, routing) = layer(&self.mlp, &x).forward_routed(h);
        (x + y, routing)
    }

    /// The layer's output alone.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_routed(x).0
    }
}
