//! [`ModelSpec`]: a decoder-only transformer as the cost model sees it — its sizes, its
//! architecture (Bonfire's GPT, Llama or Mixtral), its parameters per pipeline piece and per
//! tensor-parallel rank, its FLOPs and the activations it keeps for backward (multi-head
//! latent attention, shared experts and dense blocks among sparse ones included). Its
//! presets are in `presets.rs` (`gpt-bench` … `deepseek-v3-671b`, [`crate::PRESETS`]), its
//! JSON description and checks in `describe.rs`.
//!
//! Pieces are the pipeline's unit, as the trainer cuts the GPT: piece 0 is the embeddings,
//! pieces 1..=L the blocks, piece L + 1 the final norm and the head.

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

/// A mixture of experts' shape: E experts per layer, k of them per token; DeepSeek's shared
/// experts beside them and its first dense layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Moe {
    /// Experts per layer (E, Hugging Face's `num_local_experts`).
    pub experts: usize,
    /// Experts each token is routed to (k, `num_experts_per_tok`).
    pub top_k: usize,
    /// The shared experts' width beside the routed ones (DeepSeek: `n_shared_experts ×
    /// moe_intermediate_size`), every token through them; 0: none. Split over tp as an MLP.
    pub shared_ff: usize,
    /// The first blocks are dense (DeepSeek's `first_k_dense_replace`): a SwiGLU MLP of
    /// [`Self::dense_ff`] in place of the experts.
    pub dense_layers: usize,
    /// The dense blocks' MLP width.
    pub dense_ff: usize,
}

/// Multi-head latent attention's sizes (DeepSeek-V2/V3): the query through a rank
/// `q_lora_rank` bottleneck (0: one projection), keys and values from one `kv_lora_rank`
/// latent a token, `qk_nope + qk_rope` features a query and key head (one rotary key shared
/// by the heads), `v_head` a value head. Tensor parallelism splits the heads (the up- and
/// output projections); the down-projections and their norms are whole on every tp rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentAttention {
    /// The query's bottleneck (0: none, one `q_proj`).
    pub q_lora_rank: usize,
    /// The key/value latent's width.
    pub kv_lora_rank: usize,
    /// A head's features without positions.
    pub qk_nope: usize,
    /// A head's rotary features.
    pub qk_rope: usize,
    /// A value head's width.
    pub v_head: usize,
}

