//! The Llama family trained by plain Burn (`families.rs`'s plain-Burn checks): the math of
//! transformers' `LlamaForCausalLM` and of the families' additions — Llama 3's RoPE scaling,
//! Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm, Mistral's sliding window, a tied head —
//! written with Burn tensor ops on the parameters of the same `Llama` module (its own
//! `forward` runs Bonfire's fused kernels and layer wrappers), with nothing of Bonfire's: the
//! RoPE frequencies computed here from the config's numbers, the mask built here. Trained by
//! [`super::plain::plain_burn_with`] (Burn's `backward`, `GradientsParams`, Burn's optimizers).

use bonfire_models::decoder_layer::{DecoderLayer, FeedForward};
use bonfire_models::llama::{Llama, LlamaConfig};
use bonfire_models::mixtral::moe::Experts;
use bonfire_tp::{ParallelLinear, ParallelRmsNorm};
use burn::tensor::activation::{log_softmax, silu, softmax};
use burn::tensor::{Int, Tensor, TensorData};

/// `x Wᵀ + b` on `[B, T, in]`.
pub(super) fn linear(l: &ParallelLinear, x: Tensor<3>) -> Tensor<3> {
    let [b, t, d_in] = x.dims();
    let w = l.weight.val();
    let d_out = w.dims()[0];
    let y = x
        .reshape([b * t, d_in])
        .matmul(w.transpose())
        .reshape([b, t, d_out]);
    match &l.bias {
        Some(bias) => y + bias.val().unsqueeze::<3>(),
        None => y,
    }
}

/// RMSNorm over the last dim: `x / √(mean(x²) + ε) · w`.
pub(super) fn rms<const D: usize>(n: &ParallelRmsNorm, x: Tensor<D>, eps: f64) -> Tensor<D> {
    let scale = (x.clone().powi_scalar(2).mean_dim(D - 1) + eps)
        .sqrt()
        .recip();
    x * scale * n.weight.val().unsqueeze::<D>()
}

