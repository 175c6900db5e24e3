//! DeepSeek-V3 against Hugging Face transformers in float64 (`fixtures/deepseek_v3/`, written
//! by its `generate.py`; no Bonfire code computed it): multi-head latent attention (a query
//! bottleneck with its norm, the shared key/value latent, decoupled interleaved RoPE, values
//! narrower than the queries), a first dense layer, shared experts beside 8 routed ones in 4
//! groups (sigmoid scores, top 2 from the best 2 groups, each layer's balancing bias in the
//! choice, `routed_scaling_factor`), and in `q_proj/` the other paths (one query projection,
//! RoPE on halves, no renormalization, no dense layer). Each loads from its `config.json`
//! and the published per-expert `model.safetensors` — equal to the fused `state_dict`, bias
//! included —, its logits equal transformers', and 2 steps of SGD and of AdamW equal
//! transformers' on one device and in a layout of each class. With auxiliary-loss-free
//! balancing (`--expert-bias-update`) the biases move as transformers' run of the contract's
//! rule in every layout class, survive a checkpoint resumed in another layout, come out of
//! the parity harness; `train --model` reads a slice per rank, and the export — biases
//! beside the parameters — is what transformers loads.

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
    // The planner counts what the model holds: latent attention, shared experts, dense layers.
    let held: usize = params::inventory(&model).iter().map(|p| p.numel()).sum();
    assert_eq!((cfg.num_params(), cfg.spec().num_params()), (held, held));
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

/// AdamW's parameter tolerance: relative 1e-5 with a floor of 9e-3·lr (the dense families'
/// 2e-3·lr, Qwen3-MoE's 5e-3·lr). AdamW's first step moves an element by lr·g/(|g| + ε), so
/// where a gradient is near ε (rows of the vocabulary and experts few tokens reach) f32's
/// gradient error becomes a step difference. Fitted on one device of the main fixture
/// (6.0e-5 = 6e-3·lr, 1.5× that); judged on what it never saw: the layouts against
/// transformers, 7.1e-5 at most (tp = 2; `q_proj/` 2.9e-5), the balanced runs 6.2e-5, a
/// resumed run against one device 7.5e-5. SGD, the same gradients taken as they are, stays
/// within F64 everywhere.
fn adamw(lr: f64) -> bonfire_comm::testing::Tolerance {
    bonfire_comm::testing::Tolerance::new(1e-5, 9e-3 * lr as f32)
}

