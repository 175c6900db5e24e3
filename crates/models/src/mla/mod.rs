//! DeepSeek's multi-head latent attention ([`Mla`], transformers' `DeepseekV3Attention`), an
//! attention kind of the one decoder layer ([`LlamaAttention`] with these projections): the
//! query through a low-rank bottleneck with its norm (or one projection), keys and values
//! from one shared latent per token (`kv_lora_rank` wide, normed) expanded per head, and
//! RoPE on a decoupled part of each head (`qk_rope_head_dim`, one rotary key shared by every
//! head; interleaved pairs when `rope_interleave`), the rest (`qk_nope_head_dim`) without
//! positions. Scores are scaled by `(nope + rope)^−½`; values are `v_head_dim` wide.
//!
//! Under tensor parallelism the heads split: the query's (up-)projection and `kv_b_proj`
//! column-wise, `o_proj` row-wise; the down-projections and their norms are replicated (each
//! rank computes the whole latent). Under context parallelism attention is ring attention,
//! the values zero-padded to the query width (the kernels take one head width) and cut back.
//!
//! This file holds the sizes (a `config.json`'s fields); [`attention`] the layer's parameters
//! and forward.

mod attention;
mod yarn;

pub use yarn::Yarn;

use crate::fields;
use serde_json::{Value, json};

/// Multi-head latent attention's sizes (the `config.json` fields of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mla {
    /// The query's bottleneck (`None`: one projection `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// The key/value latent's width.
    pub kv_lora_rank: usize,
    /// Each head's features without positions.
    pub qk_nope_head_dim: usize,
    /// Each head's rotary features (the rotary key is shared by the heads).
    pub qk_rope_head_dim: usize,
    /// Each head's value width.
    pub v_head_dim: usize,
    /// Whether RoPE rotates interleaved pairs `(x0, x1), (x2, x3), …` (DeepSeek's layout)
    /// rather than halves.
    pub rope_interleave: bool,
    /// YaRN's RoPE scaling (`rope_type: yarn`: DeepSeek-V3's own config).
    pub yarn: Option<Yarn>,
}

impl Mla {
    /// A query's and a key's width per head (`nope + rope`).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Reads the fields of a `config.json` object (transformers' defaults: DeepSeek-V3's),
    /// its RoPE (`rope_parameters` or `rope_scaling`, of `rope_type` or `type` default or
    /// yarn; others refused).
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let field = |name: &str| fields::field(v, name);
        let count = |name: &str, default: usize| fields::count(v, name, default);
        let rope = fields::rope(v);
        let q_lora_rank = match v.get("q_lora_rank") {
            Some(Value::Null) => None,
            _ => Some(count("q_lora_rank", 1536)?),
        };
        let mla = Self {
            q_lora_rank,
            kv_lora_rank: count("kv_lora_rank", 512)?,
            qk_nope_head_dim: count("qk_nope_head_dim", 128)?,
            qk_rope_head_dim: count("qk_rope_head_dim", 64)?,
            v_head_dim: count("v_head_dim", 128)?,
            rope_interleave: field("rope_interleave").and_then(Value::as_bool) != Some(false),
            yarn: match (rope.and_then(fields::rope_type), rope) {
                (None | Some("default"), _) => None,
                (Some("yarn"), Some(rope)) => Some(Yarn::from_json(rope)?),
                (Some(other), _) => {
                    return Err(format!(
                        "rope_type `{other}` is not supported (default, yarn)"
                    ));
                }
            },
        };
        mla.validate()?;
        Ok(mla)
    }

    /// The rotary width must be even; the values no wider than a query (they are padded to
    /// its width for the attention kernels).
    pub fn validate(&self) -> Result<(), String> {
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(format!(
                "qk_rope_head_dim {} is odd (RoPE needs pairs)",
                self.qk_rope_head_dim
            ));
        }
        if self.v_head_dim > self.qk_head_dim() {
            return Err(format!(
                "v_head_dim {} exceeds qk_nope_head_dim + qk_rope_head_dim {}: not supported",
                self.v_head_dim,
                self.qk_head_dim()
            ));
        }
        Ok(())
    }

    /// The fields of an exported `config.json`.
    pub fn json_fields(&self) -> Value {
        json!({
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_interleave": self.rope_interleave,
        })
    }

    /// Parameters of one layer's attention on a residual stream of `d` with `h` heads.
    pub fn num_params(&self, d: usize, h: usize) -> usize {
        let q = h * self.qk_head_dim();
        let query = match self.q_lora_rank {
            Some(r) => d * r + r + r * q,
            None => d * q,
        };
        let r = self.kv_lora_rank;
        query
            + d * (r + self.qk_rope_head_dim)
            + r
            + r * h * (self.qk_nope_head_dim + self.v_head_dim)
            + h * self.v_head_dim * d
    }

    /// The query projection tp splits by heads (`q_proj` or `q_b_proj`): its module name.
    pub fn query_projection(&self) -> &'static str {
        match self.q_lora_rank {
            Some(_) => "q_b_proj",
            None => "q_proj",
        }
    }
}
