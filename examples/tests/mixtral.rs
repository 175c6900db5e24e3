//! The Mixtral against Hugging Face transformers, and in the layouts it supports against one
//! device.
//!
//! **transformers, in float64** (`fixtures/mixtral/`, written by its `generate.py`; no
//! Bonfire code computed it): 2 layers of 4 experts, top 2, α = 0.02, arranged so that expert
//! 3 of layer 0 and expert 2 of layer 1 get no token of the first batch. Bonfire loads the
//! fixture's `config.json` and `model.safetensors`, computes the logits and the sequence-wise
//! balance term of a batch, and trains 2 steps with SGD and with AdamW on one device; logits,
//! balance, losses, every step-0 gradient and every parameter after the SGD steps equal
//! transformers' within f32's error of a float64 result (relative 1e-5, floor 1e-6); the
//! parameters after AdamW within relative 1e-5 and the suites' AdamW floor 2e-3·lr.
//!
//! **Layouts** on the fixture's model (idle experts included) and random batches: dp = 2 with
//! ZeRO 0–3, dp = 4 ZeRO-3, HSDP (dp_replicate = 2 × dp = 2, ZeRO-2), tp = 2 (± loss
//! parallelism, with dp and ZeRO-3), cp = 2 and 4 (alone, with dp and ZeRO, with tp, all
//! three) — every loss, step-0 gradient and parameter after 2 steps equals one device: SGD
//! within the suites' tolerance, AdamW within [`ADAMW`]. Every pipeline schedule, pipelines
//! with dp, tp and cp, and activation checkpointing, the same. bf16 trains in dp, cp, tp and
//! cp × tp. Sequence parallelism is refused naming why.
//!
//! **Expert parallelism**: ep = 2, 4 over dp and over dp × cp, with tp, with ZeRO 1–3, with
//! pipelines and activation checkpointing — the same; bf16 under ep (DDP, ZeRO-2); a run
//! saved at ep = 2 resumes at ep = 1 and ep = 4; the parity harness with `ep=` equals
//! transformers. Experts that do not split over ep and ep not dividing dp × cp are refused.

mod common;

use bonfire_comm::testing::{Tolerance, assert_close};
use bonfire_examples::cli::LayoutArgs;
use bonfire_examples::default_device;
use bonfire_examples::harness;
use bonfire_models::ModelConfig;
use bonfire_models::data;
use bonfire_models::mixtral::{Mixtral, MixtralConfig, balance, pretrained as moe_pretrained};
use bonfire_models::pretrained;
use bonfire_models::tensor_file::{self, F32Tensors};
use bonfire_train::OptimizerKind;
use std::path::PathBuf;
use std::sync::OnceLock;

fn fixture_dir() -> PathBuf {
    common::fixture_dir("mixtral")
}

use common::F64;

fn config() -> MixtralConfig {
    let ModelConfig::Mixtral(cfg) = ModelConfig::load(&fixture_dir().join("config.json")).unwrap()
    else {
        panic!("a Mixtral config");
    };
    cfg
}

fn fixture_model() -> Mixtral {
    common::mixtral_fixture()
}

fn flat(m: &Mixtral) -> Vec<f32> {
    bonfire_module::params::flatten_values(m, &bonfire_module::params::inventory(m))
}

