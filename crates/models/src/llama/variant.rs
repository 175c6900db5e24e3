//! What a Llama-family `model_type` adds to the Llama ([`LlamaVariant`]), read from its
//! `config.json`: Llama 3's RoPE frequency scaling ([`Llama3Rope`]), Qwen2's q/k/v biases,
//! Qwen3's per-head q/k RMSNorm, Mistral's sliding window — each a layer option of the one
//! decoder, not a copy of it.

use serde_json::{Map, Value, json};

/// A Hugging Face family the Llama decoder computes (its `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Family {
    /// `llama` (Llama 2, 3.x): `LlamaForCausalLM`.
    #[default]
    Llama,
    /// `qwen2` (Qwen2, Qwen2.5): q/k/v biases.
    Qwen2,
    /// `qwen3` (dense Qwen3): q/k RMSNorm per head, an explicit head width.
    Qwen3,
    /// `mistral` (Mistral 7B v0.1–v0.3, Mistral NeMo): the Llama with a sliding window when
    /// its `sliding_window` is set (v0.1's 4096 tokens).
    Mistral,
}

impl Family {
    /// Every family, for messages.
    pub const ALL: [Family; 4] = [Family::Llama, Family::Qwen2, Family::Qwen3, Family::Mistral];

    /// Its `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
        }
    }

    /// transformers' class (`architectures` in an exported `config.json`).
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
        }
    }

    /// The family of `model_type`, if it is one of these.
    pub fn parse(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.model_type() == model_type)
    }
}

/// Llama 3's RoPE scaling (`rope_type: "llama3"`): frequencies whose wavelength exceeds
/// `original / low_freq_factor` are divided by `factor`, those under `original /
/// high_freq_factor` kept, those between blended smoothly (transformers'
/// `_compute_llama3_parameters`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Rope {
    /// How much longer the context is than the one trained on.
    pub factor: f64,
    /// Wavelengths above `original / low_freq_factor` are scaled.
    pub low_freq_factor: f64,
    /// Wavelengths below `original / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was trained on first.
    pub original_max_position_embeddings: usize,
}

impl Llama3Rope {
    /// The scaled inverse frequency of `inv_freq`.
    pub fn scale(&self, inv_freq: f64) -> f64 {
        let original = self.original_max_position_embeddings as f64;
        let low_wavelen = original / self.low_freq_factor;
        let high_wavelen = original / self.high_freq_factor;
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        if wavelen < high_wavelen {
            inv_freq
        } else if wavelen > low_wavelen {
            inv_freq / self.factor
        } else {
            let smooth = (original / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }

    /// Reads the `llama3` fields of a `rope_parameters` object.
    fn from_json(rope: &Value) -> Result<Self, String> {
        let number = |field: &str| {
            rope.get(field)
                .and_then(Value::as_f64)
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| format!("rope_type llama3: `{field}` missing or not positive"))
        };
        let scaling = Self {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: number("original_max_position_embeddings")? as usize,
        };
        if scaling.high_freq_factor <= scaling.low_freq_factor {
            return Err("rope_type llama3: high_freq_factor must exceed low_freq_factor".into());
        }
        Ok(scaling)
    }
}

/// What a family adds to the Llama decoder (see the module docs). The default is the Llama.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LlamaVariant {
    /// The family (`model_type`).
    pub family: Family,
    /// Biases on the query, key and value projections (Qwen2's; the output has none).
    pub qkv_bias: bool,
    /// RMSNorm over each query and key head before RoPE, one `[head_dim]` weight each
    /// (Qwen3's `q_norm`, `k_norm`).
    pub qk_norm: bool,
    /// Llama 3's RoPE scaling.
    pub rope_scaling: Option<Llama3Rope>,
    /// The head is the embedding (`tie_word_embeddings`: Llama 3.2, small Qwens): one
    /// parameter, its gradient the sum of both uses.
    pub tie_word_embeddings: bool,
    /// Mistral's `sliding_window` W: query `i` sees keys `i − W < j ≤ i` (every layer).
    pub sliding_window: Option<usize>,
    /// DeepSeek's multi-head latent attention in place of grouped-query attention.
    pub mla: Option<crate::mla::Mla>,
}

impl LlamaVariant {
    /// The variant a `config.json` object of `family` describes: `rope` its `rope_parameters`
    /// (or `rope_scaling`). Refuses, naming the field, what the decoder does not compute: MLP
    /// biases, an output-projection bias, Qwen's per-layer sliding windows, other RoPE types.
    pub(crate) fn from_json(
        family: Family,
        obj: &Map<String, Value>,
        rope: Option<&Value>,
    ) -> Result<Self, String> {
        let flag = |f: &str| obj.get(f).and_then(Value::as_bool) == Some(true);
        let refuse = |f: &str, what: &str| Err(format!("{f} is true: {what} are not supported"));
        if flag("mlp_bias") {
            return refuse("mlp_bias", "MLP biases");
        }
        if flag("attention_bias") {
            return refuse("attention_bias", "output-projection biases");
        }
        if flag("use_sliding_window") {
            return refuse("use_sliding_window", "Qwen's per-layer sliding windows");
        }
        let sliding_window = match (family, obj.get("sliding_window")) {
            (Family::Mistral, Some(w)) if !w.is_null() => Some(
                w.as_u64()
                    .filter(|&w| w > 0)
                    .ok_or("field `sliding_window`: not a positive integer or null")?
                    as usize,
            ),
            _ => None,
        };
        let kind = rope.and_then(crate::fields::rope_type);
        let rope_scaling = match kind {
            None | Some("default") => None,
            Some("llama3") => Some(Llama3Rope::from_json(rope.expect("a rope_type"))?),
            Some(other) => {
                return Err(format!(
                    "rope_type `{other}` is not supported (default, llama3)"
                ));
            }
        };
        Ok(Self {
            family,
            qkv_bias: family == Family::Qwen2,
            qk_norm: family == Family::Qwen3,
            rope_scaling,
            tie_word_embeddings: flag("tie_word_embeddings"),
            sliding_window,
            mla: None,
        })
    }

    /// The fields of an exported `config.json` that say this variant (over the Llama's).
    pub(crate) fn json_fields(&self, rope_theta: f64) -> Value {
        let rope = match self.rope_scaling {
            None => json!({"rope_type": "default", "rope_theta": rope_theta}),
            Some(s) => json!({
                "rope_type": "llama3", "rope_theta": rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }),
        };
        let mut fields = json!({
            "architectures": [self.family.architecture()],
            "model_type": self.family.model_type(),
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
        });
        match self.family {
            Family::Llama => {}
            Family::Mistral => fields["sliding_window"] = json!(self.sliding_window),
            Family::Qwen2 | Family::Qwen3 => fields["use_sliding_window"] = json!(false),
        }
        fields
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_divides_and_blends() {
        let s = Llama3Rope {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 8.0,
            original_max_position_embeddings: 64,
        };
        // Wavelength 2π < 8: kept; 2π/0.001 > 64: divided; 2π/0.1 ≈ 62.8: blended.
        assert_eq!(s.scale(1.0), 1.0);
        assert_eq!(s.scale(0.001), 0.001 / 8.0);
        let smooth = (64.0 / (2.0 * std::f64::consts::PI / 0.1) - 1.0) / 7.0;
        let want = (1.0 - smooth) * 0.1 / 8.0 + smooth * 0.1;
        assert!((s.scale(0.1) - want).abs() < 1e-15);
    }
}
