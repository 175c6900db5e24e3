//! [`ZeroConfig`]: the stage and its options.

use bonfire_layout::ZeroStage;

/// Options of a [`crate::Zero`] wrapper.
#[derive(Debug, Clone)]
pub struct ZeroConfig {
    /// What is sharded over the ranks: nothing (0), optimizer state (1), gradients too (2),
    /// parameters too (3).
    pub stage: ZeroStage,
    /// Gradient bucket size for the stage-2 reduce-scatter, in bytes (f32).
    pub bucket_bytes: usize,
    /// Stage 3: start the all-gather of the next layer's parameters (in the order the last
    /// forward entered its layers; the next parameter for a first forward or outside layer
    /// scopes) while the current layer computes.
    pub prefetch: bool,
    /// ZeRO-Offload: the optimizer state and the update live on `offload_device` (a CPU
    /// device), the gradient goes down to it and the updated parameters come back.
    pub offload: bool,
    /// Where offloaded optimizer state and updates live: Burn's CPU device (plain, no
    /// autodiff) by default — a device of its own, distinct from the one the model trains on.
    pub offload_device: burn::tensor::Device,
    /// Stage 3: backward re-gathers each layer's parameters instead of keeping them from
    /// forward (the wrapper computes on its device with Burn's Balanced gradient
    /// checkpointing; FSDP's `reshard_after_forward`). On by default; off keeps the gathered
    /// parameters alive until their gradients are computed, on the model's own device.
    pub recompute: bool,
    /// Say once (on rank 0, at the first forward) when the model shows no layers (stage 2
    /// then reduces after backward, stage 3 gathers for the whole forward). The trainer turns
    /// it off: it says so itself.
    pub report_no_layers: bool,
    /// Mixed precision: stages 0–2 hold the model in the param dtype and keep an fp32 master
    /// of the own range with the optimizer state; stage 3 keeps its shard in fp32 (the master)
    /// and gathers parameters in the param dtype (FSDP2's policy). Gradients are reduced in
    /// the reduce dtype.
    pub precision: bonfire_layout::MixedPrecision,
    /// Keep each step's timings (forward, backward, stage 2's bucket reduce-scatters):
    /// [`crate::Zero::timings`].
    pub record_timings: bool,
    /// Weight decay applied to the own range's elements of parameters with two or more
    /// dimensions only, before Burn's step (whose optimizer then decays nothing): PyTorch's
    /// AdamW with two parameter groups, which one flat range cannot hand Burn as groups.
    /// `None`: the optimizer's own decay, on every element.
    pub decay: Option<bonfire_module::DecaySplit>,
}

impl ZeroConfig {
    /// `stage` with the defaults: 4 MiB buckets, prefetch and recompute on, no offload (to
    /// Burn's CPU device when turned on), fp32 throughout, no timings.
    pub fn new(stage: ZeroStage) -> Self {
        Self {
            stage,
            bucket_bytes: 4 << 20,
            prefetch: true,
            offload: false,
            offload_device: burn::tensor::Device::flex(),
            recompute: true,
            report_no_layers: true,
            precision: bonfire_layout::MixedPrecision::f32(),
            record_timings: false,
            decay: None,
        }
    }
    /// Sets the mixed-precision policy ([`ZeroConfig::precision`]).
    pub fn with_precision(mut self, precision: bonfire_layout::MixedPrecision) -> Self {
        self.precision = precision;
        self
    }
    /// Turns the note about a model with no layers on or off
    /// ([`ZeroConfig::report_no_layers`]).
    pub fn with_report_no_layers(mut self, report: bool) -> Self {
        self.report_no_layers = report;
        self
    }
    /// Stage 3: re-gathers parameters in backward (`true`) or keeps them from forward
    /// ([`ZeroConfig::recompute`]).
    pub fn with_recompute(mut self, recompute: bool) -> Self {
        self.recompute = recompute;
        self
    }
    /// Turns ZeRO-Offload on or off ([`ZeroConfig::offload`]).
    pub fn with_offload(mut self, offload: bool) -> Self {
        self.offload = offload;
        self
    }
    /// Offload to `device` (with offload on).
    pub fn with_offload_device(mut self, device: burn::tensor::Device) -> Self {
        self.offload_device = device;
        self
    }
    /// Stage 3: turns the all-gather of the next layer's parameters ahead of time on or off
    /// ([`ZeroConfig::prefetch`]).
    pub fn with_prefetch(mut self, prefetch: bool) -> Self {
        self.prefetch = prefetch;
        self
    }
    /// Turns per-step timing records on or off ([`ZeroConfig::record_timings`]).
    pub fn with_record_timings(mut self, record: bool) -> Self {
        self.record_timings = record;
        self
    }
    /// Sets the weight decay kept off 1-d parameters ([`ZeroConfig::decay`]).
    pub fn with_decay(mut self, decay: Option<bonfire_module::DecaySplit>) -> Self {
        self.decay = decay;
        self
    }
    /// Stage 2's gradient bucket size in bytes (at least 4, one f32).
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(4);
        self
    }
}
