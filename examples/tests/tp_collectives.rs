//! The collectives each layer of the tensor-parallel GPT issues, forward and backward, with
//! and without sequence and loss parallelism (PyTorch's `CommDebugMode` check).

mod common;

use bonfire_comm::{OpKind, ThreadWorld};
use bonfire_dtensor::{CommCounter, DeviceMesh};
use bonfire_examples::default_device;
use bonfire_models::gpt::parallelize::gpt_tp_plan;
use bonfire_models::{Gpt, GptConfig};
use bonfire_tp::{clear_parallel_states, parallelize_module};
use burn::module::Module;
use std::time::Duration;

/// The collectives of one forward and backward of the parallelized GPT, per layer kind.
#[test]
fn collective_counts() {
    let cfg = GptConfig {
        n_heads: 4,
        ..GptConfig::tiny()
    };
    let model = bonfire_module::params::seeded(41, &default_device(), |d| Gpt::new(&cfg, d));
    let batches = common::random_batches(&cfg, 1, 4, 7);
    let layers = cfg.n_layers;
    for (sp, lp) in [(false, false), (true, true), (false, true), (true, false)] {
        let counts = ThreadWorld::new(2)
            .timeout(Duration::from_secs(60))
            .launch(|pg| {
                let device = default_device();
                let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
                let plan = gpt_tp_plan(sp, lp);
                let model =
                    parallelize_module(model.clone().fork(&device), &mesh, "tp", &plan).unwrap();
                let (ids, targets) = batches.rows(0, 0, 4, &device);
                let counter = CommCounter::start();
                let loss = model.loss(ids, targets);
                let fwd = counter.counts();
                counter.reset();
                loss.backward();
                let bwd = counter.counts();
                clear_parallel_states();
                (fwd, bwd)
            })
            .unwrap();
        let (fwd, bwd) = &counts[0];
        let n =
            |m: &std::collections::BTreeMap<OpKind, usize>, op| m.get(&op).copied().unwrap_or(0);
        let what = format!("sp={sp} lp={lp}: forward {fwd:?}, backward {bwd:?}");
        if !sp {
            // Forward: one all-reduce per row-wise output (tok_emb, o, fc2 per block); the
            // head's logits gathered, or loss_parallel's all-gather and all-reduce of B·T
            // floats.
            assert_eq!(
                n(fwd, OpKind::AllReduce),
                1 + 2 * layers + if lp { 1 } else { 0 },
                "{what}"
            );
            assert_eq!(n(fwd, OpKind::AllGather), 1, "{what}");
            assert_eq!(n(fwd, OpKind::ReduceScatter), 0, "{what}");
            // Backward: one all-reduce per column-wise input (q, k, v, fc1, head).
            assert_eq!(n(bwd, OpKind::AllReduce), 4 * layers + 1, "{what}");
            assert_eq!(bwd.len(), 1, "{what}");
        } else {
            // Forward: a reduce-scatter per row-wise output, an all-gather of the sequence
            // per column-wise input, plus the head's vocabulary gather without lp, or
            // loss_parallel's all-gather and all-reduce of B·T floats with it.
            assert_eq!(n(fwd, OpKind::ReduceScatter), 1 + 2 * layers, "{what}");
            assert_eq!(n(fwd, OpKind::AllGather), 4 * layers + 2, "{what}");
            assert_eq!(n(fwd, OpKind::AllReduce), if lp { 1 } else { 0 }, "{what}");
            // Backward: the duals, and one all-reduce per replicated parameter used on
            // sequence shards (2 per LayerNorm, the row-wise biases, pos_emb).
            assert_eq!(n(bwd, OpKind::AllGather), 1 + 2 * layers, "{what}");
            assert_eq!(n(bwd, OpKind::ReduceScatter), 4 * layers + 1, "{what}");
            assert_eq!(
                n(bwd, OpKind::AllReduce),
                2 * (2 * layers + 1) + 2 * layers + 1,
                "{what}"
            );
        }
    }
}
