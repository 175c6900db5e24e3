//! The data-parallel wrapper of a dp axis: DDP or ZeRO stage 1–3 (`bonfire-zero`), behind
//! one small interface so that the same training loop — the parity harness's, `train_gpt`'s —
//! runs with either.

use crate::gpt::Gpt;
use bonfire_comm::ProcessGroup;
use bonfire_ddp::{DdpConfig, DistributedDataParallel};
use bonfire_zero::{Stage, Zero, ZeroConfig};
use burn::optim::{ModuleOptimizer, Optimizer, Sgd, SgdConfig};
use burn::tensor::Tensor;

/// One rank's wrapper over the dp group. DDP steps with Burn's module optimizer; ZeRO with a
/// per-tensor optimizer `O` (the same algorithm: e.g. `AdamConfig::init()` and `build()`).
pub enum DpAxis<O: Optimizer> {
    Ddp(Box<DistributedDataParallel<Gpt>>),
    Zero(Box<Zero<Gpt, O>>),
}

impl DpAxis<Sgd> {
    /// Plain SGD over `dp_group`: DDP for `zero == 0`, else ZeRO of that stage (the parity
    /// harness's `--zero`).
    pub fn sgd(replica: Gpt, dp_group: ProcessGroup, zero: usize) -> Result<Self, String> {
        if zero == 0 {
            return Self::ddp(replica, dp_group, SgdConfig::new().init(), DdpConfig::new());
        }
        let stage =
            Stage::from_index(zero).ok_or_else(|| format!("--zero {zero}: must be 0..=3"))?;
        Self::zero(
            replica,
            dp_group,
            SgdConfig::new().build(),
            ZeroConfig::new(stage),
        )
    }
}

impl<O: Optimizer> DpAxis<O> {
    pub fn ddp(
        replica: Gpt,
        dp_group: ProcessGroup,
        optim: ModuleOptimizer,
        config: DdpConfig,
    ) -> Result<Self, String> {
        DistributedDataParallel::new(replica, optim, dp_group, config)
            .map(|d| Self::Ddp(Box::new(d)))
            .map_err(|e| e.to_string())
    }

    pub fn zero(
        replica: Gpt,
        dp_group: ProcessGroup,
        optim: O,
        config: ZeroConfig,
    ) -> Result<Self, String> {
        Zero::new(replica, optim, dp_group, config)
            .map(|z| Self::Zero(Box::new(z)))
            .map_err(|e| e.to_string())
    }

    pub fn forward(&mut self, f: impl FnOnce(&Gpt) -> Tensor<1>) -> Tensor<1> {
        match self {
            Self::Ddp(d) => d.forward(f),
            Self::Zero(z) => z.forward(f),
        }
    }

    pub fn backward(&mut self, loss: Tensor<1>) -> Result<(), String> {
        match self {
            Self::Ddp(d) => d.backward(loss).map_err(|e| e.to_string()),
            Self::Zero(z) => z.backward(loss).map_err(|e| e.to_string()),
        }
    }

    pub fn step(&mut self, lr: f64) -> Result<(), String> {
        match self {
            Self::Ddp(d) => d.step(lr).map_err(|e| e.to_string()),
            Self::Zero(z) => z.step(lr).map_err(|e| e.to_string()),
        }
    }

    /// Forward, backward and step; returns this rank's loss.
    pub fn train_step(
        &mut self,
        lr: f64,
        f: impl FnOnce(&Gpt) -> Tensor<1>,
    ) -> Result<f32, String> {
        let loss = self.forward(f);
        let value = loss.clone().into_scalar();
        self.backward(loss)?;
        self.step(lr)?;
        Ok(value)
    }

    /// The averaged gradient of every (local) parameter from the last backward, by path, in
    /// module order (ZeRO gathers it from the owners: a collective).
    pub fn gradients(&self) -> Result<Vec<(String, Vec<f32>)>, String> {
        match self {
            Self::Ddp(d) => Ok(d.gradients()),
            Self::Zero(z) => z.full_gradients().map_err(|e| e.to_string()),
        }
    }

    /// Every (local) parameter's values, concatenated in module order (ZeRO gathers them
    /// at stages 1–3 where they are sharded: a collective).
    pub fn values(&self) -> Result<Vec<f32>, String> {
        match self {
            Self::Ddp(d) => {
                let infos = bonfire_ddp::params::inventory(d.model());
                Ok(bonfire_ddp::params::flatten_values(d.model(), &infos))
            }
            Self::Zero(z) => z.full_values().map_err(|e| e.to_string()),
        }
    }

    /// The trained model with every parameter in full (ZeRO gathers it: a collective).
    pub fn into_model(self) -> Result<Gpt, String> {
        match self {
            Self::Ddp(d) => Ok(d.into_parts().0),
            Self::Zero(z) => z.full_model().map_err(|e| e.to_string()),
        }
    }
}
