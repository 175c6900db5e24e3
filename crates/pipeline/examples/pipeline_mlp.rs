//! Trains a small MLP with pipeline parallelism on rank threads and draws the executed
//! schedule of the last step as an SVG.
//!
//!     cargo run --release -p bonfire-pipeline --example pipeline_mlp -- \
//!         --schedule 1f1b --pp 4 --microbatches 8 --steps 5
//!
//! Writes `target/pipeline-timelines/example-<schedule>-p<pp>-m<m>.svg` and prints the loss
//! of every step and the bubble fraction of the last one.

use bonfire_comm::launch;
use bonfire_dtensor::DeviceMesh;
use bonfire_pipeline::Generate;
use bonfire_pipeline::{
    Block, BurnStage, LocalChunks, ScheduleKind, Timeline, chunks_for_rank, microbatch_weights,
    run_schedule, split_balanced, split_batch,
};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::{Device, Tensor, TensorData, activation::gelu};
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug)]
struct Args {
    /// gpipe, 1f1b, interleaved[:v], zb-h1, zb-v.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    #[arg(long, default_value_t = 4)]
    pp: usize,
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Blocks in the model (at least the number of stages).
    #[arg(long, default_value_t = 8)]
    blocks: usize,
    #[arg(long, default_value_t = 256)]
    width: usize,
    #[arg(long, default_value_t = 64)]
    batch: usize,
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Module, Debug)]
struct Mlp {
    linear: Linear,
}

impl Block<2> for Mlp {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.clone() + gelu(self.linear.forward(x))
    }
}

fn data(step: usize, rows: usize, width: usize, device: &Device) -> Tensor<2> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ step as u64;
    let values: Vec<f32> = (0..rows * width)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect();
    Tensor::from_data(TensorData::new(values, [rows, width]), device)
}

fn main() {
    let args = Args::parse();
    let kind = ScheduleKind::parse(&args.schedule).unwrap_or_else(|| {
        eprintln!("unknown schedule `{}`", args.schedule);
        std::process::exit(2)
    });
    let schedule = kind.generate(args.pp, args.microbatches);
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/pipeline-timelines")
    });
    let results = launch(args.pp, |pg| {
        let device = Device::flex().autodiff();
        // Every rank builds the blocks and keeps its own chunks (random init: this example
        // does not compare with a single device; see tests/parity.rs for that).
        let blocks: Vec<Mlp> = (0..args.blocks)
            .map(|_| Mlp {
                linear: LinearConfig::new(args.width, args.width).init(&device),
            })
            .collect();
        let stages = split_balanced(blocks, schedule.stages()).expect("enough blocks");
        let mut chunks = chunks_for_rank(&stages, &schedule, pg.rank()).unwrap();
        drop(stages);
        let mut optim = SgdConfig::new().init();
        let mut losses = Vec::new();
        let mut timeline = None;
        for step in 0..args.steps {
            // The same batch on every rank (the first stage reads x, the last one y).
            let x = data(step % 2, args.batch, args.width, &device);
            let y = x.clone().mul_scalar(0.5);
            let targets = split_batch(y, args.microbatches);
            let mut stage = BurnStage::new(
                LocalChunks::new(chunks),
                &schedule,
                pg.rank(),
                device.clone(),
                microbatch_weights(args.batch, args.microbatches),
            )
            .with_inputs(split_batch(x, args.microbatches))
            .with_loss(move |mb, out: Tensor<2>| (out - targets[mb].clone()).powi_scalar(2).mean());
            pg.barrier().unwrap();
            let mesh = DeviceMesh::one_d(&pg, "pp").unwrap();
            timeline = Some(run_schedule(&mesh, "pp", &schedule, &mut stage).unwrap());
            let (held, loss) = stage.finish();
            let (c, grads) = held.into_parts();
            chunks = optim.step(0.05, c, grads);
            losses.push(loss);
        }
        (losses, timeline.unwrap())
    })
    .unwrap();
    let mut timelines = Vec::new();
    for (losses, t) in results {
        if losses.iter().all(Option::is_some) {
            for (i, l) in losses.iter().enumerate() {
                println!("step {i}: loss {:.5}", l.unwrap());
            }
        }
        timelines.push(t);
    }
    let timeline = Timeline::merge(timelines);
    std::fs::create_dir_all(&out).unwrap();
    let file = out.join(format!(
        "example-{}-p{}-m{}.svg",
        kind.name().replace(':', "v"),
        args.pp,
        args.microbatches
    ));
    let title = format!(
        "{} p={} m={} (MLP, Burn autodiff)",
        kind.name(),
        args.pp,
        args.microbatches
    );
    std::fs::write(&file, timeline.to_svg(&title)).unwrap();
    println!(
        "schedule={} p={} m={} bubble={:.4} step_ms={:.2} svg={}",
        kind.name(),
        args.pp,
        args.microbatches,
        timeline.bubble(),
        timeline.makespan().as_secs_f64() * 1e3,
        file.display()
    );
}
