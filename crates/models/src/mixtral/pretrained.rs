//! Mixtral checkpoints in and out. transformers 5 stores a layer's experts fused
//! (`mlp.experts.gate_up_proj` `[E, 2F, d]`, `mlp.experts.down_proj` `[E, d, F]`, router
//! `mlp.gate.weight`): those are the model's own names, and export writes them
//! ([`crate::pretrained::save_pretrained`]). Published Mixtral checkpoints name each expert
//! (`block_sparse_moe.experts.j.w1.weight` the gate `[F, d]`, `.w3` the up `[F, d]`, `.w2`
//! the down `[d, F]`, router `block_sparse_moe.gate.weight`): [`fuse_experts`] folds those
//! into the fused names, and [`load_pretrained`] reads a directory of either kind.

use super::model::Mixtral;
use crate::pretrained::{load_tensors, read_weights};
use crate::tensor_file::F32Tensors;
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
