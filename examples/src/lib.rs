//! # bonfire-examples
//!
//! Bonfire's runnable programs and the models they train, written once and used by every
//! example, parity test and benchmark:
//!
//! - [`Gpt`] (with [`GptConfig`]): the reference decoder of the parity contract
//!   (`docs`/`shared/notes/parity-harness.md`), parameters named and laid out as in PyTorch
//!   (`blocks.0.attn.q.weight` is `[out, in]`), so [`checkpoint`] files load in PyTorch too.
//!   [`parallel`] describes how it is parallelized (its `bonfire_train::ParallelModel`:
//!   tensor-parallel plan, layers, pipeline pieces).
//! - [`classifier::Classifier`]: a second model, plain Burn, trained with DDP and ZeRO with
//!   no change to its code ([`classifier_parallel`] gives the trainer its loss).
//! - [`harness`]: the parity harness behind `cargo run --release -p bonfire-examples
//!   --example parity -- ...`, any layout through the trainer's one loop.
//! - [`corpus`]: a small generated text corpus and character tokenizer for `train_gpt`.
//! - [`throughput`]: step times of a layout through the trainer's loop, for the benches.
//! - [`memory`]: a global allocator that counts live and peak bytes per rank (and enforces a
//!   per-rank budget); [`memory_formula`]: what the ZeRO formula says a rank should hold;
//!   [`planner`]: the planner (`bonfire_plan`) on the GPT, the trainer's layouts and this
//!   machine (`--mesh auto`, `cargo run --example plan`).
//!
//! ```
//! use bonfire_examples::{Gpt, GptConfig, default_device};
//! use burn::tensor::{Int, Tensor};
//!
//! let device = default_device();
//! let model = Gpt::new(&GptConfig::tiny(), &device);
//! let ids = Tensor::<2, Int>::zeros([2, 8], &device);
//! let loss = model.loss(ids.clone(), ids);
//! // Untrained: close to ln(vocab) = ln(32) ≈ 3.47.
//! let v = loss.into_data().to_vec::<f32>().unwrap()[0];
//! assert!((v - 32f32.ln()).abs() < 0.2);
//! ```

pub mod attention;
pub mod block;
pub mod checkpoint;
pub mod classifier;
pub mod classifier_parallel;
pub mod cli;
pub mod config;
pub mod corpus;
pub mod data;
pub mod gpt;
pub mod harness;
pub mod layers;
pub mod ledger;
pub mod memory;
pub mod memory_formula;
pub mod parallel;
pub mod planner;
pub mod tensor_file;
pub mod throughput;

pub use config::GptConfig;
pub use gpt::{Gpt, cross_entropy, default_device};
