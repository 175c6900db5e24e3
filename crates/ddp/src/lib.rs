//! # bonfire-ddp
//!
//! Data parallelism for [Burn](https://burn.dev): every rank holds a replica of the model,
//! trains on its own slice of the batch, and gradients are averaged over the ranks so the
//! replicas stay identical — PyTorch's `DistributedDataParallel`, on Bonfire's process groups
//! (ranks as threads or MPI processes).
//!
//! - [`DistributedDataParallel`] wraps any Burn [`Module`](burn::module::Module) and Burn
//!   optimizer (anything that converts into a [`ModuleOptimizer`](burn::optim::ModuleOptimizer):
//!   `AdamWConfig::new().init()`, `SgdConfig::new().build()`, …). At construction it checks
//!   that all ranks hold the same parameters and broadcasts rank 0's values. It implements
//!   [`DataParallel`], the interface it shares with ZeRO (`bonfire-zero`).
//! - Gradients are grouped in buckets ([`DdpConfig::bucket_bytes`], 25 MiB by default, in
//!   reverse parameter order). Models that run their layers through [`bonfire_module::layer`] get each bucket's
//!   all-reduce started during backward, as soon as its gradients are final.
//! - [`DistributedDataParallel::no_sync`] for gradient accumulation, [`SyncMode::Periodic`]
//!   for local SGD, [`Compression`] (bf16, fp16 with error feedback), [`UnusedParams`] for
//!   parameters that get no gradient.
//! - [`primitives`]: the simple one-call primitives (`replicate`, `scatter`,
//!   `parallel_apply`, `gather`) — easier, slower.
//!
//! ```
//! use bonfire_comm::ThreadWorld;
//! use bonfire_ddp::{DdpConfig, DistributedDataParallel};
//! use bonfire_module::DataParallel;
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::SgdConfig;
//! use burn::tensor::{Device, Tensor};
//!
//! let device = Device::flex().autodiff();
//! let model = LinearConfig::new(4, 2).init(&device);
//! let weights = ThreadWorld::new(2).launch(|pg| {
//!     // Each rank owns its parameters (fork); DDP copies rank 0's values everywhere.
//!     let replica = model.clone().fork(&device);
//!     let mut ddp = DistributedDataParallel::new(replica, SgdConfig::new().init(), pg.clone(),
//!         DdpConfig::new()).unwrap();
//!     let x = Tensor::<2>::ones([3, 4], &device) * (pg.rank() as f32 + 1.0);
//!     ddp.train_step(0.1, |m: &Linear| m.forward(x).powi_scalar(2).mean()).unwrap();
//!     // Every parameter, whole, by path: the same call on ZeRO, which gathers its shards.
//!     let params = ddp.parameters().unwrap();
//!     assert_eq!((params[0].path.as_str(), params[0].shape.as_slice()), ("weight", &[4, 2][..]));
//!     params[0].values.clone()
//! }).unwrap();
//! assert_eq!(weights[0], weights[1]); // replicas stay identical
//! ```

#![forbid(unsafe_code)]

mod bucket;
mod compress;
mod config;
mod ddp;
mod error;
pub mod primitives;
mod reducer;

pub use bucket::BucketPlan;
pub use compress::Compression;
pub use config::{DdpConfig, SyncMode, UnusedParams};
pub use ddp::DistributedDataParallel;
pub use error::DdpError;

/// Short name.
pub type Ddp<M> = DistributedDataParallel<M>;
