//! [`ModelConfig`]: a model's configuration, whatever its family — the GPT's `cfg.json`, or a
//! Hugging Face `config.json` whose `model_type` names the family — the one place a config
//! file is mapped to a model.

use crate::gpt::config::GptConfig;
use crate::llama::LlamaConfig;
use crate::mixtral::MixtralConfig;
use std::path::Path;

/// A model's configuration (see the module docs).
#[derive(Debug, Clone)]
pub enum ModelConfig {
    /// The contract's GPT.
    Gpt(GptConfig),
    /// A Hugging Face Llama (`model_type` `llama`).
    Llama(LlamaConfig),
    /// A Hugging Face mixture of experts (`model_type` `mixtral`, `qwen3_moe`, `deepseek_v3`).
    Mixtral(MixtralConfig),
}

impl ModelConfig {
    /// Reads `path`: a Hugging Face config when it names a `model_type`, else a GPT `cfg.json`.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = crate::read_config(path)?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("invalid config {}: {e}", path.display()))?;
        let what = path.display().to_string();
        match value.get("model_type").map(|t| t.as_str()) {
            None => GptConfig::from_json(&what, &text).map(Self::Gpt),
            Some(Some("mixtral" | "qwen3_moe" | "deepseek_v3")) => {
                MixtralConfig::from_json(&what, &text).map(Self::Mixtral)
            }
            Some(_) => LlamaConfig::from_json(&what, &text).map(Self::Llama),
        }
    }

    /// The vocabulary and the longest sequence, which the data must fit.
    pub fn limits(&self) -> (usize, usize) {
        match self {
            Self::Gpt(c) => (c.vocab_size, c.max_seq_len),
            Self::Llama(c) => (c.vocab_size, c.max_position_embeddings),
            Self::Mixtral(c) => (c.base.vocab_size, c.base.max_position_embeddings),
        }
    }

    /// The vocabulary's size.
    pub fn vocab_size(&self) -> usize {
        self.limits().0
    }

    /// The configuration as JSON (a GPT's `cfg.json`, a Hugging Face `config.json`).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Self::Gpt(c) => serde_json::to_value(c).expect("a config serializes"),
            Self::Llama(c) => serde_json::from_str(&c.to_json()).expect("valid JSON"),
            Self::Mixtral(c) => serde_json::from_str(&c.to_json()).expect("valid JSON"),
        }
    }

    /// The model as the planner sees it.
    pub fn spec(&self) -> bonfire_plan::ModelSpec {
        match self {
            Self::Gpt(c) => c.spec(),
            Self::Llama(c) => c.spec(),
            Self::Mixtral(c) => c.spec(),
        }
    }

    /// Checks the configuration, and that sequences of `seq` tokens fit its positions.
    pub fn validate(&self, seq: usize) -> Result<(), String> {
        let (_, max) = self.limits();
        if seq > max {
            let field = match self {
                Self::Gpt(_) => "max_seq_len",
                _ => "max_position_embeddings",
            };
            return Err(format!("--seq {seq}: the model's {field} is {max}"));
        }
        match self {
            Self::Gpt(c) => c.validate(),
            Self::Llama(c) => c.validate(),
            Self::Mixtral(c) => c.base.validate().and_then(|()| c.validate()),
        }
    }
}
