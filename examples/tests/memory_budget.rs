//! The point of sharding, shown with a per-rank memory budget (`train --memory-budget`):
//! a GPT that cannot train with DDP on 2 ranks — a rank runs out of its budget and the run
//! aborts with one clear `out of memory` line — trains with ZeRO-3, with tensor parallelism
//! and with pipeline parallelism on the same 2 ranks under the same budget.
//!
//! Each case runs `train` as a child process (the allocator aborts the process on a
//! refused allocation). The test builds the example first with the cargo that runs it, in
//! the same profile.
//!
//! Sizes, found by measurement with the counting allocator (`peak_bytes` lines of
//! `train --sample 0`, 3 AdamW steps, 2 rows of 32 tokens per replica): the GPT of d 256,
//! 4 heads, 4 layers, d_ff 1024, character vocabulary (Ψ = 3,184,128) peaks per rank at
//! 77.3 MB under DDP, 53.4 MB under ZeRO-3, 39.7 MB under TP=2 and 43.2 MB under PP=2
//! (1F1B). The budget, 64 MiB (67.1 MB), sits between.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

const BUDGET: &str = "64MiB";
const BUDGET_BYTES: usize = 64 << 20;

/// `train` on 2 ranks under the budget with the layout `layout`.
fn run(exe: &PathBuf, layout: &[&str]) -> Output {
    let start = std::time::Instant::now();
    let out = Command::new(exe)
        .args(layout)
        .args(common::BUDGET_GPT_MODEL)
        .args(common::BUDGET_GPT_RUN)
        .args(["--sample", "0", "--memory-budget", BUDGET])
        .output()
        .expect("run train");
    eprintln!(
        "{layout:?}: {:?} in {:.1} s",
        out.status,
        start.elapsed().as_secs_f64()
    );
    out
}

/// The peaks the run printed, one per rank.
fn peaks(out: &Output) -> Vec<usize> {
    common::printed_peaks(&String::from_utf8_lossy(&out.stdout))
}

#[test]
fn ddp_runs_out_of_its_budget_where_zero3_tp_and_pp_train() {
    let exe = common::train();

    let ddp = run(&exe, &["--mesh", "dp=2"]);
    let stderr = String::from_utf8_lossy(&ddp.stderr);
    assert!(!ddp.status.success(), "DDP should not fit: {stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("out of memory: rank "))
        .unwrap_or_else(|| panic!("no out-of-memory line in: {stderr}"));
    assert!(
        line.ends_with(&format!(
            "live; its budget is {BUDGET_BYTES} bytes (--memory-budget)"
        )),
        "{line}"
    );
    let asked: usize = common::number_after(line, "asked for ");
    let live: usize = common::number_after(line, " with ");
    assert!(
        live + asked > BUDGET_BYTES && live <= BUDGET_BYTES,
        "{line}"
    );
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(ddp.status.signal(), Some(6), "aborted (SIGABRT): {stderr}");
    }

    for layout in [
        &["--mesh", "dp=2", "--zero", "3"][..],
        &["--mesh", "tp=2"][..],
        &["--mesh", "pp=2", "--schedule", "1f1b"][..],
    ] {
        let out = run(&exe, layout);
        assert!(
            out.status.success(),
            "{layout:?} should fit {BUDGET}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let peaks = peaks(&out);
        assert_eq!(peaks.len(), 2, "one peak per rank");
        assert!(
            peaks.iter().all(|&p| p > 0 && p <= BUDGET_BYTES),
            "{peaks:?}"
        );
    }
}
