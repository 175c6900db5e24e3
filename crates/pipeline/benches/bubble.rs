//! `cargo xtask bench pipeline`: the measured bubble fraction of every schedule next to theory.
//!
//! Two stage workloads, both driven by the real runtime (`run_unchecked` over `bonfire-comm`
//! send/recv between rank threads):
//! - `sleep`: each action sleeps its simulated compute time (forward `F` = 4 ms per rank and
//!   micro-batch, backward `2F` split into B = W = `F`, divided by `v` for `v` chunks), so
//!   the ranks do not compete for the 2 cores and the bubble can be held against theory;
//! - `matmul`: fixed-size matmuls with a hand-written backward (B: `dx = dy·Wᵀ`, W:
//!   `dW = xᵀ·dy`), so forward, input-gradient and weight-gradient steps cost the same flops
//!   and the zero-bubble split is real. Ranks are threads on a small machine, so this one
//!   includes core contention.
//!
//! The third workload, `gpt` (the GPT's real stages), is `bonfire-examples`' `pipeline_gpt`
//! bench, which `cargo xtask bench pipeline` runs after this one with the same flags.
//!
//! Prints `bench pipeline schedule=… p=… m=… bubble=… theory=… workload=… step_ms=…` and
//! writes each configuration's last step as an SVG under `target/pipeline-timelines/`.

use bonfire_comm::{ProcessGroup, ThreadWorld};
use bonfire_pipeline::Generate;
use bonfire_pipeline::schedule::Costs;
use bonfire_pipeline::{
    Activation, PipelineError, Schedule, ScheduleKind, StageCompute, Timeline, check, run_unchecked,
};
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use clap::Parser;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(about = "Pipeline bubble fraction per schedule, measured against theory")]
struct Args {
    /// Pipeline sizes.
    #[arg(long, value_delimiter = ',', default_values_t = vec![2, 4])]
    ranks: Vec<usize>,
    /// Micro-batch counts.
    #[arg(long, value_delimiter = ',', default_values_t = vec![4, 8, 16])]
    microbatches: Vec<usize>,
    /// Schedules: gpipe, 1f1b, interleaved[:v], zb-h1, zb-v.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["gpipe".to_string(), "1f1b".into(), "interleaved:2".into(), "zb-h1".into(), "zb-v".into()])]
    schedules: Vec<String>,
    /// Workloads: sleep, matmul (gpt: see `examples/benches/pipeline_gpt.rs`).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["sleep".to_string(), "matmul".into()])]
    workloads: Vec<String>,
    /// Simulated forward time per rank and micro-batch (ms); backward is twice that. At 2 ms
    /// thread wake-up latency on a loaded 2-core machine shows up as extra bubble.
    #[arg(long, default_value_t = 4.0)]
    forward_ms: f64,
    /// Matmul workload: rows per micro-batch. With the width, keeps each matmul under
    /// Flex's 192³ threshold for multi-threaded gemm, so a rank is one thread.
    #[arg(long, default_value_t = 96)]
    rows: usize,
    /// Matmul workload: width of the square weights.
    #[arg(long, default_value_t = 256)]
    width: usize,
    /// Matmul workload: layers per rank (split evenly over its chunks).
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Measured steps per configuration (after one warm-up step); the bubble reported is
    /// their median (the machine is shared, outliers are common).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Where the SVG timelines go (default: the workspace's `target/pipeline-timelines`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Accepted for `cargo bench` compatibility.
    #[arg(long, hide = true)]
    bench: bool,
    /// The `gpt` workload's pieces (`examples/benches/pipeline_gpt.rs`); accepted and unused
    /// here, so that `cargo xtask bench pipeline` can pass it to both benches.
    #[arg(long, hide = true)]
    pieces: Option<String>,
    /// The `gpt` workload's block count; accepted and unused here (see `pieces`).
    #[arg(long, hide = true)]
    gpt_layers: Option<usize>,
}

/// Sleeps for the simulated cost of each action.
struct SleepStage {
    forward: Duration,
    backward_input: Duration,
    backward_weight: Duration,
}

fn small() -> Option<Activation> {
    Some(Activation::new(vec![16], vec![0.5; 16]))
}

