//! An ordinary Burn model — `bonfire_models::classifier::Classifier`, three `burn::nn::Linear`
//! layers and ReLUs, no Bonfire type inside — trained data-parallel with DDP or ZeRO 1–3,
//! chosen on the command line like the optimizer, then checked against one device.
//!
//! ```sh
//! cargo run --release --example train_classifier                    # DDP on 2 ranks, AdamW
//! cargo run --release --example train_classifier -- --ranks 4 --zero 3 --optim sgd --lr 0.1
//! ```
//!
//! The model is built on a plain autodiff device; under ZeRO-3 the trainer moves its
//! parameters onto the checkpointing device stage 3 needs and creates the batches there.
//! At the end the whole parameters come back from the wrapper (`Engine::parameters`, built on
//! `bonfire_module::DataParallel::parameters`) and are compared with plain single-device
//! training on the same data.

use bonfire_examples::cli::{fail, init_logging};
use bonfire_layout::ParallelDims;
use bonfire_layout::ZeroStage;
use bonfire_models::classifier::{Classifier, blobs};
use bonfire_module::params;
use bonfire_train::{FitConfig, Launcher, OptimizerKind, Trainer, fit};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Train a plain Burn MLP classifier with DDP or ZeRO on CPU rank threads")]
struct Cli {
    /// Data-parallel ranks.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// ZeRO stage (0 is DDP).
    #[arg(long, default_value_t = 0)]
    zero: usize,
    /// sgd or adamw.
    #[arg(long, default_value = "adamw")]
    optim: String,
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Rows of the global batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
}

const INPUTS: usize = 8;
const HIDDEN: usize = 32;
const CLASSES: usize = 4;

fn main() {
    init_logging();
    let cli = Cli::parse();
    let stage = ZeroStage::from_index(cli.zero)
        .unwrap_or_else(|| fail(format!("--zero {}: 0..=3", cli.zero)));
    let optim = OptimizerKind::parse(&cli.optim).unwrap_or_else(|e| fail(e));
    let device = Device::flex().autodiff();
    device.seed(7);
    let model = Classifier::new(INPUTS, HIDDEN, CLASSES, &device);
    let data =
        |step: usize, device: &Device| blobs(cli.batch, INPUTS, CLASSES, step as u64, device);
    let dims = ParallelDims::new()
        .with_degree(bonfire_layout::Axis::Dp, cli.ranks)
        .with_zero(stage);
    let trainer = Trainer::new(dims.clone(), move || optim.build());
    let config = FitConfig {
        log_every: 10,
        ..FitConfig::new(cli.steps, cli.lr)
    };
    println!(
        "train_classifier: layout {dims}, {} steps of {} rows, {}",
        cli.steps,
        cli.batch,
        optim.name()
    );
    let out = Launcher::Threads { ranks: cli.ranks }
        .run("classifier", |pg| {
            let mut engine = trainer.build(model.clone(), &pg, &data(0, &device))?;
            fit(engine.as_mut(), &data, &config, &mut ())?;
            engine.parameters()
        })
        .unwrap_or_else(|e| fail(e));
    let whole: Vec<f32> = out
        .into_iter()
        .next()
        .expect("rank 0")
        .unwrap_or_else(|e| fail(e))
        .into_iter()
        .flat_map(|p| p.values)
        .collect();
    // The same steps on one device, plain Burn.
    let mut single = model.fork(&device);
    let mut opt = optim.build();
    for step in 0..cli.steps {
        let (x, y) = data(step, &device);
        let grads = GradientsParams::from_grads(single.loss(x, y).backward(), &single);
        single = opt.step(cli.lr, single, grads);
    }
    let reference = params::flatten_values(&single, &params::inventory(&single));
    let worst = whole
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
        .fold(0.0f32, f32::max);
    let (x, y) = blobs(256, INPUTS, CLASSES, 999, &device);
    let accuracy = single
        .forward(x)
        .argmax(1)
        .flatten::<1>(0, 1)
        .equal(y)
        .int()
        .sum()
        .into_scalar::<i64>() as f64
        / 256.0;
    println!("parameters vs one device: largest relative difference {worst:.2e}");
    println!("held-out accuracy {:.1}%", accuracy * 100.0);
}
