//! Checkpoints are safetensors in PyTorch layout under the contract's names, and load back.

use bonfire_examples::default_device;
use bonfire_models::tensor_file;
use bonfire_models::weights;
use bonfire_models::{Gpt, GptConfig};
use bonfire_module::params;
use std::collections::BTreeMap;

#[test]
fn save_load_round_trip_in_pytorch_layout() {
    let cfg = GptConfig {
        d_ff: 24,
        ..GptConfig::tiny()
    };
    let device = default_device();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("checkpoint-test");
    let path = dir.join("model.safetensors");
    let model = bonfire_module::params::seeded(61, &device, |d| Gpt::new(&cfg, d));
    weights::save(&model, &path).unwrap();

    let file = tensor_file::read(&path).unwrap();
    let shapes: BTreeMap<&str, Vec<usize>> = file
        .iter()
        .map(|(k, v)| (k.as_str(), v.shape().to_vec()))
        .collect();
    let (v, d, t, f) = (cfg.vocab_size, cfg.d_model, cfg.max_seq_len, cfg.d_ff);
    assert_eq!(shapes["tok_emb.weight"], vec![v, d]);
    assert_eq!(shapes["pos_emb.weight"], vec![t, d]);
    assert_eq!(shapes["blocks.1.attn.o.weight"], vec![d, d]);
    assert_eq!(shapes["blocks.0.ln1.bias"], vec![d]);
    assert_eq!(shapes["blocks.0.mlp.fc1.weight"], vec![f, d]); // [out, in]
    assert_eq!(shapes["blocks.0.mlp.fc2.weight"], vec![d, f]);
    assert_eq!(shapes["head.weight"], vec![v, d]);
    assert!(!shapes.contains_key("head.bias"));
    assert_eq!(shapes.len(), 2 + 16 * cfg.n_layers + 3);

    let loaded = weights::load(Gpt::new(&cfg, &device), &path).unwrap();
    let infos = params::inventory(&model);
    let loaded_infos = params::inventory(&loaded);
    assert_eq!(loaded_infos.len(), infos.len(), "loaded parameters train");
    let same =
        params::flatten_values(&loaded, &loaded_infos) == params::flatten_values(&model, &infos);
    assert!(same, "loaded values differ from the saved ones");

    // A file for another shape is refused with the parameter's name.
    let other = GptConfig { d_ff: 40, ..cfg };
    let err = weights::load(Gpt::new(&other, &device), &path).unwrap_err();
    assert!(err.contains("fc1"), "{err}");
}
