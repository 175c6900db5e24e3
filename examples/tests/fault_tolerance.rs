//! Fault-tolerant data parallelism: with dp=4 on threads, rank 2 is killed at the start of
//! step 3 of 8; the three survivors shrink the group, drop the failed step, rebuild from their
//! in-memory copies (ZeRO shards re-partitioned from the buddy copy) and finish. Their losses
//! and final parameters equal a reference that trains steps 0–2 on 4 ranks, saves a
//! checkpoint and resumes steps 3–7 on 3 ranks over the same global batches (the parity
//! tolerance of `common`), for DDP and ZeRO-1/2/3 with SGD and AdamW. Also: the metrics lines
//! name the ranks of each step, a failure before the first step and two failures in one run
//! are survived, and a tp or pp layout is refused before anything is built.

mod common;

use bonfire_comm::ThreadWorld;
use bonfire_comm::testing::assert_close;
use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_layout::ParallelDims;
use bonfire_module::params::ParamValues;
use bonfire_train::checkpoint::{CheckpointConfig, Checkpointer, resume};
use bonfire_train::fault::{FaultTolerance, KillAt, Recovery};
use bonfire_train::{
    FitConfig, Launcher, OptimizerKind, TrainError, Trainer, fit, fit_fault_tolerant,
};
use burn::tensor::Device;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Divisible by 4 and by 3: the global batch is unchanged after the failure.
const ROWS: usize = 12;
const STEPS: usize = 8;
const KILL: KillAt = KillAt { rank: 2, step: 3 };

type Fixture = common::GptFixture;

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    common::gpt_fixture(&F, STEPS, ROWS, 5, 11)
}

fn dims(mesh: &str, zero: usize) -> ParallelDims {
    LayoutArgs {
        mesh: Some(mesh.into()),
        zero,
        ..LayoutArgs::default()
    }
    .dims("dp=1")
    .unwrap()
}

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fault-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// What a surviving rank finished with.
struct Survivor {
    losses: Vec<f32>,
    ranks: Vec<Vec<usize>>,
    recoveries: Vec<Recovery>,
    params: Vec<ParamValues>,
}

/// The fault-tolerant run on 4 rank threads with `kills`; every rank's outcome.
fn fault_run(
    zero: usize,
    optim: OptimizerKind,
    kills: &[KillAt],
    metrics: Option<&Path>,
) -> Vec<Result<Survivor, String>> {
    let f = fixture();
    let trainer = Trainer::new(dims("dp=4", zero), move || optim.build());
    let data = |s: usize, device: &Device| f.batches.rows(s, 0, ROWS, device);
    let config = FitConfig {
        metrics: metrics.map(Path::to_path_buf),
        ..FitConfig::new(STEPS, common::gpt_lr(optim))
    };
    ThreadWorld::new(4)
        .timeout(Duration::from_secs(30))
        .launch_each(|pg| {
            let options = FaultTolerance {
                kill: kills.iter().copied().find(|k| k.rank == pg.rank()),
                ..FaultTolerance::default()
            };
            let mut run =
                fit_fault_tolerant(&trainer, &f.model, &pg, &data, &config, &mut (), &options)
                    .map_err(|e| e.to_string())?;
            let params = run.engine.parameters().map_err(|e| e.to_string())?;
            Ok(Survivor {
                losses: run.steps.iter().map(|s| s.report.loss).collect(),
                ranks: run.steps.iter().map(|s| s.ranks.clone()).collect(),
                recoveries: run.recoveries,
                params,
            })
        })
        .into_iter()
        .map(|o| {
            o.map_err(|f| format!("panicked: {}", f.message))
                .and_then(|r| r)
        })
        .collect()
}

/// `steps` under `mesh` with ZeRO `zero`: saved at the end into `save`, resumed from `resume`.
fn leg(
    mesh: &str,
    zero: usize,
    optim: OptimizerKind,
    steps: std::ops::Range<usize>,
    save: Option<&Path>,
    resume_from: Option<&Path>,
) -> (Vec<f32>, Vec<ParamValues>) {
    let f = fixture();
    let d = dims(mesh, zero);
    let trainer = Trainer::new(d.clone(), move || optim.build());
    let data = |s: usize, device: &Device| f.batches.rows(s, 0, ROWS, device);
    let first = data(0, &default_device());
    let config = FitConfig {
        start_step: steps.start,
        ..FitConfig::new(steps.end, common::gpt_lr(optim))
    };
    let out = Launcher::Threads {
        ranks: d.world_size(),
    }
    .run("reference", |pg| -> Result<_, TrainError> {
        let mut engine = trainer.build(f.model.clone(), &pg, &first)?;
        if let Some(dir) = resume_from {
            resume(engine.as_mut(), dir)?;
        }
        let reports = match save {
            Some(dir) => {
                let config_save = CheckpointConfig::new(dir).with_background(false);
                let mut hooks = Checkpointer::new(config_save);
                fit(engine.as_mut(), &data, &config, &mut hooks)?
            }
            None => fit(engine.as_mut(), &data, &config, &mut ())?,
        };
        Ok((
            reports.iter().map(|r| r.loss).collect::<Vec<_>>(),
            engine.parameters()?,
        ))
    })
    .unwrap();
    out.into_iter().next().unwrap().unwrap()
}

