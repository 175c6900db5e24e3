//! The Llama against Hugging Face transformers, and in every kind of layout against one
//! device.
//!
//! **transformers, in float64** (`fixtures/llama/`, written by its `generate.py`; no Bonfire
//! code computed it): Bonfire loads the fixture's `config.json` and `model.safetensors` as
//! `save_pretrained` wrote them, computes the logits of a batch, and trains 2 steps with SGD
//! and with AdamW on one device; logits, losses, every step-0 gradient and every parameter
//! after the steps equal transformers' within f32's error of a float64 result.
//!
//! **Layouts** (the GPT's suite, `tests/layouts.rs`, on the Llama: 4 query heads, 2 key/value
//! heads, 4 layers): dp with ZeRO 0–3 (± offload), tp = 2 ± sequence and loss parallelism,
//! every pipeline schedule, their compositions, activation checkpointing — every loss,
//! step-0 gradient and parameter after 3 steps within 1e-5 relative of one device, SGD and
//! AdamW.

mod common;

use bonfire_comm::testing::{Tolerance, assert_close};
use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
#[path = "../examples/gpu_check/checks.rs"]
#[allow(dead_code)]
mod device_checks;
#[path = "../benches/common/throughput.rs"]
#[allow(dead_code)]
mod throughput;
use bonfire_examples::harness;
use bonfire_models::ModelConfig;
use bonfire_models::data;
use bonfire_models::llama::{Llama, LlamaConfig};
use bonfire_models::tensor_file;
use bonfire_models::weights;
use bonfire_train::OptimizerKind;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;

fn fixture_dir() -> PathBuf {
    common::fixture_dir("llama")
}

#[test]
fn transformers_config_and_weights_load() {
    let ModelConfig::Llama(cfg) = ModelConfig::load(&fixture_dir().join("config.json")).unwrap()
    else {
        panic!("a Llama config");
    };
    assert_eq!(
        cfg,
        LlamaConfig {
            rope_theta: 10_000.0,
            ..LlamaConfig::tiny()
        }
    );
    // Every tensor of the file is a parameter and every parameter is in the file.
    weights::load(
        Llama::new(&cfg, &default_device()),
        fixture_dir().join("model.safetensors"),
    )
    .unwrap();
    let other = LlamaConfig {
        intermediate_size: 32,
        ..cfg
    };
    let err = weights::load(
        Llama::new(&other, &default_device()),
        fixture_dir().join("model.safetensors"),
    )
    .unwrap_err();
    assert!(err.contains("mlp.gate_proj"), "{err}");
}

/// One device's AdamW run against transformers' float64 one: `F64`'s relative 1e-5 with an
/// absolute 1.6e-6 (`F64`'s is 1e-6). Measured: within `F64` on the AVX-512 CPUs; 1.25e-6 on
/// an AVX2-only AMD EPYC (Zen 3, 2026-12-06; one element of a `gate_proj`, −0.0045180 against
/// −0.0045193), `gemm`'s AVX2 kernel summing in other blocks; the floor is 1.25× that.
const ONE_DEVICE_ADAMW: Tolerance = Tolerance::new(1e-5, 1.6e-6);

#[test]
fn logits_and_training_match_transformers_in_float64() {
    let (_, model, batches) = common::llama_fixture("llama");
    // One device, then the axes whose suites compare only with Bonfire's one device: context
    // parallelism (cp = 2 over the fixture's 8 tokens, with ZeRO over dp × cp), HSDP, and one
    // composition of three axes — each against transformers' own run.
    let layouts = [
        layout("dp=1", 0, None, None, ""),
        layout("cp=2", 0, None, None, ""),
        layout("dp=2,cp=2", 3, None, None, ""),
        layout("dp_replicate=2,dp=2", 2, None, None, ""),
        layout("dp=2,cp=2,tp=2", 1, None, None, "sp"),
    ];
    // One device within f32's error of float64 (under AdamW an absolute 1.6e-6,
    // [`ONE_DEVICE_ADAMW`]); a distributed layout sums in other orders, which AdamW turns into
    // up to a step on an element whose gradient cancels: its parameters within the suites'
    // AdamW floor.
    let tol = |optim, lr, dims: &bonfire_layout::ParallelDims| match optim {
        OptimizerKind::AdamW if dims.world_size() > 1 => common::adamw(lr),
        OptimizerKind::AdamW => ONE_DEVICE_ADAMW,
        _ => common::F64,
    };
    let worst = common::against_fixture("llama", &model, &batches, &layouts, tol);
    println!("transformers sgd, adamw: {} {}", worst[0], worst[1]);
}

