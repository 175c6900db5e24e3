//! Multi-head latent attention's layer: [`Mla::attention`] (a fresh `LlamaAttention` with the
//! latent projections) and [`Mla::forward`] (see the module above).

use super::Mla;
use crate::decoder_layer::{LlamaAttention, default_freqs, rope_tables_of, rotate};
use crate::gpt::attention::{merge_heads, split_heads, windowed_attention};
use crate::llama::LlamaConfig;
use bonfire_tp::{ParallelLinear, ParallelRmsNorm};
use burn::tensor::{Device, Tensor};

/// transformers' `DeepseekV3RMSNorm` default ε, which its latent norms keep.
const LATENT_NORM_EPS: f64 = 1e-6;

impl Mla {
    /// A fresh attention of `cfg` (N(0, 0.02) projections, unit norms), in transformers'
    /// order: the query's projections, the latent's, the output.
    pub fn attention(&self, cfg: &LlamaConfig, device: &Device) -> LlamaAttention {
        let (d, h) = (cfg.hidden_size, cfg.num_attention_heads);
        let linear = |i, o| ParallelLinear::new(i, o, false, device);
        let norm = |w| Some(ParallelRmsNorm::new(w, device).with_eps(LATENT_NORM_EPS));
        let q = h * self.qk_head_dim();
        let (q_proj, q_a_proj, q_a_layernorm, q_b_proj) = match self.q_lora_rank {
            None => (Some(linear(d, q)), None, None, None),
            Some(r) => {
                let a = linear(d, r);
                (None, Some(a), norm(r), Some(linear(r, q)))
            }
        };
        let r = self.kv_lora_rank;
        let kv_a = linear(d, r + self.qk_rope_head_dim);
        let kv_b = linear(r, h * (self.qk_nope_head_dim + self.v_head_dim));
        let o_proj = linear(h * self.v_head_dim, d);
        let mut a = LlamaAttention::empty(cfg, o_proj);
        a.q_proj = q_proj;
        a.q_a_proj = q_a_proj;
        a.q_a_layernorm = q_a_layernorm;
        a.q_b_proj = q_b_proj;
        a.kv_a_proj_with_mqa = Some(kv_a);
        a.kv_a_layernorm = norm(r);
        a.kv_b_proj = Some(kv_b);
        a
    }

    /// The heads `a` computes on this rank (its share under tp).
    pub fn heads(&self, a: &LlamaAttention) -> usize {
        let kv_b = a.kv_b_proj.as_ref().expect("latent attention's kv_b_proj");
        kv_b.weight.dims()[0] / (self.qk_nope_head_dim + self.v_head_dim)
    }

    /// `x` `[B, T, d]` → `[B, T, d]` (see the module docs).
    pub fn forward(&self, a: &LlamaAttention, x: Tensor<3>) -> Tensor<3> {
        fn part(p: &Option<ParallelLinear>) -> &ParallelLinear {
            p.as_ref().expect("a latent projection")
        }
        let (nope, rope, vd) = (
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        );
        let qk = nope + rope;
        let q = match &a.q_proj {
            Some(p) => p.forward(x.clone()),
            None => {
                let down = part(&a.q_a_proj).forward(x.clone());
                let normed = a
                    .q_a_layernorm
                    .as_ref()
                    .expect("q_a_layernorm")
                    .forward(down);
                part(&a.q_b_proj).forward(normed)
            }
        };
        let q = split_heads(q, qk);
        let [b, h, t, _] = q.dims();
        let latent = part(&a.kv_a_proj_with_mqa).forward(x);
        let r = self.kv_lora_rank;
        let mut k_rot = latent.clone().narrow(2, r, rope).unsqueeze_dim::<4>(1);
        let kv_b = part(&a.kv_b_proj);
        if let Some(group) = kv_b.output_shard_group() {
            // Every head uses the one rotary key: under tp this rank's heads give a part of
            // its gradient, summed over the group in backward.
            k_rot = bonfire_dtensor::functional::copy_to_group(k_rot, &group);
        }
        let normed = a.kv_a_layernorm.as_ref().expect("kv_a_layernorm");
        let kv = kv_b.forward(normed.forward(latent.narrow(2, 0, r)));
        let kv = split_heads(kv, nope + vd);
        let positions = bonfire_cp::positions(t);
        let theta = a.rope().0;
        let freqs = match self.yarn {
            Some(y) => y.inv_freqs(theta, rope),
            None => default_freqs(theta, rope),
        };
        let (cos, sin) = rope_tables_of(&positions, rope, &freqs, &q.device());
        // YaRN's attention factor multiplies cos and sin: the rotated features.
        let factor = self.yarn.map_or(1.0, |y| y.attention_factor());
        let rotary = |x: Tensor<4>| {
            let x = match self.rope_interleave {
                true => deinterleave(x),
                false => x,
            };
            let y = rotate(x, &cos, &sin);
            match factor {
                1.0 => y,
                f => y.mul_scalar(f),
            }
        };
        let q_rot = rotary(q.clone().narrow(3, nope, rope));
        let k_rot = rotary(k_rot).repeat_dim(1, h);
        let mut q = Tensor::cat(vec![q.narrow(3, 0, nope), q_rot], 3);
        // YaRN's softmax scale: (nope + rope)^−½ · mscale², the kernels applying the first.
        if let Some(y) = self.yarn
            && y.softmax_factor() != 1.0
        {
            q = q.mul_scalar(y.softmax_factor());
        }
        let k = Tensor::cat(vec![kv.clone().narrow(3, 0, nope), k_rot], 3);
        let mut v = kv.narrow(3, nope, vd);
        if vd < qk {
            let pad = Tensor::<4>::zeros([b, h, t, qk - vd], &v.device()).cast(v.dtype());
            v = Tensor::cat(vec![v, pad], 3);
        }
        let y = bonfire_cp::attention(q, k, v, None, |q, k, v| windowed_attention(q, k, v, None));
        a.o_proj.forward(merge_heads(y.narrow(3, 0, vd)))
    }
}

/// `[…, r]` with interleaved pairs `(x0, x1), (x2, x3), …` → `[x0, x2, …, x1, x3, …]`: the
/// halves RoPE's rotate-half pairs (transformers' `apply_rotary_pos_emb_interleave`, whose
/// output is in this order).
fn deinterleave(x: Tensor<4>) -> Tensor<4> {
    let [b, h, t, r] = x.dims();
    x.reshape([b, h, t, r / 2, 2])
        .swap_dims(3, 4)
        .reshape([b, h, t, r])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    /// Interleaved pairs become halves: `[0, 1, 2, 3, 4, 5]` → `[0, 2, 4, 1, 3, 5]`.
    #[test]
    fn deinterleaves_pairs_into_halves() {
        let device = Device::flex();
        let x = Tensor::<4>::from_data(
            TensorData::new((0..6).map(|i| i as f32).collect::<Vec<_>>(), [1, 1, 1, 6]),
            &device,
        );
        let got = deinterleave(x).into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(got, [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]);
    }
}