/// `fixture`'s logits, then its training in each of `layouts`, against transformers.
fn check(fixture: &str, layouts: &[LayoutArgs]) -> MixtralConfig {
    let (cfg, model, batches) = load(fixture);
    let want = common::fixture_reference(fixture);
    let (ids, _) = batches.rows(0, 0, batches.batch, &default_device());
    let logits = model.forward(ids).into_data().try_to_vec::<f32>().unwrap();
    let c = bonfire_comm::testing::assert_close("logits", &logits, &want["logits"], F64);
    println!("{fixture} logits vs transformers: {c}");
    let tol = |optim, lr: f64, _: &bonfire_layout::ParallelDims| match optim {
        OptimizerKind::Sgd => F64,
        OptimizerKind::AdamW => adamw(lr),
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

/// YaRN's RoPE scaling (`yarn/`: the main model with `rope_type: yarn`, factor 4 over 2
/// original positions, mscale 0.707 and mscale_all_dim 1 — cos and sin × 0.964, the softmax
/// scale × 1.296 —, as DeepSeek-V3's own config asks) on one device, ZeRO-3 × ep, tp = 2, a
/// pipeline and cp = 2 × ep = 2.
#[test]
fn deepseek_v3_with_yarn_matches_transformers() {
    let layouts = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2,ep=2", 3, None, None, ""),
        layout("tp=2", 0, None, None, ""),
        layout("pp=2", 0, Some("1f1b"), Some(2), ""),
        layout("cp=2,ep=2", 0, None, None, ""),
    ];
    let cfg = check("deepseek_v3/yarn", &layouts);
    let y = cfg.base.variant.mla.unwrap().yarn.unwrap();
    assert!((y.attention_factor() - 0.9643).abs() < 1e-4, "{y:?}");
    assert!((y.softmax_factor() - 1.2964).abs() < 1e-4, "{y:?}");
}

/// Auxiliary-loss-free balancing (`--expert-bias-update 0.01`) against transformers' run of
/// the contract's rule in each of `layouts`, SGD and AdamW: losses, parameters and every
/// routed layer's bias after the last step (an update's step is 0.01 · sign: a load counted
/// differently anywhere — a replica, a micro-batch, a cp chunk missed or counted twice —
/// moves a bias by 0.01, far outside F64).
fn check_balanced(fixture: &str, layouts: &[(LayoutArgs, usize)]) {
    let (_, model, batches) = load(fixture);
    let want = common::fixture_reference(fixture);
    let biases: Vec<String> = params::buffers(&model)
        .into_iter()
        .map(|b| b.path)
        .collect();
    for (optim, name, lr) in [
        (OptimizerKind::Sgd, "sgd", 0.5),
        (OptimizerKind::AdamW, "adamw", 0.01),
    ] {
        let tol = match optim {
            OptimizerKind::Sgd => F64,
            OptimizerKind::AdamW => adamw(lr),
        };
        for (case, accum) in layouts {
            let dims = case.dims("dp=1").unwrap();
            let what = format!("{fixture} {dims} accum={accum} {name} balanced vs transformers");
            let config = bonfire_train::FitConfig {
                expert_bias_update: Some(0.01),
                grad_accum: *accum,
                ..bonfire_train::FitConfig::new(batches.steps(), lr)
            };
            let (got, _) =
                bonfire_examples::harness::train_with(&model, &batches, &dims, optim, &config)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
            let close = bonfire_comm::testing::assert_close;
            let key = |n: &str| format!("balanced.{name}.{n}");
            let mut w = close(
                &format!("{what} loss"),
                &got.losses,
                &want[&key("loss")],
                F64,
            );
            for (param, (_, values)) in &got.params {
                w = w.max(close(
                    &format!("{what} {param}"),
                    values,
                    &want[&key(param)],
                    tol,
                ));
            }
            assert_eq!(got.state.len(), biases.len(), "{what}: the biases");
            for b in &biases {
                w = w.max(close(
                    &format!("{what} {b}"),
                    &got.state[b].1,
                    &want[&key(b)],
                    F64,
                ));
            }
            println!("{what}: {w}");
        }
    }
}

/// The balancing bias moves as transformers' run of the contract's rule: on one device, with
/// the loads summed over dp with ep (ZeRO-3), over HSDP's replicas, over a pipeline's
/// micro-batches, over cp chunks with ep, over dp × cp × tp (tp ranks counting the same rows
/// once), and with gradient accumulation and every layer recomputed (the recomputation
/// counts nothing).
#[test]
fn deepseek_v3_balancing_bias_moves_as_transformers_does() {
    let layouts = [
        (layout("dp=1", 0, None, None, ""), 1),
        (layout("dp=2,ep=2", 3, None, None, ""), 1),
        (layout("dp_replicate=2,dp=2,ep=2", 2, None, None, ""), 1),
        (layout("pp=3", 0, Some("1f1b"), Some(2), ""), 1),
        (layout("cp=2,ep=2", 0, None, None, ""), 1),
        (layout("dp=2,cp=2,tp=2", 1, None, None, ""), 1),
        (layout("dp=2", 0, None, None, "ac"), 2),
    ];
    check_balanced("deepseek_v3", &layouts);
    check_balanced("deepseek_v3/q_proj", &layouts[..2]);
}

/// Evaluation between steps (forwards that record loads too) leaves the update alone: the
/// biases after 2 balanced steps with an evaluation of another batch after each equal those
/// without, bit for bit (the loop forgets what an evaluation recorded before each step).
#[test]
fn evaluation_between_steps_leaves_the_balancing_alone() {
    use bonfire_train::{Evaluation, FitConfig, Launcher, Trainer, fit};
    let (_, model, batches) = load("deepseek_v3");
    let dims = layout("dp=2", 0, None, None, "").dims("dp=1").unwrap();
    let config = FitConfig {
        expert_bias_update: Some(0.01),
        ..FitConfig::new(batches.steps(), 0.5)
    };
    let data = |s: usize, device: &burn::tensor::Device| batches.rows(s, 0, batches.batch, device);
    // Evaluated on step 0's batch: other rows than step 1 trains on (the same rows would only
    // double step 1's loads, which the sign rule cannot see).
    let eval = |_: usize, device: &burn::tensor::Device| batches.rows(0, 0, batches.batch, device);
    let run = |evaluate: bool| {
        let trainer = Trainer::with_optimizer(dims.clone(), OptimizerKind::Sgd);
        let first = batches.rows(0, 0, batches.batch, &default_device());
        Launcher::Threads { ranks: 2 }
            .run("eval", |pg| -> Result<_, bonfire_train::TrainError> {
                let mut engine = trainer.build(model.clone(), &pg, &first)?;
                let mut hooks = evaluate.then(|| Evaluation::new(&eval, 1, 1));
                fit(engine.as_mut(), &data, &config, &mut hooks)?;
                let evaluated = hooks.map_or(0, |h| h.losses.len());
                Ok((engine.buffers()?, evaluated))
            })
            .unwrap()
            .remove(0)
            .unwrap()
    };
    let (plain, none) = run(false);
    let (evaluated, count) = run(true);
    assert_eq!((none, count), (0, 2), "an evaluation after each step");
    assert_eq!(plain, evaluated);
}

/// A balanced run (`--expert-bias-update 0.01`) checkpointed after step 0 and resumed in
/// another layout — dp = 2 × ep = 2 ZeRO-3 → a 3-stage pipeline → one device — equals
/// transformers' 2 steps: losses, parameters and the biases (a checkpoint holds them,
/// whole, after the parameters; a bias restored wrong is 0.01 off). Against the reference
/// rather than against one device: the layouts' f32 runs sit on both sides of it (one
/// device and the pipeline 6.2e-5 and 5.8e-5 from it under AdamW, 1.2e-4 apart).
#[test]
fn deepseek_v3_resumes_its_biases_across_layouts() {
    use common::resume::leg;
    let fixture = "deepseek_v3";
    let (_, model, batches) = load(fixture);
    let want = common::fixture_reference(fixture);
    let dims = |mesh: &str, zero, schedule: Option<&str>, m| {
        layout(mesh, zero, schedule, m, "").dims("dp=1").unwrap()
    };
    let chain = [
        dims("dp=2,ep=2", 3, None, None),
        dims("pp=3", 0, Some("1f1b"), Some(2)),
        dims("dp=1", 0, None, None),
    ];
    let names: Vec<String> = (params::inventory(&model).into_iter())
        .chain(params::buffers(&model))
        .map(|p| p.path)
        .collect();
    for (optim, name, lr) in [
        (OptimizerKind::Sgd, "sgd", 0.5),
        (OptimizerKind::AdamW, "adamw", 0.01),
    ] {
        let recipe = bonfire_train::FitConfig {
            expert_bias_update: Some(0.01),
            ..bonfire_train::FitConfig::new(0, lr)
        };
        let key = |n: &str| format!("balanced.{name}.{n}");
        let reference: Vec<f32> = names.iter().flat_map(|n| want[&key(n)].clone()).collect();
        let tol = match optim {
            OptimizerKind::Sgd => F64,
            OptimizerKind::AdamW => adamw(lr),
        };
        for pair in chain.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            let dir = std::env::temp_dir().join(format!(
                "bonfire-deepseek-resume-{name}-{}",
                std::process::id()
            ));
            let rows = batches.batch;
            let (mut losses, _) = leg(
                &model,
                &batches,
                rows,
                a,
                optim,
                0..1,
                None,
                Some(&dir),
                &recipe,
            );
            let (more, got) = leg(
                &model,
                &batches,
                rows,
                b,
                optim,
                1..2,
                Some(&dir),
                None,
                &recipe,
            );
            std::fs::remove_dir_all(&dir).ok();
            losses.extend(more);
            let what = format!("{fixture} {a} -> {b} {name} balanced vs transformers");
            let close = bonfire_comm::testing::assert_close;
            let c = close(&format!("{what} loss"), &losses, &want[&key("loss")], F64);
            let c = c.max(close(&format!("{what} tensors"), &got, &reference, tol));
            println!("resume {what}: {c}");
        }
    }
}

