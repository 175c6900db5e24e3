//! [`ModelSpec`]: a decoder-only transformer as the cost model sees it — its sizes, its
//! architecture (Bonfire's GPT, Llama or Mixtral), its parameters per pipeline piece and per
//! tensor-parallel rank, its FLOPs and the activations it keeps for backward — and the
//! presets `gpt-bench`, `gpt3-175b`, `llama3-8b`, `llama3-70b`, `llama3-405b`,
//! `mixtral-8x7b`.
//!
//! Pieces are the pipeline's unit, as the trainer cuts the GPT: piece 0 is the embeddings,
//! pieces 1..=L the blocks, piece L + 1 the final norm and the head.

use crate::error::PlanError;
use crate::json::Fields;

/// The block's architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Bonfire's GPT (`bonfire_models::Gpt`, GPT-2/3 style): learned positions, LayerNorm
    /// with bias, biases on every linear, GELU MLP (`fc1`, `fc2`), untied head.
    Gpt,
    /// Llama: RoPE (no position table), RMSNorm, no biases, grouped-query attention,
    /// SwiGLU MLP (gate, up, down), untied head.
    Llama,
    /// Mixtral: the Llama's block with its MLP replaced by a sparse mixture of experts
    /// (`bonfire_models::mixtral`): a router `[E, d]` and E SwiGLU experts of width `d_ff`
    /// (gate+up `[2F, d]`, down `[d, F]`), each token routed to its top k. Tensor parallelism
    /// splits the attention only: the router and the experts are whole on every tp rank.
    Mixtral(Moe),
}

/// A mixture of experts' shape: E experts per layer, k of them per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moe {
    /// Experts per layer (E, Hugging Face's `num_local_experts`).
    pub experts: usize,
    /// Experts each token is routed to (k, `num_experts_per_tok`).
    pub top_k: usize,
}

/// How attention keeps its scores for backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// The score and probability matrices (heads × seq per token) are kept (Bonfire's GPT;
    /// Megatron in 2021).
    Materialized,
    /// FlashAttention: no seq-sized buffer is kept (what the published runs the planner is
    /// compared with used; Bonfire's own is [`Self::Fused`]).
    Flash,
    /// Bonfire's own models (`bonfire_models`' `causal_attention`): the fused op
    /// (`bonfire_kernels::attention`) in f32, which keeps no seq-sized buffer but its own
    /// output `[B, h, T, dh]` and log-sum-exp `[B, h, T]` beside the heads' merged copy the
    /// output projection keeps (`d + h` elements a token, split over tp: derived from the
    /// code) — under context parallelism ring attention's fused blocks instead
    /// ([`ModelSpec::ring_attention_elems`]); Burn's materialized scores in a 16-bit compute
    /// dtype, with or without cp; and Burn's materialized scores on a CubeCL device (CUDA,
    /// wgpu), where the fused op does not run yet. Resolved per device by
    /// [`ModelSpec::on_device`] and per dtype by [`ModelSpec::attention_under`].
    Fused,
}

/// The sizes of a decoder-only transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// The model's name in the planner's output (the preset's, or the description's).
    pub name: String,
    /// The block's architecture.
    pub arch: Arch,
    /// How attention keeps its scores for backward.
    pub attention: AttentionKind,
    /// Tokens in the vocabulary: the embedding table's and the head's rows.
    pub vocab_size: usize,
    /// The hidden (residual stream) width.
    pub d_model: usize,
    /// Attention (query) heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention); `n_heads` for plain multi-head attention.
    pub n_kv_heads: usize,
    /// Features per head: `d_model / n_heads` unless the model says otherwise (Qwen3's
    /// 128 at any width): the query and output projections are `d_model × n_heads·head_dim`.
    pub head_dim: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Context length: the position table's rows (GPT) and the default tokens per sequence.
    pub seq_len: usize,
    /// The MLP's inner width.
    pub d_ff: usize,
    /// A sliding attention window (Mistral's `sliding_window`): each query sees at most this
    /// many keys, which bounds attention's FLOPs per token; `None`: the whole causal prefix.
    pub window: Option<usize>,
    /// The head is the embedding table (`tie_word_embeddings`: Llama 3.2, small Qwens): one
    /// `V × d` table, not two. Bonfire trains it without pp, loss parallelism or activation
    /// checkpointing, and the planner searches the same.
    pub tied: bool,
}

