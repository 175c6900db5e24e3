//! The reference GPT: [`model`] (the decoder and its loss, pieces [`embed`], blocks,
//! [`head`]), [`attention`] and [`block`] (its layers), [`config`], [`parallelize`] (its
//! tensor-parallel plan, layers and pipeline pieces for the trainer).

pub mod attention;
pub mod block;
pub mod config;
pub mod model;
pub mod parallelize;

pub use config::GptConfig;
pub use model::{Gpt, cross_entropy, embed, fused_head_loss, head, head_loss_by_blocks};
