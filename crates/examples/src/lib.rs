//! # bonfire-examples
//!
//! Bonfire's reference GPT-style decoder, written once and used by every example, parity
//! test and benchmark:
//!
//! - [`Gpt`] (with [`GptConfig`]): the model of the parity contract
//!   (`docs`/`shared/notes/parity-harness.md`), parameters named and laid out as in PyTorch
//!   (`blocks.0.attn.q.weight` is `[out, in]`), so [`checkpoint`] files load in PyTorch too.
//! - [`harness`]: the parity harness behind `cargo run --release -p bonfire-examples
//!   --example parity -- ...` (`--mesh dp=N`, `tp=M`, `dp=N,tp=M`, `pp=K`, `dp=N,pp=K`;
//!   `--zero 1|2|3` on dp; pp with tp or ZeRO, and ZeRO with tp, are rejected clearly); pp
//!   runs through [`pipeline_harness`]; the dp axis is wrapped by DDP or ZeRO ([`dp_axis`]).
//! - [`tp`]: the GPT's tensor-parallel plan ([`tp::gpt_tp_plan`]) and
//!   [`tp::parallelize_gpt`].
//! - [`corpus`]: a small generated text corpus and character tokenizer for `train_gpt`.
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
pub mod config;
pub mod corpus;
pub mod data;
pub mod dp_axis;
pub mod gpt;
pub mod harness;
pub mod layers;
pub mod mesh;
pub mod pipeline_harness;
pub mod tensor_file;
pub mod tp;

pub use config::GptConfig;
pub use gpt::{Gpt, cross_entropy, default_device};