const STEPS: usize = 3;
const ROWS: usize = 8;

/// 4 query heads, 2 kv heads, 4 layers (6 pipeline pieces), seq 8.
fn cfg() -> LlamaConfig {
    LlamaConfig {
        num_hidden_layers: 4,
        ..LlamaConfig::tiny()
    }
}

fn fixture() -> &'static common::Suite<Llama> {
    static F: OnceLock<common::Suite<Llama>> = OnceLock::new();
    F.get_or_init(|| {
        let cfg = cfg();
        let model = common::seeded(5, &default_device(), |d| Llama::new(&cfg, d));
        let shape = bonfire_models::GptConfig {
            vocab_size: cfg.vocab_size,
            max_seq_len: cfg.max_position_embeddings,
            ..common::gpt_cfg()
        };
        common::Suite::new(
            model,
            common::random_batches(&shape, STEPS, ROWS, 11),
            STEPS,
        )
    })
}

use common::layout;

fn check(cases: &[LayoutArgs]) {
    fixture().check("llama ", cases);
}

#[test]
fn data_parallel_with_every_zero_stage() {
    let mut cases: Vec<LayoutArgs> = (0..=3).map(|z| layout("dp=2", z, None, None, "")).collect();
    cases.push(layout("dp=2", 2, None, None, "offload"));
    cases.push(layout("dp=2", 3, None, None, "ac"));
    check(&cases);
}

#[test]
fn tensor_parallel_with_sequence_and_loss_parallelism() {
    let cases: Vec<LayoutArgs> = ["", "sp", "lp", "sp lp ac"]
        .into_iter()
        .map(|flags| layout("tp=2", 0, None, None, flags))
        .collect();
    check(&cases);
}

#[test]
fn pipelines_with_every_schedule() {
    let cases: Vec<LayoutArgs> = ["gpipe", "1f1b", "interleaved", "zb", "zb-v"]
        .into_iter()
        .map(|s| layout("pp=2", 0, Some(s), Some(4), ""))
        .collect();
    check(&cases);
}

#[test]
fn compositions() {
    check(&[
        layout("dp=2,tp=2", 3, None, None, "sp lp"),
        layout("dp=2,pp=2", 1, Some("1f1b"), Some(2), ""),
        layout("tp=2,pp=2", 0, Some("zb"), Some(2), "sp lp"),
        layout("dp=2,tp=2,pp=2", 2, Some("interleaved"), Some(2), "sp ac"),
    ]);
}

/// Context parallelism (every sequence in load-balanced chunks over cp, ring attention):
/// alone (cp = 2, 4), with dp and every ZeRO stage over dp × cp, with tp and SP/LP, with a
/// pipeline, with activation checkpointing, and all together.
#[test]
fn context_parallel_layouts() {
    check(&[
        layout("cp=2", 0, None, None, ""),
        layout("cp=4", 0, None, None, ""),
        layout("dp=2,cp=2", 1, None, None, ""),
        layout("dp=2,cp=2", 3, None, None, "ac"),
        layout("cp=2,tp=2", 0, None, None, "sp lp"),
        layout("pp=2,cp=2", 0, Some("1f1b"), Some(2), ""),
        layout("pp=2,cp=2", 2, Some("zb-v"), Some(2), ""),
        layout("dp=2,cp=2,tp=2", 2, None, None, "sp"),
    ]);
}

