//! # bonfire-zero
//!
//! ZeRO sharded data parallelism for [Burn](https://burn.dev): data-parallel training where
//! no rank holds every optimizer state (stage 1), gradient (stage 2) or parameter (stage 3),
//! with the optimizer state optionally kept in a host store between steps (ZeRO-Offload).
//!
//! - [`Zero`] wraps any Burn [`Module`](burn::module::Module) and any per-tensor Burn
//!   [`Optimizer`](burn::optim::Optimizer) (`SgdConfig::new().build()`,
//!   `AdamConfig::new().build()`, `AdamWConfig::new().build()`), on a data-parallel
//!   [`ProcessGroup`](bonfire_comm::ProcessGroup) (a mesh axis's group for 2-d layouts).
//! - [`Partition`]: parameters flattened in module order into one logical vector, cut into
//!   contiguous byte-balanced ranges; a parameter may straddle ranks.
//! - Stage 3 gathers each parameter right before its first use through a recomputable
//!   all-gather (re-gathered in backward under Balanced checkpointing), prefetching the next.
//! - [`checkpoint`]: consolidated (full tensors, safetensors, loads into a plain model) and
//!   sharded (one file per rank; N ranks' files load on M ranks).
//!
//! See `docs/zero.md`.

pub mod checkpoint;
mod config;
mod error;
mod gather;
pub mod optim;
pub use bonfire_dtensor::params;
pub mod partition;
mod zero;

pub use config::{Stage, ZeroConfig};
pub use error::{Result, ZeroError};
pub use gather::GatherSummary;
pub use optim::{FlatState, HostStore, ShardOptimizer};
pub use partition::{Partition, Piece};
pub use zero::{MemoryReport, Zero, formula_bytes, held_param_bytes};
