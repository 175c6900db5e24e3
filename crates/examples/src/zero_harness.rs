//! `--zero N` in the parity harness: data parallelism over rank threads with ZeRO stage N
//! (`bonfire-zero`) on the dp axis.
//!
//! Every rank starts from the same weights; each step takes its rows of the global batch,
//! the loss is averaged over the dp group, and the SGD update is ZeRO's sharded step. The
//! step-0 gradients and the final parameters are gathered whole (collectives at stages 2–3).

use crate::data::Batches;
use crate::gpt::{Gpt, default_device};
use crate::harness::HarnessResult;
use bonfire_comm::{ReduceOp, ThreadWorld};
use bonfire_zero::{Stage, Zero, ZeroConfig, params};
use burn::module::Module;
use burn::optim::SgdConfig;
use std::time::Duration;

/// `steps` SGD steps of `model` on `batches` with `dp` rank threads at ZeRO `stage`.
pub fn train_zero(
    model: &Gpt,
    batches: &Batches,
    dp: usize,
    stage: usize,
    steps: usize,
    lr: f64,
) -> Result<HarnessResult, String> {
    let stage = Stage::from_index(stage).ok_or_else(|| format!("--zero {stage}: must be 0..=3"))?;
    let device = default_device();
    let rows = batches.batch / dp;
    let outcomes = ThreadWorld::new(dp)
        .timeout(Duration::from_secs(120))
        .name("parity-zero")
        .launch(|pg| -> Result<HarnessResult, String> {
            let replica = model.clone().fork(&device);
            let sgd = SgdConfig::new().build();
            let mut zero = Zero::new(replica, sgd, pg.clone(), ZeroConfig::new(stage))
                .map_err(|e| e.to_string())?;
            let infos = zero.params().to_vec();
            let mut result = HarnessResult::default();
            for s in 0..steps {
                let (ids, targets) = batches.rows(s, pg.rank() * rows, rows, &device);
                let loss = zero.forward(|m| m.loss(ids, targets));
                let mut global = params::to_host(loss.clone().detach());
                pg.all_reduce(&mut global, ReduceOp::Avg)
                    .map_err(|e| e.to_string())?;
                result.losses.push(global[0]);
                zero.backward(loss).map_err(|e| e.to_string())?;
                if s == 0 {
                    for (name, g) in zero.full_gradients().map_err(|e| e.to_string())? {
                        result.grad0.insert(name, g);
                    }
                }
                zero.step(lr).map_err(|e| e.to_string())?;
            }
            let flat = zero.full_values().map_err(|e| e.to_string())?;
            let mut at = 0;
            for p in &infos {
                let v = flat[at..at + p.numel()].to_vec();
                at += p.numel();
                result.params.insert(p.path.clone(), (p.shape.clone(), v));
            }
            Ok(result)
        })
        .map_err(|e| e.to_string())?;
    outcomes.into_iter().next().expect("rank 0")
}