/// tp = 4 over 2 key/value heads: the kv projections stay whole on every rank and their
/// gradients are summed over tp (± sequence and loss parallelism, with dp and pp).
#[test]
fn tensor_parallel_beyond_the_kv_heads() {
    check(&[
        layout("tp=4", 0, None, None, ""),
        layout("tp=4", 0, None, None, "sp lp"),
        layout("dp=2,tp=4", 3, None, None, "sp"),
        layout("tp=4,pp=2", 0, Some("1f1b"), Some(2), "lp"),
    ]);
}

/// A tp that neither divides the key/value heads nor is a multiple of them (6 over 4, with
/// 12 query heads) is refused before anything is built, naming the heads.
#[test]
fn tp_that_does_not_fit_the_kv_heads_is_refused() {
    let cfg = LlamaConfig {
        hidden_size: 48,
        num_attention_heads: 12,
        num_key_value_heads: 4,
        ..LlamaConfig::tiny()
    };
    let model = common::seeded(19, &default_device(), |d| Llama::new(&cfg, d));
    let dims = layout("tp=6", 0, None, None, "").dims("dp=1").unwrap();
    let batch = fixture().batches.rows(0, 0, 1, &default_device());
    let err = bonfire_train::Trainer::new(dims, || OptimizerKind::Sgd.build())
        .check(&model, 6, &batch)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "tp=6: tp is neither a divisor nor a multiple of num_key_value_heads 4"
    );
}

/// The parity harness's files in and out on a transformers checkpoint: `--config` a
/// Hugging Face `config.json`, `--weights` its `model.safetensors`; in a 4-rank layout the
/// result file holds every parameter under transformers' name, its `grad0.` and the losses,
/// equal to transformers' float64 run.
#[test]
fn the_harness_trains_a_transformers_checkpoint_in_any_layout() {
    let out = std::env::temp_dir().join(format!("bonfire-llama-harness-{}", std::process::id()));
    let layout = LayoutArgs {
        zero: 3,
        sequence_parallel: true,
        loss_parallel: true,
        ..LayoutArgs::mesh("dp=2,tp=2")
    };
    let closeness =
        device_checks::llama_against_transformers(&fixture_dir(), "flex", layout, &out).unwrap();
    println!("{closeness}");
    std::fs::remove_dir_all(out).ok();
}

