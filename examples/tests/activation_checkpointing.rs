//! Activation checkpointing leaves training unchanged, in any layout: with the GPT's
//! transformer blocks recomputed in backward — every block, or every second one — losses,
//! step-0 gradients and parameters after a few steps equal the same layout without
//! checkpointing (to the last bit: the same operations run on the same values), and one
//! device (the parity tolerance), under SGD and AdamW: DDP, ZeRO-1, ZeRO-3, tp=2 with
//! sequence parallelism, 1F1B, interleaved and zero-bubble pipelines, dp × pp with ZeRO-2,
//! dp × tp with ZeRO-3, the whole mesh; and under bf16 compute. The regions do run again in
//! backward; a model that names no checkpointable layer is refused before anything is built.

mod common;

use bonfire_comm::testing::Tolerance;
use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_examples::harness;
use bonfire_layout::{LayoutError, MixedPrecision, ParallelDims, Recompute};
use bonfire_models::data::Batches;
use bonfire_models::{Gpt, GptConfig};
use bonfire_parallel::ParallelModel;
use bonfire_train::parity::{Outcome, RankRecord};
use bonfire_train::{OptimizerKind, Trainer};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::Tensor;
use std::sync::OnceLock;
use std::time::Instant;

const STEPS: usize = 2;
const ROWS: usize = 8;
const OPTIMIZERS: [OptimizerKind; 2] = [OptimizerKind::Sgd, OptimizerKind::AdamW];

/// Checkpointing against the same layout without it: the same operations on the same
/// values, so no difference at all (the issue asks for 1e-6 relative).
const SAME: Tolerance = Tolerance::new(0.0, 0.0);

/// 4 heads, 4 blocks (6 pipeline pieces): tp=2, pp=2 with two blocks per stage.
fn cfg() -> GptConfig {
    GptConfig {
        n_layers: 4,
        ..common::gpt_cfg()
    }
}

struct Fixture {
    model: Gpt,
    batches: Batches,
    /// One device, no checkpointing, per optimizer.
    reference: [Outcome; 2],
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let cfg = cfg();
        let model = common::seeded(3, &default_device(), |d| Gpt::new(&cfg, d));
        let batches = common::random_batches(&cfg, STEPS, ROWS, 7);
        let reference = OPTIMIZERS.map(|optim| {
            let dims = ParallelDims::new();
            common::train_layout(&model, &batches, &dims, optim, STEPS)
        });
        Fixture {
            model,
            batches,
            reference,
        }
    })
}

/// `flags`: `sp` (space separated).
fn layout(mesh: &str, zero: usize, schedule: Option<&str>, flags: &str) -> LayoutArgs {
    common::layout(mesh, zero, schedule, schedule.map(|_| 2), flags)
}

/// Each case without checkpointing equals one device; with every block and every second
/// block checkpointed it equals itself without, and the regions ran again in backward.
fn check(cases: &[LayoutArgs]) {
    let f = fixture();
    for (k, optim) in OPTIMIZERS.into_iter().enumerate() {
        let tol = match optim {
            OptimizerKind::Sgd => common::SGD,
            OptimizerKind::AdamW => common::adamw(common::gpt_lr(optim)),
        };
        let train = |dims: &ParallelDims| {
            let lr = common::gpt_lr(optim);
            harness::train_recorded(&f.model, &f.batches, dims, optim, STEPS, lr)
                .unwrap_or_else(|e| panic!("{dims} {}: {e}", optim.name()))
        };
        for case in cases {
            let off = case.dims("dp=1").unwrap();
            let (plain, ranks) = train(&off);
            let what = format!("{off} {}", optim.name());
            let closeness = common::assert_same_run(&what, &plain, &f.reference[k], tol);
            println!("parity {what}: {closeness}");
            // This run's own ranks recomputed nothing, whatever runs beside it.
            let ran: Vec<u64> = ranks.iter().map(|r| r.recomputations).collect();
            assert!(
                ran.iter().all(|&n| n == 0),
                "{what}: {ran:?} recomputations"
            );
            for every in [1, 2] {
                let dims = off.clone().with_recompute(Recompute::Every(every));
                let start = Instant::now();
                let (got, ranks) = train(&dims);
                let what = format!("{dims} {}", optim.name());
                common::assert_same_run(&what, &got, &plain, SAME);
                assert_recomputed(&what, &dims, every, &ranks);
                println!("{what}: identical, {:?}", start.elapsed());
            }
        }
    }
}

