//! The layer kinds of the GPT and the Llama, storing parameters in PyTorch's layout so that the
//! module's parameter paths and shapes are exactly the parity contract's names (a Linear
//! weight is `[out_features, in_features]`; LayerNorm has `weight` and `bias`), and
//! safetensors files need no renaming or transposition.
//!
//! They are `bonfire-dtensor`'s parallel-aware layers: unsharded they are exactly the plain
//! layers (`y = x Wᵀ + b`, a lookup table, LayerNorm with biased variance and eps 1e-5);
//! after [`crate::gpt::parallelize::gpt_tp_plan`] each rank holds its shard and `forward` runs the
//! tensor-parallel version (see `docs/tensor-parallel.md`).

pub use bonfire_tp::{
    ParallelEmbedding as Embedding, ParallelLayerNorm as LayerNorm, ParallelLinear as Linear,
    ParallelRmsNorm as RmsNorm,
};