/// Steps 0–2 on 4 ranks, a checkpoint, steps 3–7 on 3 ranks.
fn reference(zero: usize, optim: OptimizerKind) -> (Vec<f32>, Vec<ParamValues>) {
    let dir = tmp(&format!("ref-z{zero}-{}", optim.name()));
    let (mut losses, _) = leg("dp=4", zero, optim, 0..KILL.step, Some(&dir), None);
    let (rest, params) = leg("dp=3", zero, optim, KILL.step..STEPS, None, Some(&dir));
    losses.extend(rest);
    let _ = std::fs::remove_dir_all(&dir);
    (losses, params)
}

fn tolerance(optim: OptimizerKind) -> bonfire_comm::testing::Tolerance {
    match optim {
        OptimizerKind::Sgd => common::SGD,
        OptimizerKind::AdamW => common::adamw(common::gpt_lr(optim)),
    }
}

fn check_kill_rank_2_at_step_3(zero: usize) {
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        let what = format!("zero={zero} {}", optim.name());
        let started = Instant::now();
        let outcomes = fault_run(zero, optim, &[KILL], None);
        let took = started.elapsed();
        let dead = outcomes[2].as_ref().err().expect("rank 2 dies");
        assert!(
            dead.contains("injected failure: rank 2 killed at step 3"),
            "{dead}"
        );
        let (want_losses, want_params) = reference(zero, optim);
        let tol = tolerance(optim);
        for rank in [0, 1, 3] {
            let s = outcomes[rank]
                .as_ref()
                .unwrap_or_else(|e| panic!("{what}: rank {rank}: {e}"));
            let mut worst = assert_close(
                &format!("{what} rank {rank} losses"),
                &s.losses,
                &want_losses,
                tol,
            );
            assert!(!want_params.is_empty(), "{what}: empty reference");
            assert_eq!(s.params.len(), want_params.len(), "{what}: parameter count");
            for (g, w) in s.params.iter().zip(&want_params) {
                assert_eq!((&g.path, &g.shape), (&w.path, &w.shape), "{what}");
                let c = assert_close(&format!("{what} {}", g.path), &g.values, &w.values, tol);
                worst = worst.max(c);
            }
            assert_eq!(
                s.ranks.len(),
                STEPS,
                "{what}: one committed report per step"
            );
            for (step, ranks) in s.ranks.iter().enumerate() {
                let want: &[usize] = if step < KILL.step {
                    &[0, 1, 2, 3]
                } else {
                    &[0, 1, 3]
                };
                assert_eq!(ranks, want, "{what}: ranks of step {step}");
            }
            assert_eq!(s.recoveries.len(), 1, "{what}");
            let r = &s.recoveries[0];
            assert_eq!(
                (r.step, &r.lost, &r.survivors),
                (3, &vec![2], &vec![0, 1, 3])
            );
            if rank == 0 {
                println!(
                    "{what}: recovered in {:.1} ms ({} bytes pooled), run {took:?}: {worst}",
                    r.seconds * 1e3,
                    r.pooled_bytes
                );
            }
        }
    }
}

#[test]
fn ddp_survives_rank_2_killed_at_step_3() {
    check_kill_rank_2_at_step_3(0);
}

#[test]
fn zero1_survives_rank_2_killed_at_step_3() {
    check_kill_rank_2_at_step_3(1);
}

#[test]
fn zero2_survives_rank_2_killed_at_step_3() {
    check_kill_rank_2_at_step_3(2);
}

#[test]
fn zero3_survives_rank_2_killed_at_step_3() {
    check_kill_rank_2_at_step_3(3);
}

