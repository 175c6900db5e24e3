//! A [`ModelSpec`] from a JSON description ([`ModelSpec::from_json`]) and the checks every
//! model passes ([`ModelSpec::validate`]).

use crate::error::PlanError;
use crate::json::Fields;
use crate::model::{Arch, AttentionKind, LatentAttention, ModelSpec, Moe};

const FIELDS: [&str; 24] = [
    "name",
    "arch",
    "attention",
    "vocab_size",
    "d_model",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "n_layers",
    "seq_len",
    "d_ff",
    "n_experts",
    "experts_per_token",
    "window",
    "tied",
    "shared_ff",
    "dense_layers",
    "dense_ff",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "fused_loss_rows",
];

impl ModelSpec {
    /// A model from a JSON object (`what` names it in errors): `vocab_size`, `d_model`,
    /// `n_heads`, `n_layers`, `seq_len`, `d_ff` required; `arch` (`gpt` | `llama` |
    /// `mixtral`, default gpt), `attention` (`materialized` | `flash` | `fused` — see
    /// [`AttentionKind`] —, default materialized for gpt, Bonfire's fused op (resolved per device and dtype) otherwise), `n_kv_heads` (default `n_heads`), `name` optional; for
    /// `mixtral` `n_experts` (E) and `experts_per_token` (k) required, `d_ff` each expert's
    /// width, `shared_ff`, `dense_layers`, `dense_ff` optional (refused for the others);
    /// latent attention with `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`,
    /// `v_head_dim` and an optional `q_lora_rank`.
    pub fn from_json(what: &str, text: &str) -> Result<Self, PlanError> {
        let mut f = Fields::parse(what, text)?;
        let arch = match f.string_opt("arch")?.as_deref() {
            None | Some("gpt") => Arch::Gpt,
            Some("llama") => Arch::Llama,
            Some("mixtral") => Arch::Mixtral(Moe {
                experts: f.count("n_experts")?,
                top_k: f.count("experts_per_token")?,
                shared_ff: f.count_opt("shared_ff")?.unwrap_or(0),
                dense_layers: f.count_opt("dense_layers")?.unwrap_or(0),
                dense_ff: f.count_opt("dense_ff")?.unwrap_or(0),
            }),
            Some(other) => {
                return Err(f.error(
                    "arch",
                    format!("`{other}` is unknown (gpt, llama, mixtral)"),
                ));
            }
        };
        let attention = match f.string_opt("attention")?.as_deref() {
            None if arch != Arch::Gpt => AttentionKind::Fused,
            None | Some("materialized") => AttentionKind::Materialized,
            Some("flash") => AttentionKind::Flash,
            Some("fused") => AttentionKind::Fused,
            Some(other) => {
                return Err(f.error(
                    "attention",
                    format!("`{other}` is unknown (materialized, flash, fused)"),
                ));
            }
        };
        let name = f.string_opt("name")?.unwrap_or_else(|| what.to_string());
        let n_heads = f.count("n_heads")?;
        let d_model = f.count("d_model")?;
        let spec = Self {
            name,
            arch,
            attention,
            vocab_size: f.count("vocab_size")?,
            d_model,
            n_heads,
            n_kv_heads: f.count_opt("n_kv_heads")?.unwrap_or(n_heads),
            head_dim: match f.count_opt("head_dim")? {
                Some(hd) => hd,
                // Zero heads: refused by `validate`, naming the field.
                None if n_heads == 0 => 0,
                None if d_model % n_heads == 0 => d_model / n_heads,
                None => {
                    return Err(f.error(
                        "n_heads",
                        format!("{n_heads} heads do not divide d_model {d_model} (give head_dim)"),
                    ));
                }
            },
            n_layers: f.count("n_layers")?,
            seq_len: f.count("seq_len")?,
            d_ff: f.count("d_ff")?,
            window: f.count_opt("window")?,
            tied: f.bool_opt("tied")?.unwrap_or(false),
            latent: match f.count_opt("kv_lora_rank")? {
                None => None,
                Some(kv_lora_rank) => Some(LatentAttention {
                    q_lora_rank: f.count_opt("q_lora_rank")?.unwrap_or(0),
                    kv_lora_rank,
                    qk_nope: f.count("qk_nope_head_dim")?,
                    qk_rope: f.count("qk_rope_head_dim")?,
                    v_head: f.count("v_head_dim")?,
                }),
            },
            fused_loss_rows: f.count_opt("fused_loss_rows")?.filter(|&r| r > 0),
        };
        let what = f.what().to_string();
        f.finish(&FIELDS)?;
        spec.validate(&what)?;
        Ok(spec)
    }

    /// Checks the sizes fit together (`what` names the description in errors).
    pub fn validate(&self, what: &str) -> Result<(), PlanError> {
        let bad = |field: &str, reason: String| Err(PlanError::field(what, field, reason));
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("n_layers", self.n_layers),
            ("seq_len", self.seq_len),
            ("d_ff", self.d_ff),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1, got 0".into());
            }
        }
        if self.arch == Arch::Gpt && self.head_dim * self.n_heads != self.d_model {
            return bad(
                "head_dim",
                "the GPT's heads split d_model: head_dim must be d_model / n_heads".into(),
            );
        }
        if self.n_kv_heads > self.n_heads || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(
                "n_kv_heads",
                format!(
                    "{} key/value heads must divide the {} heads",
                    self.n_kv_heads, self.n_heads
                ),
            );
        }
        if self.arch == Arch::Gpt && self.n_kv_heads != self.n_heads {
            return bad(
                "n_kv_heads",
                "grouped-query attention needs arch `llama`".into(),
            );
        }
        if let Some(moe) = self.moe()
            && moe.dense_layers > 0
            && (moe.dense_layers >= self.n_layers || moe.dense_ff == 0)
        {
            return bad(
                "dense_layers",
                format!(
                    "{} dense blocks of {} need a dense_ff and a sparse block after them",
                    moe.dense_layers, self.n_layers
                ),
            );
        }
        if let Some(l) = self.latent
            && (self.arch == Arch::Gpt || l.qk_rope % 2 != 0 || l.qk() != self.head_dim)
        {
            return bad(
                "kv_lora_rank",
                "latent attention needs arch llama or mixtral, an even qk_rope_head_dim and \
                 head_dim = qk_nope_head_dim + qk_rope_head_dim"
                    .into(),
            );
        }
        if let Some(moe) = self.moe()
            && (moe.experts == 0 || moe.top_k == 0 || moe.top_k > moe.experts)
        {
            return bad(
                "experts_per_token",
                format!(
                    "{} experts per token of {} experts: k must be between 1 and E (≥ 1)",
                    moe.top_k, moe.experts
                ),
            );
        }
        Ok(())
    }
}
