//! [`GptConfig`]: the model's sizes, as in the parity contract's `cfg.json`.

use bonfire_plan::{AttentionKind, ModelSpec};
use serde::{Deserialize, Serialize};

/// Sizes of the GPT decoder (`cfg.json` of the parity harness).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Number of token ids (rows of `tok_emb`, columns of the logits).
    pub vocab_size: usize,
    /// Width of the activations `d`.
    pub d_model: usize,
    /// Attention heads per block (must divide `d_model`).
    pub n_heads: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Longest sequence the model takes (rows of `pos_emb`).
    pub max_seq_len: usize,
    /// Hidden width of each block's MLP.
    pub d_ff: usize,
}

impl GptConfig {
    /// The GPT as the planner sees it (its position table has `max_seq_len` rows; its
    /// attention [`AttentionKind::Fused`]).
    pub fn spec(&self) -> ModelSpec {
        ModelSpec {
            attention: AttentionKind::Fused,
            ..ModelSpec::gpt(
                "gpt",
                self.vocab_size,
                self.d_model,
                self.n_heads,
                self.n_layers,
                self.max_seq_len,
                self.d_ff,
            )
        }
    }

    /// A tiny model for tests: vocab 32, d 16, 2 heads, 2 layers, seq 8, d_ff 32.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 32,
            d_model: 16,
            n_heads: 2,
            n_layers: 2,
            max_seq_len: 8,
            d_ff: 32,
        }
    }

    /// The benchmark size: vocab 4096, d 256, 8 heads, 4 layers, seq 128, d_ff 1024.
    pub const fn bench() -> Self {
        Self {
            vocab_size: 4096,
            d_model: 256,
            n_heads: 8,
            n_layers: 4,
            max_seq_len: 128,
            d_ff: 1024,
        }
    }

    /// Reads a `cfg.json`.
    pub fn load(path: impl AsRef<std::path::Path>) -> Result<Self, String> {
        let path = path.as_ref();
        Self::from_json(&path.display().to_string(), &crate::read_config(path)?)
    }

    /// Parses and validates the text of a `cfg.json`; `what` names it in errors.
    pub fn from_json(what: &str, text: &str) -> Result<Self, String> {
        let cfg: Self =
            serde_json::from_str(text).map_err(|e| format!("invalid config {what}: {e}"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the sizes are usable (heads divide the width, nothing is zero).
    pub fn validate(&self) -> Result<(), String> {
        let sizes = [
            self.vocab_size,
            self.d_model,
            self.n_heads,
            self.n_layers,
            self.max_seq_len,
            self.d_ff,
        ];
        if sizes.contains(&0) {
            return Err(format!("every size must be positive: {self:?}"));
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return Err(format!(
                "d_model {} is not divisible by n_heads {}",
                self.d_model, self.n_heads
            ));
        }
        Ok(())
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        let (v, d, t, f) = (self.vocab_size, self.d_model, self.max_seq_len, self.d_ff);
        let block = 4 * d + 4 * (d * d + d) + (f * d + f) + (d * f + d);
        v * d + t * d + self.n_layers * block + 2 * d + v * d
    }
}
