//! [`LlamaConfig`]: a Llama model's sizes, read from and written as a Hugging Face
//! `config.json` (`"model_type": "llama"`, the fields of `shared/notes/parity-harness.md`).

use super::variant::{Family, LlamaVariant};
use bonfire_plan::{Arch, AttentionKind, ModelSpec};
use serde_json::{Map, Value, json};

/// Sizes of a Llama decoder, named as in Hugging Face's `LlamaConfig`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary (V).
    pub vocab_size: usize,
    /// Width of the residual stream (d).
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP (F).
    pub intermediate_size: usize,
    /// Decoder layers (L).
    pub num_hidden_layers: usize,
    /// Query heads (h).
    pub num_attention_heads: usize,
    /// Key/value heads (h_kv; h is a multiple of it: grouped-query attention).
    pub num_key_value_heads: usize,
    /// Features per head (hd; `hidden_size / num_attention_heads` unless given).
    pub head_dim: usize,
    /// RMSNorm's epsilon.
    pub rms_norm_eps: f64,
    /// RoPE's base θ (inverse frequencies θ^(−2j/hd)).
    pub rope_theta: f64,
    /// The longest sequence the model is meant for (positions are computed, not learnt).
    pub max_position_embeddings: usize,
    /// What its family adds (Llama 3's RoPE scaling, Qwen2's biases, Qwen3's q/k norms).
    pub variant: LlamaVariant,
}

impl LlamaConfig {
    /// The Llama as the planner sees it: grouped-query attention, SwiGLU, RMSNorm, no
    /// biases — and attention as the GPT computes it ([`AttentionKind::Fused`]: no scores kept in
    /// f32, kept in 16-bit types and under ring attention).
    pub fn spec(&self) -> ModelSpec {
        ModelSpec {
            name: "llama".into(),
            arch: Arch::Llama,
            attention: AttentionKind::Fused,
            vocab_size: self.vocab_size,
            d_model: self.hidden_size,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            n_layers: self.num_hidden_layers,
            seq_len: self.max_position_embeddings,
            d_ff: self.intermediate_size,
            window: self.variant.sliding_window,
            tied: self.variant.tie_word_embeddings,
            latent: None,
            fused_loss_rows: None,
        }
    }

