//! Parameter-set checks at construction, unused parameters (zero contribution or a clear
//! error on every rank, never a hang), and usage errors.

use bonfire_comm::ThreadWorld;
use bonfire_ddp::{DdpConfig, DdpError, DistributedDataParallel, UnusedParams};
use bonfire_module::DataParallel;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::{Device, Tensor};
use std::time::Duration;

#[derive(Module, Debug)]
struct TwoHeads {
    a: Linear,
    b: Linear,
}

impl TwoHeads {
    fn new(d_out_b: usize, device: &Device) -> Self {
        Self {
            a: LinearConfig::new(4, 3).init(device),
            b: LinearConfig::new(4, d_out_b).init(device),
        }
    }
    /// Uses `b` only when `use_b`.
    fn loss(&self, x: Tensor<2>, use_b: bool) -> Tensor<1> {
        let y = self.a.forward(x.clone()).powi_scalar(2).mean();
        if use_b {
            y + self.b.forward(x).mean()
        } else {
            y
        }
    }
}

fn world(n: usize) -> ThreadWorld {
    ThreadWorld::new(n).timeout(Duration::from_secs(60))
}

fn device() -> Device {
    Device::flex().autodiff()
}

#[test]
fn mismatched_shapes_fail_on_every_rank_with_the_name() {
    let errors = world(2).launch(|pg| {
        let d = if pg.rank() == 1 { 5 } else { 2 };
        let model = TwoHeads::new(d, &device());
        DistributedDataParallel::new(model, SgdConfig::new().init(), pg, DdpConfig::new())
            .err()
            .map(|e| e.to_string())
    });
    for e in errors.unwrap() {
        let e = e.expect("construction must fail");
        assert!(e.contains("b.weight"), "{e}");
    }
}

#[test]
fn construction_broadcasts_rank_0_parameters() {
    let weights = world(3)
        .launch(|pg| {
            // Different random initial values on every rank.
            let model = TwoHeads::new(2, &device());
            let ddp =
                DistributedDataParallel::new(model, SgdConfig::new().init(), pg, DdpConfig::new())
                    .unwrap();
            ddp.model().a.weight.val().into_data()
        })
        .unwrap();
    assert_eq!(weights[0], weights[1]);
    assert_eq!(weights[0], weights[2]);
}

#[test]
fn unused_parameters_contribute_zero() {
    let out = world(2)
        .launch(|pg| {
            let model = TwoHeads::new(2, &device());
            let mut ddp = DistributedDataParallel::new(
                model,
                SgdConfig::new().init(),
                pg.clone(),
                DdpConfig::new(),
            )
            .unwrap();
            let x = Tensor::<2>::ones([2, 4], &device());
            // `b` is used on rank 0 only; rank 1 contributes zeros.
            let use_b = pg.rank() == 0;
            ddp.train_step(0.1, |m| m.loss(x, use_b)).unwrap();
            let grads = ddp.gradients().unwrap();
            let b_bias = grads
                .into_iter()
                .find(|p| p.path == "b.bias")
                .unwrap()
                .values;
            (ddp.model().b.weight.val().into_data(), b_bias)
        })
        .unwrap();
    assert_eq!(out[0].0, out[1].0, "replicas stay identical");
    // d(mean(b(x)))/d(bias) = 1/2 per output on rank 0, 0 on rank 1: average 1/4.
    assert_eq!(out[0].1.len(), 2, "b.bias has two outputs");
    for g in &out[0].1 {
        assert!((g - 0.25).abs() < 1e-6, "{g}");
    }
}

#[test]
fn unused_parameters_can_be_an_error_naming_them() {
    let out = world(2)
        .launch(|pg| {
            let model = TwoHeads::new(2, &device());
            let config = DdpConfig::new().with_unused(UnusedParams::Error);
            let mut ddp =
                DistributedDataParallel::new(model, SgdConfig::new().init(), pg.clone(), config)
                    .unwrap();
            let x = Tensor::<2>::ones([2, 4], &device());
            let use_b = pg.rank() == 0;
            ddp.train_step(0.1, |m| m.loss(x, use_b)).unwrap_err()
        })
        .unwrap();
    for e in out {
        match e {
            DdpError::UnusedParams(names) => {
                assert_eq!(names, vec!["b.weight".to_string(), "b.bias".to_string()])
            }
            other => panic!("unexpected error {other}"),
        }
    }
}

#[test]
fn step_without_backward_is_a_usage_error() {
    let out = world(1)
        .launch(|pg| {
            let model = TwoHeads::new(2, &device());
            let mut ddp =
                DistributedDataParallel::new(model, SgdConfig::new().init(), pg, DdpConfig::new())
                    .unwrap();
            ddp.step(0.1).unwrap_err().to_string()
        })
        .unwrap();
    assert!(out[0].contains("backward"), "{}", out[0]);
}
