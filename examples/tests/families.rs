//! The Llama-family models beyond the Llama against Hugging Face transformers in float64
//! (`fixtures/families/`, written by its `generate.py`; no Bonfire code computed it): Llama 3's
//! RoPE scaling (`rope_type: llama3`, its three frequency bands) with an explicit head width,
//! Mistral without a sliding window (v0.2/v0.3), Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm with an explicit head width. Each loads
//! from its `config.json` and `model.safetensors` as `save_pretrained` wrote them; the logits
//! of a batch, and 2 steps of SGD and of AdamW — every loss, step-0 gradient and parameter —
//! equal transformers' on one device and in a layout of each class: DDP, ZeRO-3, tp = 2 with
//! sequence parallelism (biases sharded with their columns; the q/k norms' gradients summed
//! over tp), tp = 4 over 2 kv heads (kv projections and norms whole on every rank), a
//! pipeline, cp = 2 (ring attention), HSDP, and dp × tp × cp. Tied embeddings (a Llama 3.2
//! shape: the head is the embedding table, one parameter) in every layout class, pipelines
//! included (the first stage owns the table, the last borrows it each step). Exported with
//! `save_pretrained`, each has the fixture's tensors, names and shapes and its config reads back
//! as the same model; with `BONFIRE_KEEP_EXPORT=DIR` the exports and their logits are left in
//! `DIR/<family>` for transformers' `AutoModelForCausalLM` (`fixtures/llama/check_export.py`,
//! the gate's `clients` step).

mod common;

use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_models::data;
use bonfire_models::llama::Family;
use bonfire_train::OptimizerKind;
use common::{F64, layout};

/// Every layout class.
fn all_layouts() -> Vec<LayoutArgs> {
    vec![
        layout("dp=1", 0, None, None, ""),
        layout("dp=2", 0, None, None, ""),
        layout("dp=2", 3, None, None, ""),
        layout("tp=2", 0, None, None, "sp"),
        layout("tp=4", 0, None, None, "lp"),
        layout("pp=2", 0, Some("1f1b"), Some(2), ""),
        layout("cp=2", 0, None, None, ""),
        layout("dp_replicate=2,dp=2", 2, None, None, ""),
        layout("dp=2,cp=2,tp=2", 1, None, None, "sp"),
    ]
}

/// `family`'s fixture: logits, then every layout of `layouts` against transformers' run.
fn check(family: &str, want: Family, layouts: &[LayoutArgs]) {
    let name = format!("families/{family}");
    let (cfg, model, batches) = common::llama_fixture(&name);
    assert_eq!(cfg.variant.family, want, "{family}: its model_type");
    // AdamW divides each gradient element by its running RMS: an element whose gradient is
    // near ε turns f32's error of the float64 gradient into a step difference — on one device
    // too here (measured 1.1e-6 on the Llama 3 fixture, 1.9e-6 on the Qwen3 one, where F64
    // allows 1.0e-6): parameters after AdamW within the suites' AdamW floor, 2e-3·lr.
    let tol = |optim, lr, _: &bonfire_layout::ParallelDims| match optim {
        OptimizerKind::AdamW => common::adamw(lr),
        OptimizerKind::Sgd => F64,
    };
    let worst = common::against_fixture(&name, &model, &batches, layouts, tol);
    println!(
        "{family} sgd, adamw vs transformers: {} {}",
        worst[0], worst[1]
    );
    // A run saved under DDP with ZeRO-1 resumes under tp = 2 (4 steps of random batches).
    let shape = bonfire_models::GptConfig {
        vocab_size: cfg.vocab_size,
        max_seq_len: 8,
        ..common::gpt_cfg()
    };
    let four = common::random_batches(&shape, 4, 4, 19);
    let dims = |mesh: &str, zero| layout(mesh, zero, None, None, "").dims("dp=1").unwrap();
    let (a, b) = (dims("dp=2", 1), dims("tp=2", 0));
    let adamw = common::adamw(common::gpt_lr(OptimizerKind::AdamW));
    common::resume::check_resume(family, &model, &four, 4, (&a, &b), 4, 2, adamw);
    let reads_back = |path: &std::path::Path| {
        let back = bonfire_models::llama::LlamaConfig::load(path).unwrap();
        assert_eq!(back, cfg, "{family}: the exported config");
    };
    let logits = |ids| model.forward(ids);
    let json = cfg.to_json();
    let files = format!("{name}/model.safetensors");
    common::export::export(
        family,
        (&model, &json),
        &files,
        reads_back,
        logits,
        &batches,
    );
}

