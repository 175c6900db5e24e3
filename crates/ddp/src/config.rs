//! [`DdpConfig`]: how DDP groups, reduces and synchronizes gradients.

use crate::compress::Compression;

/// What to do with a parameter that got no gradient in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnusedParams {
    /// Contribute zeros to the average (PyTorch's `find_unused_parameters=True`).
    #[default]
    Zero,
    /// Fail the step on every rank with an error naming the parameters (costs one small
    /// extra all-reduce per step so that every rank agrees, and nothing hangs).
    Error,
}

/// When ranks synchronize.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncMode {
    /// Average gradients at every step (classic DDP).
    #[default]
    EveryStep,
    /// Local SGD: each rank steps on its own gradients and parameters are averaged every
    /// `every` steps. Less communication, slightly different optimization.
    Periodic {
        /// Steps between two parameter averages (0 never averages).
        every: u64,
    },
}

/// Configuration of [`crate::DistributedDataParallel`], builder style.
#[derive(Debug, Clone)]
pub struct DdpConfig {
    /// Bucket capacity in bytes (of f32 gradients). Default 25 MiB, like PyTorch.
    pub bucket_bytes: usize,
    /// Start each bucket's all-reduce during backward as soon as it is complete (needs a
    /// model that calls [`bonfire_module::layer`]); `false` reduces everything after backward.
    pub overlap: bool,
    /// What a parameter that got no gradient contributes (zeros, or an error).
    pub unused: UnusedParams,
    /// Average gradients every step, or parameters every few steps (local SGD).
    pub sync: SyncMode,
    /// How gradients travel in the all-reduce: f32, or 16 bits with error feedback.
    pub compression: Compression,
    /// Record per-step timings (forward, backward, each bucket) for traces.
    pub record_timings: bool,
    /// Say once (on rank 0, at the first forward) when the model shows no layers, so every
    /// bucket waits for the end of backward. The trainer turns it off: it says so itself.
    pub report_no_layers: bool,
    /// Mixed precision: the replica computes in the param dtype, gradients are all-reduced
    /// in the reduce dtype, the optimizer steps an fp32 master.
    pub precision: bonfire_layout::MixedPrecision,
    /// Weight decay applied by the wrapper to the parameters of two or more dimensions only,
    /// before Burn's step (whose optimizer then decays nothing): PyTorch's AdamW with two
    /// parameter groups. `None`: the optimizer's own decay, on every parameter.
    pub decay: Option<bonfire_module::DecaySplit>,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl DdpConfig {
    /// The defaults: 25 MiB buckets, overlap on, unused parameters contribute zero, sync
    /// every step, no compression.
    pub fn new() -> Self {
        Self {
            bucket_bytes: 25 << 20,
            overlap: true,
            unused: UnusedParams::Zero,
            sync: SyncMode::EveryStep,
            compression: Compression::None,
            record_timings: false,
            report_no_layers: true,
            precision: bonfire_layout::MixedPrecision::f32(),
            decay: None,
        }
    }
    /// Sets the mixed-precision policy ([`DdpConfig::precision`]).
    pub fn with_precision(mut self, precision: bonfire_layout::MixedPrecision) -> Self {
        self.precision = precision;
        self
    }
    /// Sets the weight decay kept off 1-d parameters ([`DdpConfig::decay`]).
    pub fn with_decay(mut self, decay: Option<bonfire_module::DecaySplit>) -> Self {
        self.decay = decay;
        self
    }
    /// Bucket capacity in MiB.
    pub fn with_bucket_mb(mut self, mib: f64) -> Self {
        self.bucket_bytes = ((mib * (1 << 20) as f64) as usize).max(4);
        self
    }
    /// Bucket capacity in bytes.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(4);
        self
    }
    /// Reduces buckets during backward (`true`) or after it ([`DdpConfig::overlap`]).
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }
    /// Sets what parameters without a gradient do ([`DdpConfig::unused`]).
    pub fn with_unused(mut self, unused: UnusedParams) -> Self {
        self.unused = unused;
        self
    }
    /// Sets when ranks synchronize ([`DdpConfig::sync`]).
    pub fn with_sync(mut self, sync: SyncMode) -> Self {
        self.sync = sync;
        self
    }
    /// Sets the gradient compression ([`DdpConfig::compression`]).
    pub fn with_compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }
    /// Turns the note about a model with no layers on or off
    /// ([`DdpConfig::report_no_layers`]).
    pub fn with_report_no_layers(mut self, report: bool) -> Self {
        self.report_no_layers = report;
        self
    }
    /// Turns per-step timing records on or off ([`DdpConfig::record_timings`]).
    pub fn with_record_timings(mut self, record: bool) -> Self {
        self.record_timings = record;
        self
    }
}