#[test]
fn logits_balance_and_training_match_transformers_in_float64() {
    let cfg = config();
    assert_eq!(cfg, MixtralConfig::tiny());
    let device = default_device();
    let model = fixture_model();
    let batches = data::load_batches(fixture_dir().join("batch.safetensors"), 64, 8).unwrap();
    let want = common::fixture_reference("mixtral");
    let (ids, _) = batches.rows(0, 0, batches.batch, &device);
    let (logits, routing) = model.forward_routed(ids);
    // The fixture's idle experts are idle here too.
    let idle: Vec<f32> = routing
        .iter()
        .flat_map(|r| {
            let [b, t, e] = r.counts.dims();
            r.counts
                .clone()
                .reshape([b * t, e])
                .sum_dim(0)
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
        })
        .map(|c| (c == 0.0) as u8 as f32)
        .collect();
    assert_eq!(idle, want["unused"]);
    assert!(idle.contains(&1.0));
    let bal = balance(&routing).into_data().try_to_vec::<f32>().unwrap();
    let mut worst = assert_close("balance", &bal, &want["balance"], F64);
    let logits = logits.into_data().try_to_vec::<f32>().unwrap();
    worst = worst.max(assert_close("logits", &logits, &want["logits"], F64));
    println!("transformers logits and balance: {worst}");
    // One device, then expert, context and HSDP layouts (and a composition), each against
    // transformers' own run. AdamW turns f32's error on a gradient that cancels near ε into a
    // step error of up to lr: the parameters' floor there is the suites' AdamW floor.
    let layouts = [
        layout("dp=1", 0, None, None, ""),
        layout("dp=2,ep=2", 1, None, None, ""),
        layout("dp=4,ep=4", 3, None, None, ""),
        layout("cp=2", 0, None, None, ""),
        layout("dp=2,cp=2,ep=4", 2, None, None, ""),
        layout("dp_replicate=2,dp=2,ep=2", 2, None, None, ""),
    ];
    let tol = |optim, lr, _: &bonfire_layout::ParallelDims| match optim {
        OptimizerKind::Sgd => common::F64,
        OptimizerKind::AdamW => common::adamw(lr),
    };
    let worst = common::against_fixture("mixtral", &model, &batches, &layouts, tol);
    println!("transformers sgd, adamw: {} {}", worst[0], worst[1]);
}

#[test]
fn per_expert_and_fused_checkpoints_load_the_same_model() {
    let (cfg, device, dir) = (config(), default_device(), fixture_dir());
    let saved = pretrained::read_weights(&dir).unwrap();
    assert!(saved.contains_key("model.layers.1.block_sparse_moe.experts.3.w2.weight"));
    let loaded = moe_pretrained::load_pretrained(Mixtral::new(&cfg, &device), &dir).unwrap();
    let fused = fixture_model();
    assert_eq!(flat(&loaded), flat(&fused));

    let tmp = std::env::temp_dir().join(format!("bonfire-mixtral-{}", std::process::id()));
    let out = tmp.join("export");
    pretrained::save_pretrained(&loaded, &cfg.to_json(), &out, usize::MAX).unwrap();
    let shapes = |p: PathBuf| -> Vec<(String, Vec<usize>)> {
        tensor_file::read(p)
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.shape().to_vec()))
            .collect()
    };
    assert_eq!(
        shapes(out.join("model.safetensors")),
        shapes(dir.join("state_dict.safetensors"))
    );
    let back = moe_pretrained::load_pretrained(Mixtral::new(&cfg, &device), &out).unwrap();
    assert_eq!(flat(&back), flat(&fused));
    assert_eq!(
        MixtralConfig::load(out.join("config.json")),
        Ok(cfg.clone())
    );

    let mut short: F32Tensors = saved;
    short.remove("model.layers.0.block_sparse_moe.experts.2.w3.weight");
    tensor_file::write_f32(tmp.join("short/model.safetensors"), &short).unwrap();
    let err = moe_pretrained::load_pretrained(Mixtral::new(&cfg, &device), &tmp.join("short"))
        .unwrap_err();
    assert!(
        err.contains("missing expert tensor model.layers.0.block_sparse_moe.experts.2.w3"),
        "{err}"
    );
    std::fs::remove_dir_all(tmp).ok();
}

const STEPS: usize = 2;
const ROWS: usize = 4;

fn suite() -> &'static common::Suite<Mixtral> {
    static F: OnceLock<common::Suite<Mixtral>> = OnceLock::new();
    F.get_or_init(|| {
        let shape = bonfire_models::GptConfig {
            vocab_size: 64,
            max_seq_len: 8,
            ..common::gpt_cfg()
        };
        let batches = common::random_batches(&shape, STEPS, ROWS, 11);
        common::Suite::new(fixture_model(), batches, STEPS)
    })
}

use common::layout;