impl StageCompute for SleepStage {
    fn forward(
        &mut self,
        _: usize,
        _: usize,
        _: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        std::thread::sleep(self.forward);
        Ok(small())
    }
    fn backward(
        &mut self,
        _: usize,
        _: usize,
        _: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        std::thread::sleep(self.backward_input + self.backward_weight);
        Ok(small())
    }
    fn backward_input(
        &mut self,
        _: usize,
        _: usize,
        _: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        std::thread::sleep(self.backward_input);
        Ok(small())
    }
    fn backward_weight(&mut self, _: usize, _: usize) -> Result<(), PipelineError> {
        std::thread::sleep(self.backward_weight);
        Ok(())
    }
}

/// Linear layers without bias or activation, with a hand-written split backward.
struct MatmulStage {
    device: Device,
    rows: usize,
    width: usize,
    /// `weights[chunk][layer]`.
    weights: Vec<Vec<Tensor<2>>>,
    grads: Vec<Vec<Tensor<2>>>,
    /// Layer inputs kept from forward, per (mb, chunk).
    inputs: HashMap<(usize, usize), Vec<Tensor<2>>>,
    /// Output gradients of each layer kept from B for W, per (mb, chunk).
    out_grads: HashMap<(usize, usize), Vec<Tensor<2>>>,
}

impl MatmulStage {
    fn new(chunks: usize, layers: usize, rows: usize, width: usize) -> Self {
        let device = Device::flex();
        let per = (layers / chunks).max(1);
        let scale = 1.0 / (width as f64).sqrt();
        let weights: Vec<Vec<Tensor<2>>> = (0..chunks)
            .map(|_| {
                (0..per)
                    .map(|_| {
                        Tensor::random(
                            [width, width],
                            Distribution::Uniform(-scale, scale),
                            &device,
                        )
                    })
                    .collect()
            })
            .collect();
        let grads = weights
            .iter()
            .map(|c| c.iter().map(|w| w.zeros_like()).collect())
            .collect();
        Self {
            device,
            rows,
            width,
            weights,
            grads,
            inputs: HashMap::new(),
            out_grads: HashMap::new(),
        }
    }

    fn tensor(&self, a: Option<Activation>) -> Tensor<2> {
        match a {
            Some(a) => Tensor::from_data(
                TensorData::new(a.data, [self.rows, self.width]),
                &self.device,
            ),
            None => Tensor::ones([self.rows, self.width], &self.device),
        }
    }

    fn host(t: Tensor<2>) -> Option<Activation> {
        let shape = t.dims().to_vec();
        Some(Activation::new(
            shape,
            t.into_data().try_into_vec::<f32>().unwrap(),
        ))
    }

    fn input_grad(&mut self, mb: usize, chunk: usize, g: Option<Activation>) -> Tensor<2> {
        let mut dy = self.tensor(g);
        let mut kept = Vec::with_capacity(self.weights[chunk].len());
        for w in self.weights[chunk].iter().rev() {
            kept.push(dy.clone());
            dy = dy.matmul(w.clone().transpose());
        }
        kept.reverse();
        self.out_grads.insert((mb, chunk), kept);
        dy
    }

    fn weight_grad(&mut self, mb: usize, chunk: usize) {
        let xs = self.inputs.remove(&(mb, chunk)).unwrap();
        let dys = self.out_grads.remove(&(mb, chunk)).unwrap();
        for (l, (x, dy)) in xs.into_iter().zip(dys).enumerate() {
            let g = x.transpose().matmul(dy);
            self.grads[chunk][l] = self.grads[chunk][l].clone() + g;
        }
    }
}

impl StageCompute for MatmulStage {
    fn forward(
        &mut self,
        mb: usize,
        chunk: usize,
        input: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        let mut x = self.tensor(input);
        let mut kept = Vec::with_capacity(self.weights[chunk].len());
        for w in &self.weights[chunk] {
            kept.push(x.clone());
            x = x.matmul(w.clone());
        }
        self.inputs.insert((mb, chunk), kept);
        Ok(Self::host(x))
    }
    fn backward(
        &mut self,
        mb: usize,
        chunk: usize,
        g: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        let dx = self.input_grad(mb, chunk, g);
        self.weight_grad(mb, chunk);
        Ok(Self::host(dx))
    }
    fn backward_input(
        &mut self,
        mb: usize,
        chunk: usize,
        g: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        let dx = self.input_grad(mb, chunk, g);
        Ok(Self::host(dx))
    }
    fn backward_weight(&mut self, mb: usize, chunk: usize) -> Result<(), PipelineError> {
        self.weight_grad(mb, chunk);
        Ok(())
    }
}