#[test]
fn llama3_rope_scaling_matches_transformers_in_every_layout_class() {
    check("llama3", Family::Llama, &all_layouts());
}

#[test]
fn qwen2_biases_match_transformers_in_every_layout_class() {
    check("qwen2", Family::Qwen2, &all_layouts());
}

#[test]
fn mistral_without_a_window_matches_transformers_in_every_layout_class() {
    check("mistral", Family::Mistral, &all_layouts());
}

/// Mistral with a sliding window of 3 over 8 positions: the fused attention skips the keys
/// before each window; under cp = 2 (chunks of 2) the window crosses chunks and ranks, ring
/// attention computing only the chunk pairs it reaches.
#[test]
fn mistral_sliding_window_matches_transformers_in_every_layout_class() {
    check("mistral_window", Family::Mistral, &all_layouts());
}

#[test]
fn qwen3_qk_norms_match_transformers_in_every_layout_class() {
    check("qwen3", Family::Qwen3, &all_layouts());
}

/// A tied head (Llama 3.2's shape): one parameter whose gradient sums the embedding's and the
/// head's use, in every layout class (ZeRO-3 gathers the table a second time for the head;
/// under tp ± SP each rank's vocabulary shard is also its head's, the logits gathered — or
/// kept sharded under loss parallelism); with activation checkpointing (the head piece
/// borrows the embedding's table: on one rank the same parameter); under every pipeline
/// schedule the first stage owns the table and lends it to the last each step, which hands
/// its gradient back (`bonfire_module::tied`) — on another rank (1F1B, GPipe, interleaved,
/// ZB-H1; with ZeRO-3, whose surrogate backward reduce-scatters it; with tp's shards; with cp)
/// or on the same one (ZB-V). A run saved under pp = 2 × dp = 2 resumes under tp = 2.
#[test]
fn tied_embeddings_match_transformers_in_every_layout_class() {
    let supported = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2", 0, None, None, ""),
        layout("dp=2", 1, None, None, "offload"),
        layout("dp=2", 3, None, None, ""),
        layout("cp=2", 0, None, None, ""),
        layout("dp_replicate=2,dp=2", 3, None, None, ""),
        layout("tp=2", 0, None, None, ""),
        layout("tp=4", 0, None, None, "sp"),
        layout("tp=2", 0, None, None, "lp"),
        layout("dp=2,tp=2", 3, None, None, "sp"),
        layout("dp=2,tp=2", 1, None, None, "sp,lp"),
        layout("dp=2,cp=2,tp=2", 1, None, None, ""),
        layout("dp=1", 0, None, None, "ac"),
        layout("dp=2", 3, None, None, "ac"),
        layout("dp=2,tp=2", 1, None, None, "sp,lp,ac"),
        layout("pp=2", 0, Some("1f1b"), Some(2), ""),
        layout("pp=2", 0, Some("gpipe"), Some(2), "ac"),
        layout("pp=2", 0, Some("interleaved"), Some(2), ""),
        layout("pp=2", 0, Some("zb-h1"), Some(2), ""),
        layout("pp=2", 0, Some("zb-v"), Some(2), ""),
        layout("pp=2,dp=2", 3, Some("1f1b"), Some(2), ""),
        layout("pp=2,tp=2", 0, Some("1f1b"), Some(2), "sp,lp"),
        layout("pp=2,cp=2", 1, Some("1f1b"), Some(2), ""),
        layout("pp=2,dp=2,tp=2", 2, Some("interleaved"), Some(2), "sp"),
    ];
    check("llama32", Family::Llama, &supported);
    let (cfg, model, _) = common::llama_fixture("families/llama32");
    assert!(model.lm_head.is_none(), "tied: no lm_head");
    let shape = bonfire_models::GptConfig {
        vocab_size: cfg.vocab_size,
        max_seq_len: 8,
        ..common::gpt_cfg()
    };
    let four = common::random_batches(&shape, 4, 4, 19);
    let a = layout("pp=2,dp=2", 1, Some("1f1b"), Some(2), "");
    let b = layout("tp=2", 0, None, None, "");
    let (a, b) = (a.dims("dp=1").unwrap(), b.dims("dp=1").unwrap());
    let adamw = common::adamw(common::gpt_lr(OptimizerKind::AdamW));
    common::resume::check_resume("llama32-pp", &model, &four, 4, (&a, &b), 4, 2, adamw);
}