/// The presets' names.
pub const PRESETS: [&str; 14] = [
    "gpt-bench",
    "gpt3-175b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "llama3.1-8b",
    "llama3.1-70b",
    "llama3.2-1b",
    "qwen3-0.6b",
    "qwen3-8b",
    "qwen3-32b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
];

const FIELDS: [&str; 15] = [
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
];

impl ModelSpec {
    /// Bonfire's GPT with `attention` materialized.
    #[allow(clippy::too_many_arguments)]
    pub fn gpt(
        name: &str,
        vocab_size: usize,
        d_model: usize,
        n_heads: usize,
        n_layers: usize,
        seq_len: usize,
        d_ff: usize,
    ) -> Self {
        Self {
            name: name.to_string(),
            arch: Arch::Gpt,
            attention: AttentionKind::Materialized,
            vocab_size,
            d_model,
            n_heads,
            n_kv_heads: n_heads,
            head_dim: d_model / n_heads,
            n_layers,
            seq_len,
            d_ff,
            window: None,
            tied: false,
        }
    }

    /// A Llama 3 model (vocabulary 128,256, 8 key/value heads, 8K context) with Bonfire's
    /// attention ([`AttentionKind::Fused`], resolved per device and dtype).
    fn llama3(name: &str, d_model: usize, n_heads: usize, n_layers: usize, d_ff: usize) -> Self {
        Self {
            name: name.to_string(),
            arch: Arch::Llama,
            attention: AttentionKind::Fused,
            vocab_size: 128_256,
            d_model,
            n_heads,
            n_kv_heads: 8,
            head_dim: d_model / n_heads,
            n_layers,
            seq_len: 8192,
            d_ff,
            window: None,
            tied: false,
        }
    }

    /// A dense Qwen3 (vocabulary 151,936, heads of 128, 8 kv heads, 40,960 positions, untied).
    fn qwen3(name: &str, d_model: usize, n_heads: usize, n_layers: usize, d_ff: usize) -> Self {
        Self {
            vocab_size: 151_936,
            head_dim: 128,
            seq_len: 40_960,
            ..Self::llama3(name, d_model, n_heads, n_layers, d_ff)
        }
    }