#[test]
fn metrics_lines_name_the_ranks_of_every_step() {
    let dir = tmp("metrics");
    let path = dir.join("metrics.jsonl");
    let outcomes = fault_run(3, OptimizerKind::Sgd, &[KILL], Some(&path));
    assert!(outcomes[0].is_ok());
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), STEPS, "{text}");
    for (step, line) in lines.iter().enumerate() {
        assert_eq!(line["step"], step);
        let want = if step < KILL.step {
            vec![0, 1, 2, 3]
        } else {
            vec![0, 1, 3]
        };
        assert_eq!(line["ranks"], serde_json::json!(want), "step {step}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failure_before_the_first_step_and_a_second_failure_are_survived() {
    // Rank 0 (the metrics writer) dies before step 0; rank 3 at step 5: 4 → 3 → 2 ranks.
    let kills = [KillAt { rank: 0, step: 0 }, KillAt { rank: 3, step: 5 }];
    let started = Instant::now();
    let outcomes = fault_run(2, OptimizerKind::AdamW, &kills, None);
    assert!(started.elapsed() < Duration::from_secs(120));
    assert!(outcomes[0].is_err() && outcomes[3].is_err());
    let a = outcomes[1].as_ref().unwrap();
    let b = outcomes[2].as_ref().unwrap();
    assert_eq!(a.losses, b.losses, "the survivors agree");
    assert_eq!(a.ranks[0], vec![1, 2, 3]);
    assert_eq!(a.ranks[STEPS - 1], vec![1, 2]);
    let lost: Vec<Vec<usize>> = a.recoveries.iter().map(|r| r.lost.clone()).collect();
    assert_eq!(lost, vec![vec![0], vec![3]]);
    assert!(a.losses.iter().all(|l| l.is_finite()));
}

#[test]
fn a_context_tensor_or_pipeline_parallel_layout_is_refused() {
    for (mesh, axis) in [
        ("dp=2,cp=2", "cp=2"),
        ("dp=2,tp=2", "tp=2"),
        ("dp=2,pp=2", "pp=2"),
    ] {
        let err = bonfire_train::fault::check_layout(&dims(mesh, 0))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(axis) && err.contains("fault tolerance needs a pure dp layout"),
            "{err}"
        );
    }
    // HSDP's two groups (shards, replicas) are not re-formed around a dead rank.
    let err = bonfire_train::fault::check_layout(&dims("dp_replicate=2,dp=2", 3))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("dp_replicate=2: fault tolerance re-forms one dp group"),
        "{err}"
    );
}

/// `train` with `args` on the tiny GPT of the MPI steps (`examples/tiny_gpt.args`), 6
/// steps, a 12-row global batch on dp=4.
fn train(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(common::train())
        .args(["--steps", "6", "--batch", "3"])
        .args(include_str!("../tiny_gpt.args").split_whitespace())
        .args(["--sample", "0"])
        .args(args)
        .output()
        .expect("train runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn train_gpt_fault_tolerant_kill_rank_and_refusals() {
    let dir = tmp("train-gpt");
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = dir.join("m.jsonl");
    let m = metrics.to_str().unwrap();
    let kill = [
        "--mesh",
        "dp=4",
        "--zero",
        "3",
        "--kill-rank",
        "2",
        "--at-step",
        "3",
    ];
    let (ok, text) = train(&[&kill[..], &["--fault-tolerant", "--metrics", m]].concat());
    assert!(ok, "{text}");
    assert!(
        text.contains("rank 2 died: injected failure: rank 2 killed at step 3"),
        "{text}"
    );
    assert!(
        text.contains("fault_recovery step=3 lost=[2] survivors=[0, 1, 3]"),
        "{text}"
    );
    assert!(text.contains("fault_buddy commits="), "{text}");
    let ranks: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["ranks"].clone())
        .collect();
    assert_eq!(ranks.len(), 6);
    assert_eq!(ranks[2], serde_json::json!([0, 1, 2, 3]));
    assert_eq!(ranks[3], serde_json::json!([0, 1, 3]));

    // Without --fault-tolerant the job ends with an error naming the dead rank.
    let (ok, text) = train(&kill);
    assert!(!ok, "{text}");
    assert!(
        text.contains("ranks failed:") && text.contains("[rank 2] injected failure: rank 2"),
        "{text}"
    );

    // Layouts and launchers that cannot shrink are refused before anything is built.
    let (ok, text) = train(&["--mesh", "dp=2,tp=2", "--fault-tolerant"]);
    assert!(
        !ok && text.contains("fault tolerance needs a pure dp layout"),
        "{text}"
    );
    let (ok, text) = train(&["--mesh", "dp=4", "--fault-tolerant", "--launcher", "env"]);
    assert!(
        !ok && text.contains("under mpirun a communicator cannot shrink"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_and_its_buddy_dying_together_loses_zero_state_but_not_ddp_state() {
    // Rank 1 keeps rank 2's copy: both die at step 3, before the next commit.
    let kills = [KillAt { rank: 1, step: 3 }, KillAt { rank: 2, step: 3 }];
    let zero = fault_run(2, OptimizerKind::AdamW, &kills, None);
    for rank in [0, 3] {
        let err = zero[rank]
            .as_ref()
            .err()
            .expect("ZeRO's shards of rank 2 are lost");
        assert!(
            err.contains("rank 2 and rank 1, which kept the copy of its state, both failed"),
            "{err}"
        );
    }
    // Under DDP only dp rank 0's copy matters (every replica is whole): the run goes on.
    let ddp = fault_run(0, OptimizerKind::AdamW, &kills, None);
    let s = ddp[0].as_ref().unwrap();
    assert_eq!(s.ranks[STEPS - 1], vec![0, 3]);
    assert_eq!(s.recoveries[0].lost, vec![1, 2]);
}
