//! Loading and saving a model's parameters as one safetensors file in PyTorch layout, through
//! burn-store. The models store their parameters in PyTorch's layout under the names of
//! their reference (the parity contract's for the GPT, transformers' for the Llama; see
//! [`crate::layers`]), so files map one to one with no adapter.

use burn::module::Module;
use burn_store::{ModuleSnapshot, SafetensorsStore};
use std::path::Path;

/// Writes every parameter of `model` to `path` (f32, PyTorch names and layout).
pub fn save<M: Module>(model: &M, path: impl AsRef<Path>) -> Result<(), String> {
    let path = path.as_ref();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let mut store = SafetensorsStore::from_file(path).overwrite(true);
    model
        .save_into(&mut store)
        .map_err(|e| format!("cannot save {}: {e}", path.display()))
}

/// Loads every parameter of `model` from `path`; fails, naming them, if the file lacks
/// parameters, has extra tensors, or has a shape the model does not.
pub fn load<M: Module>(mut model: M, path: impl AsRef<Path>) -> Result<M, String> {
    let path = path.as_ref();
    let mut store = SafetensorsStore::from_file(path).allow_partial(true);
    let result = model
        .load_from(&mut store)
        .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
    let mut problems = Vec::new();
    if !result.missing.is_empty() {
        let names: Vec<&str> = result.missing.iter().map(|(n, _)| n.as_str()).collect();
        problems.push(format!("missing parameters: {}", names.join(", ")));
    }
    if !result.unused.is_empty() {
        problems.push(format!("unexpected tensors: {}", result.unused.join(", ")));
    }
    if !result.errors.is_empty() {
        let errs: Vec<String> = result.errors.iter().map(|e| format!("{e:?}")).collect();
        problems.push(format!("errors: {}", errs.join("; ")));
    }
    if problems.is_empty() {
        Ok(model)
    } else {
        Err(format!("{}: {}", path.display(), problems.join("; ")))
    }
}
