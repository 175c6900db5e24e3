//! # bonfire-models
//!
//! The models Bonfire trains in its tests, parity checks and benchmarks, each a folder with
//! the model, its configuration and how it is parallelized (its
//! `bonfire_parallel::ParallelModel`, applied from outside the model's code):
//!
//! - [`gpt`]: the reference decoder of the parity contract (`shared/notes/parity-harness.md`),
//!   parameters named and laid out as in PyTorch (`blocks.0.attn.q.weight` is `[out, in]`),
//!   trained on token batches ([`data`]).
//! - [`llama`]: Hugging Face's Llama, parameters under transformers' names, its config a
//!   Hugging Face `config.json`.
//! - [`mixtral`]: Hugging Face's Mixtral (a sparse mixture of experts in every layer), the
//!   Llama's attention and layers ([`decoder_layer`]) around its router and experts.
//! - [`classifier`]: a plain Burn model, trained with DDP and ZeRO with no change to its code.
//!
//! The models are built from `bonfire_tp`'s parallel-aware layers (unsharded, exactly the plain
//! layers, with PyTorch's parameter layout); [`decoder`] what the
//! decoders share when parallelized; [`weights`] loads and
//! saves a model's parameters as safetensors; [`pretrained`] Hugging Face model
//! directories (`config.json`, sharded safetensors) in and out; [`tensor_file`] reads and writes plain
//! safetensors files of named tensors.

#![forbid(unsafe_code)]

pub mod classifier;
pub mod config;
pub mod data;
pub mod decoder;
pub mod decoder_layer;
pub mod fields;
pub mod gpt;
pub mod llama;
pub mod mixtral;
pub mod mla;
pub mod pretrained;
pub mod tensor_file;
pub mod weights;

pub use classifier::Classifier;
pub use config::ModelConfig;
pub use gpt::{Gpt, GptConfig, cross_entropy};
pub use llama::{Llama, LlamaConfig};
pub use mixtral::{Mixtral, MixtralConfig};

/// The text of the configuration file at `path` (`cfg.json`, `config.json`), or an error
/// naming the file — what every model's `load` parses.
pub fn read_config(path: &std::path::Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read config {}: {e}", path.display()))
}
