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
//! shape: the head is the embedding table, one parameter) in the layouts it supports yet — DDP,
//! ZeRO 1–3, HSDP, cp, offload — and tp, pp and activation checkpointing refused naming it. Exported with
//! `save_pretrained`, each has the fixture's tensors, names and shapes and its config reads back
//! as the same model; with `BONFIRE_KEEP_EXPORT=DIR` the exports and their logits are left in
//! `DIR/<family>` for transformers' `AutoModelForCausalLM` (`fixtures/llama/check_export.py`,
//! the gate's `clients` step).

mod common;

use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_models::data;
use bonfire_models::llama::{Family, Llama};
use bonfire_models::{pretrained, tensor_file};
use bonfire_train::OptimizerKind;
use common::{F64, layout};
use std::collections::BTreeMap;

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
    export(family, &model, &cfg, &batches);
}

/// `model` exported as transformers writes it: the fixture's tensors (names, shapes), its
/// config read back as `cfg`; kept with step 0's logits under `BONFIRE_KEEP_EXPORT`.
fn export(
    family: &str,
    model: &Llama,
    cfg: &bonfire_models::llama::LlamaConfig,
    batches: &data::Batches,
) {
    let keep = std::env::var_os("BONFIRE_KEEP_EXPORT").map(std::path::PathBuf::from);
    let tmp = std::env::temp_dir().join(format!("bonfire-{family}-export-{}", std::process::id()));
    let out = keep.as_ref().map_or(tmp.clone(), |k| k.join(family));
    pretrained::save_pretrained(model, &cfg.to_json(), &out, usize::MAX).unwrap();
    let shapes = |p: std::path::PathBuf| -> Vec<(String, Vec<usize>)> {
        let tensors = tensor_file::read(p).unwrap();
        tensors
            .into_iter()
            .map(|(k, t)| (k, t.shape().to_vec()))
            .collect()
    };
    let fixture = common::fixture_dir(&format!("families/{family}"));
    assert_eq!(
        shapes(out.join("model.safetensors")),
        shapes(fixture.join("model.safetensors")),
        "{family}: the export's tensors"
    );
    let back = bonfire_models::llama::LlamaConfig::load(out.join("config.json")).unwrap();
    assert_eq!(&back, cfg, "{family}: the exported config");
    if keep.is_some() {
        let device = default_device();
        let (ids, _) = batches.rows(0, 0, batches.batch, &device);
        let logits = model.forward(ids.clone());
        let mut t = BTreeMap::new();
        let shape = logits.dims().to_vec();
        t.insert(
            "logits".to_string(),
            (shape, logits.into_data().try_to_vec::<f32>().unwrap()),
        );
        let ids_shape = ids.dims().to_vec();
        let ids: Vec<f32> = ids.float().into_data().try_to_vec::<f32>().unwrap();
        t.insert("input_ids".to_string(), (ids_shape, ids));
        tensor_file::write_f32(out.join("logits.safetensors"), &t).unwrap();
    } else {
        std::fs::remove_dir_all(tmp).ok();
    }
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

#[test]
fn qwen3_qk_norms_match_transformers_in_every_layout_class() {
    check("qwen3", Family::Qwen3, &all_layouts());
}

/// A tied head (Llama 3.2's shape): one parameter whose gradient sums the embedding's and the
/// head's use, in every layout that supports it yet (ZeRO-3 gathers the table a second time
/// for the head); tp, pp and activation checkpointing refused, naming `tie_word_embeddings`.
#[test]
fn tied_embeddings_match_transformers_where_supported() {
    let supported = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2", 0, None, None, ""),
        layout("dp=2", 1, None, None, "offload"),
        layout("dp=2", 3, None, None, ""),
        layout("cp=2", 0, None, None, ""),
        layout("dp_replicate=2,dp=2", 3, None, None, ""),
    ];
    check("llama32", Family::Llama, &supported);
    let (_, model, batches) = common::llama_fixture("families/llama32");
    assert!(model.lm_head.is_none(), "tied: no lm_head");
    let batch = batches.rows(0, 0, batches.batch, &default_device());
    for (case, world, says) in [
        (layout("tp=2", 0, None, None, ""), 2, "tie_word_embeddings"),
        (
            layout("pp=2", 0, Some("1f1b"), Some(2), ""),
            2,
            "tie_word_embeddings",
        ),
        (layout("dp=1", 0, None, None, "ac"), 1, "pipeline pieces"),
    ] {
        let dims = case.dims("dp=1").unwrap();
        let err = bonfire_train::Trainer::new(dims.clone(), || OptimizerKind::Sgd.build())
            .check(&model, world, &batch)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(err.contains(says), "{dims}: {err}");
    }
}
