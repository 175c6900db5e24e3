//! DeepSeek-V3's `config.json` ([`MixtralConfig`] of `MoeFamily::DeepseekV3`): its fields over
//! the Llama's — latent attention's sizes and RoPE (YaRN among them, [`Mla`]), the routing and
//! shared experts ([`DeepseekMoe`]), the first dense layers — read and written.

use super::config::{DeepseekMoe, MixtralConfig, MoeFamily};
use crate::fields;
use crate::llama::LlamaConfig;
use crate::mla::Mla;
use serde_json::{Value, json};

impl MixtralConfig {
    /// DeepSeek-V3's fields over the Llama's `base` (transformers' defaults: DeepSeek-V3's;
    /// `router_aux_loss_coef` means nothing to it: α = 0). Refuses, naming the field, other
    /// scoring functions and top-k methods, a MoE layer frequency other than 1.
    pub(super) fn deepseek_from_json(mut base: LlamaConfig, v: &Value) -> Result<Self, String> {
        let field = |name: &str| fields::field(v, name);
        let count = |name: &str, default: usize| fields::count(v, name, default);
        for (name, supported) in [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")] {
            if let Some(x) = field(name).and_then(Value::as_str)
                && x != supported
            {
                return Err(format!("{name} `{x}` is not supported ({supported})"));
            }
        }
        if let Some(f) = field("moe_layer_freq").and_then(Value::as_u64)
            && f != 1
        {
            return Err(format!("moe_layer_freq {f} is not supported (1)"));
        }
        let mla = Mla::from_json(v)?;
        base.variant.mla = Some(mla);
        base.head_dim = mla.qk_rope_head_dim;
        base.num_key_value_heads = base.num_attention_heads;
        let dense = base.intermediate_size;
        base.intermediate_size = count("moe_intermediate_size", 2048)?;
        let first_dense = match field("first_k_dense_replace") {
            None => 3,
            Some(x) => x
                .as_u64()
                .ok_or("field `first_k_dense_replace`: not an integer ≥ 0")?
                as usize,
        };
        let scaling = match field("routed_scaling_factor") {
            None => 2.5,
            Some(x) => x
                .as_f64()
                .filter(|f| f.is_finite() && *f > 0.0)
                .ok_or("field `routed_scaling_factor`: not a positive number")?,
        };
        Ok(Self {
            base,
            num_local_experts: count("n_routed_experts", count("num_local_experts", 256)?)?,
            num_experts_per_tok: count("num_experts_per_tok", 8)?,
            router_aux_loss_coef: 0.0,
            family: MoeFamily::DeepseekV3,
            norm_topk_prob: field("norm_topk_prob").and_then(Value::as_bool) != Some(false),
            dense_intermediate_size: Some(dense),
            decoder_sparse_step: 1,
            mlp_only_layers: (0..first_dense).collect(),
            deepseek: Some(DeepseekMoe {
                n_shared_experts: count("n_shared_experts", 1)?,
                n_group: count("n_group", 8)?,
                topk_group: count("topk_group", 4)?,
                routed_scaling_factor: scaling,
            }),
        })
    }

    /// DeepSeek-V3's fields of an exported `config.json`.
    pub(super) fn deepseek_json(&self, m: &mut serde_json::Map<String, Value>) {
        let (Some(d), Some(mla)) = (self.deepseek, self.base.variant.mla) else {
            return;
        };
        let f = self.base.intermediate_size;
        let fields = json!({
            "moe_intermediate_size": f,
            "intermediate_size": self.dense_width(),
            "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.mlp_only_layers.len(),
            "n_shared_experts": d.n_shared_experts,
            "n_group": d.n_group,
            "topk_group": d.topk_group,
            "routed_scaling_factor": d.routed_scaling_factor,
        });
        for fields in [fields, mla.json_fields()] {
            if let Value::Object(fields) = fields {
                m.extend(fields);
            }
        }
        if let Some(y) = mla.yarn {
            m.insert("rope_parameters".into(), y.json(self.base.rope_theta));
        }
    }

    /// `v` as JSON with its RoPE object's type (`rope_type` or `type`) made default.
    pub(super) fn default_rope(v: &Value) -> String {
        let mut v = v.clone();
        for field in fields::ROPE_FIELDS {
            if let Some(Value::Object(rope)) = v.get_mut(field) {
                for kind in fields::ROPE_TYPE_FIELDS {
                    rope.remove(kind);
                }
                rope.insert("rope_type".into(), "default".into());
            }
        }
        v.to_string()
    }
}
