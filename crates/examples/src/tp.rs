//! Tensor (and sequence) parallelism for the GPT: the ready plan, like torchtitan's Llama
//! plan, and the checks it needs beyond the plan's own validation.
//!
//! | module | without SP | with sequence parallelism |
//! |---|---|---|
//! | `tok_emb` | vocab-parallel (row-wise), output all-reduced | vocab-parallel, output reduce-scattered along the sequence |
//! | `pos_emb` | replicated | `SequenceParallel` (each rank its positions) |
//! | `blocks.*.ln1`, `ln2`, `ln_f` | replicated | `SequenceParallel` |
//! | `blocks.*.attn.q`, `k`, `v`, `mlp.fc1` | column-wise | column-wise, input all-gathered along the sequence |
//! | `blocks.*.attn.o`, `mlp.fc2` | row-wise, output all-reduced | row-wise, output reduce-scattered along the sequence |
//! | `head` | column-wise, output gathered (or kept vocab-sharded for `loss_parallel`) | the same, input all-gathered along the sequence |
//!
//! Attention heads are split across the tensor-parallel ranks (rank r holds heads
//! r·h/tp .. (r+1)·h/tp), so `n_heads` must be divisible by the tensor-parallel size.

use crate::config::GptConfig;
use crate::gpt::Gpt;
use bonfire_comm::ProcessGroup;
use bonfire_dtensor::DeviceMesh;
use bonfire_dtensor::parallel::{
    ColwiseParallel, Layout, ParallelPlan, RowwiseParallel, SequenceParallel, parallelize_module,
    sequence::check_divisible,
};

/// The GPT's tensor-parallel plan (see the module docs).
pub fn gpt_tp_plan(sequence_parallel: bool, loss_parallel: bool) -> ParallelPlan {
    let head_out = if loss_parallel {
        Layout::Shard(-1)
    } else {
        Layout::Replicate
    };
    if !sequence_parallel {
        let colwise = ColwiseParallel::default();
        let rowwise = RowwiseParallel::default();
        return ParallelPlan::new()
            .add(
                "tok_emb",
                RowwiseParallel::vocab_embedding(Layout::Replicate),
            )
            .add("blocks.*.attn.q", colwise)
            .add("blocks.*.attn.k", colwise)
            .add("blocks.*.attn.v", colwise)
            .add("blocks.*.attn.o", rowwise)
            .add("blocks.*.mlp.fc1", colwise)
            .add("blocks.*.mlp.fc2", rowwise)
            .add("head", colwise.output_layout(head_out));
    }
    let seq = Layout::Shard(1);
    let colwise = ColwiseParallel::default().input_layout(seq);
    let rowwise = RowwiseParallel::default().output_layout(seq);
    let sp = SequenceParallel::default();
    ParallelPlan::new()
        .add("tok_emb", RowwiseParallel::vocab_embedding(seq))
        .add("pos_emb", sp)
        .add("blocks.*.ln1", sp)
        .add("blocks.*.ln2", sp)
        .add("blocks.*.attn.q", colwise)
        .add("blocks.*.attn.k", colwise)
        .add("blocks.*.attn.v", colwise)
        .add("blocks.*.attn.o", rowwise)
        .add("blocks.*.mlp.fc1", colwise)
        .add("blocks.*.mlp.fc2", rowwise)
        .add("ln_f", sp)
        .add("head", colwise.output_layout(head_out))
}

/// Checks what the plan's validation cannot see: heads (and the vocabulary, sharded by the
/// embedding and the head) divisible by the tensor-parallel size.
pub fn check_tp(cfg: &GptConfig, tp: usize) -> Result<(), String> {
    if cfg.n_heads % tp != 0 {
        return Err(format!(
            "n_heads {} is not divisible by the tensor-parallel size {tp}: attention heads are split across tp ranks",
            cfg.n_heads
        ));
    }
    check_divisible(cfg.vocab_size, tp, "vocab_size")?;
    check_divisible(cfg.d_ff, tp, "d_ff")?;
    Ok(())
}

/// Applies [`gpt_tp_plan`] to this rank's `model` over the mesh axis `axis`.
pub fn parallelize_gpt(
    model: Gpt,
    mesh: &DeviceMesh,
    axis: &str,
    sequence_parallel: bool,
    loss_parallel: bool,
) -> Result<Gpt, String> {
    let tp = mesh.axis_size(axis).map_err(|e| e.to_string())?;
    let n_heads = model.blocks.first().map_or(tp, |b| b.attn.n_heads());
    if n_heads % tp != 0 {
        return Err(format!(
            "n_heads {n_heads} is not divisible by the tensor-parallel size {tp}: attention heads are split across tp ranks"
        ));
    }
    let plan = gpt_tp_plan(sequence_parallel, loss_parallel);
    parallelize_module(model, mesh, axis, &plan).map_err(|e| e.to_string())
}

/// All-gathers a row-major host tensor of local `shape`, sharded evenly along `dim` over
/// `group`, into the full tensor's values.
pub fn gather_host(
    values: &[f32],
    shape: &[usize],
    dim: usize,
    group: &ProcessGroup,
) -> Result<Vec<f32>, String> {
    let n = group.size();
    let mut all = vec![0f32; values.len() * n];
    group
        .all_gather(values, &mut all)
        .map_err(|e| e.to_string())?;
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim..].iter().product();
    let mut full = Vec::with_capacity(all.len());
    for o in 0..outer {
        for r in 0..n {
            let part = &all[r * values.len()..(r + 1) * values.len()];
            full.extend_from_slice(&part[o * inner..(o + 1) * inner]);
        }
    }
    Ok(full)
}
