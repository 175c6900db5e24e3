//! Expert parallelism, in the validation set (`planner_validation.rs`'s rows of the Mixtral): no constant
//! was fitted on a mixture of experts. The bench Mixtral's sizes (the bench Llama's body:
//! vocab 4096, hidden 256, 8 heads, 4 kv heads, 4 layers; 8 experts of width 344, top 2)
//! at 64 tokens, one sequence a rank on 4 rank threads (dp = 4, AdamW): without ep, ep = 2
//! and 4 under DDP, ep = 2 under ZeRO-1 and ZeRO-2, ep = 2 DDP in bf16, and ep = 2 and 4
//! under ZeRO-3 (the experts' values sharded over their replicas too). Every rank's held
//! bytes and steady peak are judged as the GPT rows are, all asserted.

use super::{Row, measure_model_row};
use bonfire_examples::default_device;
use bonfire_layout::Axis;
use bonfire_layout::{MixedPrecision, ZeroStage};
use bonfire_models::llama::LlamaConfig;
use bonfire_models::mixtral::{Mixtral, MixtralConfig};
use bonfire_plan::predict_ranks;
use bonfire_plan::{Request, base_layout};
use std::time::Instant;

/// Trains the rows (allocator ranks from `slot`), prints each with the planner's state
/// split into parameters, gradients and optimizer state, and adds them to `rows`.
///
/// The ZeRO-3 rows' peaks have the least headroom (1.14 on two ranks of ep = 2): ZeRO-3 at
/// one sequence a rank reads high on a dense model too — the bench Llama (the same body, no
/// experts) on dp = 4 ZeRO-3 1.16–1.18 (2 layers: 1.24–1.29), the ranks' peaks differing
/// with their timing, as *small*'s HSDP ZeRO-3 did (docs/planner.md).
pub(crate) fn expert_rows(rows: &mut Vec<Row>, mut slot: usize) {
    let clock = Instant::now();
    let cfg = MixtralConfig {
        base: LlamaConfig {
            max_position_embeddings: 64,
            ..MixtralConfig::bench().base
        },
        ..MixtralConfig::bench()
    };
    let req = Request {
        global_batch: 4,
        seq: cfg.base.max_position_embeddings,
        precisions: vec![MixedPrecision::f32()],
        memory_fraction: 1.0,
    };
    let model = bonfire_module::params::seeded(53, &default_device(), |d| Mixtral::new(&cfg, d));
    let spec = cfg.spec();
    let ep = |ep, zero| {
        base_layout(4, 1, 1)
            .with_degree(Axis::Ep, ep)
            .with_zero(zero)
    };
    use ZeroStage::{Zero0, Zero1, Zero2, Zero3};
    let cases = [
        ("dp4", ep(1, Zero0)),
        ("dp4-ep2", ep(2, Zero0)),
        ("dp4-ep4", ep(4, Zero0)),
        ("dp4-ep2-zero1", ep(2, Zero1)),
        ("dp4-ep2-zero2", ep(2, Zero2)),
        ("dp4-ep2-zero3", ep(2, Zero3)),
        ("dp4-ep4-zero3", ep(4, Zero3)),
        (
            "dp4-ep2-bf16",
            ep(2, Zero0).with_precision(MixedPrecision::bf16()),
        ),
    ];
    for (name, layout) in &cases {
        let (row, _) = measure_model_row(
            "validation",
            ("moe", name),
            layout,
            (&model, &spec),
            (&req, slot),
        );
        slot += layout.world_size();
        let parts = predict_ranks(&spec, &req, layout).expect("a layout the planner models");
        eprintln!(
            "planner-check set=validation shape=moe layout={name} \
             predicted_params_grads_optim={:.0?}",
            parts
                .iter()
                .map(|p| (p.state.params, p.state.grads, p.state.optim))
                .collect::<Vec<_>>()
        );
        rows.push(row);
    }
    eprintln!(
        "planner-check set=validation shape=moe rows={} elapsed_s={:.1}",
        cases.len(),
        clock.elapsed().as_secs_f64()
    );
}
