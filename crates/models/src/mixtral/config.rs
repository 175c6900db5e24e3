//! [`MixtralConfig`]: a Mixtral model's sizes — the Llama's ([`LlamaConfig`]) plus its
//! experts — read from and written as a Hugging Face `config.json`
//! (`"model_type": "mixtral"`, the fields of `shared/notes/parity-harness.md`).

use crate::llama::LlamaConfig;
use bonfire_plan::{Arch, ModelSpec, Moe};
use serde_json::Value;

/// Sizes of a Mixtral decoder, named as in Hugging Face's `MixtralConfig`.
#[derive(Debug, Clone, Copy, PartialEq)]
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
}

impl MixtralConfig {
    /// The Mixtral as the planner sees it: the Llama's body ([`LlamaConfig::spec`]) with each
    /// MLP a sparse mixture of `num_local_experts` SwiGLU experts of width
    /// `intermediate_size`, `num_experts_per_tok` of them per token.
    pub fn spec(&self) -> ModelSpec {
        ModelSpec {
            name: "mixtral".into(),
            arch: Arch::Mixtral(Moe {
                experts: self.num_local_experts,
                top_k: self.num_experts_per_tok,
            }),
            ..self.base.spec()
        }
    }

    /// A tiny model for tests: vocab 64, hidden 32, 4 heads of 8, 2 kv heads, 2 layers,
    /// 4 experts of width 48, top 2, α = 0.02, positions 8.
    pub fn tiny() -> Self {
        Self {
            base: LlamaConfig {
                vocab_size: 64,
                hidden_size: 32,
                intermediate_size: 48,
                head_dim: 8,
                ..LlamaConfig::tiny()
            },
            num_local_experts: 4,
            num_experts_per_tok: 2,
            router_aux_loss_coef: 0.02,
        }
    }

    /// The bench size: the Llama bench's body ([`LlamaConfig::bench`]: vocab 4096, hidden
    /// 256, 8 heads, 4 kv heads, 4 layers, positions 128) with 8 experts of width 344 per
    /// layer, top 2 — each token's active feed-forward (2 × 344) is the Llama bench's 688 —
    /// and α = 0.02.
    pub fn bench() -> Self {
        Self {
            base: LlamaConfig {
                intermediate_size: 344,
                ..LlamaConfig::bench()
            },
            num_local_experts: 8,
            num_experts_per_tok: 2,
            router_aux_loss_coef: 0.02,
        }
    }

    /// Parses a Hugging Face `config.json` of `"model_type": "mixtral"`; `what` names it in
    /// errors. The Llama fields as [`LlamaConfig::from_json`] reads them, plus
    /// `num_local_experts`, `num_experts_per_tok` (defaults 8 and 2, transformers') and
    /// `router_aux_loss_coef` (default 0.001). What the model lacks is refused: a sliding
    /// window shorter than the positions, router jitter noise.
    pub fn from_json(what: &str, text: &str) -> Result<Self, String> {
        let base = LlamaConfig::from_json_of("mixtral", what, text)?;
        let bad = |reason: String| format!("{what}: {reason}");
        if base.variant.tie_word_embeddings {
            return Err(bad(
                "tie_word_embeddings is true: the Mixtral's head is untied here".into(),
            ));
        }
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let field = |name: &str| v.get(name).filter(|x| !x.is_null());
        let count = |name: &str, default: usize| -> Result<usize, String> {
            match field(name) {
                None => Ok(default),
                Some(x) => x
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| bad(format!("field `{name}`: not a positive integer"))),
            }
        };
        if let Some(w) = field("sliding_window").and_then(Value::as_u64)
            && (w as usize) < base.max_position_embeddings
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
        let cfg = Self {
            base,
            num_local_experts: count("num_local_experts", 8)?,
            num_experts_per_tok: count("num_experts_per_tok", 2)?,
            router_aux_loss_coef: alpha,
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
        m.insert(
            "architectures".into(),
            serde_json::json!(["MixtralForCausalLM"]),
        );
        m.insert("model_type".into(), "mixtral".into());
        m.insert("num_local_experts".into(), self.num_local_experts.into());
        m.insert(
            "num_experts_per_tok".into(),
            self.num_experts_per_tok.into(),
        );
        m.insert(
            "router_aux_loss_coef".into(),
            self.router_aux_loss_coef.into(),
        );
        m.insert("output_router_logits".into(), true.into());
        m.insert("router_jitter_noise".into(), 0.0.into());
        m.insert("sliding_window".into(), Value::Null);
        m.remove("mlp_bias");
        serde_json::to_string_pretty(&v).expect("a JSON object")
    }

    /// Checks the sizes: the Llama's, and 1 ≤ k ≤ E, α ≥ 0.
    pub fn validate(&self) -> Result<(), String> {
        self.base.validate()?;
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
        let layer = 2 * d + d * q + 2 * d * kv + q * d + e * d + 3 * e * d * f;
        2 * v * d + d + b.num_hidden_layers * layer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_json_and_refuses_what_it_lacks() {
        let cfg = MixtralConfig::tiny();
        assert_eq!(MixtralConfig::from_json("c", &cfg.to_json()), Ok(cfg));
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
}
