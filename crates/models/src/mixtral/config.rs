//! [`MixtralConfig`]: a sparse mixture-of-experts model's sizes — the Llama's
//! ([`LlamaConfig`]) plus its experts — read from and written as a Hugging Face `config.json`
//! of `"model_type"` `mixtral`, `qwen3_moe` or `deepseek_v3` ([`MoeFamily`]; the fields of
//! `shared/notes/parity-harness.md`).

use super::router::Scoring;
use crate::fields;
use crate::llama::{Family, LlamaConfig};
use bonfire_plan::{Arch, LatentAttention, ModelSpec, Moe};
use serde_json::{Value, json};

/// A Hugging Face mixture-of-experts family the Mixtral's decoder computes (its `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeFamily {
    /// `mixtral`: `MixtralForCausalLM`, the router's top k always renormalized.
    #[default]
    Mixtral,
    /// `qwen3_moe` (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's q/k norms and explicit head width,
    /// the experts' own width `moe_intermediate_size`, renormalization by `norm_topk_prob`.
    Qwen3Moe,
    /// `deepseek_v3` (DeepSeek-V3, Kimi K2): multi-head latent attention, the first
    /// `first_k_dense_replace` layers dense, shared experts beside the routed ones, sigmoid
    /// scores chosen within groups with a balancing bias ([`DeepseekMoe`]), the loss
    /// cross-entropy only.
    DeepseekV3,
}

impl MoeFamily {
    /// Its `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            MoeFamily::Mixtral => "mixtral",
            MoeFamily::Qwen3Moe => "qwen3_moe",
            MoeFamily::DeepseekV3 => "deepseek_v3",
        }
    }

    /// The family of `model_type`, if it is one of these.
    pub fn parse(model_type: &str) -> Option<Self> {
        [
            MoeFamily::Mixtral,
            MoeFamily::Qwen3Moe,
            MoeFamily::DeepseekV3,
        ]
        .into_iter()
        .find(|f| f.model_type() == model_type)
    }

    /// transformers' class (`architectures` in an exported `config.json`).
    pub fn architecture(self) -> &'static str {
        match self {
            MoeFamily::Mixtral => "MixtralForCausalLM",
            MoeFamily::Qwen3Moe => "Qwen3MoeForCausalLM",
            MoeFamily::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }
}

/// DeepSeek-V3's routing and shared experts (the `config.json` fields of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeepseekMoe {
    /// Shared experts: one SwiGLU MLP `n_shared_experts × moe_intermediate_size` wide.
    pub n_shared_experts: usize,
    /// Groups of routed experts.
    pub n_group: usize,
    /// Groups a token chooses its experts from.
    pub topk_group: usize,
    /// The routed experts' weights' factor.
    pub routed_scaling_factor: f64,
}

/// Sizes of a Mixtral decoder, named as in Hugging Face's `MixtralConfig`.
#[derive(Debug, Clone, PartialEq)]
pub struct MixtralConfig {
    /// The Llama-family sizes (attention, norms, RoPE; `intermediate_size` is each
    /// expert's width F).
    pub base: LlamaConfig,
    /// Experts per layer (E).
    pub num_local_experts: usize,
    /// Experts each token is routed to (k ≤ E).
    pub num_experts_per_tok: usize,
    /// The weight α of the load-balancing loss.
    pub router_aux_loss_coef: f64,
    /// The family (`model_type`).
    pub family: MoeFamily,
    /// Whether each token's k weights are divided by their sum (Mixtral: always; Qwen3-MoE:
    /// `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Qwen3-MoE's dense `intermediate_size` (its experts' width is `moe_intermediate_size`,
    /// `base.intermediate_size` here): the width of its dense layers' MLPs.
    pub dense_intermediate_size: Option<usize>,
    /// Qwen3-MoE's `decoder_sparse_step`: layer `i` is sparse when `(i + 1) % step == 0`
    /// (and it is not in `mlp_only_layers`); 1: every layer.
    pub decoder_sparse_step: usize,
    /// Qwen3-MoE's `mlp_only_layers`: layers whose feed-forward is a dense MLP (DeepSeek's
    /// first `first_k_dense_replace`).
    pub mlp_only_layers: Vec<usize>,
    /// DeepSeek-V3's routing and shared experts.
    pub deepseek: Option<DeepseekMoe>,
}

