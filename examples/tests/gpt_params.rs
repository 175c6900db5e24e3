//! The GPT's parameters per rank as the memory bench counts them (`benches/common/formula.rs`,
//! from the planner's `ModelSpec`) against the real model: whole, in pipeline pieces, under
//! each schedule's stage placement and under tensor parallelism.

#[path = "../benches/common/formula.rs"]
mod formula;

use bonfire_layout::ParallelDims;
use bonfire_models::gpt::config::GptConfig;
use formula::{gpt_piece_params, gpt_rank_params};

fn default_device() -> burn::tensor::Device {
    burn::tensor::Device::flex().autodiff()
}
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
    let model = bonfire_module::params::seeded(59, &default_device(), |d| Gpt::new(&cfg, d));
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
    let model = bonfire_module::params::seeded(59, &default_device(), |d| Gpt::new(&cfg, d));
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
