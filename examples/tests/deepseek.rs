//! DeepSeek-V3 against Hugging Face transformers in float64 (`fixtures/deepseek_v3/`, written
//! by its `generate.py`; no Bonfire code computed it): multi-head latent attention (a query
//! bottleneck with its norm, the shared key/value latent, decoupled interleaved RoPE, values
//! narrower than the queries), a first dense layer, shared experts beside 8 routed ones in 4
//! groups (sigmoid scores, top 2 from the best 2 groups, each layer's balancing bias in the
//! choice, `routed_scaling_factor`), and in `q_proj/` the other paths (one query projection,
//! RoPE on halves, no renormalization, no dense layer). Each loads from its `config.json`
//! and the published per-expert `model.safetensors` — equal to the fused `state_dict`, bias
//! included —, its logits equal transformers', and 2 steps of SGD and of AdamW equal
//! transformers' on one device and in a layout of each class.

mod common;

use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_models::ModelConfig;
use bonfire_models::data;
use bonfire_models::mixtral::config::MoeFamily;
use bonfire_models::mixtral::{Mixtral, MixtralConfig, pretrained as moe};
use bonfire_module::params;
use bonfire_train::OptimizerKind;
use common::{F64, layout};

/// The fixture `fixture`: its config, the model loaded from the per-expert directory (checked
/// equal to the fused `state_dict`, the biases too) and its batches.
fn load(fixture: &str) -> (MixtralConfig, Mixtral, data::Batches) {
    let dir = common::fixture_dir(fixture);
    let ModelConfig::Mixtral(cfg) = ModelConfig::load(&dir.join("config.json")).unwrap() else {
        panic!("a mixture-of-experts config");
    };
    assert_eq!(cfg.family, MoeFamily::DeepseekV3);
    assert_eq!(
        MixtralConfig::from_json("c", &cfg.to_json()),
        Ok(cfg.clone())
    );
    let device = default_device();
    let model = moe::load_pretrained(Mixtral::new(&cfg, &device), &dir).unwrap();
    let fused = bonfire_models::weights::load(
        Mixtral::new(&cfg, &device),
        dir.join("state_dict.safetensors"),
    )
    .unwrap();
    let all = |m: &Mixtral| params::flatten_values(m, &params::all_tensors(m));
    assert_eq!(all(&model), all(&fused), "per-expert and fused files");
    let biases = params::buffers(&model);
    let routed = (0..cfg.base.num_hidden_layers)
        .filter(|&i| cfg.is_sparse(i))
        .count();
    assert_eq!(biases.len(), routed, "one bias per routed layer");
    let bias = params::flatten_values(&model, &biases);
    assert!(
        bias.iter().any(|&b| b != 0.0),
        "the fixture's biases are set"
    );
    let batches = data::load_batches(dir.join("batch.safetensors"), 64, 8).unwrap();
    (cfg, model, batches)
}

/// `fixture`'s logits, then its training in each of `layouts`, against transformers.
fn check(fixture: &str, layouts: &[LayoutArgs]) -> MixtralConfig {
    let (cfg, model, batches) = load(fixture);
    let want = common::fixture_reference(fixture);
    let (ids, _) = batches.rows(0, 0, batches.batch, &default_device());
    let logits = model.forward(ids).into_data().try_to_vec::<f32>().unwrap();
    let c = bonfire_comm::testing::assert_close("logits", &logits, &want["logits"], F64);
    println!("{fixture} logits vs transformers: {c}");
    // AdamW's floor 9e-3·lr (the dense families' 2e-3·lr, Qwen3-MoE's 5e-3·lr): the first
    // step moves an element by lr·g/(|g| + ε), so where a gradient is near ε (rows of the
    // vocabulary and experts few tokens reach) f32's gradient error becomes a step
    // difference. Fitted on one device of the main fixture (6.0e-5 = 6e-3·lr, 1.5× that);
    // judged on the layouts, which it never saw: 7.1e-5 at most (tp = 2), `q_proj/` 2.9e-5.
    // SGD, the same gradients taken as they are, stays within F64 everywhere.
    let tol = |optim, lr: f64, _: &bonfire_layout::ParallelDims| match optim {
        OptimizerKind::Sgd => F64,
        OptimizerKind::AdamW => bonfire_comm::testing::Tolerance::new(1e-5, 9e-3 * lr as f32),
    };
    let worst = common::against_fixture(fixture, &model, &batches, layouts, tol);
    println!(
        "{fixture} sgd, adamw vs transformers: {} {}",
        worst[0], worst[1]
    );
    cfg
}

/// The main fixture (query bottleneck, interleaved RoPE, a dense first layer) on one device
/// and under ep over dp with ZeRO-1, tp = 2 (heads and shared experts split), a pipeline
/// with the dense layer on its first stage, cp = 2 with ep (ring attention over the padded
/// values) and dp × cp × tp.
#[test]
fn deepseek_v3_matches_transformers_in_every_layout_class() {
    let layouts = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2,ep=2", 1, None, None, ""),
        layout("dp=4,ep=4", 3, None, None, ""),
        layout("dp_replicate=2,dp=2,ep=2", 2, None, None, ""),
        layout("tp=2", 0, None, None, "lp"),
        layout("pp=3", 0, Some("1f1b"), Some(2), ""),
        layout("cp=2,ep=2", 0, None, None, ""),
        layout("dp=2,cp=2,tp=2", 1, None, None, ""),
    ];
    let cfg = check("deepseek_v3", &layouts);
    let mla = cfg.base.variant.mla.unwrap();
    assert_eq!((mla.q_lora_rank, mla.rope_interleave), (Some(16), true));
    assert_eq!(cfg.mlp_only_layers, [0]);
}

/// The other paths (`q_proj/`): one query projection, RoPE on halves, weights not
/// renormalized, every layer routed.
#[test]
fn deepseek_v3_without_a_query_bottleneck_matches_transformers() {
    let layouts = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2,ep=2", 3, None, None, ""),
        layout("tp=4", 0, None, None, ""),
        layout("pp=2", 0, Some("interleaved"), Some(4), ""),
        layout("cp=2", 0, None, None, ""),
    ];
    let cfg = check("deepseek_v3/q_proj", &layouts);
    let mla = cfg.base.variant.mla.unwrap();
    assert_eq!((mla.q_lora_rank, mla.rope_interleave), (None, false));
    assert!(!cfg.norm_topk_prob && cfg.mlp_only_layers.is_empty());
}
