//! Context parallelism at the model level: the GPT and the Llama, each rank holding its
//! load-balanced chunks of every sequence inside a `ContextScope` (ring attention, positions
//! of its chunks), give the one-device loss (the mean of the ranks' losses) and the one-device
//! gradient of every parameter (the mean of the ranks' gradients), cp = 2 and 4, with
//! exactly `2·(cp − 1)` sends and as many receives per layer and nothing else.

mod common;

use bonfire_comm::testing::{Tolerance, assert_close};
use bonfire_comm::{OpKind, ReduceOp, ThreadWorld};
use bonfire_cp::{ContextScope, ContextSplit};
use bonfire_dtensor::CommCounter;
use bonfire_examples::default_device;
use bonfire_models::Gpt;
use bonfire_models::data::TokenBatch;
use bonfire_models::llama::{Llama, LlamaConfig};
use bonfire_module::params;
use bonfire_parallel::ParallelModel;
use burn::optim::GradientsParams;
use std::time::Duration;

/// f32 against f32 in another order (ring attention's online softmax).
const TOL: Tolerance = Tolerance::new(1e-5, 1e-6);

/// The loss and every parameter's gradient, flat in module order.
fn loss_and_grads<M: ParallelModel<Batch = TokenBatch>>(
    model: &M,
    batch: TokenBatch,
) -> (f32, Vec<f32>) {
    let loss = model.loss(batch);
    let value = params::to_host(loss.clone().detach())[0];
    let mut grads = GradientsParams::from_grads(loss.backward(), model);
    let infos = params::inventory(model);
    let flat = params::take_flat_grads(model, &infos, &mut grads)
        .into_iter()
        .zip(&infos)
        .flat_map(|(g, info)| match g {
            Some(g) => params::to_host(g),
            None => vec![0.0; info.shape.iter().product()],
        })
        .collect();
    (value, flat)
}

fn check<M: ParallelModel<Batch = TokenBatch> + Sync>(
    what: &str,
    (model, layers): (&M, usize),
    batch: &TokenBatch,
    cp: usize,
) {
    let (want_loss, want_grads) = loss_and_grads(model, batch.clone());
    let seq = batch.0.dims()[1];
    let split = ContextSplit::new(seq, cp, true).unwrap();
    let ranks = ThreadWorld::new(cp)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let r = pg.rank();
            let local = (
                split.local(batch.0.clone(), 1, r),
                split.local(batch.1.clone(), 1, r),
            );
            let _scope = ContextScope {
                group: pg.clone(),
                split,
            }
            .enter();
            let counter = CommCounter::start();
            let (loss, mut grads) = loss_and_grads(model, local);
            // Each layer's attention: cp − 1 K/V blocks forward, as many gradients back.
            let ring = 2 * (cp - 1) * layers;
            assert_eq!(
                (
                    counter.count(OpKind::Send),
                    counter.count(OpKind::Recv),
                    counter.total()
                ),
                (ring, ring, 2 * ring),
                "{what} cp={cp}: sends, receives and all calls of one forward and backward"
            );
            drop(counter);
            let mut loss = [loss];
            pg.all_reduce(&mut loss, ReduceOp::Avg).unwrap();
            pg.all_reduce(&mut grads, ReduceOp::Avg).unwrap();
            (loss[0], grads)
        })
        .unwrap();
    for (r, (loss, grads)) in ranks.into_iter().enumerate() {
        let what = format!("{what} cp={cp} rank {r}");
        let c = assert_close(&format!("{what} loss"), &[loss], &[want_loss], TOL).max(
            assert_close(&format!("{what} gradients"), &grads, &want_grads, TOL),
        );
        println!("{what}: {c}");
    }
}

#[test]
fn gpt_and_llama_with_their_sequences_split_equal_one_device() {
    let device = default_device();
    let cfg = common::gpt_cfg();
    let gpt = common::seeded(3, &device, |d| Gpt::new(&cfg, d));
    let batches = common::random_batches(&cfg, 1, 4, 7);
    let llama_cfg = LlamaConfig {
        num_hidden_layers: 2,
        ..LlamaConfig::tiny()
    };
    let llama = common::seeded(5, &device, |d| Llama::new(&llama_cfg, d));
    for cp in [2, 4] {
        check(
            "gpt",
            (&gpt, cfg.n_layers),
            &batches.rows(0, 0, 4, &device),
            cp,
        );
        let layers = llama_cfg.num_hidden_layers;
        check(
            "llama",
            (&llama, layers),
            &batches.rows(0, 0, 4, &device),
            cp,
        );
    }
}
