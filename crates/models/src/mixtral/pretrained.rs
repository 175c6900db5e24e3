//! Mixture-of-experts checkpoints in and out. transformers 5 stores a layer's experts fused
//! (`mlp.experts.gate_up_proj` `[E, 2F, d]`, `mlp.experts.down_proj` `[E, d, F]`, router
//! `mlp.gate.weight`): those are the model's own names, and export writes them
//! ([`crate::pretrained::save_pretrained`]). Published checkpoints name each expert
//! ([`ExpertNames`]): the Mixtral's `block_sparse_moe.experts.j.w1.weight` (the gate `[F, d]`),
//! `.w3` (the up `[F, d]`), `.w2` (the down `[d, F]`), router `block_sparse_moe.gate.weight`;
//! Qwen3-MoE's (and DeepSeek's) `mlp.experts.j.gate_proj.weight`, `up_proj`, `down_proj`,
//! router `mlp.gate.weight`. [`fuse_experts`] folds either into the fused names, and
//! [`load_pretrained`] reads a directory of any kind. [`MixtralWeights`] is the same for
//! ranks that load a slice each ([`bonfire_train::checkpoint::load_parameters`]).

use super::model::Mixtral;
use crate::pretrained::{Weights, load_tensors, read_weights};
use crate::tensor_file::F32Tensors;
use bonfire_parallel::{ParameterSource, Region};
use std::path::Path;

/// How a published checkpoint names a layer's experts (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertNames {
    /// The block's name under a layer (`block_sparse_moe`, `mlp`).
    block: &'static str,
    /// Expert j's gate, up and down projections (`w1`, `w3`, `w2`).
    gate: &'static str,
    up: &'static str,
    down: &'static str,
}

impl ExpertNames {
    /// The Mixtral's.
    pub const MIXTRAL: Self = Self {
        block: "block_sparse_moe",
        gate: "w1",
        up: "w3",
        down: "w2",
    };
    /// Qwen2/3-MoE's and DeepSeek's.
    pub const QWEN: Self = Self {
        block: "mlp",
        gate: "gate_proj",
        up: "up_proj",
        down: "down_proj",
    };

    /// The scheme of a checkpoint holding `names`, if it names experts one by one.
    pub fn detect<'a>(mut names: impl Iterator<Item = &'a str>) -> Option<Self> {
        names.find_map(|n| {
            [Self::MIXTRAL, Self::QWEN]
                .into_iter()
                .find(|s| n.ends_with(&format!(".{}.experts.0.{}.weight", s.block, s.gate)))
        })
    }

    /// Layer `layer`'s (a `model.layers.i` prefix) router.
    fn router(&self, layer: &str) -> String {
        format!("{layer}.{}.gate.weight", self.block)
    }

    /// Expert `j`'s projection `w` of layer `layer`.
    fn expert(&self, layer: &str, j: usize, w: &str) -> String {
        format!("{layer}.{}.experts.{j}.{w}.weight", self.block)
    }
}

