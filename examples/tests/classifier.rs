//! An ordinary Burn model (`Classifier`: `burn::nn::Linear` + ReLU, `#[derive(Module)]`, no
//! Bonfire type inside) under DDP and ZeRO, as a new user meets them:
//!
//! 1. ZeRO-3 on a model built on a plain autodiff device works (the docs' recipe, forking onto
//!    a checkpointing device, used to panic in Burn's matmul), and inputs on a device of the
//!    wrong strategy fail with an error that says what to do;
//! 2. Burn's optimizer is chosen at run time and handed to every wrapper the same way;
//! 3. whole parameters come back the same way from DDP and ZeRO (`DataParallel::parameters`);
//! 4. a model that shows the wrappers no layers is reported once.
//!
//! Every run is compared with plain single-device Burn training on the same global batches.

mod common;

use bonfire_comm::ThreadWorld;
use bonfire_comm::testing::{Tolerance, assert_close};
use bonfire_ddp::{DdpConfig, DistributedDataParallel};
use bonfire_layout::ZeroStage;
use bonfire_layout::{MixedPrecision, ParallelDims};
use bonfire_models::classifier::{Classifier, blobs};
use bonfire_module::DataParallel;
use bonfire_module::params::{self, ParamValues};
use bonfire_train::{FitConfig, Launcher, OptimizerKind, Trainer, fit};
use bonfire_zero::{Zero, ZeroConfig};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

const STEPS: usize = 4;
const ROWS: usize = 8;
const INPUTS: usize = 6;
const HIDDEN: usize = 16;
const CLASSES: usize = 3;

fn lr(optim: OptimizerKind) -> f64 {
    match optim {
        OptimizerKind::Sgd => 0.2,
        OptimizerKind::AdamW => 0.01,
    }
}

/// The parity suites' tolerances ([`common::SGD`], [`common::adamw`]): AdamW turns the
/// rounding of a gradient that cancels into a step of up to lr, so its floor follows lr.
fn tol(optim: OptimizerKind) -> Tolerance {
    match optim {
        OptimizerKind::Sgd => common::SGD,
        OptimizerKind::AdamW => common::adamw(lr(optim)),
    }
}

/// The model, built on a plain autodiff device, always with the same initial values (seed
/// 11, drawn once for the whole file and cloned: the tests run in parallel).
fn model() -> Classifier {
    static INIT: OnceLock<Classifier> = OnceLock::new();
    INIT.get_or_init(|| {
        let model = common::seeded(11, &Device::flex().autodiff(), |d| {
            Classifier::new(INPUTS, HIDDEN, CLASSES, d)
        });
        let values = params::flatten_values(&model, &params::inventory(&model));
        assert!(values.iter().any(|&v| v != 0.0), "drawn, not zeros");
        model
    })
    .clone()
}

fn batch(
    step: usize,
    device: &Device,
) -> (
    burn::tensor::Tensor<2>,
    burn::tensor::Tensor<1, burn::tensor::Int>,
) {
    blobs(ROWS, INPUTS, CLASSES, step as u64, device)
}

/// Plain Burn on one device, the whole batch each step.
fn single(optim: OptimizerKind) -> Vec<f32> {
    let device = Device::flex().autodiff();
    let mut m = model().fork(&device);
    let mut opt = optim.build();
    for step in 0..STEPS {
        let (x, y) = batch(step, &device);
        let grads = GradientsParams::from_grads(m.loss(x, y).backward(), &m);
        m = opt.step(lr(optim), m, grads);
    }
    params::flatten_values(&m, &params::inventory(&m))
}

fn flat(values: Vec<ParamValues>) -> Vec<f32> {
    values.into_iter().flat_map(|p| p.values).collect()
}