impl MixtralConfig {
    /// The Mixtral as the planner sees it: the Llama's body ([`LlamaConfig::spec`]) with each
    /// MLP a sparse mixture of `num_local_experts` SwiGLU experts of width
    /// `intermediate_size`, `num_experts_per_tok` of them per token; DeepSeek-V3's shared
    /// experts, its dense layers (DeepSeek's first ones, Qwen3-MoE's `mlp_only_layers` and
    /// `decoder_sparse_step`'s) and its latent attention. The planner places the dense blocks
    /// first: parameters and FLOPs are exact, a pipeline's stages see them there.
    pub fn spec(&self) -> ModelSpec {
        let n = self.base.num_hidden_layers;
        let first_dense = (0..n).filter(|&i| !self.is_sparse(i)).count();
        let mla = self.base.variant.mla;
        let body = self.base.spec();
        ModelSpec {
            name: self.family.model_type().into(),
            arch: Arch::Mixtral(Moe {
                experts: self.num_local_experts,
                top_k: self.num_experts_per_tok,
                shared_ff: self.shared_width().unwrap_or(0),
                dense_layers: first_dense,
                dense_ff: if first_dense > 0 {
                    self.dense_width()
                } else {
                    0
                },
            }),
            head_dim: mla.map_or(body.head_dim, |m| m.qk_head_dim()),
            latent: mla.map(|m| LatentAttention {
                q_lora_rank: m.q_lora_rank.unwrap_or(0),
                kv_lora_rank: m.kv_lora_rank,
                qk_nope: m.qk_nope_head_dim,
                qk_rope: m.qk_rope_head_dim,
                v_head: m.v_head_dim,
            }),
            ..body
        }
    }

    /// A tiny model for tests: vocab 64, hidden 32, 4 heads of 8, 2 kv heads, 2 layers,
    /// 4 experts of width 48, top 2, α = 0.02, positions 8.
    pub fn tiny() -> Self {
        Self::mixtral(
            LlamaConfig {
                vocab_size: 64,
                hidden_size: 32,
                intermediate_size: 48,
                head_dim: 8,
                ..LlamaConfig::tiny()
            },
            4,
            2,
            0.02,
        )
    }

    /// A Mixtral of `base`: `experts` experts a layer, `top_k` per token (renormalized), every
    /// layer sparse, balance weight `alpha`.
    fn mixtral(base: LlamaConfig, experts: usize, top_k: usize, alpha: f64) -> Self {
        Self {
            base,
            num_local_experts: experts,
            num_experts_per_tok: top_k,
            router_aux_loss_coef: alpha,
            family: MoeFamily::Mixtral,
            norm_topk_prob: true,
            dense_intermediate_size: None,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
            deepseek: None,
        }
    }

    /// How a sparse layer's router scores its experts.
    pub fn scoring(&self) -> Scoring {
        match self.deepseek {
            None => Scoring::Softmax {
                renormalize: self.norm_topk_prob,
            },
            Some(d) => Scoring::GroupLimited {
                n_group: d.n_group,
                topk_group: d.topk_group,
                scaling: d.routed_scaling_factor,
                renormalize: self.norm_topk_prob,
            },
        }
    }

    /// The shared experts' MLP width (DeepSeek's; none elsewhere).
    pub fn shared_width(&self) -> Option<usize> {
        self.deepseek
            .map(|d| d.n_shared_experts * self.base.intermediate_size)
    }

