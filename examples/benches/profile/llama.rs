//! `cargo xtask bench profile -- --model llama`: where a one-rank training step of the bench
//! Llama goes (vocab 4096, hidden 256, 8 heads, 4 kv heads, 4 layers, intermediate 688, seq
//! 128), piece by piece with the model's own modules, then the whole model and the AdamW step
//! (lr 1e-3, β 0.9/0.95, ε 1e-6, weight decay 0.1: the train bench's).
//!
//! Parts: `embed`, `rms_norm` (2·layers + 1 uses), `attention` (a layer's whole attention:
//! projections, RoPE, GQA core) and, for the record, `attention.projections` (its four linear
//! layers alone); `mlp` (the SwiGLU MLP) and `mlp.projections`; `head`, `cross_entropy`; then
//! `part=sum`, `part=model`, `part=adamw`, and the `split` line (see [`super::Split`]).

use super::{Report, Split, Step, leaf, time};
use crate::common::throughput::random_batches;
use bonfire_examples::default_device;
use bonfire_kernels::FusedAdamWConfig;
use bonfire_models::gpt::cross_entropy;
use bonfire_models::llama::model::{LlamaAttention, Mlp};
use bonfire_models::llama::{Llama, LlamaConfig};
use bonfire_tp::{ParallelEmbedding, ParallelLinear, ParallelRmsNorm};
use burn::tensor::{Distribution, Int, Tensor};

/// Profiles the bench Llama at `b` sequences per step, `reps` timed runs per piece.
pub fn run(b: usize, reps: usize) {
    let cfg = LlamaConfig::bench();
    let dev = default_device();
    let (t, d, l) = (
        cfg.max_position_embeddings,
        cfg.hidden_size,
        cfg.num_hidden_layers,
    );
    let (v, f, hd) = (cfg.vocab_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    eprintln!(
        "Llama bench size, batch {b} x {t}: Flex with autodiff, {reps} timed runs per piece; \
         step_ms = uses per step x (forward + backward)"
    );
    let mut r = Report::default();
    let x = leaf([b, t, d], &dev);
    let ids = Tensor::<2, Int>::random([b, t], Distribution::Uniform(0.0, v as f64), &dev);
    let emb = ParallelEmbedding::new(v, d, &dev);
    r.line("embed", 1, time(reps, || emb.forward(ids.clone())));
    let norm = ParallelRmsNorm::new(d, &dev).with_eps(cfg.rms_norm_eps);
    r.line(
        "rms_norm",
        2 * l + 1,
        time(reps, || norm.forward(x.clone())),
    );
    let attn = LlamaAttention::new(&cfg, &dev);
    r.line("attention", l, time(reps, || attn.forward(x.clone())));
    let (wq, wk, wv, wo) = (
        ParallelLinear::new(d, q, false, &dev),
        ParallelLinear::new(d, kv, false, &dev),
        ParallelLinear::new(d, kv, false, &dev),
        ParallelLinear::new(q, d, false, &dev),
    );
    let xq = leaf([b, t, q], &dev);
    r.record(
        "attention.projections",
        l,
        time(reps, || {
            let qkv = [&wq, &wk, &wv].map(|w| w.forward(x.clone()).sum());
            let [a, b, c] = qkv;
            a + b + c + wo.forward(xq.clone()).sum()
        }),
    );
    let mlp = Mlp::new(d, f, &dev);
    r.line("mlp", l, time(reps, || mlp.forward(x.clone())));
    let (gate, up) = (
        ParallelLinear::new(d, f, false, &dev),
        ParallelLinear::new(d, f, false, &dev),
    );
    let down = ParallelLinear::new(f, d, false, &dev);
    let xf = leaf([b, t, f], &dev);
    r.record(
        "mlp.projections",
        l,
        time(reps, || {
            gate.forward(x.clone()).sum()
                + up.forward(x.clone()).sum()
                + down.forward(xf.clone()).sum()
        }),
    );
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
    let optimizer_ms = whole_model(&cfg, b, reps);
    Split {
        matmul: r.get("attention.projections") + r.get("mlp.projections") + r.get("head"),
        attention: r.get("attention") - r.get("attention.projections"),
        elementwise: r.get("embed")
            + r.get("rms_norm")
            + (r.get("mlp") - r.get("mlp.projections"))
            + r.get("cross_entropy"),
        optimizer: optimizer_ms,
    }
    .print("llama");
}

/// The whole model's forward and backward, and the AdamW step on its gradients — Burn's
/// (`part=adamw.burn`), then the bench's one pass (`part=adamw`, `FusedAdamW`); returns the
/// latter's median (ms).
fn whole_model(cfg: &LlamaConfig, b: usize, reps: usize) -> f64 {
    let dev = default_device();
    let data = random_batches(cfg.vocab_size, cfg.max_position_embeddings, b, 1, 3);
    let (ids, targets) = data.rows(0, 0, b, &dev);
    let loss = |m: &Llama| m.loss(ids.clone(), targets.clone());
    let config = FusedAdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.95)
        .with_epsilon(1e-6)
        .with_weight_decay(0.1);
    let burn = Step {
        optimizer: config.burn().init(),
        name: "adamw.burn",
        lr: 1e-3,
    };
    burn.time(Llama::new(cfg, &dev), reps, loss);
    let fused = Step {
        optimizer: config.init(),
        name: "adamw",
        lr: 1e-3,
    };
    fused.time(Llama::new(cfg, &dev), reps, loss)
}
