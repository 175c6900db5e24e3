//! The `collectives` lines of `cargo xtask bench ledger`: what one training step's
//! collectives carry per rank under HSDP (`dp_replicate=2,dp=2`, ZeRO-3) against ZeRO-3 over
//! the whole dp (`dp=4`), counted by kind by the transfer ledger (`Transfers::by_op`) on
//! rank 0 during the second step (AdamW; the first warms up), on the same global batch.
//!
//! Bytes are each call's whole buffer: an all-gather's gathered output, a reduce-scatter's
//! input, an all-reduce's buffer. `allgather_sent` is what a ring all-gather sends from each
//! rank of a group of n: (n−1)/n of the gathered bytes (the shard group's n).

use bonfire_comm::OpKind;
use bonfire_dtensor::plane::{TransferLedger, Transfers};
use bonfire_examples::default_device;
use bonfire_layout::ZeroStage;
use bonfire_layout::{Axis, ParallelDims};
use bonfire_models::data::TokenBatch;
use bonfire_models::{Gpt, GptConfig};
use bonfire_parallel::DataSource;
use bonfire_train::{Launcher, OptimizerKind, TrainError, Trainer};
use burn::tensor::Device;

const RANKS: usize = 4;

/// Rank 0's transfers during the second step under `dims`.
fn second_step(
    model: &Gpt,
    dims: &ParallelDims,
    batch: &(impl Fn(usize, &Device) -> TokenBatch + Sync),
) -> Result<Transfers, TrainError> {
    let trainer = Trainer::new(dims.clone(), || OptimizerKind::AdamW.build());
    let first = batch(0, &default_device());
    let ranks = Launcher::Threads { ranks: RANKS }.run("hsdp", |pg| {
        let mut engine = trainer.build(model.clone(), &pg, &first)?;
        let (device, replica) = (engine.device().clone(), engine.replica());
        engine.forward_backward(&batch.replica_batch(0, replica, &device))?;
        engine.step(1e-3)?;
        let next = batch.replica_batch(1, replica, &device);
        let ledger = TransferLedger::start();
        engine.forward_backward(&next)?;
        engine.step(1e-3)?;
        Ok::<_, TrainError>(ledger.snapshot())
    })?;
    ranks.into_iter().next().expect("rank 0")
}

/// Prints the `collectives` line of ZeRO-3 over dp=4 and of HSDP dp_replicate=2 × dp=2 for
/// `model`, on the same global batch (`batch(cfg, replicas, step, device)`, 4 data-parallel
/// replicas).
pub fn lines(
    model: &Gpt,
    cfg: &GptConfig,
    batch: fn(&GptConfig, usize, usize, &Device) -> TokenBatch,
) {
    let zero3 = ParallelDims::new()
        .with_degree(Axis::Dp, RANKS)
        .with_zero(ZeroStage::Zero3);
    let hsdp = zero3
        .clone()
        .with_degree(Axis::Dp, 2)
        .with_degree(Axis::DpReplicate, 2);
    let global = |s: usize, d: &Device| batch(cfg, RANKS, s, d);
    for (name, dims) in [("zero3-dp4", zero3), ("hsdp-r2-dp2", hsdp)] {
        let t = second_step(model, &dims, &global).unwrap_or_else(|e| panic!("{name}: {e}"));
        let n = dims.dp() as u64;
        let gathered = t.carried(OpKind::AllGather);
        println!(
            "bench ledger collectives layout={name} shard_group={n} replicas={} allgather={gathered} \
             allgather_sent={} reduce_scatter={} allreduce={} rank=0 ranks={RANKS}",
            dims.dp_replicate(),
            gathered * (n - 1) / n,
            t.carried(OpKind::ReduceScatter),
            t.carried(OpKind::AllReduce),
        );
    }
}
