//! What the kernel suites share: host copies, tensors from values, and a fixed spread of
//! values in [-3.5, 3.8) — the device suite's own ([`bonfire_kernels::testing`]).

#![allow(unused_imports)]

pub use bonfire_kernels::testing::{host, tensor, values};
