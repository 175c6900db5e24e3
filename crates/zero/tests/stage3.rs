//! Stage 3's mechanics: parameters are gathered in forward, re-gathered in backward under
//! Balanced checkpointing (recompute), gradients come back reduce-scattered, gathers are
//! prefetched, and between steps a rank holds only its shard.

mod common;
use bonfire_comm::OpKind;
use bonfire_comm::ThreadWorld;
use bonfire_dtensor::CommCounter;
use bonfire_layout::ZeroStage;
use bonfire_module::DataParallel;
use bonfire_zero::{Zero, ZeroConfig, held_param_bytes};
use burn::optim::SgdConfig;
use common::*;
use std::time::Duration;

fn counts(model: &Net, prefetch: bool) -> Vec<(usize, usize, usize, usize, Vec<f32>)> {
    let device = device();
    ThreadWorld::new(2)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let config = ZeroConfig::new(ZeroStage::Zero3).with_prefetch(prefetch);
            let replica = on_device(model, &device);
            let mut z = Zero::new(replica, SgdConfig::new().build(), pg.clone(), config).unwrap();
            // Between steps: only the shard, no full parameter.
            assert_eq!(held_param_bytes(z.model()), 0);
            let (x, y) = batch(0, pg.rank() * 4..(pg.rank() + 1) * 4, &device);
            let fwd = CommCounter::start();
            let loss = z.forward(|m: &Net| m.loss(x, y));
            let forward_gathers = fwd.count(OpKind::AllGather);
            drop(fwd);
            let bwd = CommCounter::start();
            z.backward(loss).unwrap();
            let backward_gathers = bwd.count(OpKind::AllGather);
            let scatters = bwd.count(OpKind::ReduceScatter);
            drop(bwd);
            let mem = z.memory();
            assert_eq!(mem.grads, z.own_range().len() * 4);
            assert_eq!(mem.params, z.own_range().len() * 4);
            z.step(0.1).unwrap();
            (
                forward_gathers,
                backward_gathers,
                scatters,
                z.params().len(),
                z.full_values().unwrap(),
            )
        })
        .unwrap()
}

#[test]
fn regathered_in_backward_and_prefetched() {
    let model = initial();
    let plain = counts(&model, false);
    for (fwd, bwd, scatters, params, _) in &plain {
        assert_eq!(fwd, params, "one gather per parameter in forward");
        assert!(*bwd > 0, "backward re-gathers (recompute)");
        assert_eq!(
            scatters, params,
            "one reduce-scatter per parameter in backward"
        );
    }
    let pre = counts(&model, true);
    for (fwd, _, _, params, _) in &pre {
        // The prefetched gathers ran on the helper thread, not on the rank's thread.
        assert!(
            fwd < params,
            "prefetch: {fwd} of {params} gathers on the rank thread"
        );
    }
    assert_eq!(plain[0].4, pre[0].4, "prefetch changes nothing numerically");
}