/// AdamW's absolute floor on this model's layouts against one device, 4e-2·lr (the dense
/// suites' is 2e-3·lr): Adam divides each gradient element by its running RMS, and this model
/// has elements whose gradient is a cancellation near ε (rows of the 64-token vocabulary
/// that 32 tokens rarely reach, experts that get their first tokens at step 2): any change of
/// the sums' order turns into a step difference there. Measured (issue 45) over the 47 AdamW
/// cases of this file: largest |diff| 3.2e-4 (cp = 2 × tp = 2), 2.9e-4 in 11 cases (pipelines
/// of 2 stages and plain dp = 2 among them), the median 1.8e-4; the floor was 1.25× the
/// largest, 4e-4. (It was 5e-4, 5e-2·lr, set from a largest gap of 2.9e-4.) On an AVX2-only
/// CPU (AMD EPYC, Zen 3, 2026-12-06: `gemm`'s AVX2 kernel sums in other blocks) the same
/// cases measured up to 4.5e-4 (dp = 4 × ep = 2, every ZeRO stage; one element of an expert's
/// `gate_up_proj`, 0.1388 against one device's 0.1384), past that floor: it is now 1.25× the
/// largest over both CPUs, 5.6e-4 (5.6e-2·lr). SGD's tolerance checks the same runs at 1e-5.
const ADAMW: Tolerance = Tolerance::new(1e-5, 5.6e-4);

/// Every case with SGD (the suites' tolerance) and AdamW ([`ADAMW`]) against one device.
fn check(cases: &[LayoutArgs]) {
    let s = suite();
    for (k, optim, tol) in [
        (0, OptimizerKind::Sgd, common::SGD),
        (1, OptimizerKind::AdamW, ADAMW),
    ] {
        for case in cases {
            let dims = case.dims("dp=1").unwrap();
            let name = format!("mixtral {dims} {}", optim.name());
            let lr = common::gpt_lr(optim);
            let got = harness::train(&s.model, &s.batches, &dims, optim, STEPS, lr)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let closeness = common::assert_same_run(&name, &got, &s.reference[k], tol);
            println!("parity {name}: {closeness}");
        }
    }
}

#[test]
fn data_parallel_with_every_zero_stage() {
    let mut cases: Vec<LayoutArgs> = (0..=3).map(|z| layout("dp=2", z, None, None, "")).collect();
    cases.push(layout("dp=4", 3, None, None, ""));
    cases.push(layout("dp_replicate=2,dp=2", 2, None, None, ""));
    check(&cases);
}

/// Experts split over ep ranks borrowed from dp (× cp), the grouped tokens exchanged
/// all-to-all (the fixture's idle experts included: at ep = 4 a rank's only expert gets no
/// token): ep = 2 and 4 over dp, with tp on the attention, and over dp × cp (cp = 2 alone,
/// dp = 2 × cp = 2 at ep = 2 and 4), where one backward runs the ring attention's shifts and
/// the experts' exchanges on ranks whose loads differ.
#[test]
fn expert_parallel_layouts() {
    check(&[
        layout("dp=2,ep=2", 0, None, None, ""),
        layout("dp=4,ep=2", 0, None, None, ""),
        layout("dp=4,ep=4", 0, None, None, ""),
        layout("dp=2,tp=2,ep=2", 0, None, None, "lp"),
        layout("cp=2,ep=2", 0, None, None, ""),
        layout("dp=2,cp=2,ep=2", 0, None, None, ""),
        layout("dp=2,cp=2,ep=4", 0, None, None, ""),
    ]);
}

