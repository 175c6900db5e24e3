//! Llama (Hugging Face's `LlamaForCausalLM`): [`model`] (the decoder, its layers and its
//! pieces [`embed`], layers, [`head`]), [`config`] (a Hugging Face `config.json`) and
//! [`parallelize`] (its tensor-parallel plan, layers and pipeline pieces for the trainer);
//! [`variant`]: the families it also computes (Llama 3's RoPE scaling, Qwen2, Qwen3).

pub mod config;
pub mod model;
pub mod parallelize;
pub mod variant;

pub use config::LlamaConfig;
pub use model::{HeadWeights, Llama, embed, head, head_loss};
pub use variant::{Family, Llama3Rope, LlamaVariant};
