//! What the planner's validation and test sets share (`tests/planner_validation.rs`,
//! `tests/planner_test_set.rs`, `tests/planner_fused_head.rs`): the layouts' builders
//! ([`layouts`]), a row — one layout of one shape trained under the counting allocator, every
//! rank's bytes over the planner's for that rank — and the check of a set.

use super::measure::{RankRun, measure_layout};
use bonfire_layout::ParallelDims;

/// The sets' layouts on 2 ranks, as the planner searches them.
pub mod layouts {
    use bonfire_layout::{MixedPrecision, ParallelDims, Recompute, ScheduleKind, ZeroStage};
    use bonfire_plan::base_layout;

    /// Data parallelism over `n` ranks under ZeRO stage `zero`.
    pub fn dp(n: usize, zero: ZeroStage) -> ParallelDims {
        base_layout(n, 1, 1).with_zero(zero)
    }

    /// tp = 2, with or without sequence parallelism.
    #[allow(dead_code)] // Not every set has a tp row.
    pub fn tp(sp: bool) -> ParallelDims {
        base_layout(1, 2, 1).with_sequence_parallel(sp)
    }

    /// pp = 2 under `schedule` with `m` micro-batches.
    pub fn pp(schedule: ScheduleKind, m: usize) -> ParallelDims {
        base_layout(1, 1, 2)
            .with_schedule(schedule)
            .with_microbatches(m)
    }

    /// `l` with every block recomputed.
    pub fn ac(l: ParallelDims) -> ParallelDims {
        l.with_recompute(Recompute::Every(1))
    }

    /// `l` in bf16 (f32 masters).
    pub fn bf16(l: ParallelDims) -> ParallelDims {
        l.with_precision(MixedPrecision::bf16())
    }
}
use bonfire_models::data::TokenBatch;
use bonfire_parallel::ParallelModel;
use bonfire_plan::{ModelSpec, Request, predict_ranks};

/// AdamW steps each row trains (the steady peak is the second's).
pub const STEPS: usize = 2;
/// The band every rank's bytes must keep around the planner's.
pub const BAND: f64 = 0.15;

/// One row: every rank's measured/predicted held state and steady peak.
pub struct Row {
    /// `shape/layout`.
    pub name: String,
    /// Every rank's held bytes over the planner's state.
    pub state: Vec<f64>,
    /// Every rank's steady peak over the planner's bytes.
    pub peak: Vec<f64>,
}

/// `layout` of `model` (described to the planner by `spec`) trained on `req`'s batch, the
/// allocator's ranks from `slot`: its line (`planner-check set=<set> …`) printed, its row and
/// rank 0's run returned.
pub fn measure_model_row<M: ParallelModel<Batch = TokenBatch> + Sync>(
    set: &str,
    (shape, name): (&str, &str),
    layout: &ParallelDims,
    (model, spec): (&M, &ModelSpec),
    (req, slot): (&Request, usize),
) -> (Row, RankRun) {
    let batch = (req.global_batch, req.seq, STEPS);
    let runs = measure_layout(spec.vocab_size, layout, model, batch, slot);
    let predicted = predict_ranks(spec, req, layout).expect("a layout the planner models");
    assert_eq!(runs.len(), predicted.len(), "{name}: ranks");
    let row = Row {
        name: format!("{shape}/{name}"),
        state: runs
            .iter()
            .zip(&predicted)
            .map(|(r, p)| r.held as f64 / p.state.total())
            .collect(),
        peak: runs
            .iter()
            .zip(&predicted)
            .map(|(r, p)| r.steady_peak() as f64 / p.total())
            .collect(),
    };
    eprintln!(
        "planner-check set={set} shape={shape} layout={name} ({layout}) \
         measured_held={:?} state_ratio={:.3?} measured_peaks={:?} \
         predicted_peaks={:.0?} peak_ratio={:.3?} workspace={:?} \
         measured_backward_step={:?} predicted_backward_sum={:.0?} measured_ms={:.1}",
        runs.iter().map(|r| r.held).collect::<Vec<_>>(),
        row.state,
        runs.iter().map(|r| r.steady_peak()).collect::<Vec<_>>(),
        predicted.iter().map(|p| p.total()).collect::<Vec<_>>(),
        row.peak,
        runs.iter().map(|r| r.workspace).collect::<Vec<_>>(),
        runs.iter()
            .map(|r| (r.backward_peak, r.step_peak))
            .collect::<Vec<_>>(),
        predicted
            .iter()
            .map(|p| (p.at_backward(), p.at_gradient_sum()))
            .collect::<Vec<_>>(),
        runs[0].step_ms,
    );
    (row, runs[0])
}

/// A ratio of a row known outside [`BAND`] since the row's first run: (row, rank, `peak` or
/// `held/state`, the first run's ratio).
pub type KnownMiss = (&'static str, usize, &'static str, f64);

/// How far a known miss may move before the check calls it a change of the planner (to be
/// reported, not refitted).
pub const MOVED: f64 = 0.02;

/// Every rank of every row of `set` within [`BAND`], both figures, but the `known` misses,
/// each of which must stay within [`MOVED`] of its first run and out of band (one that came
/// into band must leave the list, saying so); every failure named at once.
pub fn check(set: &str, rows: &[Row], seconds: f64, known: &[KnownMiss]) {
    let (lo, hi) = rows
        .iter()
        .flat_map(|r| r.state.iter().chain(&r.peak))
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let ranks: usize = rows.iter().map(|r| r.peak.len()).sum();
    let (mut misses, mut failures, mut seen) = (0, Vec::new(), 0);
    for row in rows {
        for (what, ratios) in [("held/state", &row.state), ("peak", &row.peak)] {
            for (rank, &r) in ratios.iter().enumerate() {
                let out = !r.is_finite() || (r - 1.0).abs() > BAND;
                misses += usize::from(out);
                let first = known
                    .iter()
                    .find(|k| k.0 == row.name && k.1 == rank && k.2 == what)
                    .map(|k| k.3);
                let name = format!("{} rank {rank} {what} {r:.3}", row.name);
                match first {
                    None if out => failures.push(format!("{name} outside {:.0} %", BAND * 100.0)),
                    None => {}
                    Some(f) => {
                        seen += 1;
                        if (r - f).abs() > MOVED {
                            failures.push(format!("{name}: a known miss moved from {f:.3}"));
                        } else if !out {
                            failures.push(format!("{name}: a known miss came into band"));
                        }
                    }
                }
            }
        }
    }
    eprintln!(
        "planner-check set={set} summary rows={} (all asserted) ranks={ranks} \
         ratios={lo:.3}–{hi:.3} outside_{:.0}pct={misses} known_misses={} elapsed_s={seconds:.0}",
        rows.len(),
        BAND * 100.0,
        known.len()
    );
    assert!(rows.len() >= 10, "{set}: too few rows asserted");
    assert_eq!(
        seen,
        known.len(),
        "{set}: a known miss names no row's ratio"
    );
    assert!(failures.is_empty(), "{set}: {}", failures.join("; "));
}
