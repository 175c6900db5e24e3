//! Every kind of layout the trainer accepts equals one device, with SGD and with AdamW:
//! {dp with ZeRO 0–3} × {tp with and without sequence and loss parallelism} × {pp with each
//! schedule}, and their combinations on up to 8 rank threads — pp × ZeRO-3 and pp × SP
//! included. The loss of every step, every step-0 gradient and every parameter after 3 steps,
//! within 1e-5 relative (absolute floor 1e-7 under SGD, 2e-3·lr under AdamW; see
//! `common::adamw`). Each case prints how much of the tolerance it used and its largest
//! absolute difference.

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

/// A comparison of untouched weights would pass trivially: training moves every tensor by
/// more than 100× the SGD floor, but for the attention key biases, whose gradient is zero
/// (softmax over keys is invariant to the constant `q·b_k` they add to every score).
#[test]
fn reference_training_moves_the_parameters() {
    let f = fixture();
    let infos = bonfire_module::params::inventory(&f.model);
    let init = bonfire_module::params::flatten_values(&f.model, &infos);
    let offsets = bonfire_module::params::offsets_of(&infos);
    for r in &f.reference {
        let still: Vec<&str> = infos
            .iter()
            .enumerate()
            .filter(|(i, p)| {
                let before = &init[offsets[*i]..offsets[i + 1]];
                let after = &r.params[&p.path].1;
                let moved = before.iter().zip(after).map(|(a, b)| (a - b).abs());
                moved.fold(0.0, f32::max) <= 100.0 * common::SGD.abs
            })
            .map(|(_, p)| p.path.as_str())
            .collect();
        assert!(
            still.iter().all(|p| p.ends_with("attn.k.bias")),
            "{still:?} barely moved"
        );
        assert_eq!(still.len(), common::gpt_cfg().n_layers, "{still:?}");
    }
}

#[test]
fn data_parallel_with_every_zero_stage() {
    let mut cases: Vec<LayoutArgs> = (0..=3).map(|z| layout("dp=2", z, None, None, "")).collect();
    cases.push(layout("dp=4", 0, None, None, ""));
    cases.push(layout("dp=4", 3, None, None, ""));
    cases.push(layout("dp=2", 1, None, None, "offload"));
    cases.push(layout("dp=4", 3, None, None, "offload"));
    check(&cases);
}

#[test]
fn tensor_parallel_with_sequence_and_loss_parallelism() {
    let mut cases = Vec::new();
    for mesh in ["tp=2", "tp=4"] {
        for flags in ["", "sp", "lp", "sp lp"] {
            cases.push(layout(mesh, 0, None, None, flags));
        }
    }
    check(&cases);
}

#[test]
fn data_and_tensor_parallel() {
    let mut cases: Vec<LayoutArgs> = (0..=3)
        .map(|z| layout("dp=2,tp=2", z, None, None, ""))
        .collect();
    cases.push(layout("dp=2,tp=2", 0, None, None, "sp lp"));
    cases.push(layout("dp=2,tp=2", 3, None, None, "sp lp"));
    check(&cases);
}

#[test]
fn pipelines_with_every_schedule() {
    let mut cases = Vec::new();
    for schedule in ["gpipe", "1f1b", "interleaved", "zb", "zb-v"] {
        cases.push(layout("pp=2", 0, Some(schedule), Some(4), ""));
    }
    cases.push(layout("pp=2", 0, Some("1f1b"), Some(3), ""));
    cases.push(layout("pp=4", 0, Some("1f1b"), Some(4), ""));
    cases.push(layout("pp=4", 0, Some("interleaved"), Some(8), ""));
    cases.push(layout("pp=4", 0, Some("zb-v"), Some(2), ""));
    check(&cases);
}

#[test]
fn pipelines_with_data_parallelism_and_every_zero_stage() {
    let cases: Vec<LayoutArgs> = (0..=3)
        .map(|z| {
            layout(
                "dp=2,pp=2",
                z,
                Some(["1f1b", "gpipe", "zb", "interleaved"][z]),
                Some(2),
                "",
            )
        })
        .collect();
    check(&cases);
}

#[test]
fn pipelines_with_tensor_and_sequence_parallelism() {
    let mut cases = Vec::new();
    for (flags, schedule) in [
        ("", "1f1b"),
        ("sp", "zb"),
        ("lp", "interleaved"),
        ("sp lp", "gpipe"),
    ] {
        cases.push(layout("tp=2,pp=2", 0, Some(schedule), Some(2), flags));
    }
    check(&cases);
}

#[test]
fn the_whole_mesh() {
    check(&[
        layout("dp=2,tp=2,pp=2", 0, Some("1f1b"), Some(2), ""),
        layout("dp=2,tp=2,pp=2", 2, Some("gpipe"), Some(2), "sp"),
        layout("dp=2,tp=2,pp=2", 3, Some("zb"), Some(2), "sp lp"),
        layout("dp=2,tp=2,pp=2", 1, Some("zb-v"), Some(4), "lp"),
    ]);
}

/// Context parallelism on the GPT (position embeddings at the chunks' positions, ring
/// attention): alone, with dp and ZeRO over dp × cp, with tp and SP/LP (position rows
/// sharded over tp within a rank's chunks), with a pipeline and activation checkpointing.
#[test]
fn context_parallel() {
    check(&[
        layout("cp=2", 0, None, None, ""),
        layout("cp=4", 0, None, None, ""),
        layout("dp=2,cp=2", 2, None, None, ""),
        layout("dp=2,cp=2", 3, None, None, ""),
        layout("cp=2,tp=2", 0, None, None, "sp lp"),
        layout("pp=2,cp=2", 1, Some("interleaved"), Some(2), "ac"),
    ]);
}