fn step(
    pg: &ProcessGroup,
    schedule: &Schedule,
    stage: &mut dyn StageCompute,
) -> bonfire_pipeline::RankTimeline {
    pg.barrier().unwrap();
    run_unchecked(pg, schedule, stage).unwrap()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn main() {
    let args = Args::parse();
    // `cargo bench` runs in the package directory: default to the workspace's target dir.
    let out = args.out.clone().unwrap_or_else(|| {
        std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"))
            .join("pipeline-timelines")
    });
    std::fs::create_dir_all(&out).expect("create the timeline directory");
    // The machine is shared: say how loaded it was.
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        println!(
            "# pipeline bubble bench: cores={cores} loadavg={}",
            load.trim()
        );
    }
    for workload in &args.workloads {
        if workload == "gpt" {
            // The GPT's stages live above this crate: `bonfire-examples`' `pipeline_gpt`
            // bench, which `cargo xtask bench pipeline` runs after this one.
            continue;
        }
        for &p in &args.ranks {
            for &m in &args.microbatches {
                for name in &args.schedules {
                    if name.ends_with(":nosplit") {
                        continue; // the gpt workload's variant (B/W split off)
                    }
                    measure(&args, &out, workload, p, m, name);
                }
            }
        }
    }
}

/// One configuration of the synthetic workloads: `workload` on `p` rank threads, `m`
/// micro-batches under schedule `name`; prints its line and writes its last step's SVG.
fn measure(args: &Args, out: &std::path::Path, workload: &str, p: usize, m: usize, name: &str) {
    let Some(kind) = ScheduleKind::parse(name) else {
        eprintln!("unknown schedule `{name}`");
        std::process::exit(2);
    };
    let schedule = kind.generate(p, m);
    check(&schedule).expect("generated schedules pass the checker");
    let v = kind.chunks();
    let (theory, theory_kind) = match kind.theory_bubble(p, m) {
        Some(t) => (t, "formula"),
        None => (
            Timeline::simulate(&schedule, Costs::default())
                .unwrap()
                .bubble(),
            "simulated",
        ),
    };
    let per_chunk = Duration::from_secs_f64(args.forward_ms / 1e3 / v as f64);
    let results = ThreadWorld::new(p)
        .timeout(Duration::from_secs(120))
        .launch(|pg| {
            let mut stage: Box<dyn StageCompute> = match workload {
                "sleep" => Box::new(SleepStage {
                    forward: per_chunk,
                    backward_input: per_chunk,
                    backward_weight: per_chunk,
                }),
                "matmul" => Box::new(MatmulStage::new(v, args.layers, args.rows, args.width)),
                other => panic!("unknown workload `{other}` (sleep, matmul)"),
            };
            step(&pg, &schedule, stage.as_mut()); // warm-up
            (0..args.steps)
                .map(|_| step(&pg, &schedule, stage.as_mut()))
                .collect::<Vec<_>>()
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let mut per_rank: Vec<_> = results.into_iter().map(|r| r.into_iter()).collect();
    let mut bubbles = Vec::new();
    let mut makespans = Vec::new();
    let mut last = None;
    for _ in 0..args.steps {
        let t = Timeline::merge(per_rank.iter_mut().map(|r| r.next().unwrap()).collect());
        bubbles.push(t.bubble());
        makespans.push(t.makespan().as_secs_f64() * 1e3);
        last = Some(t);
    }
    let bubble = median(&mut bubbles);
    let step_ms = median(&mut makespans);
    println!(
        "bench pipeline schedule={} p={p} m={m} bubble={bubble:.4} theory={theory:.4} workload={workload} theory_from={theory_kind} step_ms={step_ms:.2} peak_act={}",
        kind.name(),
        schedule.peak_activations().iter().max().unwrap_or(&0)
    );
    if let Some(t) = last {
        let file = out.join(format!(
            "{workload}-{}-p{p}-m{m}.svg",
            kind.name().replace(':', "v")
        ));
        let title = format!("{} p={p} m={m} ({workload})", kind.name());
        std::fs::write(&file, t.to_svg(&title)).expect("write the SVG");
    }
}
