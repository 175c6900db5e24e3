//! `gpu_check profile` (docs/gpu.md): where a training step of the 1 B Llama goes on one GPU,
//! split as the CPU's `bench profile` splits it — matrix products, attention, element-wise,
//! optimizer — plus communication and idle.
//!
//! Each piece runs alone at the step's shapes, in the step's compute type, with the model's own
//! modules and fresh tracked inputs: forward, then backward of its output's sum, the device
//! synchronized before the clock starts and before it stops (a GPU queues work: a clock read
//! without a sync times the launches). The medians, times the uses a step makes:
//!
//! - `matmul`: a layer's q/k/v/o and gate/up/down projections (× layers) and the head;
//! - `attention`: RoPE on the queries and keys and the causal GQA core (× layers);
//! - `elementwise`: the embedding, the RMSNorms (2 × layers + 1), SwiGLU (× layers), the
//!   cross-entropy, and the cast of the f32 masters to the compute type that mixed precision
//!   makes each step;
//! - `optimizer`: the bench's fused AdamW over the f32 masters (gradients drawn, not computed);
//! - `communication`: 0 — one rank on one GPU has nothing to exchange (the layouts of several
//!   ranks split theirs in the CPU's `bench profile --layouts`);
//! - `idle`: the whole step (trained by the engine, as `bench-1b` trains it) less the pieces:
//!   what the device waits for the host (launch-bound gaps, the loop's own work) and what no
//!   piece covers (the residual additions, the gradient's type casts). A large idle says
//!   host-bound: CUDA graphs or fewer launches (issue 48, point 4).

use crate::throughput::median;
use bonfire_models::gpt::attention::causal_attention;
use bonfire_models::gpt::cross_entropy;
use bonfire_models::llama::LlamaConfig;
use bonfire_models::llama::model::{rope_tables, rotate, swiglu};
use bonfire_module::params;
use bonfire_module::precision::cast_module;
use bonfire_tp::{ParallelEmbedding, ParallelLinear, ParallelRmsNorm};
use burn::optim::ModuleOptimizer;
use burn::tensor::{DType, Device, Distribution, Int, Tensor};
use std::time::Instant;

/// A step's time by kind, in ms ([`profile`]).
#[derive(Debug, Clone, Copy)]
pub struct Split {
    pub matmul: f64,
    pub attention: f64,
    pub elementwise: f64,
    pub optimizer: f64,
    pub communication: f64,
    /// The whole step, as the engine trains it.
    pub step: f64,
    /// The floating-point operations of the products `matmul` times (forward and both
    /// backward products: 6 · rows · in · out each).
    pub matmul_flops: f64,
}

impl Split {
    /// The step less every piece (negative where the pieces alone took longer than the step:
    /// the device ran some of them side by side).
    pub fn idle(&self) -> f64 {
        self.step
            - (self.matmul + self.attention + self.elementwise + self.optimizer)
            - self.communication
    }

    /// The products' rate, TFLOP/s: above the chip's peak, the timed regions did not hold
    /// the work they queued (docs/gpu.md, "Not yet trusted").
    pub fn matmul_tflops(&self) -> f64 {
        self.matmul_flops / (self.matmul / 1e3) / 1e12
    }

    /// `profile split model=… matmul_ms=… … idle_ms=… step_ms=…`, each kind's share, and the
    /// products' rate.
    pub fn line(&self, model: &str) -> String {
        let parts = [
            ("matmul", self.matmul),
            ("attention", self.attention),
            ("elementwise", self.elementwise),
            ("optimizer", self.optimizer),
            ("communication", self.communication),
            ("idle", self.idle()),
        ];
        let mut line = format!("profile split model={model}");
        for (name, ms) in parts {
            line += &format!(" {name}_ms={ms:.2}");
        }
        line += &format!(" step_ms={:.2}", self.step);
        for (name, ms) in parts {
            line += &format!(" {name}_share={:.3}", ms / self.step);
        }
        line + &format!(" matmul_tflops={:.1}", self.matmul_tflops())
    }
}

/// The device's queue drained (a GPU's work finished).
fn sync(device: &Device) -> Result<(), String> {
    device.sync().map_err(|e| format!("device sync: {e:?}"))
}

/// The median ms of `reps` runs of `run` (after one warm-up), the device synchronized before
/// the clock starts and before it stops.
fn timed(device: &Device, reps: usize, mut run: impl FnMut()) -> Result<f64, String> {
    let mut times = Vec::with_capacity(reps);
    for rep in 0..=reps {
        sync(device)?;
        let start = Instant::now();
        run();
        sync(device)?;
        if rep > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(times))
}

/// A fresh tracked input of `shape`: standard normal, in `dtype`.
fn tracked<const D: usize>(shape: [usize; D], dtype: DType, device: &Device) -> Tensor<D> {
    Tensor::<D>::random(shape, Distribution::Normal(0.0, 1.0), device)
        .cast(dtype)
        .require_grad()
}

/// The median ms of `f`'s forward and the backward of its output's sum.
fn fwd_bwd<const D: usize>(
    device: &Device,
    reps: usize,
    f: impl Fn() -> Tensor<D>,
) -> Result<f64, String> {
    timed(device, reps, || drop(f().sum().backward()))
}

