//! `cargo xtask bench pipeline`, workload `gpt`: the bubble of each schedule on the GPT's real
//! stage compute (the bench GPT: vocab 4096, d 256, 8 heads, 4 layers (`--gpt-layers`), seq 128,
//! d_ff 1024, f32), `p` rank threads, `8·p` sequences per step split into `m` micro-batches,
//! next to theory.
//!
//! The pieces (by default `--pieces halves`: the embeddings, each block's attention half
//! `x + Attn(LN1(x))` and MLP half `x + MLP(LN2(x))`, the final norm with the head; with
//! `--pieces blocks` the GPT's own pipeline pieces, whole blocks) are split into the
//! schedule's stages by `bonfire_pipeline::balance_measured`: the cut whose busiest rank has
//! the least measured forward-and-backward time (the same measured costs for every schedule
//! of one `m`). Halves let the cut move by half a block, so the rank holding the head and the
//! loss (the largest piece) can take less of the blocks. Each configuration runs one warm-up
//! step and `--steps` timed ones through `BurnStage` and the runtime (forward, loss,
//! backward; no optimizer step: the bubble is the schedule's); the line reports the medians.
//! Under ZB-H1 and ZB-V the stage splits each backward into B (input gradients) and W
//! (linear weight gradients from what B kept); `split=off` lines run the same schedule with
//! the whole backward in B, as before the split existed.
//!
//! Prints `bench pipeline schedule=… p=… m=… bubble=… theory=… workload=gpt split=…
//! step_ms=… f_ms=… b_ms=… w_ms=… sim_measured=… idle=… imbalance=… bubble_net=… rank_ms=…
//! planned_imbalance=… points=…`, where `f_ms`/`b_ms`/`w_ms` are the mean forward, backward
//! (B, or the whole backward) and W durations per chunk, `sim_measured` is the bubble the
//! schedule would have if each action took its measured mean on its rank and chunk (unequal
//! stages included) with instant messages — the rest of the measured bubble is the runtime's
//! —, `idle` each rank's idle fraction, `rank_ms` each rank's compute (F + B + W) per step,
//! `imbalance` the stage imbalance from it (`max / mean − 1`, `Timeline::imbalance`),
//! `bubble_net` the bubble net of the imbalance (the measured bubble less the idle unequal
//! stages force, `Timeline::bubble_net_of_imbalance`: the busiest rank's idle fraction) and
//! `planned_imbalance` the imbalance the split expected from the piece costs. It shares
//! `bench pipeline`'s flags with `crates/pipeline/benches/bubble.rs` (which runs the `sleep`
//! and `matmul` workloads and leaves `gpt` to this one) and writes each configuration's last
//! step as an SVG under `target/pipeline-timelines/`.

mod common;
use bonfire_comm::{ProcessGroup, ThreadWorld};
use bonfire_examples::default_device;
use bonfire_models::gpt::attention::GptAttention;
use bonfire_models::gpt::block::Mlp;
use bonfire_models::gpt::config::GptConfig;
use bonfire_models::gpt::parallelize::{GptPiece, pieces};
use bonfire_models::gpt::{Gpt, cross_entropy};
use bonfire_module::layer;
use bonfire_pipeline::Generate;
use bonfire_pipeline::schedule::Costs;
use bonfire_pipeline::{
    Action, Block, BurnStage, LocalChunks, RankTimeline, Schedule, ScheduleKind, Timeline,
    balance_measured, check, chunks_for_rank, imbalance, microbatch_weights, rank_loads,
    run_unchecked, split_at,
};
use bonfire_tp::ParallelLayerNorm;
use burn::module::Module;
use burn::tensor::{Int, Tensor};
use clap::Parser;
use common::throughput::{median, random_batches};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Pipeline bubble of the GPT's stages per schedule, measured against theory")]
#[command(ignore_errors = true)]
struct Args {
    /// Pipeline sizes.
    #[arg(long, value_delimiter = ',', default_values_t = vec![2])]
    ranks: Vec<usize>,
    /// Micro-batch counts.
    #[arg(long, value_delimiter = ',', default_values_t = vec![4, 8, 16])]
    microbatches: Vec<usize>,
    /// Schedules (`zb-h1`, `zb-v` run with the B/W split on, and with `:nosplit` off).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["1f1b".to_string(), "zb-h1".into(), "zb-h1:nosplit".into(), "zb-v".into()])]
    schedules: Vec<String>,
    /// Workloads: this bench runs `gpt` only.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["gpt".to_string()])]
    workloads: Vec<String>,
    /// Sequences per step and rank (the global batch is this times the pipeline size).
    #[arg(long, default_value_t = 8)]
    rows_per_rank: usize,
    /// Timed steps per configuration (after one warm-up step); the medians are reported.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// The pieces the split cuts between: `halves` (each block's attention half and MLP
    /// half apart) or `blocks` (the GPT's own pipeline pieces, whole blocks).
    #[arg(long, default_value = "halves")]
    pieces: String,
    /// Transformer blocks of the bench GPT (4 by default; a deeper variant balances finer).
    #[arg(long, default_value_t = 4)]
    gpt_layers: usize,
    /// Where the SVG timelines go (default: the workspace's `target/pipeline-timelines`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Accepted for `cargo bench` compatibility.
    #[arg(long, hide = true)]
    bench: bool,
}

