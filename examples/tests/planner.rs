//! Issue 18, point 3: the planner's predictions against measurements on this machine, for
//! the bench GPT (vocab 4096, d 256, 8 heads, 4 layers, seq 128, d_ff 1024) training a global
//! batch of 8 sequences on 2 rank threads with AdamW, under layouts the trainer runs.
//!
//! - **Bytes.** This binary's global allocator is [`RankAllocator`]: each layout trains 3
//!   steps; per rank, the state held after the last forward+backward (parameters, gradients,
//!   optimizer state) and the steady peak (the most bytes live during the steps after the
//!   first) are read, over the rank's baseline. The planner's state
//!   ([`bonfire_plan::memory::state_bytes`]) must be within 10 % of the held bytes and its
//!   bytes per rank (state + activations + transients) within 10 % of the steady peak, on
//!   the fullest rank.
//! - **Time.** The same runs time steps 2 and 3 (a clock around `forward_backward` +
//!   `step` on rank 0); a layout's time is its fastest step over three round-robin rounds (the
//!   machine is shared with builds: a busy spell then hits every layout). The planner,
//!   calibrated on this machine ([`planner::calibrate`]: matmul rate with both rank threads
//!   busy, all-reduce bandwidth and latency), predicts every layout's step time; wherever it
//!   separates two layouts by 15 % or more, they must be measured in the predicted order. A
//!   pair measured the other way is timed again, both layouts alternately (up to six more
//!   times, the fastest step kept), before it fails: a busy spell slows one timing, a wrong
//!   prediction stays wrong.
//!
//! The layouts: DDP, ZeRO-1, -2 and -3, DDP with recompute (4/3 of DDP's compute), TP = 2
//! with and without SP, PP = 2 GPipe with 2 micro-batches (bubble 1/3) and 1F1B with 1
//! (bubble 1/2). The zero-bubble schedules are left out: their bytes and their time against
//! DDP are not modelled yet (docs/planner.md, "Accuracy").

use bonfire_examples::memory::{self, RankAllocator};
use bonfire_examples::parallel::TokenBatch;
use bonfire_examples::planner::{self, calibrate, from_dims, gpt_spec, this_machine};
use bonfire_examples::{Gpt, GptConfig, default_device};
use bonfire_plan::{Estimate, Precision, Request, estimate, rank_shapes};
use bonfire_train::{Launcher, OptimizerKind, ParallelDims, TrainError, Trainer};
use burn::tensor::Device;
use std::time::Instant;

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

/// The bench GPT.
const CFG: GptConfig = GptConfig::bench();
const ROWS: usize = 8;
const SEQ: usize = 128;
const STEPS: usize = 3;
/// Rounds over the layouts (a layout's time is its fastest step over all rounds: the
/// machine is shared, and round robin spreads a busy spell over every layout).
const ROUNDS: usize = 3;
/// Further timings of the layouts in a pair measured against the prediction, at most.
const RETRIES: usize = 6;
/// Two layouts whose predicted step times differ by at least this factor should be measured
/// in the same order.
const SEPARATED: f64 = 1.15;

fn batch(step: usize, device: &Device) -> TokenBatch {
    bonfire_examples::data::pattern_batch(CFG.vocab_size, ROWS, SEQ, step, device)
}

/// One rank's measurement.
#[derive(Debug, Clone, Copy, Default)]
struct RankRun {
    held: usize,
    steady_peak: usize,
    step_ms: f64,
}

fn measure_rank(
    pg: bonfire_comm::ProcessGroup,
    trainer: &Trainer,
    model: &Gpt,
    first: usize,
) -> Result<RankRun, TrainError> {
    let r = first + pg.rank();
    let _rank = memory::enter_rank(r);
    let b0 = batch(0, &default_device());
    let base = memory::live(r);
    let mut engine = trainer.build(model.clone(), &pg, &b0)?;
    drop(b0);
    let mut run = RankRun::default();
    let mut timed = f64::MAX;
    for step in 0..STEPS {
        let b = batch(step, engine.device());
        memory::reset_peak(r);
        let start = Instant::now();
        engine.forward_backward(&b)?;
        drop(b);
        run.held = memory::live(r) - base;
        engine.step(1e-4)?;
        if step > 0 {
            timed = f64::min(timed, start.elapsed().as_secs_f64());
            run.steady_peak = run.steady_peak.max(memory::peak(r) - base);
        }
    }
    run.step_ms = timed * 1e3;
    Ok(run)
}