/// `train --model` on the DeepSeek-V3 directory (published per-expert names, the biases
/// beside them) under dp = 2 × tp = 2 and dp = 2 × ep = 2, ZeRO-3: each rank reads only its
/// slices, and `--export` writes the fused `state_dict` — biases included — value for value.
#[test]
fn train_loads_deepseek_v3_directories_a_slice_per_rank() {
    let _ = common::train_reads_slices_and_exports("deepseek_v3", "dp=2,tp=2", 3);
    let _ = common::train_reads_slices_and_exports("deepseek_v3/q_proj", "dp=2,ep=2", 3);
}

/// Both fixtures exported with `save_pretrained` — the biases beside the parameters — hold
/// the fused `state_dict`'s tensors, and their configs read back as the same models; under
/// `BONFIRE_KEEP_EXPORT` transformers loads them (the gate's `clients` step).
#[test]
fn deepseek_v3_exports_what_transformers_loads() {
    for (fixture, name) in [
        ("deepseek_v3", "deepseek_v3"),
        ("deepseek_v3/q_proj", "deepseek_v3_q_proj"),
        ("deepseek_v3/yarn", "deepseek_v3_yarn"),
    ] {
        let (cfg, model, batches) = load(fixture);
        let reads_back = |path: &std::path::Path| {
            assert_eq!(
                MixtralConfig::load(path).unwrap(),
                cfg,
                "{fixture}: its config"
            );
        };
        let logits = |ids| model.forward(ids);
        let files = format!("{fixture}/state_dict.safetensors");
        let json = cfg.to_json();
        common::export::export(name, (&model, &json), &files, reads_back, logits, &batches);
    }
}

