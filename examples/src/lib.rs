//! # bonfire-examples
//!
//! Bonfire's runnable programs (`train`, the front door; the parity harness; `tokenize`,
//! `plan`, `train_classifier`; the benches; the GPU kit's `gpu_check`) and the helpers they
//! share, which are program helpers only — the library code they run is in the crates that
//! own it (models, data, plan, train):
//!
//! - [`cli`]: the command-line arguments every program takes alike (layout, run,
//!   checkpoints, fault tolerance) and how a program fails (one line, exit 1).
//! - [`harness`]: the parity harness behind `cargo run --release -p bonfire-examples
//!   --example parity -- ...`: a model chosen by its config, trained in any layout through
//!   the trainer's one loop, its record written for comparison.
//! - [`run`]: what a `train` run records in its checkpoints, to resume it on any layout.
//!
//! ```
//! use bonfire_examples::default_device;
//! use bonfire_models::{Gpt, GptConfig};
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

pub mod cli;
pub mod harness;
pub mod run;

/// The device every example trains on: the CPU (Flex) with autodiff.
pub fn default_device() -> burn::tensor::Device {
    burn::tensor::Device::flex().autodiff()
}
