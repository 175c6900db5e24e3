//! Pipelined training equals single-device training: losses and parameters after 3 SGD steps
//! agree within 1e-5 relative (absolute floor 1e-7), for pp = 2 and 4, every schedule, and
//! micro-batch counts m = 1 (< p), 3 (not a multiple of p; uneven micro-batches 3/3/2), 4, 8.
//! The zero-bubble schedules compute every linear weight gradient in their "W" steps.

mod common;

use bonfire_pipeline::Generate;
use bonfire_pipeline::ScheduleKind;
use common::*;
use std::sync::OnceLock;

fn want() -> &'static Outcome {
    static REF: OnceLock<Outcome> = OnceLock::new();
    REF.get_or_init(reference)
}

fn parity(kind: ScheduleKind, p: usize) {
    for m in [1, 3, 4, 8] {
        let schedule = kind.generate(p, m);
        let (got, deferred) = pipelined_counting_w(&schedule);
        assert_close(&got, want(), &format!("{} p={p} m={m}", kind.name()));
        if matches!(kind, ScheduleKind::ZbH1 | ScheduleKind::ZbV) {
            // The zero-bubble schedules computed their weight gradients in "W" steps (all
            // but the first block's: its input is data, untracked, so its weight gradient is
            // the only one its backward has, and stays in B), counted on this run's ranks.
            assert!(
                deferred >= ((BLOCKS - 1) * STEPS * m) as u64,
                "{} deferred {deferred}",
                kind.name()
            );
        }
    }
}

#[test]
fn reference_loss_decreases() {
    let r = want();
    assert!(r.losses[2] < r.losses[0], "{:?}", r.losses);
    // The comparison is not vacuous: training moved every block's parameters.
    let init: Vec<_> = model(&dev()).iter().map(params_of).collect();
    for (blk, (a, b)) in r.params.iter().zip(&init).enumerate() {
        let moved = a[0]
            .iter()
            .zip(&b[0])
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        println!("block {blk} moved {moved}, loss {:?}", r.losses);
        assert!(moved > 1e-3, "block {blk} did not train ({moved})");
    }
}

#[test]
fn tolerance_catches_wrong_microbatch_weights() {
    // m = 3 splits 8 rows 3/3/2; weighting each mean by 1/3 is not the batch mean.
    let wrong = pipelined_uniform_weights(&ScheduleKind::OneFOneB.generate(2, 3));
    assert!(!is_close(&wrong, want()));
    // With m = 4 the micro-batches are even and 1/m is right.
    let right = pipelined_uniform_weights(&ScheduleKind::OneFOneB.generate(2, 4));
    assert_close(&right, want(), "uniform weights, even micro-batches");
}

#[test]
fn gpipe_pp2() {
    parity(ScheduleKind::GPipe, 2);
}
#[test]
fn gpipe_pp4() {
    parity(ScheduleKind::GPipe, 4);
}
#[test]
fn one_f_one_b_pp2() {
    parity(ScheduleKind::OneFOneB, 2);
}
#[test]
fn one_f_one_b_pp4() {
    parity(ScheduleKind::OneFOneB, 4);
}
#[test]
fn interleaved_pp2() {
    parity(ScheduleKind::Interleaved { chunks: 2 }, 2);
}
#[test]
fn interleaved_pp4() {
    parity(ScheduleKind::Interleaved { chunks: 2 }, 4);
}
#[test]
fn zb_h1_pp2() {
    parity(ScheduleKind::ZbH1, 2);
}
#[test]
fn zb_h1_pp4() {
    parity(ScheduleKind::ZbH1, 4);
}
#[test]
fn zb_v_pp2() {
    parity(ScheduleKind::ZbV, 2);
}
#[test]
fn zb_v_pp4() {
    parity(ScheduleKind::ZbV, 4);
}

#[test]
fn dp2_pp2() {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
        for m in [1, 3] {
            let got = pipelined_dp(&kind.generate(2, m), 2);
            assert_close(&got, want(), &format!("dp=2 pp=2 {} m={m}", kind.name()));
        }
    }
}
