//! The data-parallel wrapper of the harness's dp axis: DDP (`--zero 0`, the default) or
//! ZeRO stage 1–3 (`bonfire-zero`), behind one small interface so that the same training
//! loop runs every `dp × tp` layout with either.

use crate::gpt::Gpt;
use bonfire_comm::ProcessGroup;
use bonfire_ddp::{DdpConfig, DistributedDataParallel};
use bonfire_zero::{Stage, Zero, ZeroConfig};
use burn::optim::{Sgd, SgdConfig};
use burn::tensor::Tensor;

/// One rank's wrapper over the dp group.
pub enum DpAxis {
    Ddp(Box<DistributedDataParallel<Gpt>>),
    Zero(Box<Zero<Gpt, Sgd>>),
}

impl DpAxis {
    /// Wraps `replica` (this rank's, possibly tensor-parallel, model) for plain SGD over
    /// `dp_group`: DDP for `zero == 0`, else ZeRO of that stage.
    pub fn new(replica: Gpt, dp_group: ProcessGroup, zero: usize) -> Result<Self, String> {
        if zero == 0 {
            let sgd = SgdConfig::new().init();
            return DistributedDataParallel::new(replica, sgd, dp_group, DdpConfig::new())
                .map(|d| Self::Ddp(Box::new(d)))
                .map_err(|e| e.to_string());
        }
        let stage =
            Stage::from_index(zero).ok_or_else(|| format!("--zero {zero}: must be 0..=3"))?;
        Zero::new(
            replica,
            SgdConfig::new().build(),
            dp_group,
            ZeroConfig::new(stage),
        )
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
}
