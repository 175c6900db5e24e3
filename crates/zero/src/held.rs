//! What a rank holds: [`MemoryReport`], the wrapper's own account of the buffers it keeps.
//! The ZeRO paper's formula it is compared with has one owner, the planner
//! (`bonfire_plan::formula`).

use crate::zero::Zero;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;

/// Bytes one rank holds, by the wrapper's account (element counts of the tensors and buffers
/// it keeps, × 4 for f32).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Parameters held between steps (the full model for stages 0–2, the own shard for 3).
    pub params: usize,
    /// Gradients held for the step (full for stages 0–1, the own range for 2–3).
    pub grads: usize,
    /// Optimizer state on the model's device.
    pub optim_device: usize,
    /// Optimizer state on the offload device (ZeRO-Offload).
    pub optim_host: usize,
    /// Stage 3: the most bytes of gathered parameters alive at once in the last forward —
    /// the transient "live gathered layer" term of the formula (with layers entered through
    /// [`bonfire_module::layer`]: about one layer plus the prefetched next one; without:
    /// everything gathered).
    pub gathered_peak: usize,
    /// Stage 3: everything gathered in the last forward.
    pub gathered_total: usize,
}

impl MemoryReport {
    /// Parameters + gradients + optimizer state, wherever it lives.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optim_device + self.optim_host
    }
}

/// Bytes of the float parameters of `module` that hold a value (initialized).
pub fn held_param_bytes<M: Module>(module: &M) -> usize {
    struct Count(usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_initialized() {
                self.0 += param.lazy_shape().num_elements() * 4;
            }
        }
    }
    let mut c = Count(0);
    module.visit(&mut c);
    c.0
}

impl<M: Module> Zero<M> {
    /// Bytes held by this rank, by the wrapper's account, now (call between backward and step
    /// to include gradients).
    pub fn memory(&self) -> MemoryReport {
        let expert_shard = self
            .experts
            .as_ref()
            .and_then(|x| x.shard.as_ref())
            .map_or(0, |s| s.shape().num_elements() * 4);
        let params = match &self.shard {
            Some(s) => s.shape().num_elements() * 4 + held_param_bytes(self.model()) + expert_shard,
            None => held_param_bytes(self.model()),
        };
        let grads = self.grads.as_ref().and_then(Option::as_ref);
        let experts = self.experts.as_ref();
        MemoryReport {
            params,
            grads: grads.map_or(0, |g| g.shape().num_elements() * 4)
                + experts.map_or(0, |x| x.grad_bytes()),
            optim_device: self.optim.device_bytes() + experts.map_or(0, |x| x.optim.device_bytes()),
            optim_host: self.optim.offload_bytes() + experts.map_or(0, |x| x.optim.offload_bytes()),
            gathered_peak: self.last_gather.peak_live_bytes,
            gathered_total: self.last_gather.total_bytes,
        }
    }
}