/// Each checkpointed block recomputed exactly once per micro-batch and step by each of its
/// replicas (the dp × tp ranks of its pipeline stage), counted on this run's rank threads
/// (`recomputations` counts per thread), every rank taking part.
fn assert_recomputed(what: &str, dims: &ParallelDims, every: usize, ranks: &[RankRecord]) {
    let blocks = cfg().n_layers.div_ceil(every);
    let replicas = dims.world_size() / dims.pp();
    let want = replicas * blocks * STEPS * dims.microbatches();
    let ran: Vec<u64> = ranks.iter().map(|r| r.recomputations).collect();
    assert_eq!(ran.len(), dims.world_size(), "{what}: one record per rank");
    assert!(ran.iter().all(|&n| n > 0), "{what}: {ran:?} recomputations");
    let total: u64 = ran.iter().sum();
    assert_eq!(total, want as u64, "{what}: {ran:?} recomputations");
    println!("{what}: {ran:?} recomputations per rank");
}

#[test]
fn data_parallel_and_zero_with_checkpointing() {
    check(&[
        layout("dp=2", 0, None, ""),
        layout("dp=2", 1, None, ""),
        layout("dp=2", 3, None, ""),
    ]);
}

#[test]
fn tensor_parallel_with_checkpointing() {
    check(&[layout("tp=2", 0, None, "sp")]);
}

#[test]
fn pipelines_with_checkpointing() {
    check(&[
        layout("pp=2", 0, Some("1f1b"), ""),
        layout("dp=2,pp=2", 2, Some("1f1b"), ""),
        // Two chunks per rank: the blocks are counted over the model, not per stage.
        layout("pp=2", 0, Some("interleaved"), ""),
        layout("pp=2", 0, Some("zb-v"), ""),
    ]);
}

#[test]
fn the_whole_mesh_with_checkpointing() {
    check(&[layout("dp=2,tp=2,pp=2", 3, Some("zb"), "sp")]);
}

/// Under bf16 compute (fp32 master weights) checkpointing changes nothing either.
#[test]
fn mixed_precision_with_checkpointing() {
    let f = fixture();
    for case in [layout("dp=2", 0, None, ""), layout("dp=2", 3, None, "")] {
        let off = case
            .dims("dp=1")
            .unwrap()
            .with_precision(MixedPrecision::bf16());
        let on = off.clone().with_recompute(Recompute::Every(1));
        let optim = OptimizerKind::AdamW;
        let [(plain, _), (got, ranks)] = [&off, &on].map(|dims| {
            harness::train_recorded(
                &f.model,
                &f.batches,
                dims,
                optim,
                STEPS,
                common::gpt_lr(optim),
            )
            .unwrap()
        });
        common::assert_same_run(&format!("{on}"), &got, &plain, SAME);
        assert_recomputed(&format!("{on}"), &on, 1, &ranks);
    }
}

#[test]
fn data_and_tensor_parallel_zero3_with_checkpointing() {
    check(&[layout("dp=2,tp=2", 3, None, "")]);
}

/// A plain Burn model: a loss and nothing else, so no checkpointable layer.
#[derive(Module, Debug)]
struct Regressor {
    linear: Linear,
}

impl ParallelModel for Regressor {
    type Batch = (Tensor<2>, Tensor<2>);
    fn loss(&self, (x, y): Self::Batch) -> Tensor<1> {
        (self.linear.forward(x) - y).powi_scalar(2).mean()
    }
}

#[test]
fn checkpointing_a_model_without_checkpointable_layers_is_a_layout_error() {
    let device = default_device();
    let model = common::seeded(0, &device, |d| Regressor {
        linear: LinearConfig::new(4, 1).init(d),
    });
    let batch = (Tensor::ones([4, 4], &device), Tensor::ones([4, 1], &device));
    let dims = ParallelDims::parse_mesh("dp=2")
        .unwrap()
        .with_recompute(Recompute::Every(1));
    let trainer = Trainer::new(dims.clone(), || OptimizerKind::Sgd.build());
    let error = trainer.check(&model, 2, &batch).unwrap_err();
    assert!(matches!(error, LayoutError::Recompute { .. }), "{error:?}");
    assert!(
        error.to_string().contains("names no checkpointable layer"),
        "{error}"
    );
    // The GPT names its blocks: the same layout passes.
    let f = fixture();
    let first = f.batches.rows(0, 0, ROWS, &device);
    Trainer::new(dims, || OptimizerKind::Sgd.build())
        .check(&f.model, 2, &first)
        .unwrap();
}
