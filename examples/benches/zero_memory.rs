//! `cargo xtask bench zero` (or `cargo bench -p bonfire-examples --bench zero_memory`): bytes per rank
//! of parameters, gradients and optimizer state, *measured* (element counts of what each rank
//! actually holds after backward, before the step, × 4), for stages 0–3 on 1, 2 and 4 ranks of
//! the bench-size GPT (vocab 4096, d 256, 8 heads, 4 layers, seq 128, d_ff 1024; batch 8 per
//! rank; f32; Adam), next to the ZeRO formula (16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N), and the
//! step time relative to DDP (bonfire-ddp, same model, optimizer and data), every run through
//! the trainer's one loop.
//!
//! Stage 3 adds the live gathered parameters: measured, the most bytes of gathered
//! parameters the wrapper held at once in forward (`gathered_peak`: the layer being computed
//! plus the prefetched next one — the GPT enters its layers through `bonfire_dtensor::layer`,
//! and `tests/layer_release.rs` checks with a counting allocator that a layer's gathered
//! parameters are really freed when the next one starts); in the formula, the largest pair of
//! consecutive layers of the model, computed from its structure.
//!
//! Options: `--ranks 1,2,4`, `--steps K` (timed steps after one warm-up, default 1),
//! `--offload` (adds stage 1–3 runs with the optimizer state in the host store).

use bonfire_dtensor::params;
use bonfire_examples::parallel::TokenBatch;
use bonfire_examples::{Gpt, GptConfig, default_device};
use bonfire_train::{
    Axis, Engine, FitConfig, Hooks, Launcher, ParallelDims, TrainError, Trainer, fit,
};
use bonfire_zero::{MemoryReport, Stage, ZeroConfig, formula_bytes};
use burn::module::Module;
use burn::optim::AdamConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};

const BATCH: usize = 8;

/// The global batch of step `step` for `ranks` replicas.
fn batch(cfg: &GptConfig, ranks: usize, step: usize, device: &Device) -> TokenBatch {
    let t = cfg.max_seq_len;
    let n = ranks * BATCH * t;
    let make = |salt: usize| {
        let v: Vec<i64> = (0..n)
            .map(|i| ((i * 31 + step * 7 + salt) % cfg.vocab_size) as i64)
            .collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [ranks * BATCH, t]), device)
    };
    (make(0), make(1))
}

/// Keeps what the wrapper holds after the last backward, before its step.
struct MemoryAfterBackward {
    last: usize,
    report: MemoryReport,
}

impl Hooks<TokenBatch> for MemoryAfterBackward {
    fn after_backward(
        &mut self,
        step: usize,
        engine: &mut dyn Engine<TokenBatch>,
    ) -> Result<(), TrainError> {
        if step == self.last {
            self.report = engine.wrapper_report().memory.unwrap_or_default();
        }
        Ok(())
    }
}

/// `steps` timed steps (after one warm-up) of ZeRO at `config` (stage 0 is DDP's wrapper when
/// `ddp`) on `ranks` rank threads through the trainer's loop: the largest rank's memory report
/// and the mean step time of the slowest rank.
fn run(
    model: &Gpt,
    cfg: &GptConfig,
    ranks: usize,
    config: ZeroConfig,
    ddp: bool,
    steps: usize,
) -> (MemoryReport, f64) {
    let dims = ParallelDims::new()
        .with_degree(Axis::Dp, ranks)
        .with_zero(if ddp { Stage::Zero0 } else { config.stage })
        .with_offload(config.offload);
    let trainer = Trainer::new(dims, || AdamConfig::new().init()).with_zero(config);
    let data = |s: usize, d: &Device| batch(cfg, ranks, s, d);
    let out = Launcher::Threads { ranks }
        .run("bench-zero", |pg| {
            let mut engine = trainer.build(model.clone(), &pg, &data(0, &default_device()))?;
            let mut hooks = MemoryAfterBackward {
                last: steps,
                report: MemoryReport::default(),
            };
            let reports = fit(
                engine.as_mut(),
                &data,
                &FitConfig::new(steps + 1, 1e-3),
                &mut hooks,
            )?;
            let time: f64 =
                reports[1..].iter().map(|r| r.step_ms / 1e3).sum::<f64>() / steps as f64;
            Ok::<_, TrainError>((hooks.report, time))
        })
        .expect("bench run");
    let out: Vec<(MemoryReport, f64)> = out.into_iter().map(|r| r.expect("bench rank")).collect();
    let mem = out
        .iter()
        .map(|(m, _)| *m)
        .max_by_key(|m| m.total())
        .unwrap();
    let time = out.iter().map(|(_, t)| *t).fold(0.0, f64::max);
    (mem, time)
}

