//! DeepSeek-V3 trained by plain Burn (`deepseek.rs`'s plain-Burn check): multi-head latent
//! attention and the group-limited sigmoid router beside shared experts, written with Burn
//! tensor ops on the parameters of the same `Mixtral` module (its own `forward` runs
//! Bonfire's kernels, routing and expert dispatch), with nothing of Bonfire's: RoPE's angles
//! from the config's numbers, interleaved pairs picked by index, the groups and experts
//! chosen by Burn's `topk`, every expert on every token weighted. Its decoder, norms and loss
//! are [`super::plain_llama`]'s.

use super::plain_llama::{cross_entropy, decoder, every_expert, linear, mask, rms, swiglu};
use bonfire_models::decoder_layer::LlamaAttention;
use bonfire_models::mixtral::{Mixtral, SparseMoe};
use bonfire_models::{LlamaConfig, MixtralConfig};
use bonfire_tp::ParallelLinear;
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};

/// transformers' `DeepseekV3RMSNorm` default ε, which the latent norms keep.
const LATENT_EPS: f64 = 1e-6;

/// RoPE on `[B, h, T, r]` at positions `0..T` with `θ^(−2j/r)`: pairs (x_{2j}, x_{2j+1}) when
/// `interleave`, else (x_j, x_{j+r/2}); out `[a·cos − b·sin, b·cos + a·sin]`.
fn rope(x: Tensor<4>, theta: f64, interleave: bool) -> Tensor<4> {
    let [_, _, t, r] = x.dims();
    let half = r / 2;
    let device = x.device();
    let (a, b) = match interleave {
        true => {
            let pick = |o: usize| {
                let idx: Vec<i64> = (0..half).map(|j| (2 * j + o) as i64).collect();
                x.clone().select(
                    3,
                    Tensor::<1, Int>::from_data(TensorData::new(idx, [half]), &device),
                )
            };
            (pick(0), pick(1))
        }
        false => (x.clone().narrow(3, 0, half), x.narrow(3, half, half)),
    };
    let table = |f: fn(f64) -> f64| {
        let v: Vec<f32> = (0..t * half)
            .map(|i| {
                let freq = theta.powf(-2.0 * (i % half) as f64 / r as f64);
                f((i / half) as f64 * freq) as f32
            })
            .collect();
        Tensor::<2>::from_data(TensorData::new(v, [t, half]), &device).unsqueeze::<4>()
    };
    let (cos, sin) = (table(f64::cos), table(f64::sin));
    let first = a.clone() * cos.clone() - b.clone() * sin.clone();
    Tensor::cat(vec![first, b * cos + a * sin], 3)
}

/// A projection latent attention has.
fn part(p: &Option<ParallelLinear>) -> &ParallelLinear {
    p.as_ref().expect("a latent projection")
}

/// Multi-head latent attention on `x` `[B, T, d]` (transformers' `DeepseekV3Attention`).
pub fn attention(a: &LlamaAttention, x: Tensor<3>, cfg: &LlamaConfig) -> Tensor<3> {
    let m = cfg.variant.mla.expect("latent attention's sizes");
    let [b, t, _] = x.dims();
    let h = cfg.num_attention_heads;
    let (nope, rd, vd, r) = (
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.kv_lora_rank,
    );
    let qk = nope + rd;
    let q = match &a.q_proj {
        Some(p) => linear(p, x.clone()),
        None => {
            let down = linear(part(&a.q_a_proj), x.clone());
            let norm = a.q_a_layernorm.as_ref().expect("q_a_layernorm");
            linear(part(&a.q_b_proj), rms(norm, down, LATENT_EPS))
        }
    };
    let q = q.reshape([b, t, h, qk]).swap_dims(1, 2);
    let latent = linear(part(&a.kv_a_proj_with_mqa), x);
    let norm = a.kv_a_layernorm.as_ref().expect("kv_a_layernorm");
    let kv = linear(
        part(&a.kv_b_proj),
        rms(norm, latent.clone().narrow(2, 0, r), LATENT_EPS),
    );
    let kv = kv.reshape([b, t, h, nope + vd]).swap_dims(1, 2);
    let theta = cfg.rope_theta;
    let k_rot = rope(
        latent.narrow(2, r, rd).reshape([b, 1, t, rd]),
        theta,
        m.rope_interleave,
    );
    let q_rot = rope(q.clone().narrow(3, nope, rd), theta, m.rope_interleave);
    let q = Tensor::cat(vec![q.narrow(3, 0, nope), q_rot], 3);
    let k_rot = k_rot.expand([b, h, t, rd]);
    let k = Tensor::cat(vec![kv.clone().narrow(3, 0, nope), k_rot], 3);
    let v = kv.narrow(3, nope, vd);
    let scores = q.matmul(k.swap_dims(2, 3)) / (qk as f64).sqrt()
        + mask(t, None, &v.device()).unsqueeze::<4>();
    let y = softmax(scores, 3).matmul(v);
    linear(&a.o_proj, y.swap_dims(1, 2).reshape([b, t, h * vd]))
}