/// `tensors` with every per-expert name folded into the fused names (tensors already fused
/// pass unchanged). `Err` names an expert tensor that is missing or misshapen.
pub fn fuse_experts(mut tensors: F32Tensors) -> Result<F32Tensors, String> {
    let Some(names) = ExpertNames::detect(tensors.keys().map(String::as_str)) else {
        return Ok(tensors);
    };
    let suffix = format!(".{}.experts.0.{}.weight", names.block, names.gate);
    let layers: Vec<String> = tensors
        .keys()
        .filter_map(|k| k.strip_suffix(&suffix))
        .map(str::to_string)
        .collect();
    for prefix in layers {
        let router_name = names.router(&prefix);
        let router = tensors
            .remove(&router_name)
            .ok_or_else(|| format!("missing router {router_name}"))?;
        let experts = router.0[0];
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        let (mut f, mut d) = (0, 0);
        for j in 0..experts {
            let mut take = |w: &str| {
                let name = names.expert(&prefix, j, w);
                tensors
                    .remove(&name)
                    .ok_or_else(|| format!("missing expert tensor {name}"))
            };
            let (w1, w3, w2) = (take(names.gate)?, take(names.up)?, take(names.down)?);
            (f, d) = (w1.0[0], w1.0[1]);
            if w3.0 != w1.0 || w2.0 != [d, f] {
                return Err(format!(
                    "{prefix}.{}.experts.{j}: gate {:?}, up {:?}, down {:?} (want [F, d], \
                     [F, d], [d, F])",
                    names.block, w1.0, w3.0, w2.0
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
/// are fused or per expert (see the module docs), its multi-token-prediction layers left out
/// ([`prediction_layers`]); errors as [`crate::pretrained::load_pretrained`]'s.
pub fn load_pretrained(model: Mixtral, dir: &Path) -> Result<Mixtral, String> {
    let mut tensors =
        fuse_experts(read_weights(dir)?).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mtp = prediction_layers(dir)?;
    tensors.retain(|name, _| !mtp(name));
    load_tensors(model, tensors, dir)
}

/// Which tensors of `dir`'s weights are DeepSeek-V3's multi-token-prediction modules: the
/// `num_nextn_predict_layers` layers after `num_hidden_layers` (`model.layers.61.*` in the
/// published checkpoint), which transformers drops on load too; none without the field.
pub fn prediction_layers(dir: &Path) -> Result<impl Fn(&str) -> bool + use<>, String> {
    let text = crate::read_config(&dir.join("config.json"))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format!("{}: config.json is no JSON: {e}", dir.display()))?;
    let count = |f: &str| crate::fields::count(&v, f, 0).unwrap_or(0);
    let (layers, mtp) = (
        count("num_hidden_layers"),
        count("num_nextn_predict_layers"),
    );
    let prefixes: Vec<String> = (layers..layers + mtp)
        .map(|i| format!("model.layers.{i}."))
        .collect();
    Ok(move |name: &str| prefixes.iter().any(|p| name.starts_with(p)))
}

/// A mixture-of-experts directory's weights for [`bonfire_train::checkpoint::load_parameters`]: fused
/// names read as [`Weights`] reads them; per-expert files answer for the fused names — the
/// router read a slice at a time, an expert tensor assembled whole from its experts' tensors
/// and cut to the region (experts are replicated over tp; only ZeRO-3 pieces would read less).
#[derive(Debug)]
pub struct MixtralWeights {
    weights: Weights,
    per_expert: Option<ExpertNames>,
}

impl MixtralWeights {
    /// Opens `dir`'s weight files ([`Weights::open`]).
    pub fn open(dir: &Path) -> Result<Self, String> {
        let weights = Weights::open(dir)?.without(prediction_layers(dir)?);
        let per_expert = ExpertNames::detect(weights.names());
        Ok(Self {
            weights,
            per_expert,
        })
    }

    /// The file's names and shapes for one model parameter (several for a fused expert
    /// tensor in a per-expert file).
    fn file_tensors(&self, name: &str, shape: &[usize]) -> Vec<(String, Vec<usize>)> {
        let Some(names) = self.per_expert else {
            return vec![(name.to_string(), shape.to_vec())];
        };
        if let Some(p) = name.strip_suffix(".mlp.experts.gate_up_proj") {
            let (f, d) = (shape[1] / 2, shape[2]);
            let w = |j| [names.gate, names.up].map(|w| (names.expert(p, j, w), vec![f, d]));
            return (0..shape[0]).flat_map(w).collect();
        }
        if let Some(p) = name.strip_suffix(".mlp.experts.down_proj") {
            let (d, f) = (shape[1], shape[2]);
            return (0..shape[0])
                .map(|j| (names.expert(p, j, names.down), vec![d, f]))
                .collect();
        }
        match name.strip_suffix(".mlp.gate.weight") {
            Some(p) => vec![(names.router(p), shape.to_vec())],
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
