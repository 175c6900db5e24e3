//! `cargo xtask bench zero` (or `cargo bench -p bonfire-zero --bench memory`): bytes per rank
//! of parameters, gradients and optimizer state, *measured* (element counts of what each rank
//! actually holds after backward, before the step, × 4), for stages 0–3 on 1, 2 and 4 ranks of
//! the bench-size GPT (vocab 4096, d 256, 8 heads, 4 layers, seq 128, d_ff 1024; batch 8 per
//! rank; f32; Adam), next to the ZeRO formula (16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N), and the
//! step time relative to DDP (bonfire-ddp, same model, optimizer and data).
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

use bonfire_comm::ThreadWorld;
use bonfire_ddp::{DdpConfig, DistributedDataParallel};
use bonfire_examples::{Gpt, GptConfig};
use bonfire_zero::{DataParallel, MemoryReport, Stage, Zero, ZeroConfig, formula_bytes};
use burn::module::Module;
use burn::optim::AdamConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::time::{Duration, Instant};

const BATCH: usize = 8;

fn batch(
    cfg: &GptConfig,
    step: usize,
    rank: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let t = cfg.max_seq_len;
    let n = BATCH * t;
    let make = |salt: usize| {
        let v: Vec<i64> = (0..n)
            .map(|i| ((i * 31 + step * 7 + rank * 13 + salt) % cfg.vocab_size) as i64)
            .collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [BATCH, t]), device)
    };
    (make(0), make(1))
}

fn ddp_step_time(model: &Gpt, cfg: &GptConfig, ranks: usize, steps: usize) -> f64 {
    let device = Device::flex().autodiff();
    let times = ThreadWorld::new(ranks)
        .timeout(Duration::from_secs(600))
        .launch(|pg| {
            let replica = model.clone().fork(&device);
            let mut d = DistributedDataParallel::new(
                replica,
                AdamConfig::new().init(),
                pg.clone(),
                DdpConfig::new(),
            )
            .unwrap();
            let mut total = 0.0;
            for s in 0..=steps {
                let (x, y) = batch(cfg, s, pg.rank(), &device);
                let start = Instant::now();
                d.train_step(1e-3, |m: &Gpt| m.loss(x, y)).unwrap();
                if s > 0 {
                    total += start.elapsed().as_secs_f64();
                }
            }
            total / steps as f64
        })
        .unwrap();
    times.into_iter().fold(0.0, f64::max)
}

fn zero_run(
    model: &Gpt,
    cfg: &GptConfig,
    ranks: usize,
    config: ZeroConfig,
    steps: usize,
) -> (MemoryReport, f64) {
    let device = Device::flex().autodiff().gradient_checkpointing();
    let out = ThreadWorld::new(ranks)
        .timeout(Duration::from_secs(600))
        .launch(|pg| {
            // A Balanced-checkpointing copy (fork keeps the strategy of the original).
            let fresh = Gpt::new(cfg, &device);
            let infos = bonfire_ddp::params::inventory(&fresh);
            let flat = bonfire_ddp::params::flatten_values(model, &infos_of(model));
            let replica = bonfire_ddp::params::assign_values(fresh, &infos, &flat);
            let mut z = Zero::new(
                replica,
                AdamConfig::new().build(),
                pg.clone(),
                config.clone(),
            )
            .unwrap();
            let mut total = 0.0;
            let mut mem = MemoryReport::default();
            for s in 0..=steps {
                let (x, y) = batch(cfg, s, pg.rank(), &device);
                let start = Instant::now();
                let loss = z.forward(|m: &Gpt| m.loss(x, y));
                z.backward(loss).unwrap();
                let elapsed = start.elapsed().as_secs_f64();
                if s == steps {
                    mem = z.memory(); // after backward, before the step: grads and state held
                }
                let start2 = Instant::now();
                z.step(1e-3).unwrap();
                if s > 0 {
                    total += elapsed + start2.elapsed().as_secs_f64();
                }
            }
            (mem, total / steps as f64)
        })
        .unwrap();
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

fn infos_of(model: &Gpt) -> Vec<bonfire_ddp::params::ParamInfo> {
    bonfire_ddp::params::inventory(model)
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
    let psi = bonfire_ddp::params::inventory(&model)
        .iter()
        .map(|p| p.numel())
        .sum::<usize>();
    let live_formula = live_layer_formula(&model);
    println!(
        "bench zero model=gpt-bench params={psi} dtype=f32 optimizer=adam batch_per_rank={BATCH} steps={steps} live_layer_formula_bytes={live_formula}"
    );
    for &n in &ranks {
        let ddp = ddp_step_time(&model, &cfg, n, steps);
        let mut runs: Vec<(Stage, bool)> = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3]
            .into_iter()
            .map(|s| (s, false))
            .collect();
        if offload {
            runs.extend([Stage::Zero1, Stage::Zero2, Stage::Zero3].map(|s| (s, true)));
        }
        for (stage, off) in runs {
            let config = ZeroConfig::new(stage).with_offload(off);
            let (mem, time) = zero_run(&model, &cfg, n, config, steps);
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