    /// A tiny model for tests: vocab 32, hidden 16, 4 heads of 4, 2 kv heads, 2 layers,
    /// intermediate 24, positions 8.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 4,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            max_position_embeddings: 8,
            variant: LlamaVariant::default(),
        }
    }

    /// The benchmark size: vocab 4096, hidden 256, 8 heads, 4 kv heads, 4 layers,
    /// intermediate 688, positions 128.
    pub fn bench() -> Self {
        Self {
            vocab_size: 4096,
            hidden_size: 256,
            intermediate_size: 688,
            num_hidden_layers: 4,
            num_attention_heads: 8,
            num_key_value_heads: 4,
            head_dim: 32,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            max_position_embeddings: 128,
            variant: LlamaVariant::default(),
        }
    }

    /// Parses a Hugging Face `config.json` of `"model_type"` `llama`, `qwen2` or `qwen3`
    /// ([`Family`]); `what` names it in errors. θ is `rope_parameters.rope_theta` or a
    /// top-level `rope_theta` (default 10000); `head_dim` defaults to `hidden_size /
    /// num_attention_heads`, `num_key_value_heads` to `num_attention_heads`; `rope_type`
    /// `llama3` is Llama 3's scaling. What the decoder does not compute is refused naming the
    /// field ([`LlamaVariant`]: tied embeddings, MLP or output biases, sliding windows, other
    /// RoPE types).
    pub fn from_json(what: &str, text: &str) -> Result<Self, String> {
        let model_type = serde_json::from_str::<Value>(text).ok().and_then(|v| {
            v.get("model_type")
                .and_then(Value::as_str)
                .map(str::to_owned)
        });
        let family = model_type
            .as_deref()
            .and_then(Family::parse)
            .ok_or_else(|| {
                let known: Vec<_> = Family::ALL.iter().map(|f| f.model_type()).collect();
                format!("{what}: model_type is {model_type:?}, not one of {known:?}")
            })?;
        Self::from_json_of(family.model_type(), what, text)
    }

    /// [`from_json`](Self::from_json) for a config of `model_type` (the Llama family's
    /// shared fields: the Mixtral reads its own on top).
    pub(crate) fn from_json_of(model_type: &str, what: &str, text: &str) -> Result<Self, String> {
        let bad = |reason: String| format!("{what}: {reason}");
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| bad("not a JSON object".into()))?;
        match obj.get("model_type").and_then(Value::as_str) {
            Some(t) if t == model_type => {}
            other => {
                return Err(bad(format!(
                    "model_type is {other:?}, not \"{model_type}\""
                )));
            }
        }
        let count = |field: &str| -> Result<usize, String> {
            obj.get(field)
                .and_then(Value::as_u64)
                .filter(|&n| n > 0)
                .map(|n| n as usize)
                .ok_or_else(|| {
                    bad(format!(
                        "field `{field}`: missing or not a positive integer"
                    ))
                })
        };
        let optional = |field: &str| obj.get(field).filter(|v| !v.is_null());
        let rope = crate::fields::rope(&v);
        let family = Family::parse(model_type).unwrap_or_default();
        let variant = LlamaVariant::from_json(family, obj, rope).map_err(bad)?;
        let theta = rope
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| optional("rope_theta"))
            .map(|t| {
                t.as_f64()
                    .ok_or_else(|| bad("`rope_theta` is not a number".into()))
            })
            .transpose()?
            .unwrap_or(10_000.0);
        let heads = count("num_attention_heads")?;
        let hidden = count("hidden_size")?;
        let cfg = Self {
            vocab_size: count("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: count("intermediate_size")?,
            num_hidden_layers: count("num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: match optional("num_key_value_heads") {
                Some(_) => count("num_key_value_heads")?,
                None => heads,
            },
            head_dim: match optional("head_dim") {
                Some(_) => count("head_dim")?,
                None => hidden / heads,
            },
            rms_norm_eps: optional("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_theta: theta,
            max_position_embeddings: count("max_position_embeddings")?,
            variant,
        };
        cfg.validate().map_err(bad)?;
        Ok(cfg)
    }

    /// Reads a `config.json` file.
    pub fn load(path: impl AsRef<std::path::Path>) -> Result<Self, String> {
        let path = path.as_ref();
        Self::from_json(&path.display().to_string(), &crate::read_config(path)?)
    }

    /// The `config.json` transformers reads back as this model (f32, untied; its family's
    /// `model_type`, architecture and RoPE).
    pub fn to_json(&self) -> String {
        let mut m = Map::new();
        let fields = json!({
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "torch_dtype": "float32",
        });
        for f in [fields, self.variant.json_fields(self.rope_theta)] {
            if let Value::Object(f) = f {
                m.extend(f);
            }
        }
        serde_json::to_string_pretty(&Value::Object(m)).expect("a JSON object")
    }

    /// Checks the sizes: query heads a multiple of the kv heads, an even head width (RoPE
    /// pairs its halves), positive epsilon and θ.
    pub fn validate(&self) -> Result<(), String> {
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim {} is odd (RoPE needs pairs)",
                self.head_dim
            ));
        }
        if self.rms_norm_eps <= 0.0 || self.rope_theta <= 0.0 {
            return Err("rms_norm_eps and rope_theta must be positive".into());
        }
        Ok(())
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        let (v, d, f) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        let v_ = &self.variant;
        let extras =
            usize::from(v_.qkv_bias) * (q + 2 * kv) + usize::from(v_.qk_norm) * 2 * self.head_dim;
        let layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * f + extras;
        let heads = if self.variant.tie_word_embeddings {
            1
        } else {
            2
        };
        heads * v * d + d + self.num_hidden_layers * layer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_json_and_refuses_what_it_lacks() {
        let cfg = LlamaConfig::bench();
        assert_eq!(LlamaConfig::from_json("c", &cfg.to_json()), Ok(cfg));
        let text = r#"{"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 8, "rope_theta": 500000.0}"#;
        let c = LlamaConfig::from_json("c", text).unwrap();
        assert_eq!(
            (c.num_key_value_heads, c.head_dim, c.rope_theta),
            (4, 4, 5e5)
        );
        let err = LlamaConfig::from_json("c", &text.replace("\"hidden_size\": 16,", ""));
        assert_eq!(
            err.unwrap_err(),
            "c: field `hidden_size`: missing or not a positive integer"
        );
        let tied = text.replace(
            "\"rope_theta\"",
            "\"tie_word_embeddings\": true, \"rope_theta\"",
        );
        let t = LlamaConfig::from_json("c", &tied).unwrap();
        assert!(t.variant.tie_word_embeddings);
        assert_eq!(
            t.num_params() + 32 * 16,
            c.num_params(),
            "one table, not two"
        );
        assert_eq!(LlamaConfig::from_json("c", &t.to_json()), Ok(t));
        let gpt = text.replace("\"llama\"", "\"gpt2\"");
        assert!(
            LlamaConfig::from_json("c", &gpt)
                .unwrap_err()
                .contains("not one of [\"llama\", \"qwen2\", \"qwen3\", \"mistral\"]")
        );
        for (field, said) in [
            ("mlp_bias", "mlp_bias is true"),
            ("attention_bias", "attention_bias is true"),
            ("use_sliding_window", "use_sliding_window is true"),
        ] {
            let on = text.replace(
                "\"rope_theta\"",
                &format!("\"{field}\": true, \"rope_theta\""),
            );
            let err = LlamaConfig::from_json("c", &on).unwrap_err();
            assert!(err.contains(said), "{err}");
        }
        let yarn = text.replace(
            "\"rope_theta\": 500000.0",
            "\"rope_parameters\": {\"rope_type\": \"yarn\", \"rope_theta\": 1.0}",
        );
        assert!(
            LlamaConfig::from_json("c", &yarn)
                .unwrap_err()
                .contains("rope_type `yarn`")
        );
        let mistral = text.replace("\"llama\"", "\"mistral\"");
        let m = LlamaConfig::from_json("c", &mistral).unwrap();
        assert_eq!(LlamaConfig::from_json("c", &m.to_json()), Ok(m));
        let window = mistral.replace("\"rope_theta\"", "\"sliding_window\": 4, \"rope_theta\"");
        let w = LlamaConfig::from_json("c", &window).unwrap();
        assert_eq!(w.variant.sliding_window, Some(4));
        assert_eq!(LlamaConfig::from_json("c", &w.to_json()), Ok(w));
        let zero = window.replace("\"sliding_window\": 4", "\"sliding_window\": 0");
        let err = LlamaConfig::from_json("c", &zero).unwrap_err();
        assert!(err.contains("sliding_window"), "{err}");
        // A Llama's `sliding_window` field means nothing to it.
        let llama = LlamaConfig::from_json("c", &window.replace("\"mistral\"", "\"llama\""));
        assert_eq!(llama.unwrap().variant.sliding_window, None);
        let qwen3 = text.replace("\"llama\"", "\"qwen3\"");
        let q = LlamaConfig::from_json("c", &qwen3).unwrap();
        assert!(q.variant.qk_norm && !q.variant.qkv_bias);
        assert_eq!(LlamaConfig::from_json("c", &q.to_json()), Ok(q));
        let odd = text.replace("\"num_attention_heads\": 4", "\"num_attention_heads\": 3");
        assert!(LlamaConfig::from_json("c", &odd).is_err());
    }

    #[test]
    fn counts_parameters() {
        // embed 4096·256 ×2 (untied head) + norm 256 + 4 layers of
        // 2·256 + 256·256 + 2·256·128 + 256·256 + 3·256·688.
        assert_eq!(
            LlamaConfig::bench().num_params(),
            2 * 4096 * 256 + 256 + 4 * (512 + 65_536 * 2 + 65_536 + 3 * 176_128)
        );
    }
}
