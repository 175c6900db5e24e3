//! [`Gpt`]: the reference decoder of the parity contract.

use super::block::GptBlock;
use super::config::GptConfig;
use bonfire_module::layer;
use bonfire_tp::loss_parallel;
use bonfire_tp::{ParallelEmbedding, ParallelLayerNorm, ParallelLinear};
use burn::module::Module;
use burn::tensor::{DType, Device, Int, Tensor};

/// A GPT-style decoder. Parameter paths are the contract's names (`tok_emb.weight`,
/// `blocks.0.attn.q.weight`, ..., `head.weight`) in PyTorch layout.
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding table `[V, d]`.
    pub tok_emb: ParallelEmbedding,
    /// Learned position embedding table `[max_seq_len, d]`.
    pub pos_emb: ParallelEmbedding,
    /// The `n_layers` transformer blocks, in order.
    pub blocks: Vec<GptBlock>,
    /// The final LayerNorm before the head.
    pub ln_f: ParallelLayerNorm,
    /// The output projection `d → V`, without bias (weight `[V, d]`).
    pub head: ParallelLinear,
    /// Rows a block of the head's fused loss ([`Gpt::with_fused_loss`]); `None`: the head's
    /// logits whole, then the loss.
    #[module(skip)]
    pub fused_loss_rows: Option<usize>,
}

impl Gpt {
    /// A freshly initialized model (GPT-2 style: N(0, 0.02) weights, zero biases, unit norms).
    pub fn new(cfg: &GptConfig, device: &Device) -> Self {
        let d = cfg.d_model;
        Self {
            tok_emb: ParallelEmbedding::new(cfg.vocab_size, d, device),
            pos_emb: ParallelEmbedding::new(cfg.max_seq_len, d, device),
            blocks: (0..cfg.n_layers)
                .map(|_| GptBlock::new(d, cfg.n_heads, cfg.d_ff, device))
                .collect(),
            ln_f: ParallelLayerNorm::new(d, device),
            head: ParallelLinear::new(d, cfg.vocab_size, false, device),
            fused_loss_rows: None,
        }
    }

    /// [`Gpt::loss`] with the head and the loss as one node by blocks of `rows` positions
    /// ([`bonfire_kernels::linear_cross_entropy`]), where the head is not sharded (no
    /// tensor-parallel style on it): the `[B·T, V]` logits and their gradient never exist
    /// whole — on a pipeline's last stage too (`decoder::fuse_head`).
    /// `None`: the unfused head (a run's option passed as it is).
    pub fn with_fused_loss(mut self, rows: impl Into<Option<usize>>) -> Self {
        self.fused_loss_rows = rows.into().map(|r| r.max(1));
        self
    }

    /// Logits `[B, T, V]` for token ids `[B, T]` (under a tensor-parallel plan with
    /// `loss_parallel`, this rank's vocabulary slice `[B, T, V/tp]`). The same three steps
    /// are the pipeline's pieces ([`super::parallelize`]): [`embed`], the blocks, [`head`].
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        head(&self.ln_f, &self.head, self.body(ids))
    }

    /// The blocks' output `[B, T, d]` for token ids `[B, T]`: the embeddings, then the blocks.
    fn body(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let mut x = embed(&self.tok_emb, &self.pos_emb, ids);
        for block in &self.blocks {
            x = block.forward(x);
        }
        x
    }

    /// Mean cross-entropy over all `B·T` positions (vocab-parallel, on sharded logits,
    /// when the head's output is sharded over the vocabulary).
    pub fn loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        if let Some(rows) = self.fused_loss_rows {
            return head_loss(&self.ln_f, &self.head, self.body(ids), targets, rows);
        }
        match self.head.output_shard_group() {
            Some(group) => loss_parallel(self.forward(ids), targets, &group),
            None => cross_entropy(self.forward(ids), targets),
        }
    }
}

/// The mean cross-entropy of `head(LN_f(x))` against `targets`, the head fused with the loss
/// by blocks of `rows` positions ([`fused_head_loss`]) — vocab-parallel on its logits where
/// the head's output is sharded. [`Gpt::loss`] and the pipeline's head piece run it.
pub fn head_loss(
    ln_f: &ParallelLayerNorm,
    head: &ParallelLinear,
    x: Tensor<3>,
    targets: Tensor<2, Int>,
    rows: usize,
) -> Tensor<1> {
    if let Some(group) = head.output_shard_group() {
        return loss_parallel(self::head(ln_f, head, x), targets, &group);
    }
    let h = layer(ln_f, &x).forward(x.clone());
    fused_head_loss(&layer(head, &x), h, targets, rows)
}

/// `tok_emb[ids] + pos_emb[positions]` (`0..T`, or a context-parallel rank's chunks'): `[B, T]` ids to `[B, T, d]` activations. Every layer runs
/// through [`layer`] (see `GptBlock::forward`); the embeddings' input is token ids, so DDP
/// anchors nothing there, but ZeRO-3 still gathers them per layer.
pub fn embed(
    tok_emb: &ParallelEmbedding,
    pos_emb: &ParallelEmbedding,
    ids: Tensor<2, Int>,
) -> Tensor<3> {
    let [_, t] = ids.dims();
    let tokens = layer(tok_emb, &ids).forward(ids.clone());
    let positions = layer(pos_emb, &ids).position_rows(t);
    tokens + positions.unsqueeze::<3>()
}

/// `head(LN_f(x))`: `[B, T, d]` activations to logits.
pub fn head(ln_f: &ParallelLayerNorm, head: &ParallelLinear, x: Tensor<3>) -> Tensor<3> {
    let h = layer(ln_f, &x).forward(x.clone());
    layer(head, &x).forward(h)
}

/// Mean over positions of `−log softmax(logits)[target]`, computed in fp32 whatever the
/// logits' dtype (as autocast does: half-precision logits are upcast for the softmax), as
/// one fused op ([`bonfire_kernels::cross_entropy`]).
pub fn cross_entropy(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let logits = logits.cast(DType::F32);
    let [b, t, v] = logits.dims();
    bonfire_kernels::cross_entropy(logits.reshape([b * t, v]), targets.reshape([b * t]))
}

/// The mean cross-entropy of `head` (entered as its layer) on the final norm's output `h`
/// `[B, T, d]`: as one node by blocks of `rows` positions where the head allows it
/// ([`ParallelLinear::cross_entropy`]), else its logits, then [`cross_entropy`].
pub fn fused_head_loss(
    head: &ParallelLinear,
    h: Tensor<3>,
    targets: Tensor<2, Int>,
    rows: usize,
) -> Tensor<1> {
    head_loss_by_blocks(
        h,
        targets,
        |h, t| head.cross_entropy(h, t, rows),
        |h| head.forward(h),
    )
}

/// The mean cross-entropy of a head on `h` `[B, T, d]` against `targets` `[B, T]`: `blocks`
/// on the positions flattened (`[B·T, d]`, `[B·T]`), or, where it declines (`None`: a sharded
/// head), [`cross_entropy`] of the head's `logits`.
pub fn head_loss_by_blocks(
    h: Tensor<3>,
    targets: Tensor<2, Int>,
    blocks: impl FnOnce(Tensor<2>, Tensor<1, Int>) -> Option<Tensor<1>>,
    logits: impl FnOnce(Tensor<3>) -> Tensor<3>,
) -> Tensor<1> {
    let [b, t, d] = h.dims();
    let flat = targets.clone().reshape([b * t]);
    match blocks(h.clone().reshape([b * t, d]), flat) {
        Some(loss) => loss,
        None => cross_entropy(logits(h), targets),
    }
}
