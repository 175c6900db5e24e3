//! The reference GPT: [`model`] (the decoder and its loss, pieces [`embed`], blocks,
//! [`head`]), [`attention`] and [`block`] (its layers), [`config`], [`parallelize`] (its
//! tensor-parallel plan, layers and pipeline pieces for the trainer), [`weights`] (safetensors
//! in PyTorch layout) and [`data`] (the harness's token batches).

pub mod attention;
pub mod block;
pub mod config;
pub mod data;
pub mod model;
pub mod parallelize;
pub mod weights;

pub use config::GptConfig;
pub use model::{Gpt, cross_entropy, embed, head};
