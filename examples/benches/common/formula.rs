//! What a rank *should* hold for parameters, gradients and optimizer state — the ZeRO
//! paper's formula ([`formula`]) — and the GPT's parameter count per rank after tensor and
//! pipeline parallelism ([`gpt_rank_params`]), the Ψ the formula takes. Both are owned by the
//! planner's cost model (`bonfire_plan::memory::formula`, `bonfire_plan::ModelSpec`); this
//! file maps Bonfire's own types onto it (`MixedPrecision`, `ZeroStage`, `ParallelDims`, the
//! pipeline's stage map). The measured side is [`bonfire_comm::testing::rank_alloc`]'s
//! allocator (`cargo xtask bench memory`); nothing here is measured.

use bonfire_layout::ParallelDims;
use bonfire_models::gpt::config::GptConfig;
use bonfire_pipeline::Generate;

/// Parameters of the GPT's pipeline piece `piece` (0: the embeddings, 1..=L: the blocks,
/// L + 1: the final norm and the head) on one rank of `tp` (the plan of
/// [`bonfire_models::gpt::parallelize::gpt_tp_plan`]: the vocabulary, q/k/v/fc1 (weights and biases) and the
/// o/fc2 weights are split; norms, positions and the o/fc2 biases are whole).
pub fn gpt_piece_params(cfg: &GptConfig, tp: usize, piece: usize) -> usize {
    cfg.spec().piece_params(tp, piece)
}

/// The piece index of a split point's module path (`tok_emb`, `blocks.i`, `ln_f`).
fn piece_index(cfg: &GptConfig, name: &str) -> usize {
    match name {
        "tok_emb" => 0,
        "ln_f" => cfg.n_layers + 1,
        other => {
            1 + other
                .strip_prefix("blocks.")
                .and_then(|i| i.parse::<usize>().ok())
                .expect("a piece name")
        }
    }
}

/// This world rank's own parameter count Ψ under `dims`: its tensor-parallel shard of the
/// pieces of the pipeline stages it runs (before any ZeRO sharding over dp). The stages are
/// placed by the schedule's own stage map (`bonfire_pipeline`), the pieces split as the
/// trainer splits them ([`bonfire_plan::stage_ranges`]).
pub fn gpt_rank_params(cfg: &GptConfig, dims: &ParallelDims, rank: usize) -> usize {
    let tp = dims.tp();
    let Some(kind) = dims.pp_options.schedule.filter(|_| dims.pp() > 1) else {
        return (0..cfg.n_layers + 2)
            .map(|p| gpt_piece_params(cfg, tp, p))
            .sum();
    };
    let stage_map = kind.generate(dims.pp(), dims.microbatches()).stage_map;
    let points: Option<Vec<usize>> = dims
        .pp_options
        .split_points
        .as_ref()
        .map(|names| names.iter().map(|n| piece_index(cfg, n)).collect());
    let ranges =
        bonfire_plan::stage_ranges(cfg.n_layers + 2, stage_map.stages(), points.as_deref());
    let pp_rank = rank / (dims.dp() * tp);
    (0..stage_map.chunks())
        .map(|c| ranges[stage_map.stage(pp_rank, c)])
        .flat_map(|(a, b)| a..b)
        .map(|p| gpt_piece_params(cfg, tp, p))
        .sum()
}