/// A Hugging Face directory in and out: the fixture (as transformers' `save_pretrained`
/// wrote it) loads as `weights::load` reads it; saved back sharded at 8 KB it is several
/// shards and an index whose map names every parameter once, and loads back bit for bit;
/// saved whole it has exactly the tensors, names and shapes transformers wrote. A file that
/// lacks a parameter, or has a tensor that is none, is refused naming it. With
/// `BONFIRE_KEEP_EXPORT=DIR` the sharded export and the logits of the fixture's first batch
/// (`logits.safetensors`) are left in DIR for `fixtures/llama/check_export.py`.
#[test]
fn hugging_face_directories_round_trip() {
    use bonfire_models::pretrained::{self, INDEX};
    let dir = fixture_dir();
    let cfg = LlamaConfig::load(dir.join("config.json")).unwrap();
    let device = default_device();
    let model = pretrained::load_pretrained(Llama::new(&cfg, &device), &dir).unwrap();
    let infos = bonfire_module::params::inventory(&model);
    let values = bonfire_module::params::flatten_values(&model, &infos);
    let direct = weights::load(Llama::new(&cfg, &device), dir.join("model.safetensors")).unwrap();
    let flat = |m: &Llama| {
        bonfire_module::params::flatten_values(m, &bonfire_module::params::inventory(m))
    };
    assert_eq!(flat(&direct), values);

    let keep = std::env::var_os("BONFIRE_KEEP_EXPORT").map(PathBuf::from);
    let tmp = std::env::temp_dir().join(format!("bonfire-hf-{}", std::process::id()));
    let sharded = keep.clone().unwrap_or_else(|| tmp.join("sharded"));
    let files = pretrained::save_pretrained(&model, &cfg.to_json(), &sharded, 8 << 10).unwrap();
    assert!(files.len() >= 2, "{files:?}");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sharded.join(INDEX)).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), infos.len());
    assert_eq!(
        index["metadata"]["total_size"].as_u64().unwrap() as usize,
        4 * values.len()
    );
    let back = pretrained::load_pretrained(Llama::new(&cfg, &device), &sharded).unwrap();
    assert_eq!(flat(&back), values);
    if keep.is_some() {
        let batches = data::load_batches(dir.join("batch.safetensors"), cfg.vocab_size, 8).unwrap();
        let (ids, _) = batches.rows(0, 0, batches.batch, &device);
        let logits = back.forward(ids.clone());
        let shape = logits.dims().to_vec();
        let mut out = BTreeMap::new();
        out.insert(
            "logits".to_string(),
            (shape, logits.into_data().try_to_vec::<f32>().unwrap()),
        );
        let ids: Vec<f32> = ids.float().into_data().try_to_vec::<f32>().unwrap();
        out.insert("input_ids".to_string(), (vec![batches.batch, 8], ids));
        tensor_file::write_f32(sharded.join("logits.safetensors"), &out).unwrap();
    }

    let whole = tmp.join("whole");
    pretrained::save_pretrained(&model, &cfg.to_json(), &whole, usize::MAX).unwrap();
    let shapes = |p: PathBuf| -> Vec<(String, Vec<usize>)> {
        tensor_file::read(p)
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.shape().to_vec()))
            .collect()
    };
    assert_eq!(
        shapes(whole.join("model.safetensors")),
        shapes(dir.join("model.safetensors"))
    );
    assert!(!whole.join(INDEX).exists());

    // One tensor short, one too many.
    let mut tensors = pretrained::read_weights(&whole).unwrap();
    let (shape, v) = tensors.remove("model.norm.weight").unwrap();
    tensors.insert("model.extra.weight".into(), (shape, v));
    let broken = tmp.join("broken");
    tensor_file::write_f32(broken.join("model.safetensors"), &tensors).unwrap();
    let err = pretrained::load_pretrained(Llama::new(&cfg, &device), &broken).unwrap_err();
    assert!(
        err.contains("missing parameters: model.norm.weight")
            && err.contains("unexpected tensors: model.extra.weight"),
        "{err}"
    );
    let err = pretrained::load_pretrained(Llama::new(&cfg, &device), &tmp).unwrap_err();
    assert!(err.contains("has neither model.safetensors nor"), "{err}");
    std::fs::remove_dir_all(tmp).ok();
}