    /// Whether layer `i` routes to experts (else its feed-forward is a dense MLP).
    pub fn is_sparse(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// The dense layers' MLP width (the dense `intermediate_size`).
    pub fn dense_width(&self) -> usize {
        self.dense_intermediate_size
            .unwrap_or(self.base.intermediate_size)
    }

    /// The bench size: the Llama bench's body ([`LlamaConfig::bench`]: vocab 4096, hidden
    /// 256, 8 heads, 4 kv heads, 4 layers, positions 128) with 8 experts of width 344 per
    /// layer, top 2 — each token's active feed-forward (2 × 344) is the Llama bench's 688 —
    /// and α = 0.02.
    pub fn bench() -> Self {
        Self::mixtral(
            LlamaConfig {
                intermediate_size: 344,
                ..LlamaConfig::bench()
            },
            8,
            2,
            0.02,
        )
    }

    /// Parses a Hugging Face `config.json` of `"model_type"` `mixtral` or `qwen3_moe`; `what`
    /// names it in errors. The Llama fields as [`LlamaConfig::from_json`] reads them, plus
    /// the experts: `num_local_experts` (Qwen3-MoE: `num_experts`), `num_experts_per_tok`,
    /// `router_aux_loss_coef` (defaults transformers': 8, 2, 0.001 for the Mixtral; 128, 8,
    /// 0.001 for Qwen3-MoE, whose experts are `moe_intermediate_size` wide (default 768),
    /// renormalized when `norm_topk_prob`, default false; its dense layers by
    /// `decoder_sparse_step` and `mlp_only_layers`). What the model lacks is refused naming
    /// the field: a sliding window shorter than the positions, router jitter noise, a tied
    /// head.
    pub fn from_json(what: &str, text: &str) -> Result<Self, String> {
        let bad = |reason: String| format!("{what}: {reason}");
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let family = v
            .get("model_type")
            .and_then(Value::as_str)
            .and_then(MoeFamily::parse)
            .unwrap_or_default();
        // DeepSeek's RoPE (YaRN among them) is its latent attention's (`Mla`): the Llama body
        // reads the rest with a default one.
        let body = match family {
            MoeFamily::DeepseekV3 => Self::default_rope(&v),
            _ => text.to_string(),
        };
        let mut base = LlamaConfig::from_json_of(family.model_type(), what, &body)?;
        if base.variant.tie_word_embeddings {
            return Err(bad(format!(
                "tie_word_embeddings is true: the {}'s head is untied here",
                family.model_type()
            )));
        }
        let field = |name: &str| fields::field(&v, name);
        let count = |name: &str, default: usize| fields::count(&v, name, default).map_err(bad);
        if let Some(w) = field("sliding_window").and_then(Value::as_u64)
            && (w as usize) < base.max_position_embeddings
            && family == MoeFamily::Mixtral
        {
            return Err(bad(format!(
                "sliding_window {w} is shorter than max_position_embeddings {}: sliding-window \
                 attention is not supported",
                base.max_position_embeddings
            )));
        }
        if field("router_jitter_noise")
            .and_then(Value::as_f64)
            .unwrap_or(0.0)
            != 0.0
        {
            return Err(bad(
                "router_jitter_noise is not supported (must be 0)".into()
            ));
        }
        let alpha = match field("router_aux_loss_coef") {
            None => 0.001,
            Some(x) => x
                .as_f64()
                .ok_or_else(|| bad("`router_aux_loss_coef` is not a number".into()))?,
        };
        let cfg = match family {
            MoeFamily::Mixtral => {
                let (e, k) = (
                    count("num_local_experts", 8)?,
                    count("num_experts_per_tok", 2)?,
                );
                Self::mixtral(base, e, k, alpha)
            }
            MoeFamily::Qwen3Moe => {
                let mlp_only_layers = match field("mlp_only_layers") {
                    None => Vec::new(),
                    Some(l) => l
                        .as_array()
                        .and_then(|l| {
                            l.iter()
                                .map(|i| i.as_u64().map(|i| i as usize))
                                .collect::<Option<Vec<usize>>>()
                        })
                        .ok_or_else(|| {
                            bad("field `mlp_only_layers`: not a list of layer indices".into())
                        })?,
                };
                let decoder_sparse_step = count("decoder_sparse_step", 1)?;
                let dense = base.intermediate_size;
                base.intermediate_size = count("moe_intermediate_size", 768)?;
                // Qwen3's attention: per-head q/k RMSNorm before RoPE.
                base.variant.family = Family::Qwen3;
                base.variant.qk_norm = true;
                Self {
                    base,
                    // transformers saves `num_experts` as its alias `num_local_experts`.
                    num_local_experts: count("num_experts", count("num_local_experts", 128)?)?,
                    num_experts_per_tok: count("num_experts_per_tok", 8)?,
                    router_aux_loss_coef: alpha,
                    family,
                    norm_topk_prob: field("norm_topk_prob").and_then(Value::as_bool) == Some(true),
                    dense_intermediate_size: Some(dense),
                    decoder_sparse_step,
                    mlp_only_layers,
                    deepseek: None,
                }
            }
            MoeFamily::DeepseekV3 => Self::deepseek_from_json(base, &v).map_err(bad)?,
        };
        cfg.validate().map_err(bad)?;
        Ok(cfg)
    }

    /// Reads a `config.json` file.
    pub fn load(path: impl AsRef<std::path::Path>) -> Result<Self, String> {
        let path = path.as_ref();
        Self::from_json(&path.display().to_string(), &crate::read_config(path)?)
    }

    /// The `config.json` transformers reads back as this model (f32, untied, no biases,
    /// the router's logits output so that its loss includes the balance term).
    pub fn to_json(&self) -> String {
        let mut v: Value = serde_json::from_str(&self.base.to_json()).expect("JSON");
        let m = v.as_object_mut().expect("an object");
        let family = self.family;
        m.insert("architectures".into(), json!([family.architecture()]));
        m.insert("model_type".into(), family.model_type().into());
        let experts = match family {
            MoeFamily::Mixtral => "num_local_experts",
            MoeFamily::Qwen3Moe => "num_experts",
            MoeFamily::DeepseekV3 => "n_routed_experts",
        };
        m.insert(experts.into(), self.num_local_experts.into());
        let k = self.num_experts_per_tok;
        m.insert("num_experts_per_tok".into(), k.into());
        if family != MoeFamily::DeepseekV3 {
            let alpha = self.router_aux_loss_coef;
            m.insert("router_aux_loss_coef".into(), alpha.into());
            m.insert("output_router_logits".into(), true.into());
            m.insert("router_jitter_noise".into(), 0.0.into());
        }
        match family {
            MoeFamily::Mixtral => {
                m.insert("sliding_window".into(), Value::Null);
            }
            MoeFamily::Qwen3Moe => {
                let f = self.base.intermediate_size;
                m.insert("moe_intermediate_size".into(), f.into());
                let dense = self.dense_intermediate_size.unwrap_or(f);
                m.insert("intermediate_size".into(), dense.into());
                m.insert("norm_topk_prob".into(), self.norm_topk_prob.into());
                let step = self.decoder_sparse_step;
                m.insert("decoder_sparse_step".into(), step.into());
                m.insert("mlp_only_layers".into(), json!(self.mlp_only_layers));
            }
            MoeFamily::DeepseekV3 => self.deepseek_json(m),
        }
        m.remove("mlp_bias");
        serde_json::to_string_pretty(&v).expect("a JSON object")
    }

    /// Checks the sizes: the Llama's, and 1 ≤ k ≤ E, α ≥ 0; DeepSeek's dense layers the
    /// first ones, its groups dividing the experts (two at least each: a group scores by its
    /// two best), `topk_group ≤ n_group` and k within the groups a token may choose.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(d) = self.deepseek {
            let e = self.num_local_experts;
            if !e.is_multiple_of(d.n_group) || e / d.n_group < 2 {
                return Err(format!(
                    "n_group {} must divide n_routed_experts {e} into groups of 2 or more",
                    d.n_group
                ));
            }
            if d.topk_group > d.n_group {
                return Err(format!(
                    "topk_group {} exceeds n_group {}",
                    d.topk_group, d.n_group
                ));
            }
            if self.num_experts_per_tok > d.topk_group * e / d.n_group {
                return Err(format!(
                    "num_experts_per_tok {} exceeds the experts of topk_group {} groups",
                    self.num_experts_per_tok, d.topk_group
                ));
            }
            if !self
                .mlp_only_layers
                .iter()
                .enumerate()
                .all(|(i, &l)| i == l)
            {
                return Err("DeepSeek's dense layers are the first ones".into());
            }
        }
        self.base.validate()?;
        let layers = self.base.num_hidden_layers;
        if let Some(i) = self.mlp_only_layers.iter().find(|&&i| i >= layers) {
            return Err(format!("mlp_only_layers names layer {i} of {layers}"));
        }
        if !(0..layers).any(|i| self.is_sparse(i)) {
            return Err(format!(
                "decoder_sparse_step {} and mlp_only_layers {:?} leave no sparse layer",
                self.decoder_sparse_step, self.mlp_only_layers
            ));
        }
        if self.num_experts_per_tok > self.num_local_experts {
            return Err(format!(
                "num_experts_per_tok {} exceeds num_local_experts {}",
                self.num_experts_per_tok, self.num_local_experts
            ));
        }
        if self.router_aux_loss_coef.is_nan() || self.router_aux_loss_coef < 0.0 {
            return Err("router_aux_loss_coef must be a number ≥ 0".into());
        }
        Ok(())
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        let b = &self.base;
        let (v, d, f, e) = (
            b.vocab_size,
            b.hidden_size,
            b.intermediate_size,
            self.num_local_experts,
        );
        let (q, kv) = (
            b.num_attention_heads * b.head_dim,
            b.num_key_value_heads * b.head_dim,
        );
        let attention = 2 * d
            + match b.variant.mla {
                Some(m) => m.num_params(d, b.num_attention_heads),
                None => d * q + 2 * d * kv + q * d,
            };
        let shared = 3 * d * self.shared_width().unwrap_or(0);
        let ffn = |i: usize| match self.is_sparse(i) {
            true => e * d + 3 * e * d * f + shared,
            false => 3 * d * self.dense_width(),
        };
        let layers: usize = (0..b.num_hidden_layers).map(|i| attention + ffn(i)).sum();
        2 * v * d + d + layers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_json_and_refuses_what_it_lacks() {
        let cfg = MixtralConfig::tiny();
        assert_eq!(
            MixtralConfig::from_json("c", &cfg.to_json()),
            Ok(cfg.clone())
        );
        let text = cfg.to_json();
        let llama = text.replace("\"mixtral\"", "\"llama\"");
        let err = MixtralConfig::from_json("c", &llama).unwrap_err();
        assert!(err.contains("not \"mixtral\""), "{err}");
        let window = text.replace("\"sliding_window\": null", "\"sliding_window\": 4");
        let err = MixtralConfig::from_json("c", &window).unwrap_err();
        assert!(err.contains("sliding_window 4"), "{err}");
        let k = text.replace("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5");
        let err = MixtralConfig::from_json("c", &k).unwrap_err();
        assert_eq!(err, "c: num_experts_per_tok 5 exceeds num_local_experts 4");
        let jitter = text.replace(
            "\"router_jitter_noise\": 0.0",
            "\"router_jitter_noise\": 0.1",
        );
        assert!(MixtralConfig::from_json("c", &jitter).is_err());
        assert!(LlamaConfig::from_json("c", &text).is_err());
    }

