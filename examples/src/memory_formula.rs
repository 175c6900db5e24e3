//! What a rank *should* hold for parameters, gradients and optimizer state — the ZeRO
//! paper's formula ([`formula`]) — and the GPT's parameter count per rank after tensor and
//! pipeline parallelism ([`gpt_rank_params`]), the Ψ the formula takes. Both are owned by the
//! planner's cost model (`bonfire_plan::memory::formula`, `bonfire_plan::ModelSpec`); this
//! file maps Bonfire's own types onto it (`MixedPrecision`, `ZeroStage`, `ParallelDims`, the
//! pipeline's stage map). The measured side is [`bonfire_comm::testing::rank_alloc`]'s allocator (`cargo xtask
//! bench memory`); nothing here is measured.

use crate::planner::gpt_spec;
use bonfire_layout::ParallelDims;
use bonfire_models::gpt::config::GptConfig;
use bonfire_pipeline::Generate;

pub use bonfire_plan::memory::{FormulaBytes, bytes_per_param, formula};

/// Parameters of the GPT's pipeline piece `piece` (0: the embeddings, 1..=L: the blocks,
/// L + 1: the final norm and the head) on one rank of `tp` (the plan of
/// [`bonfire_models::gpt::parallelize::gpt_tp_plan`]: the vocabulary, q/k/v/fc1 (weights and biases) and the
/// o/fc2 weights are split; norms, positions and the o/fc2 biases are whole).
pub fn gpt_piece_params(cfg: &GptConfig, tp: usize, piece: usize) -> usize {
    gpt_spec(cfg).piece_params(tp, piece)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::default_device;
    use bonfire_comm::ThreadWorld;
    use bonfire_dtensor::DeviceMesh;
    use bonfire_models::gpt::Gpt;
    use bonfire_models::gpt::parallelize::{gpt_tp_plan, pieces};
    use bonfire_pipeline::ScheduleKind;
    use bonfire_tp::parallelize_module;
    use burn::module::Module;

    fn cfg() -> GptConfig {
        GptConfig {
            vocab_size: 32,
            d_model: 16,
            n_heads: 4,
            n_layers: 4,
            max_seq_len: 8,
            d_ff: 32,
        }
    }

    #[test]
    fn whole_model_and_pipeline_pieces_count_as_the_model() {
        let cfg = cfg();
        let model = Gpt::new(&cfg, &default_device());
        assert_eq!(
            gpt_rank_params(&cfg, &ParallelDims::new(), 0),
            model.num_params()
        );
        for (i, (_, piece)) in pieces(model).into_iter().enumerate() {
            assert_eq!(
                gpt_piece_params(&cfg, 1, i),
                piece.num_params(),
                "piece {i}"
            );
        }
    }

    #[test]
    fn stages_split_as_the_schedule_places_them() {
        let cfg = cfg(); // 6 pieces: embed, 4 blocks, head
        let (e, b, h) = (
            gpt_piece_params(&cfg, 1, 0),
            gpt_piece_params(&cfg, 1, 1),
            gpt_piece_params(&cfg, 1, 5),
        );
        let dims = |mesh: &str, kind| ParallelDims::parse_mesh(mesh).unwrap().with_schedule(kind);
        let pp2 = dims("pp=2,dp=2", ScheduleKind::OneFOneB);
        assert_eq!(gpt_rank_params(&cfg, &pp2, 1), e + 2 * b);
        assert_eq!(gpt_rank_params(&cfg, &pp2, 2), 2 * b + h);
        let pp4 = dims("pp=4", ScheduleKind::GPipe);
        let got: Vec<usize> = (0..4).map(|r| gpt_rank_params(&cfg, &pp4, r)).collect();
        assert_eq!(got, [e + b, 2 * b, b, h]);
        // ZB-V on 2 ranks: 4 stages of 2, 2, 1, 1 pieces; stages 0 and 3 on rank 0.
        let zbv = dims("pp=2", ScheduleKind::ZbV);
        assert_eq!(gpt_rank_params(&cfg, &zbv, 0), e + b + h);
        assert_eq!(gpt_rank_params(&cfg, &zbv, 1), 3 * b);
        let inter = dims("pp=2", ScheduleKind::Interleaved { chunks: 2 });
        assert_eq!(gpt_rank_params(&cfg, &inter, 0), e + 2 * b);
        assert_eq!(gpt_rank_params(&cfg, &inter, 1), 2 * b + h);
    }

    #[test]
    fn tensor_parallel_shards_count_as_the_plan_splits() {
        let cfg = cfg();
        let model = Gpt::new(&cfg, &default_device());
        for (tp, sp) in [(2, false), (2, true), (4, true)] {
            let counts = ThreadWorld::new(tp)
                .launch(|pg| {
                    let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
                    let m = model.clone().fork(&default_device());
                    let m = parallelize_module(m, &mesh, "tp", &gpt_tp_plan(sp, true)).unwrap();
                    m.num_params()
                })
                .unwrap();
            let dims = ParallelDims::parse_mesh(&format!("tp={tp}")).unwrap();
            for (rank, n) in counts.into_iter().enumerate() {
                assert_eq!(gpt_rank_params(&cfg, &dims, rank), n, "tp={tp} sp={sp}");
            }
        }
    }
}