/// The parity harness trains the DeepSeek-V3 fixture (`--config` of `"model_type":
/// "deepseek_v3"`, `--weights` its fused `state_dict` with the biases) under dp = 2 × ep = 2
/// ZeRO-3 with `--expert-bias-update 0.01`: the result file holds every parameter, its
/// `grad0`, the loss and the biases after the last step (no `grad0` for them), equal to
/// transformers' run.
#[test]
fn the_harness_trains_deepseek_v3_with_its_balancing() {
    use bonfire_examples::{cli::LayoutArgs, harness};
    let dir = common::fixture_dir("deepseek_v3");
    let out = std::env::temp_dir().join(format!("bonfire-deepseek-harness-{}", std::process::id()));
    let mut args = harness::HarnessArgs {
        config: dir.join("config.json"),
        weights: dir.join("state_dict.safetensors"),
        data: dir.join("batch.safetensors"),
        dims: LayoutArgs {
            zero: 3,
            ..LayoutArgs::mesh("dp=2,ep=2")
        }
        .dims("dp=1")
        .unwrap(),
        optim: OptimizerKind::Sgd,
        device: "flex".into(),
        steps: 2,
        lr: 0.5,
        recipe: Default::default(),
        out: out.join("result.safetensors"),
    };
    args.recipe.expert_bias_update = Some(0.01);
    harness::run(&args).unwrap();
    let got = harness::read_result(&args.out).unwrap();
    let want = common::fixture_reference("deepseek_v3");
    let close = bonfire_comm::testing::assert_close;
    close("loss", &got["loss"], &want["balanced.sgd.loss"], F64);
    let (_, model, _) = load("deepseek_v3");
    let (trained, state) = (params::inventory(&model), params::buffers(&model));
    for p in trained.iter().chain(&state) {
        close(
            &p.path,
            &got[&p.path],
            &want[&format!("balanced.sgd.{}", p.path)],
            F64,
        );
    }
    for p in &trained {
        let g = format!("grad0.{}", p.path);
        close(&g, &got[&g], &want[&g], F64);
    }
    assert!(
        !state.is_empty()
            && state
                .iter()
                .all(|b| !got.contains_key(&format!("grad0.{}", b.path)))
    );
    assert_eq!(got.len(), 2 * trained.len() + state.len() + 1);
    std::fs::remove_dir_all(out).ok();
}

