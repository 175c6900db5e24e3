//! The soak test (issue 17, point 5): random runs of the small GPT, each a chain of legs until
//! the run's last step — every leg a random layout (fault-tolerant dp with DDP or ZeRO 1–3, or
//! any layout with tp and pp that is not), resuming from the latest checkpoint (or the start),
//! saving every 1–3 steps (in the background or not), with a failure injected at a random
//! communication call of a random rank. Every run must end with the parameters of the
//! uninterrupted run on one device (the parity tolerance of `common`), every leg that fails
//! must fail with an error naming the injected failure, no leg may outlive its outer timeout,
//! and every checkpoint ever visible must be complete and verify (index and every block).
//!
//! The gate runs the first `GATE_SEEDS` fixed seeds, all of them (a run that ends early, or
//! skips one, fails the test); `BONFIRE_FULL=1` runs all `FULL_SEEDS`. Each run prints its
//! seed and legs, the end the number of runs; `SOAK_SEED=<seed>` replays one run.

mod common;

use bonfire_comm::ThreadWorld;
use bonfire_comm::testing::assert_close;
use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_layout::ParallelDims;
use bonfire_train::checkpoint::{Checkpoint, CheckpointConfig, Checkpointer, resume};
use bonfire_train::fault::FaultTolerance;
use bonfire_train::{FitConfig, OptimizerKind, TrainError, Trainer, fit, fit_fault_tolerant};
use burn::tensor::Device;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Divisible by every dp degree used (1–4): every layout trains the same global batch.
const ROWS: usize = 12;
const STEPS: usize = 6;
/// The runs of the full sweep, `BONFIRE_FULL=1` (fixed: a failure names its seed,
/// `SOAK_SEED` replays it).
const FULL_SEEDS: std::ops::RangeInclusive<u64> = 1..=200;
/// The runs of the gate: the first seeds of the sweep, every one of them. Measured on the
/// 2-core machine at a load average of 10: 0.2–1.4 s a seed, the 40 in 26 s.
const GATE_SEEDS: usize = 40;
/// Legs of one run before the last, which injects nothing so that every run ends.
const MAX_LEGS: usize = 4;
/// No leg may take longer (a hang fails the test, naming the seed).
const LEG_LIMIT: Duration = Duration::from_secs(30);
/// The collective timeout inside a leg.
const GROUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Layouts a leg may take without fault tolerance: `(mesh, zero, schedule)`.
const ANY_LAYOUT: &[(&str, usize, Option<&str>)] = &[
    ("dp=1", 0, None),
    ("dp=3", 2, None),
    ("dp=4", 3, None),
    ("tp=2", 0, None),
    ("dp=2,tp=2", 1, None),
    ("pp=2", 0, Some("1f1b")),
    ("dp=2,pp=2", 3, Some("gpipe")),
];

/// splitmix64: the soak's only randomness, from the printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

type Fixture = common::GptFixture;

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    common::gpt_fixture(&F, STEPS, ROWS, 9, 17)
}

/// The uninterrupted run on one device, per optimizer: every parameter, flat.
fn reference(optim: OptimizerKind) -> &'static Vec<f32> {
    static R: [OnceLock<Vec<f32>>; 2] = [OnceLock::new(), OnceLock::new()];
    R[usize::from(optim == OptimizerKind::AdamW)].get_or_init(|| {
        let f = fixture();
        common::single_device(
            &f.model,
            &f.batches,
            STEPS,
            common::gpt_lr(optim),
            optim.build(),
        )
        .params
    })
}

/// One leg: a layout, fault-tolerant or not, saving every `every` steps, a failure injected
/// at call `call` of rank `rank`.
#[derive(Debug, Clone)]
struct Leg {
    dims: ParallelDims,
    tolerant: bool,
    every: usize,
    background: bool,
    kill: Option<(usize, u64)>,
}