impl LatentAttention {
    /// A query's (and key's) width per head.
    pub fn qk(&self) -> usize {
        self.qk_nope + self.qk_rope
    }
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
    /// (`bonfire_kernels::attention`) in f32, which keeps no seq-sized buffer but its output
    /// `[B, h, T, dh]` — written sequence-major, so that the heads' merge the output
    /// projection keeps is a view of it, not a copy (since 2026-12-05) — and its log-sum-exp
    /// `[B, h, T]` (`h` elements a token beyond the attention output, split over tp: derived
    /// from the code) — under context parallelism ring attention's fused blocks instead
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
    /// `V × d` table, not two. Bonfire trains it without pp (with tp, loss parallelism and
    /// activation checkpointing), and the planner searches the same.
    pub tied: bool,
    /// Multi-head latent attention in place of grouped-query attention (DeepSeek-V3).
    pub latent: Option<LatentAttention>,
    /// The head fused with its loss by blocks of this many positions (the models'
    /// `with_fused_loss`, `train --fused-loss`) where it is not tp-sharded: the memory model
    /// counts what that node keeps and makes ([`crate::memory::head_kept_bytes`]); `None`:
    /// the logits whole, then the loss.
    pub fused_loss_rows: Option<usize>,
}

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
            latent: None,
            fused_loss_rows: None,
        }
    }

    /// The model with its head fused with the loss by blocks of `rows` positions (`None`:
    /// unfused), as the models' `with_fused_loss` runs it.
    pub fn with_fused_loss(mut self, rows: impl Into<Option<usize>>) -> Self {
        self.fused_loss_rows = rows.into().map(|r| r.max(1));
        self
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

    /// Expert parameters of piece `piece` (a sparse block's [`Self::block_expert_params`]).
    pub fn piece_expert_params(&self, piece: usize) -> usize {
        match self.is_sparse_block(piece) {
            true => self.block_expert_params(),
            false => 0,
        }
    }

    /// Whether piece `piece` is a block whose feed-forward is the mixture of experts (a
    /// Mixtral's blocks after its dense ones).
    pub fn is_sparse_block(&self, piece: usize) -> bool {
        self.moe()
            .is_some_and(|m| piece > m.dense_layers && piece <= self.n_layers)
    }

    /// The blocks whose sizes bound the others' (every block for a uniform model; a dense and
    /// a sparse one for DeepSeek's): what a per-block figure takes the largest of.
    pub fn distinct_blocks(&self) -> Vec<usize> {
        let mut out = vec![self.n_layers];
        if self.moe().is_some_and(|m| m.dense_layers > 0) {
            out.push(1);
        }
        out
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

    /// An attention's matrix parameters, (split over tp, whole on every tp rank): the q/k/v
    /// and output projections (split); latent attention's up- and output projections split,
    /// its down-projections whole.
    fn attention_matrices(&self) -> (usize, usize) {
        let d = self.d_model;
        let Some(l) = self.latent else {
            return (2 * d * self.q_dim() + 2 * d * self.kv_dim(), 0);
        };
        let (h, r) = (self.n_heads, l.kv_lora_rank);
        let (q_split, q_whole) = match l.q_lora_rank {
            0 => (d * h * l.qk(), 0),
            q => (q * h * l.qk(), d * q),
        };
        let split = q_split + r * h * (l.qk_nope + l.v_head) + h * l.v_head * d;
        (split, q_whole + d * (r + l.qk_rope))
    }

    /// Latent attention's norms (the query's and the latent's, whole on every tp rank).
    fn latent_norms(&self) -> usize {
        self.latent.map_or(0, |l| l.q_lora_rank + l.kv_lora_rank)
    }

    /// Block `piece`'s (split over tp, whole on every tp rank) parameters — the split ones
    /// divided by `tp` by the caller. GPT: q/k/v/fc1 weights and biases and the o/fc2 weights
    /// split, norms and the o/fc2 biases whole (Bonfire's TP plan); Llama: every matrix split
    /// (latent attention's down-projections and norms whole); Mixtral: the attention, a dense
    /// block's MLP and the shared experts as the Llama's, the router and the experts whole.
    fn block_params(&self, piece: usize) -> (usize, usize) {
        let (d, f) = (self.d_model, self.d_ff);
        let (a_split, a_whole) = self.attention_matrices();
        let whole = 2 * d + a_whole + self.latent_norms();
        match self.arch {
            Arch::Gpt => (3 * (d * d + d) + d * d + (f * d + f) + d * f, 4 * d + d + d),
            Arch::Llama => (a_split + 3 * d * f, whole),
            Arch::Mixtral(m) if !self.is_sparse_block(piece) => {
                (a_split + 3 * d * m.dense_ff, whole)
            }
            Arch::Mixtral(m) => (
                a_split + 3 * d * m.shared_ff,
                whole + m.experts * d + self.block_expert_params(),
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
            let (split, whole) = self.block_params(piece);
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
            Arch::Llama => 2 * norm + self.latent_norms(),
            // The experts' products are plain matrix products of their parameters, not
            // linear layers: their gradients come out of B (the caller adds the rank's
            // experts, `E/ep` of them).
            Arch::Mixtral(_) => 2 * norm + self.latent_norms(),
        }
    }

    /// Every parameter.
    pub fn num_params(&self) -> usize {
        (0..self.pieces()).map(|p| self.piece_params(1, p)).sum()
    }

    /// Forward FLOPs of piece `piece` per token on one rank of `tp`, for sequences of `seq`
    /// tokens: 2 per weight of every matrix product (the embedding lookup has none; latent
    /// attention's down-projections on every tp rank), plus attention's two products (QKᵀ
    /// and AV, 2·keys·width each — latent attention's AV over the query width, its values
    /// padded to it as Bonfire computes them —, causal mask not discounted; keys is `seq`,
    /// or the sliding window where it is shorter); a sparse block adds its experts
    /// ([`Self::moe_flops_per_token`]), its shared experts split over tp.
    pub fn piece_flops_per_token(&self, tp: usize, piece: usize, seq: usize) -> f64 {
        let (v, d) = (self.vocab_size as f64, self.d_model as f64);
        if piece == 0 {
            return 0.0;
        }
        if piece == self.n_layers + 1 {
            return 2.0 * v * d / tp as f64;
        }
        let (f, q) = (self.d_ff as f64, self.q_dim() as f64);
        let (a_split, a_whole) = self.attention_matrices();
        let (a_split, a_whole) = (a_split as f64, a_whole as f64);
        let (split, moe) = match self.arch {
            Arch::Gpt => (4.0 * d * d + 2.0 * d * f, 0.0),
            Arch::Llama => (a_split + 3.0 * d * f, 0.0),
            Arch::Mixtral(m) if !self.is_sparse_block(piece) => {
                (a_split + 3.0 * d * m.dense_ff as f64, 0.0)
            }
            Arch::Mixtral(m) => (
                a_split + 3.0 * d * m.shared_ff as f64,
                self.moe_flops_per_token(),
            ),
        };
        let keys = self.window.map_or(seq, |w| w.min(seq)) as f64;
        (2.0 * split + 4.0 * keys * q) / tp as f64 + 2.0 * a_whole + moe
    }

    /// Each pipeline piece's cost for [`bonfire_layout::PpOptions::piece_costs`]: its forward
    /// FLOPs per token in the products with weights ([`Self::piece_flops_per_token`] without
    /// attention's, which grow with the sequence: the embedding 0, the head `2·V·d`, a
    /// sparse block its active experts), the split that balances them the same for any
    /// sequence length.
    pub fn piece_costs(&self) -> Vec<u64> {
        (0..self.pieces())
            .map(|p| self.piece_flops_per_token(1, p, 0).round() as u64)
            .collect()
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
    /// parallel), q, k, v and the attention output (4d; latent attention: see the code), the
    /// MLP's hidden activations (2·d_ff GELU, 3·d_ff SwiGLU, a mixture of experts' shared
    /// experts' 3·shared_ff; its dense blocks keep less than its sparse ones, which this is),
    /// and with materialized attention the scores and probabilities
    /// (2·heads·seq; [`AttentionKind::Fused`] keeps only each query's log-sum-exp, `heads`,
    /// beyond them: its output, written sequence-major, is the attention output, the heads'
    /// merge a view of it — resolve it for a layout with [`Self::attention_under`]);
    /// everything but the replicated 4d is split over tp. (q, k, v and the attention output
    /// are [`Self::q_dim`] wide: `d` unless the model sets its head width.)
    pub fn block_activation_elems(&self, tp: usize, sp: bool, seq: usize) -> f64 {
        let (d, f, h) = (self.d_model as f64, self.d_ff as f64, self.n_heads as f64);
        let a = self.q_dim() as f64;
        let mlp = match self.arch {
            Arch::Gpt => 2.0 * f,
            Arch::Llama => 3.0 * f,
            Arch::Mixtral(m) => 3.0 * m.shared_ff as f64,
        };
        let scores = match self.attention {
            AttentionKind::Materialized => 2.0 * h * seq as f64,
            AttentionKind::Flash => 0.0,
            AttentionKind::Fused => h,
        };
        let (attention, whole) = self.latent.map_or((4.0 * a, 0.0), |l| {
            // q, k and the values padded to q's width (3a), the latent's up-projection
            // (h·(nope + v)) and the output projection's input (h·v); whole on every tp rank
            // the query's bottleneck and the latent, each normed (2·q_rank + 2·kv_rank) and
            // the rotary key.
            let (nope, v) = (l.qk_nope as f64, l.v_head as f64);
            let q_rank = l.q_lora_rank as f64;
            let kv_rank = l.kv_lora_rank as f64;
            (
                3.0 * a + h * (nope + v) + h * v,
                2.0 * q_rank + 2.0 * kv_rank + l.qk_rope as f64,
            )
        });
        let t = tp as f64;
        let replicated = if sp { 4.0 * d / t } else { 4.0 * d };
        replicated + whole + (attention + mlp + scores) / t + self.moe_activation_elems()
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
    ///   one attention keeps `h` beyond the attention output (the merged parts are a new
    ///   tensor, the output's projection keeps it).
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
                2.0 * (cp - 1.0) * kv + cp * (2.0 * d + 3.0 * h)
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
            // experts are not linear layers (their gradients come out of B); the shared
            // experts as an MLP's.
            Arch::Mixtral(m) => {
                let shared = 3.0 * m.shared_ff as f64;
                let attention = self
                    .latent_weight_grad_elems()
                    .unwrap_or(2.0 * a + 2.0 * kv);
                return 3.0 * d
                    + m.experts as f64
                    + self.latent_whole_weight_grad_elems()
                    + (attention + shared) / tp as f64;
            }
        };
        4.0 * d + (a + f + a + 2.0 * kv + up) / tp as f64
    }

    /// Of [`Self::block_weight_grad_elems`], latent attention's split over tp: the query's
    /// up-projection's output gradient, the latent's up-projection's, the output projection's
    /// input (`None` without latent attention).
    fn latent_weight_grad_elems(&self) -> Option<f64> {
        let l = self.latent?;
        let h = self.n_heads as f64;
        Some(h * l.qk() as f64 + h * (l.qk_nope + l.v_head) as f64 + h * l.v_head as f64)
    }

    /// Of [`Self::block_weight_grad_elems`], latent attention's whole on every tp rank: the
    /// down-projections' output gradients and the up-projections' inputs.
    fn latent_whole_weight_grad_elems(&self) -> f64 {
        self.latent.map_or(0.0, |l| {
            (2 * l.q_lora_rank + 2 * l.kv_lora_rank + l.qk_rope) as f64
        })
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
        let block = |p: usize| {
            let experts = self.piece_expert_params(p);
            self.piece_params(tp, p) - experts + experts / ep
        };
        let blocks = self.distinct_blocks().into_iter().map(block).max();
        blocks.unwrap_or(0).max(self.vocab_size * self.d_model / tp)
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
