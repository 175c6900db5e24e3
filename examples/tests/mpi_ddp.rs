//! DDP with ranks as MPI processes equals single-device training: 2 processes, SGD, 3 steps,
//! losses and parameters within 1e-5 relative (absolute floor 1e-7), like the thread tests.
//!
//! Run with `cargo test -p bonfire-examples --features mpi --test mpi_ddp`: the test binary
//! re-launches itself under `mpirun -np 2` and reports SKIPPED when `mpirun` is missing.

mod common;

use bonfire_comm::testing::assert_close;
use bonfire_comm::{ReduceOp, World};
use bonfire_ddp::{DdpConfig, DistributedDataParallel};
use bonfire_examples::default_device;
use bonfire_models::{Gpt, GptConfig};
use bonfire_module::{DataParallel, params};
use burn::optim::SgdConfig;
use common::*;
use std::process::Command;

const STEPS: usize = 3;
const LR: f64 = 0.5;

fn main() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none() {
        launch();
    } else {
        rank();
    }
}

/// Outside MPI: start 2 copies of this binary under mpirun.
fn launch() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        // CI must run every suite: a missing mpirun fails there instead of passing unseen.
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "mpi_ddp: mpirun not found, and CI=true requires this suite to run"
        );
        println!("mpi_ddp: SKIPPED (no mpirun)");
        println!("test result: ok. 0 passed; 0 failed; 1 ignored");
        return;
    }
    let exe = std::env::current_exe().expect("test binary path");
    let status = Command::new("mpirun")
        .args(["--oversubscribe", "--timeout", "120", "-np", "2"])
        .arg(exe)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .status()
        .expect("mpirun");
    assert!(status.success(), "mpi_ddp failed: {status}");
    println!("mpi_ddp: ok (2 MPI processes match single-device training)");
    println!("test result: ok. 1 passed; 0 failed; 0 ignored");
}

/// One MPI process: DDP over the world, and the single-device reference on the same data.
fn rank() {
    let world = World::from_env().expect("MPI world");
    let pg = world.group().clone();
    assert_eq!(pg.size(), 2);
    let cfg = GptConfig::tiny();
    let device = default_device();
    // Every process draws its own initial values; take rank 0's so the reference matches.
    let model = bonfire_module::params::seeded(29, &device, |d| Gpt::new(&cfg, d));
    let infos = params::inventory(&model);
    let mut flat = params::flatten_values(&model, &infos);
    pg.broadcast(&mut flat, 0).unwrap();
    let model = params::assign_values(model, &infos, &flat);
    let batches = random_batches(&cfg, STEPS, 8, 13);
    let reference = single_device(&model, &batches, STEPS, LR, SgdConfig::new().init());

    let mut ddp = DistributedDataParallel::new(
        model,
        SgdConfig::new().init(),
        pg.clone(),
        DdpConfig::new().with_bucket_bytes(2048),
    )
    .unwrap();
    let mut losses = Vec::new();
    for s in 0..STEPS {
        let (ids, targets) = batches.rows(s, pg.rank() * 4, 4, &device);
        let local = ddp.train_step(LR, |m| m.loss(ids, targets)).unwrap();
        let mut global = [local];
        pg.all_reduce(&mut global, ReduceOp::Avg).unwrap();
        losses.push(global[0]);
    }
    let trained = params::flatten_values(ddp.model(), &params::inventory(ddp.model()));
    assert_close("losses", &losses, &reference.losses, SGD);
    assert_close("params", &trained, &reference.params, SGD);
    pg.barrier().unwrap();
    if pg.rank() == 0 {
        println!("rank 0: {STEPS} DDP steps over MPI match single-device training");
    }
}