/// bf16 compute with fp32 master weights, in layouts of every axis, equals bf16 on one
/// device within the GPT suite's bf16 bounds (`tests/mixed_precision.rs`: a few bf16
/// roundings, (1.5e-2, 1.5e-3) without tp and (2e-2, 2e-3) with it, under SGD — fitted on
/// the GPT, held out here), and is nearer that run than the fp32 one.
#[test]
fn bf16_layouts_equal_bf16_on_one_device() {
    let f = fixture();
    let bf16 = |mut l: LayoutArgs| {
        l.precision = Some("bf16".into());
        l.dims("dp=1").unwrap()
    };
    let run = |dims: &bonfire_layout::ParallelDims| {
        harness::train(&f.model, &f.batches, dims, OptimizerKind::Sgd, STEPS, 0.5)
            .unwrap_or_else(|e| panic!("{dims}: {e}"))
    };
    let single = run(&bf16(layout("dp=1", 0, None, None, "")));
    let f32_run = &f.reference[0];
    let gap = |a: &bonfire_train::parity::Outcome, b: &bonfire_train::parity::Outcome| {
        a.params
            .iter()
            .map(|(k, (_, v))| {
                let w = &b.params[k].1;
                v.iter()
                    .zip(w)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f32::max)
            })
            .fold(0.0, f32::max)
    };
    let to_f32 = gap(&single, f32_run);
    assert!(to_f32 > 1e-4, "bf16 is {to_f32} from fp32: not in force");
    for case in [
        layout("dp=2", 1, None, None, ""),
        layout("dp=2", 3, None, None, ""),
        layout("tp=2", 0, None, None, "sp lp"),
        layout("pp=2", 0, Some("zb"), Some(4), ""),
    ] {
        let dims = bf16(case);
        let tol = match dims.tp() {
            1 => Tolerance::new(1.5e-2, 1.5e-3),
            _ => Tolerance::new(2e-2, 2e-3),
        };
        let got = run(&dims);
        let c = common::assert_same_run(&format!("llama bf16 {dims}"), &got, &single, tol);
        println!("parity llama bf16 {dims}: {c}");
        let (near, far) = (gap(&got, &single), gap(&got, f32_run));
        assert!(near < far, "{dims}: nearer fp32 ({far}) than bf16 ({near})");
    }
}

/// A Llama run checkpointed in one layout resumes in another: 3 steps under dp=2 × tp=2
/// (ZeRO-1, SP), a checkpoint, 3 more under dp=2 × pp=2 (ZeRO-3, ZB-H1) equal 6 steps on one
/// device (losses and parameters within the parity tolerance, SGD and AdamW); likewise
/// dp=2 × cp=2 (ZeRO-3) to one device, and dp=2 (ZeRO-1) to cp=2 × tp=2 (SP).
#[test]
fn checkpoints_resume_in_another_layout() {
    let f = fixture();
    let shape = bonfire_models::GptConfig {
        vocab_size: cfg().vocab_size,
        max_seq_len: cfg().max_position_embeddings,
        ..common::gpt_cfg()
    };
    // 4 steps, saved after 2. The check guards the state a checkpoint carries, so the run is
    // kept short enough that the layouts' own f32 drift (a different order of the sums) stays
    // well inside SGD's tolerance at lr 0.5. Measured without a checkpoint, each layout below
    // against one device (issue 45, the model drawn by `params::seeded(5)`): after 4 steps at
    // most 0.16 of the tolerance (6.0e-8); after 6 steps up to 1.84× (6.3e-7, dp=2 ZeRO-1, an
    // embedding element) — the 6-step version of this test failed on drift alone.
    const STEPS: usize = 4;
    const SAVED_AT: usize = 2;
    let batches = common::random_batches(&shape, STEPS, ROWS, 13);
    let dims = |mesh: &str, zero, schedule, m, flags| {
        layout(mesh, zero, schedule, m, flags).dims("dp=1").unwrap()
    };
    // Saved in one layout, resumed in another: across tp/pp, and on cp = 2 to cp = 1 and back.
    let pairs = [
        (
            dims("dp=2,tp=2", 1, None, None, "sp"),
            dims("dp=2,pp=2", 3, Some("zb"), Some(2), ""),
        ),
        (
            dims("dp=2,cp=2", 3, None, None, ""),
            dims("dp=1", 0, None, None, ""),
        ),
        (
            dims("dp=2", 1, None, None, ""),
            dims("cp=2,tp=2", 0, None, None, "sp"),
        ),
    ];
    for (a, b) in &pairs {
        let adamw = common::adamw(common::gpt_lr(OptimizerKind::AdamW));
        common::resume::check_resume(
            "llama",
            &f.model,
            &batches,
            ROWS,
            (a, b),
            STEPS,
            SAVED_AT,
            adamw,
        );
    }
}