/// (held, steady peak) of the fullest rank, and rank 0's step time.
fn measure(dims: &ParallelDims, model: &Gpt, first: usize) -> (usize, usize, f64) {
    let trainer = Trainer::new(dims.clone(), || OptimizerKind::AdamW.build());
    let runs: Vec<RankRun> = Launcher::Threads {
        ranks: dims.world_size(),
    }
    .run("planner-test", |pg| {
        measure_rank(pg, &trainer, model, first)
    })
    .expect("launch")
    .into_iter()
    .map(|r| r.expect("rank"))
    .collect();
    let held = runs.iter().map(|r| r.held).max().unwrap();
    let peak = runs.iter().map(|r| r.steady_peak).max().unwrap();
    (held, peak, runs[0].step_ms)
}

fn layouts() -> Vec<(&'static str, ParallelDims)> {
    use bonfire_examples::cli::LayoutArgs;
    let dims = |mesh: &str, edit: &dyn Fn(&mut LayoutArgs)| {
        let mut a = LayoutArgs::mesh(mesh);
        a.loss_parallel = mesh.starts_with("tp");
        edit(&mut a);
        a.dims(mesh).expect("a layout")
    };
    vec![
        ("ddp", dims("dp=2", &|_| {})),
        ("zero3", dims("dp=2", &|a| a.zero = 3)),
        (
            "ddp+ac",
            dims("dp=2", &|a| a.activation_checkpointing = Some(1)),
        ),
        ("tp2+sp", dims("tp=2", &|a| a.sequence_parallel = true)),
        (
            "pp2-gpipe-m2",
            dims("pp=2", &|a| a.schedule = Some("gpipe".into())),
        ),
        ("zero2", dims("dp=2", &|a| a.zero = 2)),
        ("zero1", dims("dp=2", &|a| a.zero = 1)),
        ("tp2", dims("tp=2", &|_| {})),
        (
            "pp2-1f1b-m1",
            dims("pp=2", &|a| {
                a.schedule = Some("1f1b".into());
                a.microbatches = Some(1);
            }),
        ),
    ]
}

#[test]
fn predictions_match_the_allocator_and_the_clock() {
    let spec = gpt_spec(&CFG);
    let calib = calibrate(2, ROWS / 2 * SEQ, CFG.d_model, CFG.d_ff);
    let cluster = this_machine(2, 8 << 30, &calib);
    eprintln!("calibration {calib:?}");
    let req = Request {
        global_batch: ROWS,
        seq: SEQ,
        precisions: vec![Precision::F32],
        memory_fraction: 1.0,
    };
    let cases = layouts();
    let estimates: Vec<Estimate> = cases
        .iter()
        .map(|(name, dims)| {
            let layout = from_dims(dims).expect("a layout the planner models");
            assert_eq!(
                from_dims(&planner::to_dims(&layout).unwrap()),
                Some(layout.clone()),
                "{name}: round trip"
            );
            let shapes = rank_shapes(&spec, &layout, SEQ);
            estimate(&spec, &cluster, &req, &layout, &shapes)
        })
        .collect();
    let predicted_ms: Vec<f64> = estimates.iter().map(Estimate::step_ms).collect();
    let model = Gpt::new(&CFG, &default_device());
    let mut slot = 0;
    let mut measure_case = |i: usize| {
        slot += 2;
        measure(&cases[i].1, &model, slot - 2)
    };
    let mut measured = vec![(0usize, 0usize, f64::MAX); cases.len()];
    for _ in 0..ROUNDS {
        for (i, m) in measured.iter_mut().enumerate() {
            let (held, peak, ms) = measure_case(i);
            *m = (m.0.max(held), m.1.max(peak), m.2.min(ms));
        }
    }
    // A pair measured against the prediction is timed again (both layouts, alternately, the
    // fastest step kept) before it counts: a busy spell on the shared machine slows one
    // layout's steps, while a wrong prediction stays wrong however often it is timed.
    for retry in 0..RETRIES {
        let times: Vec<f64> = measured.iter().map(|m| m.2).collect();
        let suspects = disagreements(&predicted_ms, &times);
        if suspects.is_empty() {
            break;
        }
        let mut again: Vec<usize> = suspects.iter().flat_map(|&(a, b)| [a, b]).collect();
        again.sort_unstable();
        again.dedup();
        eprintln!(
            "planner-check retry {retry}: timing again {:?}",
            again.iter().map(|&i| cases[i].0).collect::<Vec<_>>()
        );
        for &i in &again {
            let ms = measure_case(i).2;
            measured[i].2 = measured[i].2.min(ms);
        }
    }
    let names: Vec<&str> = cases.iter().map(|c| c.0).collect();
    check_bytes(&names, &estimates, &measured);
    let times: Vec<f64> = measured.iter().map(|m| m.2).collect();
    check_ranking(&names, &predicted_ms, &times);
}