/// ZeRO under expert parallelism: the experts' optimizer state (stage 1), gradients (stage 2)
/// and values (stage 3, gathered per layer) sharded over the ranks holding the same experts,
/// every other parameter's over the whole dp group; under HSDP each replica's shards, the
/// experts' too, averaged across the replicas.
#[test]
fn expert_parallel_with_zero() {
    check(&[
        layout("dp=2,ep=2", 1, None, None, ""),
        layout("dp=4,ep=2", 1, None, None, ""),
        layout("dp=4,ep=2", 2, None, None, ""),
        layout("dp=4,ep=4", 2, None, None, ""),
        layout("dp=2,ep=2", 3, None, None, ""),
        layout("dp=4,ep=2", 3, None, None, ""),
        layout("pp=2,dp=2,ep=2", 2, Some("1f1b"), Some(2), ""),
        layout("dp=2,cp=2,ep=4", 2, None, None, ""),
        layout("dp_replicate=2,dp=2,ep=2", 0, None, None, ""),
        layout("dp_replicate=2,dp=2,ep=2", 2, None, None, ""),
        layout("dp_replicate=2,dp=2,ep=2", 3, None, None, ""),
        // Two ranks hold each expert, one of whom routes no token to it in a layer: its
        // gather's reduce-scatter must still run (run_experts touches the experts).
        layout("dp=4,cp=2,ep=4", 3, None, None, ""),
    ]);
}

/// The resumes' AdamW floor, 2.75e-3·lr (the dense suites' is 2e-3·lr): within that on the
/// AVX-512 CPUs; on an AVX2-only AMD EPYC (Zen 3, 2026-12-06) all five resumes below measured
/// 2.2e-5 (2.19e-5 at most: one element, 0.028984 against 0.029006, where the gradient cancels
/// near ε), 1.09× the dense floor; this is 1.25× that largest.
fn resume_adamw(lr: f64) -> Tolerance {
    Tolerance::new(1e-5, 2.75e-3 * lr as f32)
}

/// An expert-parallel run checkpointed at ep = 2 resumes at ep = 1 and at ep = 4 (each ep
/// rank writes its slice of the experts — under ZeRO each rank its pieces of them — and the
/// resumed layout reads its own), under DDP and ZeRO 1–3, and a run without ep resumes with
/// it: 2 steps, a checkpoint, 2 more equal 4 steps on one device, SGD and AdamW.
#[test]
fn expert_parallel_checkpoints_resume_at_another_ep() {
    let shape = bonfire_models::GptConfig {
        vocab_size: 64,
        max_seq_len: 8,
        ..common::gpt_cfg()
    };
    let batches = common::random_batches(&shape, 4, ROWS, 17);
    let dims = |mesh: &str, zero| layout(mesh, zero, None, None, "").dims("dp=1").unwrap();
    let model = fixture_model();
    for (a, b) in [
        (dims("dp=2,ep=2", 0), dims("dp=2", 0)),
        (dims("dp=2,ep=2", 0), dims("dp=4,ep=4", 0)),
        (dims("dp=2,ep=2", 2), dims("dp=4,ep=4", 1)),
        (dims("dp=4,ep=2", 3), dims("dp=1", 0)),
        (dims("dp=2", 1), dims("dp=2,ep=2", 3)),
    ] {
        let adamw = resume_adamw(common::gpt_lr(OptimizerKind::AdamW));
        common::resume::check_resume("mixtral", &model, &batches, ROWS, (&a, &b), 4, 2, adamw);
    }
}

/// What expert parallelism cannot do is refused before anything is built, naming why.
#[test]
fn expert_parallelism_refusals() {
    let s = suite();
    let refused = |mesh: &str, zero: usize, want: &str| {
        let dims = layout(mesh, zero, None, None, "").dims("dp=1").unwrap();
        let e = harness::train(&s.model, &s.batches, &dims, OptimizerKind::Sgd, 1, 0.1)
            .expect_err(mesh)
            .to_string();
        assert!(e.contains(want), "{mesh} zero={zero}: {e}");
    };
    refused(
        "cp=3,ep=3",
        0,
        "holds 4 experts, which do not split over ep=3",
    );
    refused("dp=4,ep=3", 0, "ep borrows its ranks from dp × cp = 4");
}

/// Attention heads split over tp, the router and experts whole on every rank.
#[test]
fn tensor_parallel_with_replicated_experts() {
    check(&[
        layout("tp=2", 0, None, None, ""),
        layout("tp=2", 0, None, None, "lp"),
        layout("dp=2,tp=2", 3, None, None, "lp"),
    ]);
}

