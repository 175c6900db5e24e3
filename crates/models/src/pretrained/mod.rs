//! Hugging Face model directories, in and out, as transformers' `save_pretrained` writes
//! them: `config.json` beside either one `model.safetensors` or shards
//! `model-0000K-of-0000N.safetensors` listed by `model.safetensors.index.json`
//! (`{"metadata": {"total_size": …}, "weight_map": {name: file}}`).
//!
//! A model whose module paths are transformers' parameter names (the Llama) loads such a
//! directory with no renaming ([`load_pretrained`]: every parameter must be there with its
//! shape, and every tensor must be a parameter; f32, bf16 and f16 files are read into the
//! model's f32) and is saved back the same way in f32 ([`save_pretrained`], sharded at a
//! size), so that transformers loads it with no missing or unexpected keys. [`Weights`]
//! reads such a directory a slice at a time, for ranks that load only what they hold.

mod slices;

pub use slices::Weights;

use crate::tensor_file::{self, F32Tensors};
use bonfire_module::params;
use burn::module::Module;
use serde_json::{Map, Value, json};
use std::path::{Path, PathBuf};

/// The single-file weights' name.
pub const WEIGHTS: &str = "model.safetensors";
/// The index of sharded weights.
pub const INDEX: &str = "model.safetensors.index.json";
/// The configuration's name.
pub const CONFIG: &str = "config.json";

/// The weight files of `dir`: its `model.safetensors`, or the shards its index lists (each
/// once, in order). `Err` names what is missing or malformed.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let index = dir.join(INDEX);
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| format!("cannot read {}: {e}", index.display()))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not JSON: {e}", index.display()))?;
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| format!("{}: no `weight_map` object", index.display()))?;
        let mut files: Vec<String> = Vec::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| format!("{}: `{name}` maps to a non-string", index.display()))?;
            if !files.iter().any(|f| f == file) {
                files.push(file.to_string());
            }
        }
        files.sort();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join(WEIGHTS);
    match single.exists() {
        true => Ok(vec![single]),
        false => Err(format!(
            "{} has neither {WEIGHTS} nor {INDEX}",
            dir.display()
        )),
    }
}

/// Every tensor of `dir`'s weight files, as f32, by name; `Err` on a name in two files.
pub fn read_weights(dir: &Path) -> Result<F32Tensors, String> {
    let mut out = F32Tensors::new();
    for file in weight_files(dir)? {
        for (name, t) in tensor_file::read_floats(&file)? {
            if out.insert(name.clone(), t).is_some() {
                return Err(format!(
                    "{}: `{name}` is in two weight files",
                    dir.display()
                ));
            }
        }
    }
    Ok(out)
}

/// `model` with every parameter and state tensor taken from `dir`'s weights (same names,
/// same shapes, any float dtype read as f32). `Err`, before anything is assigned, lists the parameters the
/// files lack, the tensors that are no parameter, and shapes that differ.
pub fn load_pretrained<M: Module>(model: M, dir: &Path) -> Result<M, String> {
    load_tensors(model, read_weights(dir)?, dir)
}

/// [`load_pretrained`] from tensors already read (and renamed) from `dir`.
pub fn load_tensors<M: Module>(model: M, mut tensors: F32Tensors, dir: &Path) -> Result<M, String> {
    let infos = params::all_tensors(&model);
    let (mut missing, mut shapes, mut flat) = (Vec::new(), Vec::new(), Vec::new());
    for info in &infos {
        match tensors.remove(&info.path) {
            None => missing.push(info.path.clone()),
            Some((shape, _)) if shape != info.shape => shapes.push(format!(
                "{} is {shape:?} in the file, {:?} in the model",
                info.path, info.shape
            )),
            Some((_, values)) => flat.extend(values),
        }
    }
    let mut problems = Vec::new();
    if !missing.is_empty() {
        problems.push(format!("missing parameters: {}", missing.join(", ")));
    }
    if !tensors.is_empty() {
        let extra: Vec<&str> = tensors.keys().map(String::as_str).collect();
        problems.push(format!("unexpected tensors: {}", extra.join(", ")));
    }
    problems.extend(shapes);
    if !problems.is_empty() {
        return Err(format!("{}: {}", dir.display(), problems.join("; ")));
    }
    Ok(params::assign_values(model, &infos, &flat))
}

/// Writes `model` to `dir` as `save_pretrained` does: `config_json` as `config.json`, the
/// parameters and state tensors (f32, by module path) in one `model.safetensors` when they fit in
/// `max_shard_bytes`, else in shards of at most that size (a parameter larger than it gets
/// a shard of its own) with `model.safetensors.index.json`. Returns the weight files written.
pub fn save_pretrained<M: Module>(
    model: &M,
    config_json: &str,
    dir: &Path,
    max_shard_bytes: usize,
) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let infos = params::all_tensors(model);
    let values = params::named(&infos, &params::flatten_values(model, &infos));
    let mut shards: Vec<F32Tensors> = vec![F32Tensors::new()];
    let mut size = 0;
    for p in values {
        let bytes = 4 * p.values.len();
        if size > 0 && size + bytes > max_shard_bytes {
            shards.push(F32Tensors::new());
            size = 0;
        }
        size += bytes;
        shards
            .last_mut()
            .expect("a shard")
            .insert(p.path, (p.shape, p.values));
    }
    let write = |name: &str, text: &str| {
        std::fs::write(dir.join(name), text)
            .map_err(|e| format!("cannot write {}: {e}", dir.join(name).display()))
    };
    write(CONFIG, config_json)?;
    for stale in [WEIGHTS, INDEX] {
        std::fs::remove_file(dir.join(stale)).ok();
    }
    if shards.len() == 1 {
        let path = dir.join(WEIGHTS);
        tensor_file::write_f32(&path, &shards[0])?;
        return Ok(vec![path]);
    }
    let n = shards.len();
    let (mut map, mut total, mut files) = (Map::new(), 0, Vec::new());
    for (k, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        for (name, (_, v)) in shard {
            map.insert(name.clone(), Value::String(file.clone()));
            total += 4 * v.len();
        }
        tensor_file::write_f32(dir.join(&file), shard)?;
        files.push(dir.join(file));
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": map});
    write(INDEX, &serde_json::to_string_pretty(&index).expect("JSON"))?;
    Ok(files)
}