/// Each new layer kind against plain Burn (`common::plain_llama`: the family's math in Burn
/// tensor ops on the same parameters, Burn's backward and optimizers — no Bonfire code): Llama
/// 3's RoPE scaling, Qwen2's biases, Qwen3's q/k norms, Mistral's sliding window and the tied
/// head, each fixture's model trained 2 steps with SGD and AdamW by plain Burn and by Bonfire
/// on one device and in one layout per axis it admits (DDP with ZeRO-1, tp = 2 with SP, a
/// 1F1B pipeline, cp = 2): every loss, step-0 gradient and parameter
/// within the suites' tolerances (SGD's; AdamW's floor 2e-3·lr).
#[test]
fn new_layer_kinds_train_as_plain_burn_does() {
    use common::plain_llama::plain_llama_loss;
    let axes = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2", 1, None, None, ""),
        layout("tp=2", 0, None, None, "sp"),
        layout("pp=2", 0, Some("1f1b"), Some(2), ""),
        layout("cp=2", 0, None, None, ""),
    ];
    for family in ["llama3", "qwen2", "qwen3", "mistral_window", "llama32"] {
        let (cfg, model, batches) = common::llama_fixture(&format!("families/{family}"));
        common::plain::against_plain(family, &model, &batches, &axes, 2e-3, |m, ids, targets| {
            plain_llama_loss(m, &cfg, ids, targets)
        });
    }
}

/// Qwen3-MoE's router (top k without renormalization) and its dense layers against plain
/// Burn (`common::plain_llama::plain_moe_loss`: every expert on every token, weighted; the
/// balance written out), both fixtures, SGD and AdamW, on one device, dp = 2 × ep = 2 ZeRO-1,
/// tp = 2, a 1F1B pipeline and cp = 2 × ep = 2.
#[test]
fn qwen3_moe_trains_as_plain_burn_does() {
    use bonfire_models::ModelConfig;
    use bonfire_models::mixtral::{Mixtral, pretrained as moe};
    let axes = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2,ep=2", 1, None, None, ""),
        layout("tp=2", 0, None, None, ""),
        layout("pp=2", 0, Some("1f1b"), Some(2), ""),
        layout("cp=2,ep=2", 0, None, None, ""),
    ];
    for fixture in ["qwen3_moe", "qwen3_moe/dense_layers"] {
        let dir = common::fixture_dir(fixture);
        let ModelConfig::Mixtral(cfg) = ModelConfig::load(&dir.join("config.json")).unwrap() else {
            panic!("a mixture-of-experts config");
        };
        let model = moe::load_pretrained(Mixtral::new(&cfg, &default_device()), &dir).unwrap();
        let batches = data::load_batches(dir.join("batch.safetensors"), 64, 8).unwrap();
        // AdamW as against transformers on these fixtures (`check_moe`).
        common::plain::against_plain(fixture, &model, &batches, &axes, 5e-3, |m, ids, targets| {
            common::plain_llama::plain_moe_loss(m, &cfg, ids, targets)
        });
    }
}

