//! A model written with `save_pretrained` as transformers reads it: the tensors, names and
//! shapes of a fixture, a config that reads back, and (under `BONFIRE_KEEP_EXPORT=DIR`) the
//! export left in `DIR/<family>` with its logits for transformers' `AutoModelForCausalLM`
//! (`fixtures/llama/check_export.py`, the gate's `clients` step).

use bonfire_examples::default_device;
use bonfire_models::{data, pretrained, tensor_file};
use burn::tensor::{Int, Tensor};
use std::collections::BTreeMap;

/// `model` exported as transformers writes it: the tensors (names, shapes) of the fixture
/// file `tensors` (under `fixtures/`), its config read back as the model's (`reads_back`); kept with step 0's
/// logits under `BONFIRE_KEEP_EXPORT`.
pub fn export<M: burn::module::Module>(
    family: &str,
    (model, config_json): (&M, &str),
    tensors: &str,
    reads_back: impl Fn(&std::path::Path),
    logits: impl Fn(Tensor<2, Int>) -> Tensor<3>,
    batches: &data::Batches,
) {
    let keep = std::env::var_os("BONFIRE_KEEP_EXPORT").map(std::path::PathBuf::from);
    let tmp = std::env::temp_dir().join(format!("bonfire-{family}-export-{}", std::process::id()));
    let out = keep.as_ref().map_or(tmp.clone(), |k| k.join(family));
    pretrained::save_pretrained(model, config_json, &out, usize::MAX).unwrap();
    let shapes = |p: std::path::PathBuf| -> Vec<(String, Vec<usize>)> {
        let tensors = tensor_file::read(p).unwrap();
        tensors
            .into_iter()
            .map(|(k, t)| (k, t.shape().to_vec()))
            .collect()
    };
    let fixture = super::fixture_dir(tensors);
    assert_eq!(
        shapes(out.join("model.safetensors")),
        shapes(fixture),
        "{family}: the export's tensors"
    );
    reads_back(&out.join("config.json"));
    if keep.is_some() {
        let device = default_device();
        let (ids, _) = batches.rows(0, 0, batches.batch, &device);
        let logits = logits(ids.clone());
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
