//! Mixtral checkpoints in and out. transformers 5 stores a layer's experts fused
//! (`mlp.experts.gate_up_proj` `[E, 2F, d]`, `mlp.experts.down_proj` `[E, d, F]`, router
//! `mlp.gate.weight`): those are the model's own names, and export writes them
//! ([`crate::pretrained::save_pretrained`]). Published Mixtral checkpoints name each expert
//! (`block_sparse_moe.experts.j.w1.weight` the gate `[F, d]`, `.w3` the up `[F, d]`, `.w2`
//! the down `[d, F]`, router `block_sparse_moe.gate.weight`): [`fuse_experts`] folds those
//! into the fused names, and [`load_pretrained`] reads a directory of either kind.
//! [`MixtralWeights`] is the same for ranks that load a slice each
//! ([`bonfire_train::checkpoint::load_parameters`]).

use super::model::Mixtral;
use crate::pretrained::{Weights, load_tensors, read_weights};
use crate::tensor_file::F32Tensors;
use bonfire_parallel::{ParameterSource, Region};
use std::path::Path;

/// `tensors` with every per-expert name folded into the fused names (tensors already fused
/// pass unchanged). `Err` names an expert tensor that is missing or misshapen.
pub fn fuse_experts(mut tensors: F32Tensors) -> Result<F32Tensors, String> {
    let layers: Vec<String> = tensors
        .keys()
        .filter_map(|k| k.strip_suffix(".block_sparse_moe.gate.weight"))
        .map(str::to_string)
        .collect();
    for prefix in layers {
        let moe = format!("{prefix}.block_sparse_moe");
        let router = tensors
            .remove(&format!("{moe}.gate.weight"))
            .expect("listed");
        let experts = router.0[0];
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        let (mut f, mut d) = (0, 0);
        for j in 0..experts {
            let mut take = |w: &str| {
                let name = format!("{moe}.experts.{j}.{w}.weight");
                tensors
                    .remove(&name)
                    .ok_or_else(|| format!("missing expert tensor {name}"))
            };
            let (w1, w3, w2) = (take("w1")?, take("w3")?, take("w2")?);
            (f, d) = (w1.0[0], w1.0[1]);
            if w3.0 != w1.0 || w2.0 != [d, f] {
                return Err(format!(
                    "{moe}.experts.{j}: w1 {:?}, w3 {:?}, w2 {:?} (want [F, d], [F, d], [d, F])",
                    w1.0, w3.0, w2.0
                ));
            }
            gate_up.extend(w1.1);
            gate_up.extend(w3.1);
            down.extend(w2.1);
        }
        let mlp = format!("{prefix}.mlp");
        tensors.insert(format!("{mlp}.gate.weight"), router);
        tensors.insert(
            format!("{mlp}.experts.gate_up_proj"),
            (vec![experts, 2 * f, d], gate_up),
        );
        tensors.insert(
            format!("{mlp}.experts.down_proj"),
            (vec![experts, d, f], down),
        );
    }
    Ok(tensors)
}

/// `model` with every parameter taken from the Hugging Face directory `dir`, whose experts
/// are fused or per expert (see the module docs); errors as
/// [`crate::pretrained::load_pretrained`]'s.
pub fn load_pretrained(model: Mixtral, dir: &Path) -> Result<Mixtral, String> {
    let tensors =
        fuse_experts(read_weights(dir)?).map_err(|e| format!("{}: {e}", dir.display()))?;
    load_tensors(model, tensors, dir)
}

/// A Mixtral directory's weights for [`bonfire_train::checkpoint::load_parameters`]: fused
/// names read as [`Weights`] reads them; per-expert files answer for the fused names — the
/// router read a slice at a time, an expert tensor assembled whole from its experts' tensors
/// and cut to the region (experts are replicated over tp; only ZeRO-3 pieces would read less).
#[derive(Debug)]
pub struct MixtralWeights {
    weights: Weights,
    per_expert: bool,
}

impl MixtralWeights {
    /// Opens `dir`'s weight files ([`Weights::open`]).
    pub fn open(dir: &Path) -> Result<Self, String> {
        let weights = Weights::open(dir)?;
        let per_expert = weights
            .names()
            .any(|n| n.ends_with(".block_sparse_moe.gate.weight"));
        Ok(Self {
            weights,
            per_expert,
        })
    }

    /// The file's names and shapes for one model parameter (several for a fused expert
    /// tensor in a per-expert file).
    fn file_tensors(&self, name: &str, shape: &[usize]) -> Vec<(String, Vec<usize>)> {
        if !self.per_expert {
            return vec![(name.to_string(), shape.to_vec())];
        }
        let expert =
            |p: &str, w: &str, j: usize| format!("{p}.block_sparse_moe.experts.{j}.{w}.weight");
        if let Some(p) = name.strip_suffix(".mlp.experts.gate_up_proj") {
            let (f, d) = (shape[1] / 2, shape[2]);
            let w = |j| [("w1", j), ("w3", j)].map(|(w, j)| (expert(p, w, j), vec![f, d]));
            return (0..shape[0]).flat_map(w).collect();
        }
        if let Some(p) = name.strip_suffix(".mlp.experts.down_proj") {
            let (d, f) = (shape[1], shape[2]);
            return (0..shape[0])
                .map(|j| (expert(p, "w2", j), vec![d, f]))
                .collect();
        }
        match name.strip_suffix(".mlp.gate.weight") {
            Some(p) => vec![(format!("{p}.block_sparse_moe.gate.weight"), shape.to_vec())],
            None => vec![(name.to_string(), shape.to_vec())],
        }
    }
}

impl ParameterSource for MixtralWeights {
    fn check(&self, params: &[(String, Vec<usize>)]) -> Result<(), String> {
        let wanted: Vec<(String, Vec<usize>)> = params
            .iter()
            .flat_map(|(name, shape)| self.file_tensors(name, shape))
            .collect();
        self.weights.check(&wanted)
    }

    fn read(&self, name: &str, shape: &[usize], region: &Region) -> Result<Vec<f32>, String> {
        let parts = self.file_tensors(name, shape);
        if let [(file_name, _)] = parts.as_slice() {
            return self.weights.read(file_name, shape, region);
        }
        let mut whole = Vec::with_capacity(shape.iter().product());
        for (part, part_shape) in &parts {
            whole.extend(
                self.weights
                    .read(part, part_shape, &Region::whole(part_shape))?,
            );
        }
        let mut out = Vec::with_capacity(region.len());
        for run in region.runs_from(&Region::whole(shape)) {
            out.extend_from_slice(&whole[run.src..run.src + run.len]);
        }
        Ok(out)
    }
}