/// Each sequence's chunks over cp: the balance term's counts and probability sums are
/// summed over the cp group.
#[test]
fn context_parallel_layouts() {
    check(&[
        layout("cp=2", 0, None, None, ""),
        layout("cp=4", 0, None, None, ""),
        layout("dp=2,cp=2", 1, None, None, ""),
        layout("dp=2,cp=2", 3, None, None, ""),
        layout("cp=2,tp=2", 0, None, None, "lp"),
        layout("dp=2,cp=2,tp=2", 2, None, None, ""),
    ]);
}

/// The largest parameter difference of two runs.
fn param_gap(a: &bonfire_train::parity::Outcome, b: &bonfire_train::parity::Outcome) -> f32 {
    a.params
        .iter()
        .flat_map(|(k, (_, v))| v.iter().zip(&b.params[k].1).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f32::max)
}

/// bf16 compute with fp32 master weights (the router's softmax and weights kept in f32, the
/// experts in bf16) trains in dp = 2, cp = 2, tp = 2, cp = 2 × tp = 2 and dp = 2 × ep = 2 (the
/// exchanged rows in bf16; DDP and ZeRO-2), each within twice
/// bf16's own effect of bf16 on one device (parameters after 2 SGD steps; measured: fp32 is
/// 2.1e-3 from bf16 on one device, the layouts 5.4e-4 (dp), 1.2e-3 (cp), 2.0e-3 (tp),
/// 3.7e-3 (cp × tp) — tp's row-wise sums of bf16 partials round differently from one
/// device's matmul). A bound, not the fp32 suites' parity: bf16 rounding noise is the scale.
#[test]
fn bf16_trains_in_every_supported_layout() {
    let s = suite();
    let bf16 = |mesh: &str, zero| {
        let mut l = layout(mesh, zero, None, None, "");
        l.precision = Some("bf16".into());
        l.dims("dp=1").unwrap()
    };
    let run = |dims: &bonfire_layout::ParallelDims| {
        harness::train(&s.model, &s.batches, dims, OptimizerKind::Sgd, STEPS, 0.5)
            .unwrap_or_else(|e| panic!("{dims}: {e}"))
    };
    let single = run(&bf16("dp=1", 0));
    let to_f32 = param_gap(&single, &s.reference[0]);
    assert!(to_f32 > 1e-3, "bf16 is {to_f32} from fp32: not in force");
    let meshes = ["dp=2", "cp=2", "tp=2", "cp=2,tp=2", "dp=2,ep=2"].map(|m| (m, 0));
    for (mesh, zero) in meshes.into_iter().chain([("dp=2,ep=2", 2)]) {
        let gap = param_gap(&run(&bf16(mesh, zero)), &single);
        println!(
            "mixtral bf16 {mesh} zero={zero}: {gap:e} from bf16 on one device, fp32 {to_f32:e}"
        );
        assert!(
            gap <= 2.0 * to_f32,
            "bf16 {mesh} zero={zero}: {gap} (fp32 is {to_f32})"
        );
    }
}

/// Every pipeline schedule, pipelines composed with dp, tp, cp and ep, and activation
/// checkpointing (under ep too: the recomputed layers exchange their tokens again in
/// backward): the routing rides with the activations, so the balance term over all layers
/// is exact on the last stage.
#[test]
fn pipelines_and_recompute() {
    let mut cases: Vec<LayoutArgs> = ["gpipe", "1f1b", "interleaved", "zb", "zb-v"]
        .into_iter()
        .map(|sched| layout("pp=2", 0, Some(sched), Some(2), ""))
        .collect();
    cases.extend([
        layout("dp=2,pp=2", 1, Some("1f1b"), Some(2), ""),
        layout("pp=2,tp=2", 0, Some("zb"), Some(2), "lp"),
        layout("pp=2,cp=2", 2, Some("1f1b"), Some(2), ""),
        layout("pp=2,dp=2,ep=2", 0, Some("1f1b"), Some(2), ""),
        layout("pp=2,dp=2,ep=2", 0, Some("zb-v"), Some(2), ""),
        layout("dp=2", 3, None, None, "ac"),
        layout("dp=2", 0, None, None, "ac"),
        layout("dp=2,ep=2", 0, None, None, "ac"),
    ]);
    check(&cases);
}

