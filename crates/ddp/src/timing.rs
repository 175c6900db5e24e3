//! Per-step timings (forward, backward, each bucket's all-reduce) and their Chrome-trace
//! form: the data-parallel wrappers' one definition, [`bonfire_dtensor::timing`].

pub use bonfire_dtensor::timing::*;