/// Points 2 and 3 through the front door: the stage and the optimizer are run-time values;
/// `Engine::parameters` gives whole parameters whatever the wrapper.
#[test]
fn trained_by_the_trainer_with_ddp_and_zero() {
    for optim in ["sgd", "adamw"] {
        let kind = OptimizerKind::parse(optim).unwrap();
        let want = single(kind);
        for stage in [0, 1, 3] {
            let dims = ParallelDims::parse_mesh("dp=2")
                .unwrap()
                .with_zero(ZeroStage::from_index(stage).unwrap());
            let trainer = Trainer::new(dims.clone(), move || kind.build());
            let model = model();
            let got = Launcher::Threads { ranks: 2 }
                .run("classifier", |pg| {
                    let mut engine =
                        trainer.build(model.clone(), &pg, &batch(0, &model.fc1.weight.device()))?;
                    fit(
                        engine.as_mut(),
                        &batch,
                        &FitConfig::new(STEPS, lr(kind)),
                        &mut (),
                    )?;
                    engine.parameters()
                })
                .unwrap();
            let (a, b) = (
                flat(got[0].as_ref().unwrap().clone()),
                flat(got[1].as_ref().unwrap().clone()),
            );
            assert_eq!(a, b, "{dims} {optim}: ranks agree");
            let c = assert_close(&format!("{dims} {optim}"), &a, &want, tol(kind));
            println!("classifier {dims} {optim}: {c}");
        }
    }
}

/// Each rank's wrapper built directly, chosen at run time, behind one interface.
fn wrapper(
    model: Classifier,
    pg: bonfire_comm::ProcessGroup,
    stage: usize,
    optim: OptimizerKind,
) -> Box<dyn FnMut(usize) -> Vec<ParamValues>> {
    // The same Burn optimizer value goes to either wrapper.
    let opt = optim.build();
    fn run<W: DataParallel<Classifier> + 'static>(
        mut w: W,
        device: Device,
        optim: OptimizerKind,
        rank: usize,
    ) -> Box<dyn FnMut(usize) -> Vec<ParamValues>> {
        Box::new(move |steps| {
            for step in 0..steps {
                let (x, y) = batch(step, &device);
                let rows = ROWS / 2;
                let (x, y) = (
                    x.narrow(0, rank * rows, rows),
                    y.narrow(0, rank * rows, rows),
                );
                w.train_step(lr(optim), |m| m.loss(x, y)).unwrap();
            }
            w.parameters().unwrap()
        })
    }
    let rank = pg.rank();
    match stage {
        0 => {
            let device = Device::flex().autodiff();
            let ddp = DistributedDataParallel::new(model, opt, pg, DdpConfig::new()).unwrap();
            run(ddp, device, optim, rank)
        }
        s => {
            let config = ZeroConfig::new(ZeroStage::from_index(s).unwrap());
            let zero = Zero::new(model, opt, pg, config).unwrap();
            // Inputs go where ZeRO computes (for stage 3, its checkpointing device).
            let device = zero.device().clone();
            run(zero, device, optim, rank)
        }
    }
}

/// Points 1–3 with the wrappers used directly: the model was built on a plain autodiff
/// device; ZeRO-3 computes on `zero.device()` (Balanced checkpointing) and trains; DDP and
/// ZeRO hand back the same whole parameters, equal to one device.
#[test]
fn wrappers_used_directly_on_a_plain_device_model() {
    for optim in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        let want = single(optim);
        for stage in [0, 1, 3] {
            let got = ThreadWorld::new(2)
                .timeout(Duration::from_secs(60))
                .launch(|pg| {
                    let plain = Device::flex().autodiff();
                    // The docs' old recipe: fork onto a checkpointing device (a no-op for the
                    // parameters' strategy in Burn 0.22).
                    let ckpt = plain.clone().gradient_checkpointing();
                    let mut train = wrapper(model().fork(&ckpt), pg, stage, optim);
                    flat(train(STEPS))
                })
                .unwrap();
            assert_eq!(got[0], got[1]);
            assert_close(
                &format!("stage {stage} {}", optim.name()),
                &got[0],
                &want,
                tol(optim),
            );
        }
    }
}

