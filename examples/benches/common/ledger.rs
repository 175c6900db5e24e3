//! One training step's host↔device transfers, rank by rank, under any layout: what the
//! transfer ledger counts during the second step of a [`Trainer`] engine (forward, backward,
//! optimizer step; the first step warms up: optimizer state, ZeRO-Offload's master copy).
//! The wgpu suite asserts on it and `cargo xtask bench ledger` prints it.

use bonfire_dtensor::plane::{TransferLedger, Transfers};
use bonfire_layout::ParallelDims;
use bonfire_models::data::TokenBatch;
use bonfire_models::gpt::Gpt;
use bonfire_parallel::DataSource;
use bonfire_train::{Launcher, OptimizerKind, TrainError, Trainer};
use burn::tensor::Device;

/// Each rank's transfers during the second step of `model` trained under `dims` with
/// `optim` (Burn's, from the parity contract) at `lr`; `batch(step, device)` is the global
/// batch of a step on a device. The model's device is the one it computes on.
pub fn second_step(
    model: &Gpt,
    dims: &ParallelDims,
    optim: OptimizerKind,
    lr: f64,
    batch: impl Fn(usize, &Device) -> TokenBatch + Sync,
) -> Result<Vec<Transfers>, TrainError> {
    let trainer = Trainer::new(dims.clone(), move || optim.build());
    let first = batch(0, &Device::flex().autodiff());
    let ranks = Launcher::Threads {
        ranks: dims.world_size(),
    }
    .run("ledger", |pg| -> Result<Transfers, TrainError> {
        let mut engine = trainer.build(model.clone(), &pg, &first)?;
        let device = engine.device().clone();
        let replica = engine.replica();
        engine.forward_backward(&batch.replica_batch(0, replica, &device))?;
        engine.step(lr)?;
        let next = batch.replica_batch(1, replica, &device);
        let ledger = TransferLedger::start();
        engine.forward_backward(&next)?;
        engine.step(lr)?;
        Ok(ledger.snapshot())
    })?;
    ranks.into_iter().collect()
}