    /// A preset by name (see [`PRESETS`]; sources in `docs/planner.md`).
    pub fn preset(name: &str) -> Option<Self> {
        Some(match name {
            // The bench GPT (`GptConfig::bench`), whose attention is Bonfire's fused op.
            "gpt-bench" => Self {
                attention: AttentionKind::Fused,
                ..Self::gpt(name, 4096, 256, 8, 4, 128, 1024)
            },
            // GPT-3 175B (Brown et al. 2020, Table 2.1) with Megatron's padded vocabulary
            // (Narayanan et al. 2021): 96 layers, d 12288, 96 heads, context 2048.
            "gpt3-175b" => Self::gpt(name, 51_200, 12_288, 96, 96, 2048, 4 * 12_288),
            // Llama 3 (Dubey et al. 2024, Table 3).
            "llama3-8b" => Self::llama3(name, 4096, 32, 32, 14_336),
            "llama3-70b" => Self::llama3(name, 8192, 64, 80, 28_672),
            "llama3-405b" => Self::llama3(name, 16_384, 128, 126, 53_248),
            // Llama 3.1 (meta-llama/Llama-3.1-8B, -70B config.json): Llama 3's shapes with 131,072
            // positions (rope_type llama3, which the planner does not see).
            "llama3.1-8b" => Self {
                seq_len: 131_072,
                ..Self::llama3(name, 4096, 32, 32, 14_336)
            },
            "llama3.1-70b" => Self {
                seq_len: 131_072,
                ..Self::llama3(name, 8192, 64, 80, 28_672)
            },
            // Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json): hidden 2048, 32 heads of 64, 8
            // kv heads, 16 layers, intermediate 8192, 131,072 positions, tied — 1,235,814,400.
            "llama3.2-1b" => Self {
                seq_len: 131_072,
                tied: true,
                ..Self::llama3(name, 2048, 32, 16, 8192)
            },
            // Qwen3-0.6B (Qwen/Qwen3-0.6B config.json): vocabulary 151,936, hidden 1024, 16
            // heads of 128, 8 kv heads, 28 layers, intermediate 3072, 40,960 positions, tied —
            // 596,042,752 without the q/k norms (0.44 B without the table).
            "qwen3-0.6b" => Self {
                tied: true,
                ..Self::qwen3(name, 1024, 16, 28, 3072)
            },
            // Qwen3-8B (Qwen/Qwen3-8B config.json): hidden 4096, 32 heads of 128, 8 kv heads, 36
            // layers, intermediate 12,288, untied — 8,190,726,144 without the q/k norms.
            "qwen3-8b" => Self::qwen3(name, 4096, 32, 36, 12_288),
            // Qwen3-32B (Qwen/Qwen3-32B's config.json): vocabulary 151,936, hidden 5120, 64
            // heads of 128 (8192 wide, not 5120), 8 kv heads, 64 layers, intermediate 25,600,
            // 40,960 positions, untied — 32.76 B parameters.
            "qwen3-32b" => Self::qwen3(name, 5120, 64, 64, 25_600),
            // Mistral 7B v0.3 (mistralai/Mistral-7B-v0.3's config.json): vocabulary 32,768,
            // hidden 4096, 32 heads, 8 kv heads, 32 layers, intermediate 14,336, 32K
            // positions, no sliding window — 7.25 B parameters.
            "mistral-7b" => Self {
                vocab_size: 32_768,
                seq_len: 32_768,
                ..Self::llama3(name, 4096, 32, 32, 14_336)
            },
            // Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1's config.json): vocabulary 32,000,
            // hidden 4096, 32 heads, 8 kv heads, 32 layers, 32K positions, 8 experts of
            // width 14,336, top 2 — 46.7 B parameters, 12.9 B active per token.
            "mixtral-8x7b" => Self {
                name: name.to_string(),
                arch: Arch::Mixtral(Moe {
                    experts: 8,
                    top_k: 2,
                }),
                attention: AttentionKind::Fused,
                vocab_size: 32_000,
                d_model: 4096,
                n_heads: 32,
                n_kv_heads: 8,
                head_dim: 128,
                n_layers: 32,
                seq_len: 32_768,
                d_ff: 14_336,
                window: None,
                tied: false,
            },
            // Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B's config.json): vocabulary 151,936, hidden
            // 2048, 32 heads of 128 (4096 wide), 4 kv heads, 48 layers, 40,960 positions,
            // every layer 128 experts of width 768 (`moe_intermediate_size`), top 8, untied —
            // 30,532,110,336 parameters without the q/k norms, 3.3 B active per token.
            "qwen3-30b-a3b" => Self {
                name: name.to_string(),
                arch: Arch::Mixtral(Moe {
                    experts: 128,
                    top_k: 8,
                }),
                attention: AttentionKind::Fused,
                vocab_size: 151_936,
                d_model: 2048,
                n_heads: 32,
                n_kv_heads: 4,
                head_dim: 128,
                n_layers: 48,
                seq_len: 40_960,
                d_ff: 768,
                window: None,
                tied: false,
            },
            _ => return None,
        })
    }