impl Leg {
    fn random(rng: &mut Rng, last: bool) -> Self {
        let tolerant = rng.below(3) != 0;
        let (mesh, zero, schedule) = if tolerant {
            let dp = 2 + rng.below(3);
            (format!("dp={dp}"), rng.below(4), None)
        } else {
            let (m, z, s) = ANY_LAYOUT[rng.below(ANY_LAYOUT.len())];
            (m.to_string(), z, s)
        };
        let dims = LayoutArgs {
            mesh: Some(mesh),
            zero,
            schedule: schedule.map(str::to_string),
            ..LayoutArgs::default()
        }
        .dims("dp=1")
        .unwrap();
        let world = dims.world_size();
        // A rank makes some 60–400 calls in a leg (building, steps, commits, checkpoints):
        // most strikes land somewhere in it, a few after its end.
        let kill = (!last && world > 1).then(|| (rng.below(world), rng.below(200) as u64));
        Self {
            dims,
            tolerant,
            every: 1 + rng.below(3),
            background: rng.below(2) == 0,
            kill,
        }
    }
}

/// What a leg ended with: the parameters (when it reached the last step), and the error of
/// each rank that failed or died.
struct LegOutcome {
    params: Option<Vec<f32>>,
    errors: Vec<String>,
}

/// Runs `leg` from the latest checkpoint in `dir` (or the start) up to `STEPS`.
fn run_leg(leg: &Leg, optim: OptimizerKind, dir: &Path) -> LegOutcome {
    let f = fixture();
    let latest = Checkpoint::open(dir).ok();
    let start = latest.as_ref().map_or(0, Checkpoint::step);
    let trainer = Trainer::new(leg.dims.clone(), move || optim.build());
    let data = |s: usize, device: &Device| f.batches.rows(s, 0, ROWS, device);
    let config = FitConfig {
        start_step: start,
        checkpoint_every: Some(leg.every),
        ..FitConfig::new(STEPS, common::gpt_lr(optim))
    };
    let save = CheckpointConfig::new(dir).with_background(leg.background);
    let mut world = ThreadWorld::new(leg.dims.world_size()).timeout(GROUP_TIMEOUT);
    if let Some((rank, call)) = leg.kill {
        world = world.inject_failure(rank, call);
    }
    let outcomes = world.launch_each(|pg| -> Result<Option<Vec<f32>>, TrainError> {
        let mut hooks = Checkpointer::new(save.clone());
        let mut engine = if leg.tolerant {
            let options = FaultTolerance {
                resume: latest.as_ref().map(|c| c.dir.clone()),
                ..FaultTolerance::default()
            };
            fit_fault_tolerant(
                &trainer, &f.model, &pg, &data, &config, &mut hooks, &options,
            )?
            .engine
        } else {
            let first = data(start.min(STEPS - 1), &default_device());
            let mut engine = trainer.build(f.model.clone(), &pg, &first)?;
            if let Some(c) = &latest {
                resume(engine.as_mut(), &c.dir)?;
            }
            fit(engine.as_mut(), &data, &config, &mut hooks)?;
            engine
        };
        let params = engine.parameters()?;
        let rank0 = engine.world().rank() == 0;
        Ok(rank0.then(|| params.into_iter().flat_map(|p| p.values).collect()))
    });
    let mut out = LegOutcome {
        params: None,
        errors: Vec::new(),
    };
    for o in outcomes {
        match o {
            Ok(Ok(Some(p))) => out.params = Some(p),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => out.errors.push(e.to_string()),
            Err(failure) => out.errors.push(failure.message),
        }
    }
    out
}

/// `run_leg` on its own thread, bounded by `LEG_LIMIT`.
fn bounded_leg(leg: &Leg, optim: OptimizerKind, dir: &Path, what: &str) -> LegOutcome {
    let (tx, rx) = mpsc::channel();
    let (leg, dir) = (leg.clone(), dir.to_path_buf());
    std::thread::spawn(move || {
        let _ = tx.send(run_leg(&leg, optim, &dir));
    });
    rx.recv_timeout(LEG_LIMIT)
        .unwrap_or_else(|_| panic!("{what}: did not finish within {LEG_LIMIT:?} (a hang)"))
}

