//! `cargo xtask bench profile`: where a one-rank training step of the bench GPT (or, with
//! `--model llama`, the bench Llama: `profile/llama.rs`) goes, op by op. Each piece of the model runs alone at the bench shapes on Burn's Flex with autodiff —
//! forward, then backward of its output's sum — with fresh tracked inputs, the model's own
//! code (`ParallelLinear`, `ParallelLayerNorm`, `causal_attention`, `cross_entropy`, ...); then the whole model
//! and the optimizer step — the bench's one-pass optimizer (`bonfire_kernels::FusedSgd`, for the
//! Llama `FusedAdamW`), which the split counts, and Burn's own (`part=sgd.burn`, `adamw.burn`)
//! for the record.
//!
//! Prints `bench profile part=<name> count=<uses per step> fwd_ms=… bwd_ms=… step_ms=…` (one
//! use's medians; `step_ms` = count × (fwd + bwd)), then `part=sum` (the pieces together),
//! `part=model` (the whole forward and backward) and `part=sgd` (the optimizer step), so that
//! the pieces can be compared with the whole step, and one line splitting the step by kind:
//! `bench profile split model=… matmul_ms=… attention_ms=… elementwise_ms=… optimizer_ms=…
//! total_ms=…` (see [`Split`]). Per layout (`cargo xtask bench profile -- --layouts
//! ddp,zero3,tp,…`), xtask runs the train bench instead, whose `bench profile split
//! layout=…` lines split each layout's step into compute, communication, point-to-point
//! (a pipeline's transfers and bubble) and the optimizer, as each rank's loop measured it.

mod common;
use bonfire_examples::default_device;
use bonfire_kernels::FusedSgdConfig;
use bonfire_kernels::{attention as fused_attention, causal_softmax, gelu};
use bonfire_models::gpt::attention::{causal_attention, merge_heads, split_heads};
use bonfire_models::gpt::{cross_entropy, embed};
use bonfire_models::{Gpt, GptConfig};
use bonfire_tp::{ParallelEmbedding, ParallelLayerNorm, ParallelLinear};
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::activation::{gelu as burn_gelu, log_softmax, softmax};
use burn::tensor::{Device, Distribution, Int, Tensor};
use clap::Parser;
use common::throughput::{median, random_batches};
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Timed repetitions of each piece (after one warm-up).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// `gpt` or `llama`.
    #[arg(long, default_value = "gpt")]
    model: String,
    /// Ignored (passed by `cargo bench`).
    #[arg(long, hide = true)]
    bench: bool,
}

#[path = "profile/llama.rs"]
mod llama;

fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// The medians of `reps` runs of `f`'s forward and of the backward of its output's sum.
fn time<const D: usize>(reps: usize, mut f: impl FnMut() -> Tensor<D>) -> (f64, f64) {
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let start = Instant::now();
        let y = f();
        let f_ms = ms(start);
        let start = Instant::now();
        let grads = y.sum().backward();
        let b_ms = ms(start);
        drop(grads);
        if rep > 0 {
            fwd.push(f_ms);
            bwd.push(b_ms);
        }
    }
    (median(fwd), median(bwd))
}

fn leaf<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device).require_grad()
}

/// The parts printed so far: their step times by name, and the sum of those in the step.
#[derive(Default)]
struct Report {
    sum: f64,
    parts: Vec<(String, f64)>,
}

impl Report {
    /// Prints a part and adds its step time to the sum.
    fn line(&mut self, part: &str, count: usize, timed: (f64, f64)) {
        self.sum += self.record(part, count, timed);
    }

    /// Prints a part kept for the record (not added to the sum); returns its step time.
    fn record(&mut self, part: &str, count: usize, (fwd, bwd): (f64, f64)) -> f64 {
        let step = count as f64 * (fwd + bwd);
        self.parts.push((part.to_string(), step));
        println!(
            "bench profile part={part} count={count} fwd_ms={fwd:.2} bwd_ms={bwd:.2} step_ms={step:.1}"
        );
        step
    }

    /// A printed part's step time (ms); panics on a part never printed.
    fn get(&self, part: &str) -> f64 {
        self.parts
            .iter()
            .find(|(name, _)| name == part)
            .map(|(_, ms)| *ms)
            .unwrap_or_else(|| panic!("profile: no part `{part}`"))
    }

    fn sum_line(&self) {
        println!(
            "bench profile part=sum count=1 step_ms={:.1} (forward + backward of the pieces)",
            self.sum
        );
    }
}

/// A one-rank step by kind of work (ms, from the parts measured alone): the linear layers'
/// products, attention's core (everything between the projections), the element-wise and
/// row ops (embedding, norms, activations, residuals, cross-entropy) and the optimizer step.
/// Communication and idle time are the train bench's (`wait_ms`, `hidden`): zero on one rank.
struct Split {
    matmul: f64,
    attention: f64,
    elementwise: f64,
    optimizer: f64,
}

