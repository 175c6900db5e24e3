//! The planner's presets ([`PRESETS`], [`ModelSpec::preset`]): published models' sizes from
//! their papers and `config.json`s (sources in `docs/planner.md`).

use crate::model::{Arch, AttentionKind, LatentAttention, ModelSpec, Moe};

/// The presets' names.
pub const PRESETS: [&str; 15] = [
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
    "deepseek-v3-671b",
];

impl ModelSpec {
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
            latent: None,
            fused_loss_rows: None,
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
                    ..Moe::default()
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
                latent: None,
                fused_loss_rows: None,
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
                    ..Moe::default()
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
                latent: None,
                fused_loss_rows: None,
            },
            // DeepSeek-V3 (deepseek-ai/DeepSeek-V3's config.json; arXiv:2412.19437 §4.2):
            // vocabulary 129,280, hidden 7168, 61 layers, 128 heads of multi-head latent
            // attention (q rank 1536, kv rank 512, 128 + 64 query/key features, values 128),
            // the first 3 layers dense (18,432 wide), the others 256 routed experts of width
            // 2048, top 8, beside one shared expert; trained on 4096-token sequences —
            // 671.0 B parameters without the multi-token-prediction module, 37 B active.
            "deepseek-v3-671b" => Self {
                name: name.to_string(),
                arch: Arch::Mixtral(Moe {
                    experts: 256,
                    top_k: 8,
                    shared_ff: 2048,
                    dense_layers: 3,
                    dense_ff: 18_432,
                }),
                attention: AttentionKind::Fused,
                vocab_size: 129_280,
                d_model: 7168,
                n_heads: 128,
                n_kv_heads: 128,
                head_dim: 192,
                n_layers: 61,
                seq_len: 4096,
                d_ff: 2048,
                window: None,
                tied: false,
                latent: Some(LatentAttention {
                    q_lora_rank: 1536,
                    kv_lora_rank: 512,
                    qk_nope: 128,
                    qk_rope: 64,
                    v_head: 128,
                }),
                fused_loss_rows: None,
            },
            _ => return None,
        })
    }
}