/// A Qwen3-MoE fixture (`fixtures/<fixture>/`) loaded from the published per-expert names
/// (`mlp.experts.j.gate_proj.weight` …, folded into the fused tensors: equal to loading the
/// fused `state_dict`): its logits and balance term equal transformers', and it trains equal to
/// transformers' run in each of `layouts`; a run saved at dp = 2 × ep = 2 resumes on one
/// device; exported (as `name` under `BONFIRE_KEEP_EXPORT`), its config reads back and the
/// tensors are the fused `state_dict`'s.
fn check_moe(fixture: &str, name: &str, layouts: &[LayoutArgs]) -> bonfire_models::MixtralConfig {
    use bonfire_models::ModelConfig;
    use bonfire_models::mixtral::{Mixtral, balance, pretrained as moe};
    let dir = common::fixture_dir(fixture);
    let ModelConfig::Mixtral(cfg) = ModelConfig::load(&dir.join("config.json")).unwrap() else {
        panic!("a mixture-of-experts config");
    };
    let device = default_device();
    let model = moe::load_pretrained(Mixtral::new(&cfg, &device), &dir).unwrap();
    let fused = bonfire_models::weights::load(
        Mixtral::new(&cfg, &device),
        dir.join("state_dict.safetensors"),
    )
    .unwrap();
    let flat = |m: &Mixtral| {
        bonfire_module::params::flatten_values(m, &bonfire_module::params::inventory(m))
    };
    assert_eq!(flat(&model), flat(&fused), "per-expert and fused files");
    let batches = data::load_batches(dir.join("batch.safetensors"), 64, 8).unwrap();
    let want = common::fixture_reference(fixture);
    let (ids, _) = batches.rows(0, 0, batches.batch, &device);
    let (logits, routing) = model.forward_routed(ids);
    let bal = balance(&routing).into_data().try_to_vec::<f32>().unwrap();
    let logits = logits.into_data().try_to_vec::<f32>().unwrap();
    let c = bonfire_comm::testing::assert_close("balance", &bal, &want["balance"], F64).max(
        bonfire_comm::testing::assert_close("logits", &logits, &want["logits"], F64),
    );
    println!("{fixture} logits and balance vs transformers: {c}");
    // AdamW's floor 5e-3·lr (the dense families' 2e-3·lr): Adam's step moves by
    // lr·ε/(|g|+ε)² per unit of gradient error, and this model has elements whose gradient
    // cancels to ≈ ε (vocabulary rows its 32 tokens a step rarely reach, the idle expert's
    // first tokens): f32's error there is measured 3.1e-5 on one device, 3.3e-5 at most over
    // the layouts (fitted on `qwen3_moe`: 1.5× that), while SGD, the same gradients taken as
    // they are, stays within 1.2e-7 of transformers.
    let floor = |lr: f64| bonfire_comm::testing::Tolerance::new(1e-5, 5e-3 * lr as f32);
    let tol = |optim, lr: f64, _: &bonfire_layout::ParallelDims| match optim {
        OptimizerKind::Sgd => F64,
        OptimizerKind::AdamW => floor(lr),
    };
    let worst = common::against_fixture(fixture, &model, &batches, layouts, tol);
    println!(
        "{fixture} sgd, adamw vs transformers: {} {}",
        worst[0], worst[1]
    );
    let dims = |mesh: &str| layout(mesh, 0, None, None, "").dims("dp=1").unwrap();
    let shape = bonfire_models::GptConfig {
        vocab_size: 64,
        max_seq_len: 8,
        ..common::gpt_cfg()
    };
    let four = common::random_batches(&shape, 4, 4, 17);
    // The resume under this model's AdamW floor too (the dense suites' 2e-3·lr was 1.15× short
    // on an AVX2-only CPU: 2.3e-5 on `qwen3_moe`, the same cancelling elements as above).
    let adamw = floor(common::gpt_lr(OptimizerKind::AdamW));
    let (a, b) = (dims("dp=2,ep=2"), dims("dp=1"));
    common::resume::check_resume(fixture, &model, &four, 4, (&a, &b), 4, 2, adamw);
    let reads_back = |path: &std::path::Path| {
        let back = bonfire_models::mixtral::MixtralConfig::load(path).unwrap();
        assert_eq!(back, cfg, "{fixture}: the exported config");
    };
    let logits = |ids| model.forward(ids);
    let json = cfg.to_json();
    let files = format!("{fixture}/state_dict.safetensors");
    common::export::export(name, (&model, &json), &files, reads_back, logits, &batches);
    cfg
}

/// Qwen3-MoE (`fixtures/qwen3_moe/`): Qwen3's q/k norms and explicit head width with the
/// Mixtral's experts, routed top 2 of 4 without renormalization (`norm_topk_prob: false`),
/// expert 3 of layer 0 idle, in a layout of each class: ep over dp with ZeRO-1 and ZeRO-3,
/// HSDP with ep, tp = 2, a pipeline, cp = 2 with ep, dp × cp × tp ([`check_moe`]).
#[test]
fn qwen3_moe_matches_transformers_in_every_layout_class() {
    let layouts = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2,ep=2", 1, None, None, ""),
        layout("dp=4,ep=4", 3, None, None, ""),
        layout("dp_replicate=2,dp=2,ep=2", 2, None, None, ""),
        layout("tp=2", 0, None, None, ""),
        layout("pp=2", 0, Some("1f1b"), Some(2), ""),
        layout("cp=2,ep=2", 0, None, None, ""),
        layout("dp=2,cp=2,tp=2", 1, None, None, ""),
    ];
    let cfg = check_moe("qwen3_moe", "qwen3_moe", &layouts);
    assert_eq!(
        cfg.family,
        bonfire_models::mixtral::config::MoeFamily::Qwen3Moe
    );
    assert!(!cfg.norm_topk_prob && cfg.base.variant.qk_norm);
    assert_eq!((cfg.base.intermediate_size, cfg.base.head_dim), (24, 12));
}