impl Split {
    fn print(&self, model: &str) {
        let total = self.matmul + self.attention + self.elementwise + self.optimizer;
        println!(
            "bench profile split model={model} matmul_ms={:.1} attention_ms={:.1} \
             elementwise_ms={:.1} optimizer_ms={:.1} total_ms={total:.1}",
            self.matmul, self.attention, self.elementwise, self.optimizer
        );
    }
}

fn main() {
    let args = Args::parse();
    // As `train` and `bench train` run (`bonfire_kernels::keep_freed_memory`): without it the
    // large outputs (the head's logits, 16 MB) are fresh pages on every call.
    bonfire_kernels::keep_freed_memory();
    match args.model.as_str() {
        "gpt" => gpt(&args),
        "llama" => llama::run(args.batch, args.reps),
        other => panic!("--model {other}: expected `gpt` or `llama`"),
    }
}

/// The bench GPT's parts.
fn gpt(args: &Args) {
    let cfg = GptConfig::bench();
    let dev = default_device();
    let (b, t, d, f) = (args.batch, cfg.max_seq_len, cfg.d_model, cfg.d_ff);
    let (l, v, reps) = (cfg.n_layers, cfg.vocab_size, args.reps);
    eprintln!(
        "GPT bench size, batch {b} x {t}: Flex with autodiff, {reps} timed runs per piece; \
         step_ms = uses per step x (forward + backward)"
    );
    let mut r = Report::default();
    let x = leaf([b, t, d], &dev);
    let ids = Tensor::<2, Int>::random([b, t], Distribution::Uniform(0.0, v as f64), &dev);
    let (tok, pos) = (
        ParallelEmbedding::new(v, d, &dev),
        ParallelEmbedding::new(t, d, &dev),
    );
    r.line("embed", 1, time(reps, || embed(&tok, &pos, ids.clone())));
    let ln = ParallelLayerNorm::new(d, &dev);
    r.line(
        "layer_norm",
        2 * l + 1,
        time(reps, || ln.forward(x.clone())),
    );
    let proj = ParallelLinear::new(d, d, true, &dev);
    r.line("linear_qkvo", 4 * l, time(reps, || proj.forward(x.clone())));
    let (q, s) = attention(&mut r, &cfg, b, reps, &dev);
    let fc1 = ParallelLinear::new(d, f, true, &dev);
    let fc2 = ParallelLinear::new(f, d, true, &dev);
    let hdn = leaf([b, t, f], &dev);
    r.line("mlp_fc1", l, time(reps, || fc1.forward(x.clone())));
    r.line("mlp_gelu", l, time(reps, || gelu(hdn.clone())));
    r.line("mlp_fc2", l, time(reps, || fc2.forward(hdn.clone())));
    r.line("residual_add", 2 * l, time(reps, || x.clone() + q.clone()));
    let head = ParallelLinear::new(d, v, false, &dev);
    r.line("head", 1, time(reps, || head.forward(x.clone())));
    let logits = leaf([b, t, v], &dev);
    let targets = Tensor::<2, Int>::random([b, t], Distribution::Uniform(0.0, v as f64), &dev);
    r.line(
        "cross_entropy",
        1,
        time(reps, || cross_entropy(logits.clone(), targets.clone())),
    );
    r.sum_line();
    let split = |r: &Report, optimizer: f64| Split {
        matmul: ["linear_qkvo", "mlp_fc1", "mlp_fc2", "head"]
            .map(|p| r.get(p))
            .iter()
            .sum(),
        attention: r.get("attn_core") + r.get("attn_heads_split_merge"),
        elementwise: [
            "embed",
            "layer_norm",
            "mlp_gelu",
            "residual_add",
            "cross_entropy",
        ]
        .map(|p| r.get(p))
        .iter()
        .sum(),
        optimizer,
    };
    // The same pieces written with Burn's own ops (what the model ran before its fused
    // ops), for comparison; not in the sum.
    let mask = Tensor::<2>::ones([t, t], &dev).triu(1) * -1e30;
    r.line(
        "burn.masked_softmax",
        l,
        time(reps, || {
            softmax(s.clone() * 0.5 + mask.clone().unsqueeze::<4>(), 3)
        }),
    );
    r.line("burn.gelu", l, time(reps, || burn_gelu(hdn.clone())));
    let linear = |l: &ParallelLinear, x: Tensor<3>| {
        let b = l.bias.as_ref().map(|b| b.val());
        burn::tensor::module::linear(x, l.weight.val().transpose(), b)
    };
    r.line("burn.linear.fc1", l, time(reps, || linear(&fc1, x.clone())));
    r.line(
        "burn.linear.head",
        1,
        time(reps, || linear(&head, x.clone())),
    );
    r.line(
        "burn.cross_entropy",
        1,
        time(reps, || {
            let logp = log_softmax(logits.clone().reshape([b * t, v]), 1);
            logp.gather(1, targets.clone().reshape([b * t, 1]))
                .mean()
                .neg()
        }),
    );
    let optimizer = whole_model(&cfg, b, reps, &dev);
    split(&r, optimizer).print("gpt");
}