/// `Engine::evaluate` in every kind of layout equals the loss plain Burn computes on one
/// device (no Bonfire engine: `Llama::loss` and Burn's SGD), before and after a step, and an
/// evaluation between steps leaves training exactly as it was: the loss of the step after it
/// equals plain Burn's too. The same with a tied head, whose last pipeline stage evaluates
/// with the table the first stage lends it after the step.
#[test]
fn evaluation_in_every_kind_of_layout_equals_plain_burn() {
    let f = fixture();
    evaluation_equals_plain_burn(&f.model);
    let mut tied = cfg();
    tied.variant.tie_word_embeddings = true;
    let model = common::seeded(5, &default_device(), |d| Llama::new(&tied, d));
    assert!(model.lm_head.is_none());
    evaluation_equals_plain_burn(&model);
}

fn evaluation_equals_plain_burn(start: &Llama) {
    use bonfire_module::params;
    use bonfire_parallel::DataSource;
    use bonfire_train::{Launcher, Trainer};
    use burn::optim::{GradientsParams, SgdConfig};
    let f = fixture();
    let device = default_device();
    let lr = common::gpt_lr(OptimizerKind::Sgd);
    let batch = |s: usize, d: &burn::tensor::Device| f.batches.rows(s, 0, ROWS, d);
    // Plain Burn: eval on batch 2, a step on batch 0, eval again, the loss of batch 1.
    let mut model = start.clone();
    let loss_of = |m: &Llama, s: usize| {
        let (ids, targets) = batch(s, &device);
        m.loss(ids, targets)
    };
    let host = |t: burn::tensor::Tensor<1>| params::to_host(t.detach())[0];
    let before = host(loss_of(&model, 2));
    let grads = GradientsParams::from_grads(loss_of(&model, 0).backward(), &model);
    model = SgdConfig::new().init().step(lr, model, grads);
    let want = [before, host(loss_of(&model, 2)), host(loss_of(&model, 1))];
    let cases = [
        layout("dp=2", 0, None, None, ""),
        layout("dp=2", 2, None, None, ""),
        layout("dp=2", 3, None, None, ""),
        layout("tp=2", 0, None, None, "sp lp"),
        layout("tp=4", 0, None, None, ""),
        layout("pp=2", 0, Some("1f1b"), Some(4), ""),
        layout("pp=2", 0, Some("interleaved"), Some(4), ""),
        layout("pp=2", 0, Some("zb-v"), Some(4), "ac"),
        layout("dp=2,pp=2", 3, Some("gpipe"), Some(2), ""),
        layout("dp=2,tp=2", 1, None, None, "ac"),
    ];
    for case in &cases {
        let dims = case.dims("dp=1").unwrap();
        let trainer = Trainer::new(dims.clone(), || OptimizerKind::Sgd.build());
        let first = batch(0, &device);
        let ranks = Launcher::Threads {
            ranks: dims.world_size(),
        }
        .run("evaluate", |pg| {
            let mut engine = trainer.build(start.clone(), &pg, &first)?;
            let (replica, d) = (engine.replica(), engine.device().clone());
            let eval = batch.replica_batch(2, replica, &d);
            let e0 = engine.evaluate(&eval)?;
            engine.forward_backward(&batch.replica_batch(0, replica, &d))?;
            engine.step(lr)?;
            let e1 = engine.evaluate(&eval)?;
            let l1 = engine.forward_backward(&batch.replica_batch(1, replica, &d))?;
            Ok::<_, bonfire_train::TrainError>([e0, e1, l1])
        })
        .unwrap_or_else(|e| panic!("{dims}: {e}"));
        for got in ranks {
            let got = got.unwrap_or_else(|e| panic!("{dims}: {e}"));
            let c = assert_close(&format!("evaluate {dims}"), &got, &want, common::SGD);
            println!("evaluate {dims}: {got:?} against {want:?}: {c}");
        }
    }
}
