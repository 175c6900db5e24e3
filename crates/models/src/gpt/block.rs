//! A pre-norm transformer block: `x + Attn(LN1(x))`, then `x + MLP(LN2(x))`.

use super::attention::GptAttention;
use bonfire_kernels::gelu;
use bonfire_module::layer;
use bonfire_tp::{ParallelLayerNorm, ParallelLinear};
use burn::module::Module;
use burn::tensor::{Device, Tensor};

/// `fc2(GELU(fc1(x)))` with the exact (erf) GELU ([`bonfire_kernels::gelu`]).
#[derive(Module, Debug)]
pub struct Mlp {
    /// The up projection `d → d_ff`.
    pub fc1: ParallelLinear,
    /// The down projection `d_ff → d`.
    pub fc2: ParallelLinear,
}

impl Mlp {
    /// Width `d` and hidden width `d_ff`, with biases, GPT-2 initialization.
    pub fn new(d: usize, d_ff: usize, device: &Device) -> Self {
        Self {
            fc1: ParallelLinear::new(d, d_ff, true, device),
            fc2: ParallelLinear::new(d_ff, d, true, device),
        }
    }
    /// `x` `[B, T, d]` → `[B, T, d]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.fc2.forward(gelu(self.fc1.forward(x)))
    }
}

/// One pre-norm transformer block of the GPT (see the module docs).
#[derive(Module, Debug)]
pub struct GptBlock {
    /// The LayerNorm before attention.
    pub ln1: ParallelLayerNorm,
    /// The causal self-attention.
    pub attn: GptAttention,
    /// The LayerNorm before the MLP.
    pub ln2: ParallelLayerNorm,
    /// The feed-forward network.
    pub mlp: Mlp,
}

impl GptBlock {
    /// Width `d`, `n_heads` attention heads and MLP hidden width `d_ff`, freshly initialized.
    pub fn new(d: usize, n_heads: usize, d_ff: usize, device: &Device) -> Self {
        Self {
            ln1: ParallelLayerNorm::new(d, device),
            attn: GptAttention::new(d, n_heads, device),
            ln2: ParallelLayerNorm::new(d, device),
            mlp: Mlp::new(d, d_ff, device),
        }
    }

    /// The block. Each of its four layers runs through [`bonfire_module::layer`], anchored at
    /// the input of its half, and its copy drops at the end of its statement: under DDP the
    /// MLP's gradients leave while attention's backward still runs; under ZeRO stage 3 only
    /// the layer being computed (and the prefetched next one) holds gathered parameters.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let h = layer(&self.ln1, &x).forward(x.clone());
        let x = x.clone() + layer(&self.attn, &x).forward(h);
        let h = layer(&self.ln2, &x).forward(x.clone());
        x.clone() + layer(&self.mlp, &x).forward(h)
    }
}