    #[test]
    fn reads_qwen3_moe_with_its_dense_layers() {
        let text = r#"{"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 40, "moe_intermediate_size": 24, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
            "max_position_embeddings": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
            "norm_topk_prob": false, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "use_sliding_window": false, "sliding_window": null, "rope_theta": 1e6}"#;
        let cfg = MixtralConfig::from_json("c", text).unwrap();
        assert_eq!(cfg.family, MoeFamily::Qwen3Moe);
        assert_eq!(
            (cfg.base.intermediate_size, cfg.dense_intermediate_size),
            (24, Some(40))
        );
        assert!(cfg.base.variant.qk_norm && !cfg.norm_topk_prob);
        assert_eq!(
            (cfg.num_local_experts, cfg.router_aux_loss_coef),
            (4, 0.001)
        );
        assert_eq!(
            MixtralConfig::from_json("c", &cfg.to_json()),
            Ok(cfg.clone())
        );
        assert_eq!(cfg.spec().name, "qwen3_moe");
        let step = text.replace("\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 2");
        let s = MixtralConfig::from_json("c", &step).unwrap();
        assert_eq!((s.is_sparse(0), s.is_sparse(1)), (false, true));
        assert_eq!(MixtralConfig::from_json("c", &s.to_json()), Ok(s.clone()));
        // Layer 0 dense: its MLP (3·32·40) in place of the router and 4 experts.
        assert_eq!(
            cfg.num_params() + 3 * 32 * 40,
            s.num_params() + 4 * 32 + 3 * 4 * 32 * 24
        );
        let only = text.replace("\"mlp_only_layers\": []", "\"mlp_only_layers\": [1]");
        let o = MixtralConfig::from_json("c", &only).unwrap();
        assert_eq!((o.is_sparse(0), o.is_sparse(1)), (true, false));
        // The planner counts each dense layer wherever it stands (placed first).
        for c in [&cfg, &s, &o] {
            assert_eq!(c.spec().num_params(), c.num_params(), "{c:?}");
        }
        for (from, to, said) in [
            (
                "\"mlp_only_layers\": []",
                "\"mlp_only_layers\": [2]",
                "layer 2 of 2",
            ),
            (
                "\"mlp_only_layers\": []",
                "\"mlp_only_layers\": [0, 1]",
                "no sparse layer",
            ),
            (
                "\"mlp_only_layers\": []",
                "\"mlp_only_layers\": 1",
                "mlp_only_layers",
            ),
            (
                "\"use_sliding_window\": false",
                "\"use_sliding_window\": true",
                "use_sliding",
            ),
            (
                "\"rope_theta\"",
                "\"tie_word_embeddings\": true, \"rope_theta\"",
                "tie_word",
            ),
        ] {
            let err = MixtralConfig::from_json("c", &text.replace(from, to)).unwrap_err();
            assert!(err.contains(said), "{err}");
        }
        let mut m = serde_json::from_str::<Value>(text).unwrap();
        m.as_object_mut().unwrap().remove("norm_topk_prob");
        m["num_experts"] = 8.into();
        m.as_object_mut().unwrap().remove("num_local_experts");
        let d = MixtralConfig::from_json("c", &m.to_string()).unwrap();
        assert!(!d.norm_topk_prob, "transformers' default");
        assert_eq!(d.num_local_experts, 8);
    }
}
