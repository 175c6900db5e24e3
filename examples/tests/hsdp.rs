//! HSDP (`--mesh dp_replicate=R,dp=N --zero 1..3`): ZeRO shards over dp (× cp), R replicas
//! of the shards, each shard's gradient averaged across them, every replica on its own rows.
//! Each layout equals one device with SGD and AdamW — the loss of every step, every step-0
//! gradient and every parameter after 3 steps, within the tolerance of `common` (as in
//! `layouts.rs`) — alone with ZeRO 1, 2 and 3 (2 with offload too), as plain DDP without
//! ZeRO, and composed with tp, pp and cp, on up to 8 rank threads.

mod common;

use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_models::Gpt;
use std::sync::OnceLock;

const STEPS: usize = 3;
const ROWS: usize = 8;

fn fixture() -> &'static common::Suite<Gpt> {
    static F: OnceLock<common::Suite<Gpt>> = OnceLock::new();
    F.get_or_init(|| {
        let cfg = common::gpt_cfg();
        let model = common::seeded(3, &default_device(), |d| Gpt::new(&cfg, d));
        common::Suite::new(model, common::random_batches(&cfg, STEPS, ROWS, 7), STEPS)
    })
}

use common::layout;

/// Trains every case with SGD and AdamW and compares with one device.
fn check(cases: &[LayoutArgs]) {
    fixture().check("", cases);
}

#[test]
fn hsdp_with_every_zero_stage_and_ddp_without() {
    let mut cases: Vec<LayoutArgs> = (1..=3)
        .map(|z| layout("dp_replicate=2,dp=2", z, None, None, ""))
        .collect();
    // Without ZeRO, dp_replicate is DDP over dp_replicate × dp.
    cases.push(layout("dp_replicate=2,dp=2", 0, None, None, ""));
    // ZeRO-Offload: the replicas' average happens on the device, before the state's step.
    cases.push(layout("dp_replicate=2,dp=2", 2, None, None, "offload"));
    check(&cases);
}

#[test]
fn hsdp_with_tp_pp_and_cp() {
    check(&[
        layout("dp_replicate=2,dp=2,tp=2", 3, None, None, "sp lp"),
        layout("dp_replicate=2,dp=2,pp=2", 2, Some("1f1b"), Some(2), ""),
        layout("dp_replicate=2,dp=2,cp=2", 3, None, None, ""),
    ]);
}