/// Point 1's other half: inputs on a device of another gradient-checkpointing strategy than
/// ZeRO-3's are refused with an error that says where to create them.
#[test]
fn zero3_inputs_on_the_wrong_device_fail_clearly() {
    let errors = ThreadWorld::new(2)
        .timeout(Duration::from_secs(60))
        .launch_each(|pg| {
            let mut zero = Zero::new(
                model(),
                OptimizerKind::Sgd.build(),
                pg,
                ZeroConfig::new(ZeroStage::Zero3),
            )
            .unwrap();
            assert_eq!(
                zero.device().gradient_checkpointing_strategy(),
                Device::flex()
                    .autodiff()
                    .gradient_checkpointing()
                    .gradient_checkpointing_strategy()
            );
            let (x, y) = batch(0, &Device::flex().autodiff());
            let _ = zero.forward(|m| m.loss(x, y));
        });
    let failure = errors
        .into_iter()
        .find_map(|r| r.err())
        .expect("a rank fails");
    assert!(
        failure.message.contains("create them on `Zero::device()`"),
        "{}",
        failure.message
    );
}

/// Captured log lines.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Point 4: a model that shows the wrappers no layers is reported once per job (rank 0, the
/// first forward), whatever the number of steps and ranks.
#[test]
fn a_model_without_layers_is_reported_once() {
    for stage in [0, 3] {
        let log = Capture::default();
        ThreadWorld::new(2)
            .timeout(Duration::from_secs(60))
            .launch(|pg| {
                let sink = log.clone();
                let subscriber = tracing_subscriber::fmt()
                    .with_writer(move || sink.clone())
                    .with_ansi(false)
                    .finish();
                let _guard = tracing::subscriber::set_default(subscriber);
                let mut train = wrapper(model(), pg, stage, OptimizerKind::Sgd);
                train(3);
            })
            .unwrap();
        let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("no layer")).collect();
        assert_eq!(lines.len(), 1, "stage {stage}: {text}");
        assert!(lines[0].contains("bonfire_module::layer"), "{}", lines[0]);
    }
}

/// The layout is the one holder of the ZeRO stage, offload and precision: a ZeRO (or DDP)
/// config that says another is refused by the trainer's check, naming both (it used to be overridden in
/// silence); one that agrees, or leaves them at their defaults, is taken.
#[test]
fn a_zero_config_that_contradicts_the_layout_is_refused() {
    let dims = ParallelDims::parse_mesh("dp=2")
        .unwrap()
        .with_zero(ZeroStage::Zero1);
    let trainer = |config: ZeroConfig| {
        Trainer::new(dims.clone(), || OptimizerKind::Sgd.build()).with_zero(config)
    };
    let b = batch(0, &Device::flex().autodiff());
    let err = trainer(ZeroConfig::new(ZeroStage::Zero3))
        .check(&model(), 2, &b)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the ZeRO config says stage 3, the layout stage 1"),
        "{err}"
    );
    let err = trainer(ZeroConfig::new(ZeroStage::Zero1).with_offload(true))
        .check(&model(), 2, &b)
        .unwrap_err()
        .to_string();
    assert!(err.contains("offload"), "{err}");
    trainer(ZeroConfig::new(ZeroStage::Zero1).with_prefetch(false))
        .check(&model(), 2, &b)
        .unwrap();
    // DDP's precision too: a bf16 DdpConfig under an f32 layout is refused.
    let ddp = |config: DdpConfig| {
        Trainer::new(ParallelDims::parse_mesh("dp=2").unwrap(), || {
            OptimizerKind::Sgd.build()
        })
        .with_ddp(config)
    };
    let err = ddp(DdpConfig::new().with_precision(MixedPrecision::bf16()))
        .check(&model(), 2, &b)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the DDP config says precision bf16, the layout f32"),
        "{err}"
    );
    ddp(DdpConfig::new()).check(&model(), 2, &b).unwrap();
}