/// Latent attention and the group-limited sigmoid router with shared experts against plain
/// Burn (`common::plain_deepseek`: the layers written with Burn's ops — the groups and experts
/// by Burn's `topk`, every expert on every token weighted — on the same parameters), both
/// fixtures, SGD and AdamW, on one device, dp = 2 × ep = 2 ZeRO-3, tp = 2, a 1F1B pipeline and
/// cp = 2 × ep = 2. The biases stay (no update in plain Burn; they are no parameter).
#[test]
fn deepseek_v3_trains_as_plain_burn_does() {
    let axes = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2,ep=2", 3, None, None, ""),
        layout("tp=2", 0, None, None, ""),
        layout("pp=2", 0, Some("1f1b"), Some(2), ""),
        layout("cp=2,ep=2", 0, None, None, ""),
    ];
    for fixture in ["deepseek_v3", "deepseek_v3/q_proj"] {
        let (cfg, model, batches) = load(fixture);
        // Both runs are f32, each within F64 (SGD) and 9e-3·lr (AdamW, [`adamw`]) of
        // transformers' float64 run: within twice that of each other (derived, not fitted;
        // measured 8.8e-5 and 1.0e-4 at the element Adam's ε makes most sensitive).
        let tols = (F64, 2.0 * 9e-3);
        common::plain::against_plain_within(fixture, &model, &batches, &axes, tols, |m, ids, t| {
            common::plain_deepseek::plain_deepseek_loss(m, &cfg, ids, t)
        });
    }
}

/// DeepSeek-V3's own `config.json` (deepseek-ai/DeepSeek-V3, its fields as published: the
/// older `rope_scaling` with `"type": "yarn"`, `scoring_func`, `topk_method`,
/// `moe_layer_freq`, the MTP layer count) reads as the model the planner's preset describes
/// — 671,026,404,352 parameters —, YaRN included; what it does not compute is refused naming
/// the field.
#[test]
fn reads_deepseek_v3s_own_config() {
    let text = r#"{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "attention_bias": false, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
        "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
        "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
        "v_head_dim": 128, "vocab_size": 129280}"#;
    let cfg = MixtralConfig::from_json("c", text).unwrap();
    let mla = cfg.base.variant.mla.unwrap();
    let yarn = mla.yarn.expect("YaRN");
    assert_eq!(
        (yarn.factor, yarn.original_max_position_embeddings),
        (40.0, 4096)
    );
    assert_eq!(cfg.num_params(), 671_026_404_352);
    let preset = bonfire_plan::ModelSpec::preset("deepseek-v3-671b").unwrap();
    assert_eq!(cfg.spec().num_params(), preset.num_params());
    assert_eq!(
        MixtralConfig::from_json("c", &cfg.to_json()),
        Ok(cfg.clone())
    );
    for (from, to, said) in [
        ("\"sigmoid\"", "\"softmax\"", "scoring_func `softmax`"),
        ("\"noaux_tc\"", "\"greedy\"", "topk_method `greedy`"),
        (
            "\"type\": \"yarn\"",
            "\"type\": \"linear\"",
            "rope_type `linear`",
        ),
        (
            "\"moe_layer_freq\": 1",
            "\"moe_layer_freq\": 2",
            "moe_layer_freq 2",
        ),
        (
            "\"attention_bias\": false",
            "\"attention_bias\": true",
            "attention_bias",
        ),
        ("\"n_group\": 8", "\"n_group\": 3", "n_group 3"),
    ] {
        let err = MixtralConfig::from_json("c", &text.replace(from, to)).unwrap_err();
        assert!(err.contains(said), "{err}");
    }
}

