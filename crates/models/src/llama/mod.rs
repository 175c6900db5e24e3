//! Llama (Hugging Face's `LlamaForCausalLM`): [`model`] (the decoder, its layers and its
//! pieces [`embed`], layers, [`head`]), [`config`] (a Hugging Face `config.json`) and
//! [`parallelize`] (its tensor-parallel plan, layers and pipeline pieces for the trainer).

pub mod config;
pub mod model;
pub mod parallelize;

pub use config::LlamaConfig;
pub use model::{Llama, embed, head};