    /// A model from a JSON object (`what` names it in errors): `vocab_size`, `d_model`,
    /// `n_heads`, `n_layers`, `seq_len`, `d_ff` required; `arch` (`gpt` | `llama` |
    /// `mixtral`, default gpt), `attention` (`materialized` | `flash` | `fused` — see
    /// [`AttentionKind`] —, default materialized for gpt, Bonfire's fused op (resolved per device and dtype) otherwise), `n_kv_heads` (default `n_heads`), `name` optional; for
    /// `mixtral` `n_experts` (E) and `experts_per_token` (k) required, `d_ff` each expert's
    /// width (refused for the others).
    pub fn from_json(what: &str, text: &str) -> Result<Self, PlanError> {
        let mut f = Fields::parse(what, text)?;
        let arch = match f.string_opt("arch")?.as_deref() {
            None | Some("gpt") => Arch::Gpt,
            Some("llama") => Arch::Llama,
            Some("mixtral") => Arch::Mixtral(Moe {
                experts: f.count("n_experts")?,
                top_k: f.count("experts_per_token")?,
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
        if self.n_kv_heads > self.n_heads || self.n_heads % self.n_kv_heads != 0 {
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

    /// The mixture of experts, for a Mixtral; `None` for a dense model.
    pub fn moe(&self) -> Option<Moe> {
        match self.arch {
            Arch::Mixtral(moe) => Some(moe),
            _ => None,
        }
    }

    /// A block's expert parameters, all E experts (`3·E·d·d_ff`; 0 for a dense model): whole
    /// on every tp rank, split over ep by the caller.
    pub fn block_expert_params(&self) -> usize {
        self.moe()
            .map_or(0, |m| 3 * m.experts * self.d_model * self.d_ff)
    }

    /// Expert parameters of piece `piece` (a block's [`Self::block_expert_params`]).
    pub fn piece_expert_params(&self, piece: usize) -> usize {
        if piece >= 1 && piece <= self.n_layers {
            self.block_expert_params()
        } else {
            0
        }
    }

    /// Pipeline pieces: embeddings, the blocks, the head.
    pub fn pieces(&self) -> usize {
        self.n_layers + 2
    }

    /// The width of the key (and of the value) projection: `n_kv_heads` heads.
    pub fn kv_dim(&self) -> usize {
        self.head_dim * self.n_kv_heads
    }

    /// The width of the queries and of attention's output: `n_heads · head_dim` (`d_model`
    /// unless the model sets its head width).
    pub fn q_dim(&self) -> usize {
        self.head_dim * self.n_heads
    }

    /// A block's (split over tp, whole on every tp rank) parameters — the split ones divided
    /// by `tp` by the caller. GPT: q/k/v/fc1 weights and biases and the o/fc2 weights split,
    /// norms and the o/fc2 biases whole (Bonfire's TP plan); Llama: every matrix split.
    fn block_params(&self) -> (usize, usize) {
        let (d, f, kv, q) = (self.d_model, self.d_ff, self.kv_dim(), self.q_dim());
        match self.arch {
            Arch::Gpt => (3 * (d * d + d) + d * d + (f * d + f) + d * f, 4 * d + d + d),
            Arch::Llama => (2 * d * q + 2 * d * kv + 3 * d * f, 2 * d),
            Arch::Mixtral(m) => (
                2 * d * q + 2 * d * kv,
                2 * d + m.experts * d + self.block_expert_params(),
            ),
        }
    }

    /// Parameters of piece `piece` on one rank of `tp` (the vocabulary is split).
    pub fn piece_params(&self, tp: usize, piece: usize) -> usize {
        let (v, d) = (self.vocab_size, self.d_model);
        let positions = match self.arch {
            Arch::Gpt => self.seq_len * d,
            Arch::Llama | Arch::Mixtral(_) => 0,
        };
        let norm = match self.arch {
            Arch::Gpt => 2 * d,
            Arch::Llama | Arch::Mixtral(_) => d,
        };
        if piece == 0 {
            v * d / tp + positions
        } else if piece == self.n_layers + 1 {
            // A tied head multiplies by the embedding's table: no parameter of its own.
            norm + if self.tied { 0 } else { v * d / tp }
        } else {
            let (split, whole) = self.block_params();
            split / tp + whole
        }
    }

    /// Parameters of piece `piece` on one rank of `tp` that are not the weight of a linear
    /// layer (embeddings, norms, biases): their gradients come out of the input-gradient
    /// backward (B) even when the weights' are deferred to W.
    pub fn piece_non_linear_params(&self, tp: usize, piece: usize) -> usize {
        let d = self.d_model;
        if piece == 0 {
            return self.piece_params(tp, 0);
        }
        let norm = match self.arch {
            Arch::Gpt => 2 * d,
            Arch::Llama | Arch::Mixtral(_) => d,
        };
        if piece == self.n_layers + 1 {
            return norm;
        }
        match self.arch {
            Arch::Gpt => (3 * d + self.d_ff) / tp + 2 * d + 2 * norm,
            Arch::Llama => 2 * norm,
            // The experts' products are plain matrix products of their parameters, not
            // linear layers: their gradients come out of B (the caller adds the rank's
            // experts, `E/ep` of them).
            Arch::Mixtral(_) => 2 * norm,
        }
    }

    /// Every parameter.
    pub fn num_params(&self) -> usize {
        (0..self.pieces()).map(|p| self.piece_params(1, p)).sum()
    }

    /// Forward FLOPs of piece `piece` per token on one rank of `tp`, for sequences of `seq`
    /// tokens: 2 per weight of every matrix product (the embedding lookup has none), plus
    /// attention's two products (QKᵀ and AV, 2·keys·d each, causal mask not discounted; keys
    /// is `seq`, or the sliding window where it is shorter).
    pub fn piece_flops_per_token(&self, tp: usize, piece: usize, seq: usize) -> f64 {
        let (v, d) = (self.vocab_size as f64, self.d_model as f64);
        if piece == 0 {
            return 0.0;
        }
        if piece == self.n_layers + 1 {
            return 2.0 * v * d / tp as f64;
        }
        let (f, kv, q) = (self.d_ff as f64, self.kv_dim() as f64, self.q_dim() as f64);
        let matmuls = match self.arch {
            Arch::Gpt => 4.0 * d * d + 2.0 * d * f,
            Arch::Llama => 2.0 * d * q + 2.0 * d * kv + 3.0 * d * f,
            Arch::Mixtral(_) => 2.0 * d * q + 2.0 * d * kv,
        };
        let keys = self.window.map_or(seq, |w| w.min(seq)) as f64;
        (2.0 * matmuls + 4.0 * keys * q) / tp as f64 + self.moe_flops_per_token()
    }

    /// Forward FLOPs per token of a block's mixture of experts (0 for a dense model): the
    /// router (`2·d·E`) and the token's k experts (`2·3·d·d_ff` each) — active parameters,
    /// not all E — on every tp rank (tp does not split them).
    pub fn moe_flops_per_token(&self) -> f64 {
        self.moe().map_or(0.0, |m| {
            let (d, f) = (self.d_model as f64, self.d_ff as f64);
            2.0 * d * m.experts as f64 + m.top_k as f64 * 6.0 * d * f
        })
    }

    /// The model as Bonfire's engines run it on `device`: its attention, when it is Bonfire's
    /// own ([`AttentionKind::Fused`]), materialized where the fused op does not run
    /// ([`DeviceSpec::fused_attention`]: CubeCL devices); the dtype's part is
    /// [`Self::attention_under`]'s.
    pub fn on_device(&self, device: &crate::DeviceSpec) -> Self {
        let mut model = self.clone();
        if model.attention == AttentionKind::Fused && !device.fused_attention {
            model.attention = AttentionKind::Materialized;
        }
        model
    }

    /// How attention keeps its scores in a compute dtype of `bytes` per element:
    /// [`AttentionKind::Fused`] stays fused in f32 (with or without cp: ring attention's blocks
    /// run the fused op too) and is `Materialized` in other dtypes; the others as they are.
    pub fn attention_under(&self, bytes: usize) -> AttentionKind {
        match self.attention {
            AttentionKind::Fused if bytes != 4 => AttentionKind::Materialized,
            kind => kind,
        }
    }

    /// Elements a block keeps for backward per token, on one rank of `tp` (sequences of
    /// `seq`), after Korthikanti et al. 2022 (§4) without dropout: the two norm inputs (in
    /// f32 what Bonfire's norm cores keep: `x̂`, which the weight's product shares) and
    /// the inputs of the q/k/v and fc1 products (4d, replicated over tp unless sequence
    /// parallel), q, k, v and the attention output (4d), the MLP's hidden activations (2·d_ff
    /// GELU, 3·d_ff SwiGLU), and with materialized attention the scores and probabilities
    /// (2·heads·seq; [`AttentionKind::Fused`] keeps `d + heads` instead, as in f32 without cp —
    /// resolve it for a layout with [`Self::attention_under`]); everything but the replicated
    /// 4d is split over tp. (q, k, v, the attention output and the fused output are
    /// [`Self::q_dim`] wide: `d` unless the model sets its head width.)
    pub fn block_activation_elems(&self, tp: usize, sp: bool, seq: usize) -> f64 {
        let (d, f, h) = (self.d_model as f64, self.d_ff as f64, self.n_heads as f64);
        let a = self.q_dim() as f64;
        let mlp = match self.arch {
            Arch::Gpt => 2.0 * f,
            Arch::Llama => 3.0 * f,
            Arch::Mixtral(_) => 0.0,
        };
        let scores = match self.attention {
            AttentionKind::Materialized => 2.0 * h * seq as f64,
            AttentionKind::Flash => 0.0,
            AttentionKind::Fused => a + h,
        };
        let t = tp as f64;
        let replicated = if sp { 4.0 * d / t } else { 4.0 * d };
        replicated + (4.0 * a + mlp + scores) / t + self.moe_activation_elems()
    }

    /// Elements a block's mixture of experts keeps per token (0 for a dense model), on every
    /// tp rank (tp does not split it): for each of the token's k routed rows — dropless, and
    /// with balanced loads every rank computes `k·tokens` rows, whatever ep — the grouped
    /// input (d), the expert's SwiGLU activations (3·d_ff, the Llama MLP's count) and its
    /// output before the weighted sum (d); and the router's probabilities and weights (2·E).
    pub fn moe_activation_elems(&self) -> f64 {
        self.moe().map_or(0.0, |m| {
            let (d, f) = (self.d_model as f64, self.d_ff as f64);
            m.top_k as f64 * (2.0 * d + 3.0 * f) + 2.0 * m.experts as f64
        })
    }

    /// Elements a block keeps per token on one rank of `tp` beyond (or, negative, short of)
    /// [`Self::block_activation_elems`] at `seq` — the whole sequence — when the sequence is
    /// split over `cp > 1` ranks and attention is Bonfire's ring attention
    /// (`bonfire_cp::ring_attention`, which autodiff differentiates step by
    /// step). Derived from the code, not fitted:
    /// - [`AttentionKind::Materialized`] (16-bit types): each of the `cp` ring steps computes its
    ///   block — with balanced chunks no block lies wholly in a rank's future, so none is
    ///   skipped — and keeps for backward that block's keys and values repeated to the rank's
    ///   query heads (the products' inputs, `2·d/tp` per token per block, where one attention
    ///   keeps `2·d/tp` in all) and [`RING_KEPT_SCORES`] `T/cp × T/cp` buffers per head
    ///   (`T/cp × T` over the blocks, where one attention keeps `2` of `T × T`); the online
    ///   softmax's running numerator is kept by its final division (`d/tp`), and a row sum
    ///   or rescale factor per head and block.
    /// - [`AttentionKind::Fused`] (f32): each block's keys and values as they travelled
    ///   (`2·kv_dim/tp` a token for each of the `cp − 1` received blocks; the first is the
    ///   rank's own, which one attention keeps anyway); each fused call keeps its output and
    ///   log-sum-exp (`d + h`) for every query it covers, and the merge of a query chunk's
    ///   parts keeps each part's output stacked (`d`), its exponentiated and normalized
    ///   log-sum-exps (`2h`) and one sum per chunk (`h`). The fullest rank (the last of the
    ///   balanced split) covers each query once per step: `cp·(2d + 3h) + h` a token, where
    ///   one attention keeps `d + h`.
    /// - [`AttentionKind::Flash`]: keeps no block: 0.
    pub fn ring_attention_elems(&self, tp: usize, cp: usize, seq: usize) -> f64 {
        if cp <= 1 {
            return 0.0;
        }
        let (d, h, cp) = (self.q_dim() as f64, self.n_heads as f64, cp as f64);
        let per_token = match self.attention {
            AttentionKind::Flash => return 0.0,
            AttentionKind::Fused => {
                let kv = self.kv_dim() as f64;
                2.0 * (cp - 1.0) * kv + cp * (2.0 * d + 3.0 * h) + h - (d + h)
            }
            AttentionKind::Materialized => {
                let scores = (RING_KEPT_SCORES - 2.0) * h * seq as f64;
                (2.0 * (cp - 1.0) + 1.0) * d + cp * h + scores
            }
        };
        per_token / tp as f64
    }

    /// Of [`Self::ring_attention_elems`], the probabilities ring attention keeps per token on
    /// one rank of `tp` (`RING_KEPT_SCORES · h · T / tp`): in f32 whatever the compute dtype
    /// (the ring widens 16-bit scores as the fused softmax does). 0 without cp or unless
    /// materialized.
    pub fn ring_score_elems(&self, tp: usize, cp: usize, seq: usize) -> f64 {
        if cp <= 1 || self.attention != AttentionKind::Materialized {
            return 0.0;
        }
        RING_KEPT_SCORES * self.n_heads as f64 * seq as f64 / tp as f64
    }

    /// Elements a block keeps per token on one rank of `tp` between its input-gradient
    /// backward (B) and its deferred weight gradients (W) under a zero-bubble schedule: each
    /// linear layer's input and output gradient (`bonfire_module::weight_grad`). The inputs
    /// and output gradients of the column-parallel products' inputs and the row-parallel
    /// products' outputs are whole on every tp rank (4d, gathered under sequence
    /// parallelism too); the attention output and MLP hidden inputs, and the q/k/v and MLP
    /// up-projection output gradients, are split.
    pub fn block_weight_grad_elems(&self, tp: usize) -> f64 {
        let (d, f, kv) = (self.d_model as f64, self.d_ff as f64, self.kv_dim() as f64);
        let a = self.q_dim() as f64;
        let up = match self.arch {
            Arch::Gpt => f,
            Arch::Llama => 2.0 * f,
            // The router's input (the MLP input's d) and output gradient (E) are kept; the
            // experts are not linear layers (their gradients come out of B).
            Arch::Mixtral(m) => {
                return 3.0 * d + m.experts as f64 + (2.0 * a + 2.0 * kv) / tp as f64;
            }
        };
        4.0 * d + (a + f + a + 2.0 * kv + up) / tp as f64
    }

    /// Bytes of the largest single layer's parameters in `param_bytes` per value, on one
    /// rank of `tp` (the largest of a block and the vocabulary matrix).
    pub fn largest_layer_params(&self, tp: usize) -> usize {
        self.largest_layer_params_ep(tp, 1)
    }

    /// [`Self::largest_layer_params`] on a rank holding `E/ep` of each block's experts (what
    /// ZeRO-3 gathers under ep: the layer's other parameters over dp × cp, its experts over
    /// their replicas).
    pub fn largest_layer_params_ep(&self, tp: usize, ep: usize) -> usize {
        let experts = self.block_expert_params();
        let block = self.piece_params(tp, 1) - experts + experts / ep;
        block.max(self.vocab_size * self.d_model / tp)
    }
}

/// `[T/cp, T/cp]` buffers per head a ring-attention step keeps for backward: its
/// probabilities, kept once — by the product with the values and by the exponential, whose
/// backward (`bonfire_kernels::exp`) uses its output; Burn's own `exp` keeps its input, a
/// second buffer. Counted from the code, not fitted.
pub const RING_KEPT_SCORES: f64 = 1.0;

/// The pieces each of `stages` pipeline stages runs, `[start, end)` per stage: an even split
/// of `pieces` (the first stages one larger), or at the piece indices `points` — the split
/// the trainer makes.
pub fn stage_ranges(pieces: usize, stages: usize, points: Option<&[usize]>) -> Vec<(usize, usize)> {
    let points: Vec<usize> = match points {
        Some(p) => p.to_vec(),
        None => bonfire_layout::even_split_points(pieces, stages),
    };
    let mut starts = vec![0];
    starts.extend(points);
    starts.push(pieces);
    starts.windows(2).map(|w| (w[0], w[1])).collect()
}
