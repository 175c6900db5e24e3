//! ZeRO composed with tensor parallelism on a 2-d mesh dp=2 × tp=2: the tp axis shards the
//! layers (bonfire-dtensor's parallel plan), the dp axis is ZeRO's group. After 3 Adam steps
//! every rank's parameters equal the matching shard of single-device training.

mod common;
use bonfire_comm::ThreadWorld;
use bonfire_dtensor::DeviceMesh;
use bonfire_layout::ZeroStage;
use bonfire_module::DataParallel;
use bonfire_module::params;
use bonfire_tp::{
    ColwiseParallel, ParallelLinear, ParallelPlan, RowwiseParallel, parallelize_module,
};
use bonfire_zero::{Zero, ZeroConfig};
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor};
use common::{Opt, STEPS, assert_trained, batch, device};
use std::time::Duration;

#[derive(Module, Debug)]
struct Mlp {
    up: ParallelLinear,
    down: ParallelLinear,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Self {
            up: ParallelLinear::new(6, 12, true, device),
            down: ParallelLinear::new(12, 1, true, device),
        }
    }
    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        (self.down.forward(gelu(self.up.forward(x))) - y)
            .powi_scalar(2)
            .mean()
    }
}

fn copy(model: &Mlp, device: &Device) -> Mlp {
    let flat = params::flatten_values(model, &params::inventory(model));
    let fresh = Mlp::new(device);
    let infos = params::inventory(&fresh);
    params::assign_values(fresh, &infos, &flat)
}

fn plan() -> ParallelPlan {
    ParallelPlan::new()
        .add("up", ColwiseParallel::default())
        .add("down", RowwiseParallel::default())
}

#[test]
fn dp2_tp2_stages_1_2_3() {
    let plain = Device::flex().autodiff();
    let model = Mlp::new(&plain);
    // Single device, whole batch.
    let mut trained = model.clone().fork(&plain);
    let mut o = AdamConfig::new().init();
    for s in 0..STEPS {
        let (x, y) = batch(s, 0..8, &plain);
        let gp = GradientsParams::from_grads(trained.loss(x, y).backward(), &trained);
        trained = o.step(0.01, trained, gp);
    }
    for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
        let device = device();
        let results = ThreadWorld::new(4)
            .timeout(Duration::from_secs(60))
            .launch(|pg| {
                let mesh = DeviceMesh::new(&pg, &[2, 2], &["dp", "tp"]).unwrap();
                let local =
                    parallelize_module(copy(&model, &device), &mesh, "tp", &plan()).unwrap();
                assert_eq!(local.up.weight.dims(), [6, 6], "tp shards the layers");
                assert_eq!(local.down.weight.dims(), [1, 6]);
                let config = ZeroConfig::new(stage).with_offload(stage == ZeroStage::Zero2);
                let mut z =
                    Zero::on_mesh(local, AdamConfig::new().build(), &mesh, "dp", config).unwrap();
                let dp = z.process_group().rank();
                let rows = dp * 4..(dp + 1) * 4;
                for s in 0..STEPS {
                    let (x, y) = batch(s, rows.clone(), &device);
                    z.train_step(0.01, |m: &Mlp| m.loss(x, y)).unwrap();
                }
                let got = z.full_values().unwrap();
                // The same tp shard of the single-device result.
                let expected =
                    parallelize_module(copy(&trained, &device), &mesh, "tp", &plan()).unwrap();
                let expected = params::flatten_values(&expected, &params::inventory(&expected));
                (got, expected)
            })
            .unwrap();
        for (r, (got, expected)) in results.iter().enumerate() {
            assert_trained(
                got,
                expected,
                Opt::Adam,
                &format!("dp2xtp2 {stage:?} rank {r}"),
            );
        }
    }
}

/// A mesh axis that does not exist is a clear error, not a panic.
#[test]
fn unknown_mesh_axis_is_an_error() {
    let model = Mlp::new(&device());
    let errors = ThreadWorld::new(2)
        .timeout(Duration::from_secs(60))
        .launch(|pg| {
            let mesh = DeviceMesh::new(&pg, &[2], &["dp"]).unwrap();
            let config = ZeroConfig::new(ZeroStage::Zero1);
            let replica = copy(&model, &device());
            match Zero::on_mesh(replica, AdamConfig::new().build(), &mesh, "fsdp", config) {
                Ok(_) => String::new(),
                Err(e) => e.to_string(),
            }
        })
        .unwrap();
    for e in errors {
        assert!(e.contains("fsdp"), "{e}");
    }
}