/// Qwen3-MoE with a dense layer among the sparse ones (`fixtures/qwen3_moe/dense_layers/`: 3
/// layers, `mlp_only_layers: [1]` — a SwiGLU MLP of width 40 under transformers' names,
/// `mlp.gate_proj` …; the balance over the 2 sparse layers): every layout class, the dense
/// MLP split over tp as the Llama's, a pipeline whose stages mix dense and sparse layers, ep
/// over the sparse layers only ([`check_moe`]).
#[test]
fn qwen3_moe_dense_layers_match_transformers_in_every_layout_class() {
    let layouts = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2,ep=2", 3, None, None, ""),
        layout("dp_replicate=2,dp=2,ep=2", 1, None, None, ""),
        layout("tp=2", 0, None, None, "lp"),
        layout("pp=2", 0, Some("interleaved"), Some(4), ""),
        layout("pp=3", 0, Some("1f1b"), Some(2), ""),
        layout("cp=2,ep=2", 0, None, None, ""),
        layout("dp=2,cp=2,tp=2", 1, None, None, ""),
    ];
    let cfg = check_moe("qwen3_moe/dense_layers", "qwen3_moe_dense", &layouts);
    assert_eq!(cfg.mlp_only_layers, [1]);
    assert!(cfg.is_sparse(0) && !cfg.is_sparse(1) && cfg.is_sparse(2));
}

/// The parity harness trains the Qwen3-MoE fixture (`--config` with `"model_type":
/// "qwen3_moe"`, `--weights` its fused `state_dict`) under dp = 2 ZeRO-3 and dp = 2 × ep = 2:
/// the result file equals transformers' float64 run.
#[test]
fn the_harness_trains_a_qwen3_moe_checkpoint() {
    let cases = [("dp=2", 3), ("dp=2,ep=2", 0)];
    common::harness_matches_fixture("qwen3_moe", "state_dict.safetensors", &cases);
    let cases = [("dp=2,ep=2", 1)];
    let fixture = "qwen3_moe/dense_layers";
    common::harness_matches_fixture(fixture, "state_dict.safetensors", &cases);
}

/// `train --model` on the Qwen3-MoE directories (the published per-expert names; one with a
/// dense layer) under dp = 2 × tp = 2 ZeRO-3 and dp = 2 × ep = 2 ZeRO-3: each rank reads only
/// its slices, and `--export` writes the fused `state_dict`, value for value.
#[test]
fn train_loads_qwen3_moe_directories_a_slice_per_rank() {
    let _ = common::train_reads_slices_and_exports("qwen3_moe", "dp=2,tp=2", 3);
    let _ = common::train_reads_slices_and_exports("qwen3_moe/dense_layers", "dp=2,ep=2", 3);
}

/// The parity harness trains the dense families' fixtures (`--config` with their
/// `model_type`, `--weights` their `model.safetensors`, transformers' names): Mistral's window
/// under cp = 2 and tp = 2, the tied Llama 3.2 under ZeRO-3, tp = 2 and pp × dp, Qwen3 under dp × tp,
/// Qwen2 and Llama 3 under cp × tp — each result file equal to transformers' float64 run.
#[test]
fn the_harness_trains_the_families_checkpoints() {
    for (family, cases) in [
        ("mistral_window", &[("cp=2", 0), ("tp=2", 0)][..]),
        ("llama32", &[("dp=2", 3), ("tp=2", 0), ("pp=2,dp=2", 1)][..]),
        ("qwen3", &[("dp=2,tp=2", 1)][..]),
        ("qwen2", &[("cp=2,tp=2", 0)][..]),
        ("llama3", &[("cp=2,tp=2", 0)][..]),
    ] {
        let fixture = format!("families/{family}");
        common::harness_matches_fixture(&fixture, "model.safetensors", cases);
    }
}