/// RoPE's inverse frequencies `θ^(−2j/hd)`, Llama 3's scaling applied (kept above the
/// high-frequency wavelength, divided by `factor` below the low one, blended between).
fn inv_freqs(cfg: &LlamaConfig) -> Vec<f64> {
    let hd = cfg.head_dim;
    (0..hd / 2)
        .map(|j| {
            let f = cfg.rope_theta.powf(-2.0 * j as f64 / hd as f64);
            let Some(s) = cfg.variant.rope_scaling else {
                return f;
            };
            let original = s.original_max_position_embeddings as f64;
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < original / s.high_freq_factor {
                f
            } else if wavelen > original / s.low_freq_factor {
                f / s.factor
            } else {
                let smooth = (original / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// `x·cos + rotate_half(x)·sin` on `[B, h, T, hd]` at positions `0..T`.
fn rope(x: Tensor<4>, freqs: &[f64]) -> Tensor<4> {
    let [_, _, t, hd] = x.dims();
    let table = |f: fn(f64) -> f64| {
        let v: Vec<f32> = (0..t * hd)
            .map(|i| f((i / hd) as f64 * freqs[i % hd % (hd / 2)]) as f32)
            .collect();
        Tensor::<2>::from_data(TensorData::new(v, [t, hd]), &x.device()).unsqueeze::<4>()
    };
    let (cos, sin) = (table(f64::cos), table(f64::sin));
    let x1 = x.clone().narrow(3, 0, hd / 2);
    let x2 = x.clone().narrow(3, hd / 2, hd / 2);
    x * cos + Tensor::cat(vec![x2.neg(), x1], 3) * sin
}

/// `[T, T]`: 0 where query i sees key j (j ≤ i, and i − W < j under a window W), −∞ elsewhere.
pub(super) fn mask(t: usize, window: Option<usize>, device: &burn::tensor::Device) -> Tensor<2> {
    let v: Vec<f32> = (0..t * t)
        .map(|i| {
            let (q, k) = (i / t, i % t);
            match k <= q && window.is_none_or(|w| k + w > q) {
                true => 0.0,
                false => f32::NEG_INFINITY,
            }
        })
        .collect();
    Tensor::from_data(TensorData::new(v, [t, t]), device)
}

/// One layer's attention on `x` `[B, T, d]`.
fn attention(
    a: &bonfire_models::decoder_layer::LlamaAttention,
    x: Tensor<3>,
    cfg: &LlamaConfig,
) -> Tensor<3> {
    if a.mla().is_some() {
        return super::plain_deepseek::attention(a, x, cfg);
    }
    let [b, t, _] = x.dims();
    let (h, hkv, hd) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let heads = |y: Tensor<3>, n: usize| y.reshape([b, t, n, hd]).swap_dims(1, 2);
    let proj = |p: &Option<ParallelLinear>| p.clone().expect("grouped-query attention");
    let mut q = heads(linear(&proj(&a.q_proj), x.clone()), h);
    let mut k = heads(linear(&proj(&a.k_proj), x.clone()), hkv);
    let v = heads(linear(&proj(&a.v_proj), x), hkv);
    if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
        q = rms(qn, q, cfg.rms_norm_eps);
        k = rms(kn, k, cfg.rms_norm_eps);
    }
    let freqs = inv_freqs(cfg);
    let (q, k) = (rope(q, &freqs), rope(k, &freqs));
    // Query head j attends with kv head j / (h / hkv).
    let repeat = |y: Tensor<4>| {
        y.unsqueeze_dim::<5>(2)
            .expand([b, hkv, h / hkv, t, hd])
            .reshape([b, h, t, hd])
    };
    let (k, v) = (repeat(k), repeat(v));
    let m = mask(t, cfg.variant.sliding_window, &q.device()).unsqueeze::<4>();
    let scores = q.matmul(k.swap_dims(2, 3)) / (hd as f64).sqrt() + m;
    let y = softmax(scores, 3).matmul(v);
    linear(&a.o_proj, y.swap_dims(1, 2).reshape([b, t, h * hd]))
}

/// `down(SiLU(gate(h)) ⊙ up(h))`.
pub(super) fn swiglu(
    gate: &ParallelLinear,
    up: &ParallelLinear,
    down: &ParallelLinear,
    h: Tensor<3>,
) -> Tensor<3> {
    linear(down, silu(linear(gate, h.clone())) * linear(up, h))
}

/// The decoder's residual stream after its layers, before the final norm: the embedding of
/// `ids` `[B, T]`, then each layer's `x + Attn(RMSNorm₁(x))`, `x + ffn(mlp, RMSNorm₂(x))`.
pub(super) fn decoder<F: FeedForward>(
    table: Tensor<2>,
    layers: &[DecoderLayer<F>],
    cfg: &LlamaConfig,
    ids: Tensor<2, Int>,
    mut ffn: impl FnMut(&F, Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    let [b, t] = ids.dims();
    let d = table.dims()[1];
    let eps = cfg.rms_norm_eps;
    let mut x = table.select(0, ids.reshape([b * t])).reshape([b, t, d]);
    for l in layers {
        x = x.clone() + attention(&l.self_attn, rms(&l.input_layernorm, x.clone(), eps), cfg);
        x = x.clone() + ffn(&l.mlp, rms(&l.post_attention_layernorm, x, eps));
    }
    x
}

/// The mean cross-entropy of `logits` `[B, T, V]` against `targets` `[B, T]`.
pub(super) fn cross_entropy(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let [b, t, v] = logits.dims();
    let logp = log_softmax(logits.reshape([b * t, v]), 1);
    -logp.gather(1, targets.reshape([b * t, 1])).mean()
}

/// The mean cross-entropy over all positions of `m` (of `cfg`) on `ids` `[B, T]`.
pub fn plain_llama_loss(
    m: &Llama,
    cfg: &LlamaConfig,
    ids: Tensor<2, Int>,
    targets: Tensor<2, Int>,
) -> Tensor<1> {
    let [b, t] = ids.dims();
    let table = m.model.embed_tokens.weight.val();
    let x = decoder(table.clone(), &m.model.layers, cfg, ids, |mlp, h| {
        swiglu(&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj, h)
    });
    let h = rms(&m.model.norm, x, cfg.rms_norm_eps);
    let logits = match &m.lm_head {
        Some(head) => linear(head, h),
        None => {
            let d = table.dims()[1];
            let flat = h.reshape([b * t, d]).matmul(table.transpose());
            flat.reshape([b, t, cfg.vocab_size])
        }
    };
    cross_entropy(logits, targets)
}

/// One mixture of experts on `h` `[B, T, d]` in plain Burn: the weighted sum of every expert
/// on every token (zero where not chosen), the router's probabilities and the top-k
/// indicators `[B, T, E]`.
fn experts_on(
    gate: &bonfire_models::mixtral::Router,
    experts: &Experts,
    cfg: &bonfire_models::MixtralConfig,
    h: Tensor<3>,
) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
    let [b, t, d] = h.dims();
    let e = cfg.num_local_experts;
    let w = gate.weight.val();
    let logits = h.clone().reshape([b * t, d]).matmul(w.transpose());
    let p = softmax(logits.reshape([b, t, e]), 2);
    // Expert e's rank: the experts with a larger p, or an equal p and a lower index.
    let (pe, po) = (
        p.clone().unsqueeze_dim::<4>(3),
        p.clone().unsqueeze_dim::<4>(2),
    );
    let idx: Vec<f32> = (0..e * e)
        .map(|i| ((i % e) < (i / e)) as u8 as f32)
        .collect();
    let lower = Tensor::<2>::from_data(TensorData::new(idx, [e, e]), &p.device());
    let ahead =
        po.clone().greater(pe.clone()).float() + po.equal(pe).float() * lower.unsqueeze::<4>();
    let chosen = ahead
        .sum_dim(3)
        .squeeze_dim::<3>(3)
        .lower_elem(cfg.num_experts_per_tok as f64)
        .float();
    let kept = p.clone() * chosen.clone();
    let w = match cfg.norm_topk_prob {
        true => kept.clone() / kept.sum_dim(2),
        false => kept,
    };
    (every_expert(experts, h, w), p, chosen)
}

/// Every expert on every token of `h` `[B, T, d]`, weighted by `w` `[B, T, E]` and summed:
/// `Σ_e w_e · down_e(SiLU(g_e h) ⊙ u_e h)`.
pub(super) fn every_expert(experts: &Experts, h: Tensor<3>, w: Tensor<3>) -> Tensor<3> {
    let [b, t, d] = h.dims();
    let (gu, down) = (experts.gate_up_proj.val(), experts.down_proj.val());
    let (e, f) = (gu.dims()[0], gu.dims()[1] / 2);
    let flat = h.reshape([b * t, d]);
    let mut y = Tensor::<3>::zeros([b, t, d], &flat.device());
    for j in 0..e {
        let gu_j = gu.clone().narrow(0, j, 1).reshape([2 * f, d]);
        let down_j = down.clone().narrow(0, j, 1).reshape([d, f]);
        let hid = flat.clone().matmul(gu_j.transpose());
        let act = silu(hid.clone().narrow(1, 0, f)) * hid.narrow(1, f, f);
        let out = act.matmul(down_j.transpose()).reshape([b, t, d]);
        y = y + out * w.clone().narrow(2, j, 1);
    }
    y
}

/// A Qwen3-MoE's (or Mixtral's) loss in plain Burn: the decoder above with each layer's
/// feed-forward a mixture of experts — softmax router, each token's top k (ties to the lower
/// index), weights renormalized when `norm_topk_prob`, every expert computed on every token
/// and weighted (zero where not chosen) — or a dense MLP; mean cross-entropy + α · the
/// contract's sequence-wise balance over the sparse layers.
pub fn plain_moe_loss(
    m: &bonfire_models::mixtral::Mixtral,
    cfg: &bonfire_models::MixtralConfig,
    ids: Tensor<2, Int>,
    targets: Tensor<2, Int>,
) -> Tensor<1> {
    let t = ids.dims()[1];
    let (mut probs, mut counts, mut sparse) = (None::<Tensor<3>>, None::<Tensor<3>>, 0);
    let table = m.model.embed_tokens.weight.val();
    let x = decoder(table, &m.model.layers, &cfg.base, ids, |mlp, h| {
        let (Some(gate), Some(experts)) = (&mlp.gate, &mlp.experts) else {
            let part = |p: &Option<ParallelLinear>| p.clone().expect("a dense projection");
            let [g, u, d] = [&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj].map(part);
            return swiglu(&g, &u, &d, h);
        };
        let (y, p, chosen) = experts_on(gate, experts, cfg, h);
        probs = Some(probs.take().map_or(p.clone(), |s| s + p));
        counts = Some(counts.take().map_or(chosen.clone(), |s| s + chosen));
        sparse += 1;
        y
    });
    let h = rms(&m.model.norm, x, cfg.base.rms_norm_eps);
    let ce = cross_entropy(linear(&m.lm_head, h), targets);
    // Per sequence over its T tokens of all L sparse layers: E · Σ_e f_e · P_e.
    let rows = (sparse * t) as f64;
    let f = counts.expect("a sparse layer").detach().sum_dim(1) / rows;
    let pm = probs.expect("a sparse layer").sum_dim(1) / rows;
    let balance = (f * pm).sum_dim(2).mean() * cfg.num_local_experts as f64;
    ce + balance.reshape([1]) * cfg.router_aux_loss_coef
}