/// The pieces of a step of the Llama of `cfg` on `device` (autodiff) computing in `dtype`,
/// `batch` rows of its positions, `reps` timed runs each, stepping with `optimizer` (the
/// bench's), against `step_ms` (the whole step, measured by the caller on the same device).
pub fn profile(
    device: &Device,
    cfg: &LlamaConfig,
    (dtype, optimizer): (DType, ModuleOptimizer),
    (batch, reps): (usize, usize),
    step_ms: f64,
) -> Result<Split, String> {
    assert!(reps > 0, "profile: no timed run");
    let (t, d, l) = (
        cfg.max_position_embeddings,
        cfg.hidden_size,
        cfg.num_hidden_layers as f64,
    );
    let (v, f, hd) = (cfg.vocab_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let leaf = |shape: [usize; 3]| tracked(shape, dtype, device);
    let linear = |i, o| cast_module(ParallelLinear::new(i, o, false, device), dtype);
    let (x, xq, xf) = (
        leaf([batch, t, d]),
        leaf([batch, t, q]),
        leaf([batch, t, f]),
    );

    let (wq, wk, wv, wo) = (linear(d, q), linear(d, kv), linear(d, kv), linear(q, d));
    let projections = fwd_bwd(device, reps, || {
        let [a, b, c] = [&wq, &wk, &wv].map(|w| w.forward(x.clone()).sum());
        a + b + c + wo.forward(xq.clone()).sum()
    })?;
    let (gate, up, down) = (linear(d, f), linear(d, f), linear(f, d));
    let mlp_projections = fwd_bwd(device, reps, || {
        gate.forward(x.clone()).sum() + up.forward(x.clone()).sum() + down.forward(xf.clone()).sum()
    })?;
    let head = linear(d, v);
    let head_ms = fwd_bwd(device, reps, || head.forward(x.clone()))?;

    let heads = |n: usize| tracked([batch, n, t, hd], dtype, device);
    let (qh, kh, vh) = (
        heads(cfg.num_attention_heads),
        heads(cfg.num_key_value_heads),
        heads(cfg.num_key_value_heads),
    );
    let positions: Vec<usize> = (0..t).collect();
    let (cos, sin) = rope_tables(&positions, hd, (cfg.rope_theta, None), device);
    let attention = fwd_bwd(device, reps, || {
        let (q, k) = (
            rotate(qh.clone(), &cos, &sin),
            rotate(kh.clone(), &cos, &sin),
        );
        causal_attention(q, k, vh.clone())
    })?;
    let (gates, ups) = (leaf([batch, t, f]), leaf([batch, t, f]));
    let swiglu_ms = fwd_bwd(device, reps, || swiglu(gates.clone(), ups.clone()))?;
    let norm = cast_module(
        ParallelRmsNorm::new(d, device).with_eps(cfg.rms_norm_eps),
        dtype,
    );
    let norm_ms = fwd_bwd(device, reps, || norm.forward(x.clone()))?;
    let ids = || Tensor::<2, Int>::random([batch, t], Distribution::Uniform(0.0, v as f64), device);
    let (tokens, targets) = (ids(), ids());
    let embedding = cast_module(ParallelEmbedding::new(v, d, device), dtype);
    let embed_ms = fwd_bwd(device, reps, || embedding.forward(tokens.clone()))?;
    let logits = leaf([batch, t, v]);
    let loss_ms = fwd_bwd(device, reps, || {
        cross_entropy(logits.clone(), targets.clone())
    })?;
    drop((logits, embedding, head));

    let (cast_ms, optimizer) = optimizer_ms(device, cfg, (dtype, optimizer), reps)?;
    let layer = d * q + 2 * d * kv + q * d + 3 * d * f;
    let matmul_flops = 6.0 * (batch * t) as f64 * (l * layer as f64 + (d * v) as f64);
    Ok(Split {
        matmul: l * (projections + mlp_projections) + head_ms,
        attention: l * attention,
        elementwise: embed_ms + (2.0 * l + 1.0) * norm_ms + l * swiglu_ms + loss_ms + cast_ms,
        optimizer,
        communication: 0.0,
        step: step_ms,
        matmul_flops,
    })
}

/// The ms of casting the Llama's f32 masters to `dtype` (0 in f32: nothing to cast), and of
/// `optimizer`'s step over them with drawn gradients.
fn optimizer_ms(
    device: &Device,
    cfg: &LlamaConfig,
    (dtype, mut optimizer): (DType, ModuleOptimizer),
    reps: usize,
) -> Result<(f64, f64), String> {
    let mut model = bonfire_models::llama::Llama::new(cfg, device);
    let cast = match dtype {
        DType::F32 => 0.0,
        _ => timed(device, reps, || drop(cast_module(model.clone(), dtype)))?,
    };
    let infos = params::inventory(&model);
    let grads = |m: &bonfire_models::llama::Llama| {
        params::grads_from_parts(m, &infos, |i| {
            let n = infos[i].numel();
            Some(Tensor::<1>::random(
                [n],
                Distribution::Normal(0.0, 1e-3),
                device,
            ))
        })
    };
    let mut times = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let g = grads(&model);
        sync(device)?;
        let start = Instant::now();
        model = optimizer.step(1e-4, model, g);
        sync(device)?;
        if rep > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok((cast, median(times)))
}