/// A block's first half, `x + Attn(LN1(x))`, as `GptBlock::forward` runs it.
#[derive(Module, Debug)]
struct AttnHalf {
    ln1: ParallelLayerNorm,
    attn: GptAttention,
}

/// A block's second half, `x + MLP(LN2(x))`, as `GptBlock::forward` runs it.
#[derive(Module, Debug)]
struct MlpHalf {
    ln2: ParallelLayerNorm,
    mlp: Mlp,
}

/// A piece the bench's split cuts between: one of the GPT's pipeline pieces, or half a block.
/// Both halves take and give `[B, T, d]`, so a stage boundary between them carries the
/// residual stream, as one between blocks does.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
enum BenchPiece {
    Whole(GptPiece),
    Attn(AttnHalf),
    Mlp(MlpHalf),
}

impl Block<3> for BenchPiece {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        match self {
            BenchPiece::Whole(p) => p.forward(x),
            BenchPiece::Attn(a) => {
                let h = layer(&a.ln1, &x).forward(x.clone());
                x.clone() + layer(&a.attn, &x).forward(h)
            }
            BenchPiece::Mlp(m) => {
                let h = layer(&m.ln2, &x).forward(x.clone());
                x.clone() + layer(&m.mlp, &x).forward(h)
            }
        }
    }
}

/// The bench GPT's pieces with their names: the model's own (`halves` false) or with each
/// block cut into its attention half (`blocks.i.attn`) and MLP half (`blocks.i.mlp`).
fn bench_pieces(cfg: &GptConfig, halves: bool) -> Vec<(String, BenchPiece)> {
    let device = default_device();
    let mut out = Vec::new();
    for (name, piece) in pieces(Gpt::new(cfg, &device)) {
        match piece {
            GptPiece::Layer(b) if halves => {
                let (ln1, attn, ln2, mlp) = (b.ln1, b.attn, b.ln2, b.mlp);
                out.push((
                    format!("{name}.attn"),
                    BenchPiece::Attn(AttnHalf { ln1, attn }),
                ));
                out.push((format!("{name}.mlp"), BenchPiece::Mlp(MlpHalf { ln2, mlp })));
            }
            whole => out.push((name, BenchPiece::Whole(whole))),
        }
    }
    out
}

