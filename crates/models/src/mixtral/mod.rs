//! Mixtral (Hugging Face's `MixtralForCausalLM`): [`model`] (the decoder and its loss),
//! [`moe`] (the sparse mixture-of-experts feed-forward), [`router`] (its softmax or
//! DeepSeek's group-limited sigmoid routing), [`config`] (a Hugging Face
//! `config.json`), [`parallelize`] (its tensor-parallel plan and the layouts it refuses),
//! [`pipeline`] (its pipeline pieces, the routing riding with the activations) and
//! [`pretrained`] (published checkpoints' per-expert names folded into the fused ones).

pub mod config;
mod deepseek;
pub mod model;
pub mod moe;
pub mod parallelize;
pub mod pipeline;
pub mod pretrained;
pub mod router;

pub use config::MixtralConfig;
pub use model::{Mixtral, balance, balance_of};
pub use moe::{Routing, SparseMoe};
pub use router::{Router, Scoring, top_k_mask};