/// A routed layer on `h` `[B, T, d]`: sigmoid scores s; the choice s + bias within each
/// token's `topk_group` best groups (a group's score: its two best), the top k of them
/// weighted by s (÷ their sum + 1e-20 when `norm_topk_prob`) × `routed_scaling_factor`;
/// every expert on every token weighted (zero where not chosen), plus the shared experts.
fn routed(mlp: &SparseMoe, cfg: &MixtralConfig, h: Tensor<3>) -> Tensor<3> {
    let (gate, experts) = (mlp.gate.as_ref().unwrap(), mlp.experts.as_ref().unwrap());
    let ds = cfg.deepseek.expect("DeepSeek's routing");
    let [b, t, d] = h.dims();
    let (n, e, k, g) = (
        b * t,
        cfg.num_local_experts,
        cfg.num_experts_per_tok,
        ds.n_group,
    );
    let device = h.device();
    let s = sigmoid(
        h.clone()
            .reshape([n, d])
            .matmul(gate.weight.val().transpose()),
    );
    let bias = gate
        .e_score_correction_bias
        .as_ref()
        .expect("the bias")
        .val();
    let choice = s.clone().detach() + bias.unsqueeze::<2>();
    let groups = choice
        .clone()
        .reshape([n, g, e / g])
        .topk(2, 2)
        .sum_dim(2)
        .reshape([n, g]);
    let (_, best) = groups.topk_with_indices(ds.topk_group, 1);
    let ones = Tensor::<2>::ones([n, ds.topk_group], &device);
    let kept = Tensor::<2>::zeros([n, g], &device).scatter(1, best, ones, IndexingUpdateOp::Add);
    let kept = kept
        .unsqueeze_dim::<3>(2)
        .expand([n, g, e / g])
        .reshape([n, e]);
    let choice = choice.mask_fill(kept.equal_elem(0.0), f32::NEG_INFINITY);
    let (_, chosen) = choice.topk_with_indices(k, 1);
    let mut w = s.gather(1, chosen.clone());
    if cfg.norm_topk_prob {
        w = w.clone() / (w.sum_dim(1) + 1e-20);
    }
    let w = w * ds.routed_scaling_factor;
    let weights = Tensor::<2>::zeros([n, e], &device).scatter(1, chosen, w, IndexingUpdateOp::Add);
    let y = every_expert(experts, h.clone(), weights.reshape([b, t, e]));
    let shared = mlp.shared_experts.as_ref().expect("shared experts");
    y + swiglu(&shared.gate_proj, &shared.up_proj, &shared.down_proj, h)
}

/// The mean cross-entropy of DeepSeek-V3 `m` (of `cfg`) on `ids` `[B, T]`.
pub fn plain_deepseek_loss(
    m: &Mixtral,
    cfg: &MixtralConfig,
    ids: Tensor<2, Int>,
    targets: Tensor<2, Int>,
) -> Tensor<1> {
    let table = m.model.embed_tokens.weight.val();
    let x = decoder(
        table,
        &m.model.layers,
        &cfg.base,
        ids,
        |mlp, h| match &mlp.gate {
            Some(_) => routed(mlp, cfg, h),
            None => swiglu(
                mlp.gate_proj.as_ref().unwrap(),
                mlp.up_proj.as_ref().unwrap(),
                mlp.down_proj.as_ref().unwrap(),
                h,
            ),
        },
    );
    let h = rms(&m.model.norm, x, cfg.base.rms_norm_eps);
    cross_entropy(linear(&m.lm_head, h), targets)
}
