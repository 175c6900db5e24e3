//! The parity harness end to end: files in, `result.safetensors` out, for dp = 1, 2, 4; the
//! data-parallel results equal the single-device one (1e-5 relative, 1e-7 absolute floor),
//! and unsupported options are rejected.

mod common;

use bonfire_examples::harness::{self, HarnessArgs};
use bonfire_examples::mesh::{Layout, Mesh};
use bonfire_examples::{Gpt, GptConfig, checkpoint, default_device, tensor_file};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn write_inputs(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = GptConfig::tiny();
    let cfg_path = dir.join("cfg.json");
    std::fs::write(&cfg_path, serde_json::to_string(&cfg).unwrap()).unwrap();
    let weights = dir.join("init.safetensors");
    checkpoint::save(&Gpt::new(&cfg, &default_device()), &weights).unwrap();
    // 3 steps of B=4 rows of T'=6 (< max_seq_len 8).
    let b = common::random_batches(&cfg, 3, 4, 11);
    let (s, bb, t) = (3usize, 4usize, 6usize);
    let cut = |v: &[i64]| -> Vec<u8> {
        (0..s * bb)
            .flat_map(|row| v[row * 8..row * 8 + t].to_vec())
            .flat_map(|x| x.to_le_bytes())
            .collect()
    };
    let ids = cut(&b.input_ids);
    let tg = cut(&b.targets);
    let views = vec![
        (
            "input_ids",
            safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![s, bb, t], &ids)
                .unwrap(),
        ),
        (
            "targets",
            safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![s, bb, t], &tg)
                .unwrap(),
        ),
    ];
    let data = dir.join("batch.safetensors");
    safetensors::serialize_to_file(views, None, &data).unwrap();
    (cfg_path, weights, data)
}

fn args(dir: &Path, mesh: &str, zero: u8) -> HarnessArgs {
    let (config, weights, data) = (
        dir.join("cfg.json"),
        dir.join("init.safetensors"),
        dir.join("batch.safetensors"),
    );
    HarnessArgs {
        config,
        weights,
        data,
        layout: Layout {
            mesh: Mesh::parse(mesh).unwrap(),
            zero,
            schedule: None,
            microbatches: None,
            sequence_parallel: false,
            loss_parallel: false,
        },
        steps: 3,
        lr: 0.5,
        out: dir.join(format!("result-{mesh}.safetensors")),
    }
}

fn tmp_dir(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("harness-{test}-{}", std::process::id()));
    write_inputs(&dir);
    dir
}

#[test]
fn dp_1_2_4_agree() {
    let dir = tmp_dir("agree");
    let mut results: Vec<BTreeMap<String, Vec<f32>>> = Vec::new();
    for mesh in ["dp=1", "dp=2", "dp=4"] {
        let a = args(&dir, mesh, 0);
        harness::run(&a).unwrap();
        results.push(harness::read_result(&a.out).unwrap());
    }
    let cfg = GptConfig::tiny();
    let single = &results[0];
    // Every contract name is present: parameters, their grad0, and the losses.
    let n_params = 2 + 16 * cfg.n_layers + 3;
    assert_eq!(single.len(), 2 * n_params + 1);
    assert_eq!(single["loss"].len(), 3);
    assert_eq!(
        single["blocks.1.mlp.fc1.weight"].len(),
        cfg.d_ff * cfg.d_model
    );
    assert!(single.contains_key("grad0.head.weight"));
    for (other, mesh) in results[1..].iter().zip(["dp=2", "dp=4"]) {
        for (name, v) in single {
            common::assert_close(
                &format!("{mesh} {name}"),
                &other[name],
                v,
                common::REL,
                common::ABS,
            );
        }
    }
    // The output's parameters load back into the model (same names and layout).
    let out = tensor_file::read(dir.join("result-dp=2.safetensors")).unwrap();
    assert!(out.contains_key("tok_emb.weight"));
}

/// `--zero 1|2|3` on dp=2 and dp=4, and on dp=2 × tp=2 (ZeRO shards each rank's
/// tensor-parallel parameters over dp), equals dp=1 (ZeRO's sharded SGD step, gathered
/// outputs).
#[test]
fn zero_stages_agree_with_dp_1() {
    let dir = tmp_dir("zero");
    let single_args = args(&dir, "dp=1", 0);
    harness::run(&single_args).unwrap();
    let single = harness::read_result(&single_args.out).unwrap();
    for (mesh, stage) in [
        ("dp=2", 1),
        ("dp=2", 2),
        ("dp=2", 3),
        ("dp=4", 3),
        ("dp=2,tp=2", 2),
        ("dp=2,tp=2", 3),
    ] {
        let mut a = args(&dir, mesh, stage);
        a.out = dir.join(format!("result-{mesh}-zero{stage}.safetensors"));
        harness::run(&a).unwrap();
        let out = harness::read_result(&a.out).unwrap();
        assert_eq!(out.len(), single.len(), "{mesh} zero {stage}");
        for (name, v) in &single {
            common::assert_close(
                &format!("{mesh} zero {stage} {name}"),
                &out[name],
                v,
                common::REL,
                common::ABS,
            );
        }
    }
}

#[test]
fn unsupported_options_are_rejected() {
    let dir = tmp_dir("reject");
    let err = harness::run(&args(&dir, "dp=2,tp=2,pp=2", 0)).unwrap_err();
    assert!(
        err.contains("pp=2") && err.contains("needs --schedule"),
        "{err}"
    );
    // The tiny config has 2 heads: they cannot be split over 4 tensor-parallel ranks.
    let err = harness::run(&args(&dir, "tp=4", 0)).unwrap_err();
    assert!(err.contains("n_heads 2 is not divisible"), "{err}");
    let err = harness::run(&args(&dir, "pp=2", 0)).unwrap_err();
    assert!(err.contains("pp=2"), "{err}");
    let mut a = args(&dir, "dp=2,pp=2", 3);
    a.layout.schedule = Some("gpipe".into());
    let err = harness::run(&a).unwrap_err();
    assert!(err.contains("--zero 3"), "{err}");
    let err = harness::run(&args(&dir, "dp=2", 4)).unwrap_err();
    assert!(err.contains("--zero 4"), "{err}");
    let mut a = args(&dir, "dp=3", 0);
    a.out = dir.join("never.safetensors");
    let err = harness::run(&a).unwrap_err();
    assert!(err.contains("divisible"), "{err}");
}