/// Every layout's state and whole peak (the state live then, activations and transients)
/// within 10 % of the allocator's `(held, steady peak, _)`.
fn check_bytes(names: &[&str], estimates: &[Estimate], measured: &[(usize, usize, f64)]) {
    let mut ratios = Vec::new();
    for ((name, est), &(held, peak, ms)) in names.iter().zip(estimates).zip(measured) {
        let state = held as f64 / est.memory.state.total();
        let bytes = peak as f64 / est.bytes();
        eprintln!(
            "planner-check layout={name} measured_held={held} predicted_state={:.0} ratio={state:.3} \
             measured_peak={peak} predicted_bytes={:.0} ratio={bytes:.3} (state at the peak {:.0} activations {:.0} transient {:.0}) \
             measured_ms={ms:.1} predicted_ms={:.1}",
            est.memory.state.total(),
            est.bytes(),
            est.memory.peak_state(),
            est.memory.activations,
            est.memory.transient,
            est.step_ms()
        );
        ratios.push((name, state, bytes));
    }
    // Asserted once every layout is printed.
    for (name, state, bytes) in ratios {
        assert!(
            (state - 1.0).abs() <= 0.10,
            "{name}: state measured/predicted {state:.3}"
        );
        assert!(
            (bytes - 1.0).abs() <= 0.10,
            "{name}: peak measured/predicted {bytes:.3}"
        );
    }
}

/// Wherever the planner separates two layouts by more than the machine's noise (a predicted
/// ratio of at least `SEPARATED`), the measured order is the predicted one.
fn check_ranking(names: &[&str], predicted: &[f64], times: &[f64]) {
    let pairs = disagreements(predicted, &[]).len();
    let wrong = disagreements(predicted, times);
    for &(a, b) in &wrong {
        eprintln!(
            "planner-check ranking disagrees: {} predicted {:.2}× slower than {}, measured {:.0} vs {:.0} ms",
            names[b],
            predicted[b] / predicted[a],
            names[a],
            times[b],
            times[a]
        );
    }
    eprintln!(
        "planner-check ranking: {} of {pairs} separated pairs in the predicted order",
        pairs - wrong.len()
    );
    assert!(
        wrong.is_empty(),
        "the measured step-time ranking differs from the predicted one"
    );
}

/// The pairs (a, b) whose predicted times are at least `SEPARATED` apart (b the slower) but
/// whose measured `times` are not in that order; every separated pair when `times` is empty.
fn disagreements(predicted: &[f64], times: &[f64]) -> Vec<(usize, usize)> {
    let n = predicted.len();
    (0..n)
        .flat_map(|a| (0..n).map(move |b| (a, b)))
        .filter(|&(a, b)| predicted[b] >= SEPARATED * predicted[a])
        .filter(|&(a, b)| times.is_empty() || times[b] <= times[a])
        .collect()
}