/// The attention's pieces: heads split and merged, its core, and the core's parts (for the
/// record, not added to the sum). Returns a `[b, t, d]` leaf and the `[b, h, t, t]` scores.
fn attention(
    r: &mut Report,
    cfg: &GptConfig,
    b: usize,
    reps: usize,
    dev: &Device,
) -> (Tensor<3>, Tensor<4>) {
    let (t, d, h, l) = (cfg.max_seq_len, cfg.d_model, cfg.n_heads, cfg.n_layers);
    let dh = d / h;
    let (q, k, vv) = (
        leaf([b, t, d], dev),
        leaf([b, t, d], dev),
        leaf([b, t, d], dev),
    );
    r.line(
        "attn_heads_split_merge",
        l,
        time(reps, || {
            let y = split_heads(q.clone(), dh) + split_heads(k.clone(), dh);
            merge_heads(y + split_heads(vv.clone(), dh))
        }),
    );
    let (q4, k4, v4) = (
        leaf([b, h, t, dh], dev),
        leaf([b, h, t, dh], dev),
        leaf([b, h, t, dh], dev),
    );
    let attn = time(reps, || {
        causal_attention(q4.clone(), k4.clone(), v4.clone())
    });
    r.line("attn_core", l, attn);
    // Its parts, for the record (not added to the sum: attn_core holds them).
    let sum_before = r.sum;
    let scale = 1.0 / (dh as f64).sqrt();
    r.line(
        "attn_core.fused",
        l,
        time(reps, || {
            fused_attention(q4.clone(), k4.clone(), v4.clone(), scale, true)
        }),
    );
    // The decomposed path the model ran before the fused op: q·kᵀ, the fused masked
    // softmax, p·v (a [b, h, t, t] matrix each way).
    r.line(
        "attn_core.burn",
        l,
        time(reps, || {
            let s = q4.clone().matmul(k4.clone().swap_dims(2, 3));
            causal_softmax(s, scale).matmul(v4.clone())
        }),
    );
    r.line(
        "attn_core.scores",
        l,
        time(reps, || q4.clone().matmul(k4.clone().swap_dims(2, 3))),
    );
    let s = leaf([b, h, t, t], dev);
    r.line(
        "attn_core.softmax",
        l,
        time(reps, || causal_softmax(s.clone(), 0.5)),
    );
    r.line(
        "attn_core.pv",
        l,
        time(reps, || s.clone().matmul(v4.clone())),
    );
    r.sum = sum_before;
    (q, s)
}

/// The whole model's forward and backward, and the SGD step on its gradients — Burn's
/// (`part=sgd.burn`), then the bench's one pass (`part=sgd`); returns the latter's median (ms).
fn whole_model(cfg: &GptConfig, b: usize, reps: usize, dev: &Device) -> f64 {
    let data = random_batches(cfg.vocab_size, cfg.max_seq_len, b, 1, 3);
    let (ids, targets) = data.rows(0, 0, b, dev);
    let loss = |m: &Gpt| m.loss(ids.clone(), targets.clone());
    let burn = Step {
        optimizer: SgdConfig::new().init(),
        name: "sgd.burn",
        lr: 0.01,
    };
    burn.time(Gpt::new(cfg, dev), reps, loss);
    let fused = Step {
        optimizer: FusedSgdConfig::new().init(),
        name: "sgd",
        lr: 0.01,
    };
    fused.time(Gpt::new(cfg, dev), reps, loss)
}

/// A whole training step of a model: its optimizer, the optimizer's part name, the rate.
struct Step {
    optimizer: ModuleOptimizer,
    name: &'static str,
    lr: f64,
}

impl Step {
    /// Times `reps` steps (after one warm-up) of `model` on `loss`: prints `part=model`
    /// (forward and backward medians) and `part=<optimizer>`, returns the optimizer's median.
    fn time<M: Module>(mut self, mut model: M, reps: usize, loss: impl Fn(&M) -> Tensor<1>) -> f64 {
        let (mut fwd, mut bwd, mut opt) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..=reps {
            let start = Instant::now();
            let value = loss(&model);
            let f_ms = ms(start);
            let start = Instant::now();
            let grads = value.backward();
            let b_ms = ms(start);
            let start = Instant::now();
            let grads = GradientsParams::from_grads(grads, &model);
            model = self.optimizer.step(self.lr, model, grads);
            let o_ms = ms(start);
            if rep > 0 {
                fwd.push(f_ms);
                bwd.push(b_ms);
                opt.push(o_ms);
            }
        }
        let (f, b) = (median(fwd), median(bwd));
        println!(
            "bench profile part=model count=1 fwd_ms={f:.2} bwd_ms={b:.2} step_ms={:.1}",
            f + b
        );
        let o = median(opt);
        println!(
            "bench profile part={} count=1 step_ms={o:.1} params={}",
            self.name,
            model.num_params()
        );
        o
    }
}