/// Each piece's forward-and-backward time (ms) on one micro-batch of `rows` sequences under
/// autodiff, the last piece's with the loss: the best of 12 rounds, each running every piece
/// once in order (a burst of load on the shared machine then slows one round of all pieces,
/// not every run of one piece).
fn piece_costs(cfg: &GptConfig, halves: bool, rows: usize) -> Vec<f64> {
    let device = default_device();
    let batches = random_batches(cfg.vocab_size, cfg.max_seq_len, rows, 1, 5);
    let (ids, targets) = batches.rows(0, 0, rows, &device);
    let input: Tensor<3> = ids.float().unsqueeze_dim::<3>(2);
    let all: Vec<BenchPiece> = bench_pieces(cfg, halves)
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let n = all.len();
    let mut costs = vec![f64::INFINITY; n];
    for _ in 0..12 {
        let mut x = input.clone();
        for (i, piece) in all.iter().enumerate() {
            let start = Instant::now();
            let x_in = if i == 0 { x } else { x.require_grad() };
            let y = piece.forward(x_in);
            let root = match i + 1 == n {
                true => cross_entropy(y.clone(), targets.clone()),
                false => y.clone().sum(),
            };
            drop(root.backward());
            x = y.detach();
            costs[i] = costs[i].min(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    costs
}

/// One rank's steps: its chunks of the GPT, `steps + 1` batches, the timelines of the timed
/// ones.
fn rank_steps(
    pg: &ProcessGroup,
    cfg: &GptConfig,
    schedule: &Schedule,
    points: &[usize],
    (rows, steps, split, halves): (usize, usize, bool, bool),
) -> Vec<RankTimeline> {
    let device = default_device();
    let pieces: Vec<BenchPiece> = bench_pieces(cfg, halves)
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let stages = split_at(pieces, points).expect("valid split points");
    let mut chunks = chunks_for_rank(&stages, schedule, pg.rank()).expect("stage map");
    drop(stages);
    let m = schedule.microbatches;
    let batches = random_batches(cfg.vocab_size, cfg.max_seq_len, rows, steps + 1, 5);
    let mut timelines = Vec::with_capacity(steps);
    for s in 0..=steps {
        let micro: Vec<(Tensor<2, Int>, Tensor<2, Int>)> =
            bonfire_pipeline::microbatch_sizes(rows, m)
                .into_iter()
                .scan(0, |at, n| {
                    let b = batches.rows(s, *at, n, &device);
                    *at += n;
                    Some(b)
                })
                .collect();
        let inputs = micro
            .iter()
            .map(|(ids, _)| ids.clone().float().unsqueeze_dim::<3>(2))
            .collect();
        let mut stage = BurnStage::new(
            LocalChunks::new(chunks),
            schedule,
            pg.rank(),
            device.clone(),
            microbatch_weights(rows, m),
        )
        .with_weight_grad_split(split)
        .with_inputs(inputs)
        .with_loss(|mb, logits: Tensor<3>| cross_entropy(logits, micro[mb].1.clone()));
        pg.barrier().expect("barrier");
        let timeline = run_unchecked(pg, schedule, &mut stage).expect("pipeline step");
        let (held, _) = stage.finish();
        chunks = held.into_parts().0;
        if s > 0 {
            timelines.push(timeline);
        }
    }
    timelines
}

/// Mean duration (s) of the compute actions `pick` selects on `rank` (every rank: `None`).
fn mean_s(t: &Timeline, rank: Option<usize>, pick: impl Fn(&Action) -> bool) -> f64 {
    let d: Vec<f64> = t
        .ranks
        .iter()
        .enumerate()
        .filter(|(r, _)| rank.is_none_or(|want| want == *r))
        .flat_map(|(_, spans)| spans)
        .filter(|s| pick(&s.action))
        .map(|s| s.end - s.start)
        .collect();
    if d.is_empty() {
        0.0
    } else {
        d.iter().sum::<f64>() / d.len() as f64
    }
}

fn is_forward(a: &Action) -> bool {
    matches!(a, Action::Forward { .. })
}

fn is_backward(a: &Action) -> bool {
    matches!(a, Action::Backward { .. } | Action::BackwardInput { .. })
}

fn is_weight(a: &Action) -> bool {
    matches!(a, Action::BackwardWeight { .. })
}

/// The bubble `schedule` would have if every action took what it took on average in `t` on
/// its rank and chunk (unequal stages included) and messages were instant: what is left of
/// the measured bubble beyond this is the runtime's (waits, wake-ups, contention).
fn simulated_from(t: &Timeline, schedule: &Schedule) -> f64 {
    let mut means = std::collections::HashMap::new();
    for (r, spans) in t.ranks.iter().enumerate() {
        for s in spans.iter().filter(|s| s.action.is_compute()) {
            let kind = [is_forward, is_backward, is_weight]
                .iter()
                .position(|f| f(&s.action))
                .unwrap_or(0);
            let e = means.entry((r, s.action.chunk(), kind)).or_insert((0.0, 0));
            e.0 += s.end - s.start;
            e.1 += 1;
        }
    }
    let cost = |r: usize, a: &Action| {
        let kind = [is_forward, is_backward, is_weight]
            .iter()
            .position(|f| f(a))
            .unwrap_or(0);
        means
            .get(&(r, a.chunk(), kind))
            .map_or(0.0, |&(sum, n)| sum / n as f64)
    };
    Timeline::simulate_with(schedule, cost).map_or(f64::NAN, |t| t.bubble())
}

/// Each rank's idle fraction of the step.
fn idle(t: &Timeline) -> Vec<f64> {
    let span = t.makespan().as_secs_f64().max(1e-12);
    t.ranks
        .iter()
        .map(|spans| {
            let busy: f64 = spans
                .iter()
                .filter(|s| s.action.is_compute())
                .map(|s| s.end - s.start)
                .sum();
            1.0 - busy / span
        })
        .collect()
}

/// The measured step of one configuration and its line.
fn run(
    args: &Args,
    cfg: &GptConfig,
    (p, m, costs): (usize, usize, &[f64]),
    name: &str,
    out: &std::path::Path,
) {
    let (kind_name, split) = match name.strip_suffix(":nosplit") {
        Some(k) => (k, false),
        None => (name, true),
    };
    let Some(kind) = ScheduleKind::parse(kind_name) else {
        eprintln!("unknown schedule `{name}`");
        std::process::exit(2);
    };
    let schedule = kind.generate(p, m);
    check(&schedule).expect("generated schedules pass the checker");
    let splits = schedule
        .actions
        .iter()
        .flatten()
        .any(|a| matches!(a, Action::BackwardInput { .. }));
    let rows = args.rows_per_rank * p;
    let points = balance_measured(costs, &schedule).expect("enough pieces for the stages");
    let planned = imbalance(&rank_loads(costs, &points, &schedule));
    let halves = args.pieces == "halves";
    let step = (rows, args.steps, split, halves);
    let results = ThreadWorld::new(p)
        .timeout(Duration::from_secs(600))
        .launch(|pg| rank_steps(&pg, cfg, &schedule, &points, step))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut per_rank: Vec<_> = results.into_iter().map(|r| r.into_iter()).collect();
    let (mut bubbles, mut makespans, mut timelines) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.steps {
        let t = Timeline::merge(per_rank.iter_mut().map(|r| r.next().unwrap()).collect());
        bubbles.push(t.bubble());
        makespans.push(t.makespan().as_secs_f64() * 1e3);
        timelines.push(t);
    }
    let last = timelines.last().expect("at least one timed step");
    let ms = |pick: fn(&Action) -> bool| {
        let all: Vec<f64> = timelines.iter().map(|t| mean_s(t, None, pick)).collect();
        median(all) * 1e3
    };
    let (f, b, w) = (ms(is_forward), ms(is_backward), ms(is_weight));
    let sim = median(
        timelines
            .iter()
            .map(|t| simulated_from(t, &schedule))
            .collect(),
    );
    let of_steps = |f: fn(&Timeline) -> f64| median(timelines.iter().map(f).collect());
    let (imb, net) = (
        of_steps(Timeline::imbalance),
        of_steps(Timeline::bubble_net_of_imbalance),
    );
    let rank_ms: Vec<String> = (0..p)
        .map(|r| {
            let v = timelines.iter().map(|t| t.busy()[r] * 1e3).collect();
            format!("{:.0}", median(v))
        })
        .collect();
    let idles: Vec<String> = (0..p)
        .map(|r| {
            let v = timelines.iter().map(|t| idle(t)[r]).collect();
            format!("{:.3}", median(v))
        })
        .collect();
    let (theory, theory_from) = match kind.theory_bubble(p, m) {
        Some(t) => (t, "formula"),
        None => {
            let t = Timeline::simulate(&schedule, Costs::default())
                .unwrap()
                .bubble();
            (t, "simulated")
        }
    };
    let split_word = match (splits, split) {
        (false, _) => "none",
        (true, true) => "on",
        (true, false) => "off",
    };
    println!(
        "bench pipeline schedule={} p={p} m={m} bubble={:.4} theory={theory:.4} workload=gpt \
         theory_from={theory_from} split={split_word} step_ms={:.1} f_ms={f:.2} b_ms={b:.2} \
         w_ms={w:.2} sim_measured={sim:.4} idle={} imbalance={imb:.4} bubble_net={net:.4} \
         rank_ms={} planned_imbalance={planned:.4} stages={} points={points:?} pieces={}",
        kind.name(),
        median(bubbles),
        median(makespans),
        idles.join("/"),
        rank_ms.join("/"),
        schedule.stages(),
        args.pieces,
    );
    let file = out.join(format!(
        "gpt-{}-p{p}-m{m}-split-{split_word}.svg",
        kind.name().replace(':', "v")
    ));
    let title = format!("{} p={p} m={m} (gpt, split {split_word})", kind.name());
    std::fs::write(&file, last.to_svg(&title)).expect("write the SVG");
}

fn main() {
    let args = Args::parse();
    if !args.workloads.iter().any(|w| w == "gpt") {
        return;
    }
    let out = args.out.clone().unwrap_or_else(|| {
        std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
            .join("pipeline-timelines")
    });
    std::fs::create_dir_all(&out).expect("create the timeline directory");
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        println!(
            "# pipeline gpt bench: cores={cores} loadavg={}",
            load.trim()
        );
    }
    if !["halves", "blocks"].contains(&args.pieces.as_str()) {
        eprintln!("--pieces takes `halves` or `blocks`, not `{}`", args.pieces);
        std::process::exit(2);
    }
    let cfg = GptConfig {
        n_layers: args.gpt_layers,
        ..GptConfig::bench()
    };
    let halves = args.pieces == "halves";
    let names: Vec<String> = bench_pieces(&cfg, halves)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    println!("# pieces ({}): {}", args.pieces, names.join(" "));
    for &p in &args.ranks {
        for &m in &args.microbatches {
            // One measurement per micro-batch size: every schedule splits the same costs.
            let costs = piece_costs(&cfg, halves, (args.rows_per_rank * p).div_ceil(m));
            let shown: Vec<String> = costs.iter().map(|c| format!("{c:.1}")).collect();
            println!(
                "# p={p} m={m} layers={} piece costs (fwd+bwd ms): {}",
                cfg.n_layers,
                shown.join(" ")
            );
            for name in &args.schedules {
                run(&args, &cfg, (p, m, &costs), name, &out);
            }
        }
    }
}