/// A checkpoint's multi-token-prediction layer (DeepSeek-V3's `model.layers.61.*`: the
/// `num_nextn_predict_layers` after `num_hidden_layers`) is left out on load, as transformers
/// leaves it, by both readers (the whole directory and the slice reader `train` uses); with
/// the field at 0 the same tensor is refused as unexpected.
#[test]
fn multi_token_prediction_layers_are_left_out() {
    use bonfire_models::tensor_file;
    use bonfire_parallel::ParameterSource;
    let src = common::fixture_dir("deepseek_v3");
    let dir = std::env::temp_dir().join(format!("bonfire-deepseek-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut tensors = tensor_file::read_floats(&src.join("model.safetensors")).unwrap();
    tensors.insert(
        "model.layers.3.eh_proj.weight".into(),
        (vec![2, 2], vec![1.0; 4]),
    );
    tensor_file::write_f32(dir.join("model.safetensors"), &tensors).unwrap();
    let config = std::fs::read_to_string(src.join("config.json")).unwrap();
    assert!(config.contains("\"num_nextn_predict_layers\": 1"));
    let (cfg, model, _) = load("deepseek_v3");
    let wanted: Vec<(String, Vec<usize>)> = params::all_tensors(&model)
        .into_iter()
        .map(|p| (p.path, p.shape))
        .collect();
    for (mtp, loads) in [(1, true), (0, false)] {
        let field = format!("\"num_nextn_predict_layers\": {mtp}");
        let text = config.replace("\"num_nextn_predict_layers\": 1", &field);
        std::fs::write(dir.join("config.json"), text).unwrap();
        let fresh = Mixtral::new(&cfg, &default_device());
        let whole = moe::load_pretrained(fresh, &dir);
        let slices = moe::MixtralWeights::open(&dir).unwrap().check(&wanted);
        assert_eq!((whole.is_ok(), slices.is_ok()), (loads, loads), "{mtp}");
        if let Err(e) = slices {
            assert!(e.contains("model.layers.3.eh_proj.weight"), "{e}");
        }
    }
    std::fs::remove_dir_all(dir).ok();
}

/// Under bf16 mixed precision (DDP and ZeRO-1, dp = 2) DeepSeek-V3 trains with its balancing:
/// losses within 2e-2 of transformers' float64 run, and every bias moved by whole steps of the
/// rate from where it started — its updates not rounded to bf16 (the dtype of state in the
/// compute copy is `precision::cast_module`'s unit test's).
#[test]
fn deepseek_v3_balances_under_bf16() {
    let (_, model, batches) = load("deepseek_v3");
    let start: Vec<f32> = params::flatten_values(&model, &params::buffers(&model));
    let config = bonfire_train::FitConfig {
        expert_bias_update: Some(0.01),
        ..bonfire_train::FitConfig::new(batches.steps(), 0.5)
    };
    let want = common::fixture_reference("deepseek_v3");
    for zero in [0, 1] {
        let mut case = layout("dp=2", zero, None, None, "");
        case.precision = Some("bf16".into());
        let dims = case.dims("dp=1").unwrap();
        let (got, _) = bonfire_examples::harness::train_with(
            &model,
            &batches,
            &dims,
            OptimizerKind::Sgd,
            &config,
        )
        .unwrap();
        for (l, w) in got.losses.iter().zip(&want["balanced.sgd.loss"]) {
            assert!((l - w).abs() < 2e-2, "{dims}: loss {l} vs {w}");
        }
        let end: Vec<f32> = got.state.values().flat_map(|(_, v)| v.clone()).collect();
        assert_eq!(end.len(), start.len());
        for (e, s) in end.iter().zip(&start) {
            let steps = (e - s) / 0.01;
            assert!(
                (steps - steps.round()).abs() < 1e-4 && steps.abs() < 2.0 + 1e-4,
                "{e} vs {s}"
            );
        }
    }
}