/// Bytes of the GPT's layers in the order its forward enters them (the `layer` calls of
/// `Gpt::forward` and `Block::forward`).
fn layer_bytes(model: &Gpt) -> Vec<usize> {
    let mut layers = vec![model.tok_emb.num_params(), model.pos_emb.num_params()];
    for b in &model.blocks {
        layers.extend([
            b.ln1.num_params(),
            b.attn.num_params(),
            b.ln2.num_params(),
            b.mlp.num_params(),
        ]);
    }
    layers.extend([model.ln_f.num_params(), model.head.num_params()]);
    layers.into_iter().map(|n| n * 4).collect()
}

/// The formula's live gathered term: one layer and the prefetched next, at worst.
fn live_layer_formula(model: &Gpt) -> usize {
    let layers = layer_bytes(model);
    layers
        .windows(2)
        .map(|w| w[0] + w[1])
        .max()
        .unwrap_or(layers[0])
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let ranks: Vec<usize> = value("--ranks")
        .unwrap_or_else(|| "1,2,4".into())
        .split(',')
        .map(|s| s.parse().expect("--ranks 1,2,4"))
        .collect();
    let steps: usize = value("--steps").map_or(1, |s| s.parse().expect("--steps K"));
    let offload = args.iter().any(|a| a == "--offload");

    let cfg = GptConfig::bench();
    let model = Gpt::new(&cfg, &Device::flex().autodiff());
    let psi = params::inventory(&model)
        .iter()
        .map(|p| p.numel())
        .sum::<usize>();
    let live_formula = live_layer_formula(&model);
    println!(
        "bench zero model=gpt-bench params={psi} dtype=f32 optimizer=adam batch_per_rank={BATCH} steps={steps} live_layer_formula_bytes={live_formula}"
    );
    for &n in &ranks {
        let (_, ddp) = run(&model, &cfg, n, ZeroConfig::new(Stage::Zero0), true, steps);
        // Stage 0 through the trainer is DDP: the time baseline, with no ZeRO account.
        let mut runs: Vec<(Stage, bool)> = [Stage::Zero1, Stage::Zero2, Stage::Zero3]
            .into_iter()
            .map(|s| (s, false))
            .collect();
        if offload {
            runs.extend([Stage::Zero1, Stage::Zero2, Stage::Zero3].map(|s| (s, true)));
        }
        for (stage, off) in runs {
            let config = ZeroConfig::new(stage).with_offload(off);
            let (mem, time) = run(&model, &cfg, n, config, false, steps);
            let mut formula = formula_bytes(stage, psi, n, 2);
            let mut measured = mem.total();
            if stage == Stage::Zero3 {
                formula += live_formula as f64;
                measured += mem.gathered_peak;
            }
            println!(
                "bench zero stage={}{} ranks={n} bytes_per_rank={measured} formula_bytes={formula:.0} ratio={:.4} step_vs_ddp={:.3} params={} grads={} optim_device={} optim_host={} gathered_peak={} gathered_total={} step_s={time:.3} ddp_step_s={ddp:.3}",
                stage.index(),
                if off { "+offload" } else { "" },
                measured as f64 / formula,
                time / ddp,
                mem.params,
                mem.grads,
                mem.optim_device,
                mem.optim_host,
                mem.gathered_peak,
                mem.gathered_total,
            );
        }
    }
}