/// Sequence parallelism is refused before anything is built, naming why.
#[test]
fn sequence_parallelism_is_refused() {
    let model = fixture_model();
    let batch = suite().batches.rows(0, 0, 2, &default_device());
    let refuse = |l: LayoutArgs| {
        let dims = l.dims("dp=1").unwrap();
        let n = dims.world_size();
        bonfire_train::Trainer::new(dims, || OptimizerKind::Sgd.build())
            .check(&model, n, &batch)
            .unwrap_err()
            .to_string()
    };
    let err = refuse(layout("tp=2", 0, None, None, "sp"));
    assert!(
        err.contains("sequence parallelism is not supported"),
        "{err}"
    );
}

/// The parity harness on the fixture (`--config` its `config.json` with `"model_type":
/// "mixtral"`, `--weights` its `state_dict.safetensors`) under dp = 2 ZeRO-3, and with
/// expert parallelism (`--mesh dp=2,ep=2`, `dp=4,ep=4`): the result file equals transformers'
/// float64 run.
#[test]
fn the_harness_trains_a_mixtral_checkpoint() {
    let cases = [("dp=2", 3), ("dp=2,ep=2", 0), ("dp=4,ep=4", 0)];
    common::harness_matches_fixture("mixtral", "state_dict.safetensors", &cases);
}

/// The `train` front door takes a Mixtral directory (`--model`, its per-expert
/// `model.safetensors`): under dp = 2 × tp = 2 ZeRO-3 each rank reads only its slices through
/// `MixtralWeights` (the experts assembled from their per-expert tensors and cut to the
/// rank's ZeRO slices), and `--export` writes exactly the fixture's fused `state_dict`;
/// sequence parallelism is refused with the model's error.
#[test]
fn train_loads_a_mixtral_directory_a_slice_per_rank() {
    let run = common::train_reads_slices_and_exports("mixtral", "dp=2,tp=2", 3);
    let refused = run(&["--steps", "1", "--mesh", "tp=2", "--sequence-parallel"]);
    let stderr = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(!refused.status.success());
    assert!(
        stderr.contains("sequence parallelism is not supported"),
        "{stderr}"
    );
}

/// `MixtralWeights` on the per-expert fixture answers for the fused names: whole tensors,
/// a box of experts 1..3 and a flat range of it equal the fused `state_dict`'s elements.
#[test]
fn mixtral_weights_read_regions_of_fused_tensors() {
    use bonfire_models::mixtral::pretrained::MixtralWeights;
    use bonfire_parallel::{ParameterSource, Region};
    let source = MixtralWeights::open(&fixture_dir()).unwrap();
    let fused = pretrained::read_weights(&fixture_dir()).unwrap();
    let fused = moe_pretrained::fuse_experts(fused).unwrap();
    let params: Vec<(String, Vec<usize>)> = fused
        .iter()
        .map(|(k, (s, _))| (k.clone(), s.clone()))
        .collect();
    source.check(&params).unwrap();
    let name = "model.layers.1.mlp.experts.gate_up_proj";
    let (shape, values) = &fused[name];
    assert_eq!(
        &source.read(name, shape, &Region::whole(shape)).unwrap(),
        values
    );
    let (two_f, d) = (shape[1], shape[2]);
    let boxed = Region::of_box(vec![1, 0, 0], vec![2, two_f, d]);
    let want = &values[two_f * d..3 * two_f * d];
    assert_eq!(source.read(name, shape, &boxed).unwrap(), want);
    let range = boxed.narrow(5..two_f * d + 7);
    let got = source.read(name, shape, &range).unwrap();
    assert_eq!(got, &want[5..two_f * d + 7]);
    let mut short = params;
    short.pop();
    assert!(source.check(&short).is_err());
}
