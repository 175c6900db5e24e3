//! # bonfire-examples
//!
//! Bonfire's runnable programs (`train_gpt`, the parity harness, `train_classifier`, the
//! benches) and what they share. The models they train live in `bonfire-models` ([`Gpt`],
//! [`GptConfig`] and [`cross_entropy`] are re-exported for them):
//!
//! - [`harness`]: the parity harness behind `cargo run --release -p bonfire-examples
//!   --example parity -- ...`, any layout through the trainer's one loop.
//! - [`corpus`]: a small generated text corpus and character tokenizer for `train_gpt`.
//! - [`device_checks`]: what a device other than Flex must pass against Flex (every strategy's
//!   parity, the bench models' tokens/s), for the wgpu suite and the GPU kit.
//! - [`throughput`]: step times of a layout through the trainer's loop, for the benches.
//! - [`memory_formula`]: what the ZeRO formula says a rank should hold (the measured side is
//!   `bonfire_comm::testing::rank_alloc`, the counting allocator, per rank);
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

pub mod cli;
pub mod corpus;
pub mod device_checks;
pub mod harness;
pub mod ledger;
pub mod memory_formula;
pub mod planner;
pub mod run;
pub mod throughput;
pub mod train_data;

pub use bonfire_models::{Gpt, GptConfig, cross_entropy};

/// The device every example trains on: the CPU (Flex) with autodiff.
pub fn default_device() -> burn::tensor::Device {
    burn::tensor::Device::flex().autodiff()
}