/// Every visible checkpoint under `dir` is complete: its index opens and every block of every
/// parameter verifies.
fn check_checkpoints(dir: &Path, what: &str) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut n = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.starts_with("step-") || name.ends_with(".partial") {
            continue;
        }
        let c = Checkpoint::open(e.path()).unwrap_or_else(|err| {
            panic!("{what}: visible checkpoint {name} is not complete: {err}")
        });
        c.parameters().unwrap_or_else(|err| {
            panic!("{what}: visible checkpoint {name} does not verify: {err}")
        });
        n += 1;
    }
    n
}

/// One run: legs until one reaches the last step; then the parameters against the reference.
fn soak(seed: u64) {
    let mut rng = Rng(seed);
    let optim = [OptimizerKind::Sgd, OptimizerKind::AdamW][rng.below(2)];
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("soak-{seed}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let started = Instant::now();
    let mut log = Vec::new();
    for i in 0..=MAX_LEGS {
        let leg = Leg::random(&mut rng, i == MAX_LEGS);
        let what = format!("soak seed={seed} {} leg {i} {leg:?}", optim.name());
        let outcome = bounded_leg(&leg, optim, &dir, &what);
        let checkpoints = check_checkpoints(&dir, &what);
        log.push(format!(
            "leg {i}: {}{} every={} bg={} kill={:?} -> {} ({checkpoints} checkpoints)",
            leg.dims,
            if leg.tolerant { " fault-tolerant" } else { "" },
            leg.every,
            leg.background,
            leg.kill,
            match (&outcome.params, outcome.errors.is_empty()) {
                (Some(_), false) => "a rank died, the survivors finished",
                (Some(_), true) => "finished (nothing struck)",
                (None, _) => "failed",
            }
        ));
        for e in &outcome.errors {
            // Every error traces back to the injected failure, and says so.
            assert!(
                leg.kill.is_some() && e.contains("injected failure"),
                "{what}: an unclear error: {e}"
            );
        }
        if let Some(params) = outcome.params {
            let tol = match optim {
                OptimizerKind::Sgd => common::SGD,
                OptimizerKind::AdamW => common::adamw(common::gpt_lr(optim)),
            };
            let c = assert_close(
                &format!("{what} parameters"),
                &params,
                reference(optim),
                tol,
            );
            println!(
                "soak seed={seed} {}: {} in {:.1}s, {c}\n  {}",
                optim.name(),
                if outcome.errors.is_empty() {
                    "clean"
                } else {
                    "survived"
                },
                started.elapsed().as_secs_f64(),
                log.join("\n  ")
            );
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }
        assert!(
            !outcome.errors.is_empty(),
            "{what}: no parameters and no error"
        );
    }
    panic!(
        "soak seed={seed}: the last leg injects nothing yet did not finish:\n  {}",
        log.join("\n  ")
    );
}

/// The seeds to run and how many of them must run: `SOAK_SEED`'s one, the full sweep under
/// `BONFIRE_FULL=1`, else the gate's first `GATE_SEEDS`.
fn seeds() -> (Vec<u64>, usize) {
    if let Ok(s) = std::env::var("SOAK_SEED") {
        return (vec![s.parse().expect("SOAK_SEED is a number")], 1);
    }
    let seeds: Vec<u64> = if common::full_sweep() {
        FULL_SEEDS.collect()
    } else {
        FULL_SEEDS.take(GATE_SEEDS).collect()
    };
    let minimum = seeds.len().max(GATE_SEEDS);
    (seeds, minimum)
}

#[test]
fn soak_random_layouts_failures_and_resumes() {
    let started = Instant::now();
    let (seeds, minimum) = seeds();
    let mut ran = 0;
    for &seed in &seeds {
        soak(seed);
        ran += 1;
    }
    println!(
        "soak: {ran} runs (of {} chosen, at least {minimum} required) in {:.1}s",
        seeds.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        ran >= minimum,
        "soak: only {ran} runs, fewer than the {minimum} required"
    );
}
