//! The head and its loss as one node by blocks of rows (`with_fused_loss`,
//! `bonfire_kernels::linear_cross_entropy`) trains as the unfused head does: the Llama 3.2
//! shape's tied head, Llama 3's untied one and Qwen3-MoE's (the Mixtral model, its balance term
//! beside the loss, under expert parallelism too) against transformers' float64 runs (their
//! fixtures, no Bonfire code computed them), and the GPT against its own unfused run on one
//! device, with SGD and AdamW — in blocks that do not divide the rows (the last one short),
//! on one device, under DDP, ZeRO-3 (the head's weight gathered for the node, with and
//! without activation checkpointing, whose pieces end in the fused head too), HSDP, ZeRO-1
//! with offload and on a pipeline's last stage (the head piece makes the loss itself,
//! `Pipeline::with_head_loss`: 1F1B; for the GPT also ZB-H1, whose forwards defer the other
//! layers' weight gradients, and ZB-V, whose last stage sits on the first rank); and where
//! the head is sharded (tp, loss parallelism), the unfused head it falls back to.

mod common;

use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_models::Gpt;
use bonfire_train::OptimizerKind;
use common::{F64, layout};

/// Rows a block: 3 divides neither fixture's rows (4 × 8 = 32 a step) nor the GPT's.
const ROWS: usize = 3;

/// Every layout class the fused head runs in, and those it leaves to the unfused head.
fn layouts() -> Vec<LayoutArgs> {
    vec![
        layout("dp=1", 0, None, None, ""),
        layout("dp=2", 0, None, None, ""),
        layout("dp=2", 3, None, None, ""),
        layout("dp=2", 3, None, None, "ac"),
        layout("dp=2", 1, None, None, "offload"),
        layout("dp_replicate=2,dp=2", 3, None, None, ""),
        layout("tp=2", 0, None, None, ""),
        layout("tp=2", 0, None, None, "lp"),
        layout("pp=2", 0, Some("1f1b"), Some(2), ""),
    ]
}

/// `family`'s fixture with the fused head, in every layout of [`layouts`], against
/// transformers' run (the tolerances of `families.rs`).
fn against_transformers(family: &str) {
    let name = format!("families/{family}");
    let (_, model, batches) = common::llama_fixture(&name);
    let rows = batches.batch * batches.seq;
    assert!(
        !rows.is_multiple_of(ROWS),
        "{family}: the last block should be short"
    );
    let model = model.with_fused_loss(ROWS);
    let tol = |optim, lr, _: &bonfire_layout::ParallelDims| match optim {
        OptimizerKind::AdamW => common::adamw(lr),
        OptimizerKind::Sgd => F64,
    };
    let worst = common::against_fixture(&name, &model, &batches, &layouts(), tol);
    println!(
        "{family} fused head, sgd, adamw vs transformers: {} {}",
        worst[0], worst[1]
    );
}

#[test]
fn a_tied_fused_head_matches_transformers() {
    let (_, model, _) = common::llama_fixture("families/llama32");
    assert!(model.lm_head.is_none(), "llama32: a tied head");
    against_transformers("llama32");
}

#[test]
fn an_untied_fused_head_matches_transformers() {
    let (_, model, _) = common::llama_fixture("families/llama3");
    assert!(model.lm_head.is_some(), "llama3: its own head");
    against_transformers("llama3");
}

/// The GPT with the fused head equals its unfused run on one device (the suites' parity
/// tolerances) in every layout class above.
#[test]
fn the_gpt_with_a_fused_head_trains_as_the_unfused_one() {
    let cfg = common::gpt_cfg();
    let model = common::seeded(3, &default_device(), |d| Gpt::new(&cfg, d));
    let suite = common::Suite::new(model.clone(), common::random_batches(&cfg, 3, 8, 7), 3);
    let mut layouts = layouts();
    layouts.extend([
        layout("pp=2", 0, Some("zb-h1"), Some(2), ""),
        layout("pp=2", 0, Some("zb-v"), Some(2), ""),
    ]);
    suite.check_model("fused head ", &model.with_fused_loss(ROWS), &layouts);
}

/// Qwen3-MoE through the Mixtral model (the cross-entropy by blocks, the balance term added to
/// it): one device, DDP × ep = 2 with ZeRO-1, ZeRO-3, tp = 2 and a pipeline, against
/// transformers (AdamW within `families.rs`' floor for this model, 5e-3·lr).
#[test]
fn a_mixture_of_experts_fused_head_matches_transformers() {
    use bonfire_models::ModelConfig;
    use bonfire_models::mixtral::{Mixtral, pretrained};
    let dir = common::fixture_dir("qwen3_moe");
    let ModelConfig::Mixtral(cfg) = ModelConfig::load(&dir.join("config.json")).unwrap() else {
        panic!("qwen3_moe: a mixture-of-experts config");
    };
    let model = pretrained::load_pretrained(Mixtral::new(&cfg, &default_device()), &dir).unwrap();
    let batches = bonfire_models::data::load_batches(dir.join("batch.safetensors"), 64, 8).unwrap();
    assert!(
        !(batches.batch * batches.seq).is_multiple_of(ROWS),
        "the last block should be short"
    );
    let model = model.with_fused_loss(ROWS);
    let layouts = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2,ep=2", 1, None, None, ""),
        layout("dp=2", 3, None, None, ""),
        layout("tp=2", 0, None, None, ""),
        layout("pp=2", 0, Some("1f1b"), Some(2), ""),
    ];
    let tol = |optim, lr: f64, _: &bonfire_layout::ParallelDims| match optim {
        OptimizerKind::AdamW => bonfire_comm::testing::Tolerance::new(1e-5, 5e-3 * lr as f32),
        OptimizerKind::Sgd => F64,
    };
    let worst = common::against_fixture("qwen3_moe", &model, &batches, &layouts, tol);
    println!(
        "qwen3_moe fused head, sgd, adamw vs transformers: {} {}",
        worst[0], worst[1]
    );
}
