//! `cargo xtask bench ledger`: the host↔device bytes of one training step, per layout and
//! device, counted by the transfer ledger (`bonfire_dtensor::plane::ledger`) on rank 0 during
//! the second step of the bench-size GPT (vocab 4096, d 256, 8 heads, 4 layers, seq 128,
//! d_ff 1024; batch 8 per data-parallel rank; f32; AdamW) on two rank threads:
//!
//! `bench ledger device=flex|wgpu layout=ddp|zero1|zero2|zero3|tp|pp d2h=B h2d=B payload=B`
//!
//! `d2h`/`h2d`: bytes copied between the device and host memory (every reason: collectives
//! staged through the host, ZeRO-Offload, activations between pipeline stages, the loss read
//! for the report); `payload`: what the collectives and sends carry. On Flex the device's
//! memory is the host's, so nothing is copied; on wgpu (a build with `--features wgpu`, which
//! `cargo xtask bench ledger` turns on where Mesa's lavapipe is installed) each collective is
//! staged down and up once. A `zero2-offload` line adds ZeRO-Offload (stage 2).
//!
//! Then HSDP against ZeRO-3 over the whole dp, on four rank threads (Flex; the same global
//! batch of 32 rows), the bytes of rank 0's collectives by kind (`ledger/hsdp.rs`):
//!
//! `bench ledger collectives layout=zero3-dp4|hsdp-r2-dp2 shard_group=N replicas=R
//! allgather=B allgather_sent=B reduce_scatter=B allreduce=B rank=0 ranks=4`

mod common;
use bonfire_dtensor::plane::Transfers;
use bonfire_dtensor::plane::ledger::Direction;
use bonfire_examples::harness;
use bonfire_layout::ZeroStage;
use bonfire_layout::{Axis, ParallelDims};
use bonfire_models::data::TokenBatch;
use bonfire_models::{Gpt, GptConfig};
use bonfire_pipeline::ScheduleKind;
use bonfire_train::OptimizerKind;
use burn::tensor::{Device, Int, Tensor, TensorData};
use common::ledger;

#[path = "ledger/hsdp.rs"]
mod hsdp;

const BATCH: usize = 8;
const RANKS: usize = 2;

/// The layouts on two ranks, by their line name.
fn layouts() -> Vec<(&'static str, ParallelDims)> {
    let dp = ParallelDims::new().with_degree(Axis::Dp, RANKS);
    vec![
        ("ddp", dp.clone()),
        ("zero1", dp.clone().with_zero(ZeroStage::Zero1)),
        ("zero2", dp.clone().with_zero(ZeroStage::Zero2)),
        ("zero3", dp.clone().with_zero(ZeroStage::Zero3)),
        (
            "zero2-offload",
            dp.with_zero(ZeroStage::Zero2).with_offload(true),
        ),
        ("tp", ParallelDims::new().with_degree(Axis::Tp, RANKS)),
        (
            "pp",
            ParallelDims::new()
                .with_degree(Axis::Pp, RANKS)
                .with_schedule(ScheduleKind::OneFOneB)
                .with_microbatches(RANKS),
        ),
    ]
}

/// The global batch of `step` for `dp` data-parallel ranks (token ids from a fixed rule).
fn batch(cfg: &GptConfig, dp: usize, step: usize, device: &Device) -> TokenBatch {
    let (rows, t) = (dp * BATCH, cfg.max_seq_len);
    let make = |salt: usize| {
        let v: Vec<i64> = (0..rows * t)
            .map(|i| ((i * 31 + step * 7 + salt) % cfg.vocab_size) as i64)
            .collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [rows, t]), device)
    };
    (make(0), make(1))
}

fn devices() -> Vec<&'static str> {
    let mut names = vec!["flex"];
    if cfg!(feature = "wgpu") {
        names.push("wgpu");
    } else {
        eprintln!("bench ledger: built without `--features wgpu`, so Flex only");
    }
    names
}

fn line(device: &str, layout: &str, t: &Transfers) -> String {
    format!(
        "bench ledger device={device} layout={layout} d2h={} h2d={} payload={} rank=0 ranks={RANKS}",
        t.total(Direction::DeviceToHost),
        t.total(Direction::HostToDevice),
        t.payload
    )
}

fn main() {
    let cfg = GptConfig::bench();
    for name in devices() {
        let device = harness::device(name).unwrap_or_else(|e| panic!("{e}"));
        device.seed(0);
        let model = Gpt::new(&cfg, &device);
        for (layout, dims) in layouts() {
            let dp = dims.dp();
            let ranks = ledger::second_step(&model, &dims, OptimizerKind::AdamW, 1e-3, |s, d| {
                batch(&cfg, dp, s, d)
            })
            .unwrap_or_else(|e| panic!("{layout} on {name}: {e}"));
            println!("{}", line(name, layout, &ranks[0]));
        }
    }
    let device = harness::device("flex").unwrap_or_else(|e| panic!("{e}"));
    device.seed(0);
    hsdp::lines(&Gpt::new(&cfg, &device), &cfg, batch);
}
