//! An independent reference (issue 26, point 6): the layout suites (`layouts.rs`,
//! `loss_curves.rs`) compare every layout with Bonfire's own one-device run, so a bug every
//! layout shares — in the fused kernels, the layer wrappers, the training loop — cancels.
//! Here the reference is plain Burn: the GPT's math written with Burn tensor ops on the
//! parameters of the same `Gpt` module (its own `forward` is not plain Burn even outside an
//! engine: every layer runs through `bonfire_module::layer`, linears through
//! `bonfire_module::weight_grad::linear_matmul`, and GELU, the causal softmax and the
//! cross-entropy are `bonfire_kernels`' fused ops with hand-written backwards), Burn's
//! `loss.backward()`, `GradientsParams::from_grads` and Burn's own `SgdConfig` /
//! `AdamWConfig` (β1 0.9, β2 0.95, ε 1e-6, weight decay 0.1). Against it, with SGD and AdamW:
//! Bonfire's one-device run and one layout per axis (DDP dp=2, ZeRO-3 dp=2, tp=2, pp=2 1F1B,
//! cp=2 with ring attention) through the parity harness — the loss of every step, every step-0 gradient and every
//! parameter after 3 steps, within the suites' tolerances (`common::SGD`, `common::adamw`).

mod common;

use bonfire_examples::cli::LayoutArgs;
use bonfire_models::data::Batches;
use bonfire_models::gpt::Gpt;
use bonfire_tp::{ParallelLayerNorm, ParallelLinear};
use bonfire_train::OptimizerKind;
use bonfire_train::parity::Outcome;
use burn::module::{Module, Param};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::collections::BTreeMap;
use std::sync::OnceLock;

const STEPS: usize = 3;
const ROWS: usize = 8;

// ---------------------------------------------------------------------------------------
// The GPT in plain Burn ops (the parity contract's math, docs: parity-harness)
// ---------------------------------------------------------------------------------------

/// `x Wᵀ + b` on `[B, T, in]`, through a 2-d matmul.
fn linear(l: &ParallelLinear, x: Tensor<3>) -> Tensor<3> {
    let [b, t, d_in] = x.dims();
    let w = l.weight.val();
    let d_out = w.dims()[0];
    let y = x.reshape([b * t, d_in]).matmul(w.transpose());
    let y = y.reshape([b, t, d_out]);
    match &l.bias {
        Some(bias) => y + bias.val().unsqueeze::<3>(),
        None => y,
    }
}

/// Biased variance, eps 1e-5, then weight and bias.
fn layer_norm(n: &ParallelLayerNorm, x: Tensor<3>) -> Tensor<3> {
    let centred = x.clone() - x.mean_dim(2);
    let var = centred.clone().powi_scalar(2).mean_dim(2);
    centred / (var + 1e-5).sqrt() * n.weight.val().unsqueeze::<3>() + n.bias.val().unsqueeze::<3>()
}

/// The exact GELU, `x·Φ(x) = x·(1 + erf(x/√2))/2`.
fn gelu(x: Tensor<3>) -> Tensor<3> {
    x.clone() * ((x / std::f64::consts::SQRT_2).erf() + 1.0) * 0.5
}

/// Causal multi-head attention: head j uses features j·d/h .. (j+1)·d/h.
fn attention(
    a: &bonfire_models::gpt::attention::GptAttention,
    x: Tensor<3>,
    heads: usize,
) -> Tensor<3> {
    let [b, t, d] = x.dims();
    let dh = d / heads;
    let split = |y: Tensor<3>| y.reshape([b, t, heads, dh]).swap_dims(1, 2);
    let q = split(linear(&a.q, x.clone()));
    let k = split(linear(&a.k, x.clone()));
    let v = split(linear(&a.v, x));
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::<2>::from_data(TensorData::new(mask, [t, t]), &q.device());
    let scores = q.matmul(k.swap_dims(2, 3)) / (dh as f64).sqrt() + mask.unsqueeze::<4>();
    let y = softmax(scores, 3).matmul(v);
    linear(&a.o, y.swap_dims(1, 2).reshape([b, t, d]))
}

/// The mean cross-entropy over all positions of the GPT on `ids` `[B, T]`.
fn plain_loss(m: &Gpt, ids: Tensor<2, Int>, targets: Tensor<2, Int>, heads: usize) -> Tensor<1> {
    let [b, t] = ids.dims();
    let tok = m.tok_emb.weight.val();
    let d = tok.dims()[1];
    let tokens = tok.select(0, ids.reshape([b * t])).reshape([b, t, d]);
    let mut x = tokens + m.pos_emb.weight.val().narrow(0, 0, t).unsqueeze::<3>();
    for block in &m.blocks {
        x = x.clone() + attention(&block.attn, layer_norm(&block.ln1, x.clone()), heads);
        let h = gelu(linear(&block.mlp.fc1, layer_norm(&block.ln2, x.clone())));
        x = x + linear(&block.mlp.fc2, h);
    }
    let logits = linear(&m.head, layer_norm(&m.ln_f, x));
    let v = logits.dims()[2];
    let logp = log_softmax(logits.reshape([b * t, v]), 1);
    let picked = logp.gather(1, targets.reshape([b * t, 1]));
    -picked.mean()
}

// ---------------------------------------------------------------------------------------
// Reading parameters and gradients by their contract names (no Bonfire visitor)
// ---------------------------------------------------------------------------------------

fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().expect("f32 values")
}

/// A block's six linear layers under their contract names.
fn linears(blk: &bonfire_models::gpt::block::GptBlock) -> [(&'static str, &ParallelLinear); 6] {
    [
        ("attn.q", &blk.attn.q),
        ("attn.k", &blk.attn.k),
        ("attn.v", &blk.attn.v),
        ("attn.o", &blk.attn.o),
        ("mlp.fc1", &blk.mlp.fc1),
        ("mlp.fc2", &blk.mlp.fc2),
    ]
}

/// `(name, shape, values)` of `p`, or of its gradient in `grads`.
fn entry<const D: usize>(
    name: String,
    p: &Param<Tensor<D>>,
    grads: Option<&GradientsParams>,
) -> (String, Vec<usize>, Vec<f32>) {
    let v = match grads {
        Some(g) => host(
            g.get::<D>(p.id)
                .unwrap_or_else(|| panic!("no gradient: {name}")),
        ),
        None => host(p.val()),
    };
    (name, p.dims().to_vec(), v)
}

/// `(name, shape, values)` of every parameter, or of its gradient in `grads`.
fn named(m: &Gpt, grads: Option<&GradientsParams>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = vec![
        entry("tok_emb.weight".into(), &m.tok_emb.weight, grads),
        entry("pos_emb.weight".into(), &m.pos_emb.weight, grads),
        entry("head.weight".into(), &m.head.weight, grads),
    ];
    for (i, blk) in m.blocks.iter().enumerate() {
        for (n, l) in linears(blk) {
            out.push(entry(format!("blocks.{i}.{n}.weight"), &l.weight, grads));
        }
    }
    out.push(entry("ln_f.weight".into(), &m.ln_f.weight, grads));
    out.push(entry("ln_f.bias".into(), &m.ln_f.bias, grads));
    for (i, blk) in m.blocks.iter().enumerate() {
        for (n, ln) in [("ln1", &blk.ln1), ("ln2", &blk.ln2)] {
            out.push(entry(format!("blocks.{i}.{n}.weight"), &ln.weight, grads));
            out.push(entry(format!("blocks.{i}.{n}.bias"), &ln.bias, grads));
        }
        for (n, l) in linears(blk) {
            let b = l.bias.as_ref().expect("the block's linears have biases");
            out.push(entry(format!("blocks.{i}.{n}.bias"), b, grads));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// The plain-Burn training loop
// ---------------------------------------------------------------------------------------

/// Burn's own optimizer, configured as the parity contract says.
fn burn_optimizer(optim: OptimizerKind) -> ModuleOptimizer {
    match optim {
        OptimizerKind::Sgd => SgdConfig::new().init(),
        OptimizerKind::AdamW => AdamWConfig::new()
            .with_beta_1(0.9)
            .with_beta_2(0.95)
            .with_epsilon(1e-6)
            .with_weight_decay(0.1)
            .init(),
    }
}

/// Steps of plain Burn on the whole global batch, step `s` at `lrs[s]`, as a harness result.
fn plain_burn(model: &Gpt, batches: &Batches, optim: OptimizerKind, lrs: &[f64]) -> Outcome {
    let device = Device::flex().autodiff();
    let heads = common::gpt_cfg().n_heads;
    let mut model = model.clone().fork(&device);
    let mut optimizer = burn_optimizer(optim);
    let (mut losses, mut grad0) = (Vec::new(), BTreeMap::new());
    assert!(!lrs.is_empty());
    for (s, &lr) in lrs.iter().enumerate() {
        let (ids, targets) = batches.rows(s, 0, batches.batch, &device);
        let loss = plain_loss(&model, ids, targets, heads);
        losses.push(host(loss.clone().detach())[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        if s == 0 {
            grad0 = named(&model, Some(&grads))
                .into_iter()
                .map(|(n, _, g)| (n, g))
                .collect();
        }
        model = optimizer.step(lr, model, grads);
    }
    let params = named(&model, None)
        .into_iter()
        .map(|(n, shape, v)| (n, (shape, v)))
        .collect();
    Outcome {
        params,
        grad0,
        losses,
    }
}

// ---------------------------------------------------------------------------------------
// The comparisons
// ---------------------------------------------------------------------------------------

struct Fixture {
    model: Gpt,
    batches: Batches,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let cfg = common::gpt_cfg();
        Fixture {
            model: common::seeded(3, &Device::flex().autodiff(), |d| Gpt::new(&cfg, d)),
            batches: common::random_batches(&cfg, STEPS, ROWS, 7),
        }
    })
}

/// Bonfire's one-device run and one layout per axis: `(mesh, zero, schedule, microbatches)`.
const LAYOUTS: &[(&str, usize, Option<&str>, Option<usize>)] = &[
    ("dp=1", 0, None, None),
    ("dp=2", 0, None, None),
    ("dp=2", 3, None, None),
    ("tp=2", 0, None, None),
    ("pp=2", 0, Some("1f1b"), Some(4)),
    ("cp=2", 0, None, None),
];

/// [`LAYOUTS`] as layouts.
fn layouts() -> Vec<bonfire_layout::ParallelDims> {
    let layouts: Vec<_> = LAYOUTS
        .iter()
        .map(|&(mesh, zero, schedule, microbatches)| {
            LayoutArgs {
                mesh: Some(mesh.into()),
                zero,
                schedule: schedule.map(str::to_string),
                microbatches,
                ..LayoutArgs::default()
            }
            .dims("dp=1")
            .unwrap()
        })
        .collect();
    assert!(!layouts.is_empty());
    layouts
}

/// The suites' tolerance for `optim` at its rate `lr`.
fn tolerance(optim: OptimizerKind, lr: f64) -> bonfire_comm::testing::Tolerance {
    match optim {
        OptimizerKind::Sgd => common::SGD,
        OptimizerKind::AdamW => common::adamw(lr),
    }
}

/// Every layout of [`LAYOUTS`] trained by `train` (`steps` steps) equals `reference` within
/// `tol`; prints how close each came.
fn every_layout_equals(
    label: &str,
    reference: &Outcome,
    (steps, tol): (usize, bonfire_comm::testing::Tolerance),
    train: impl Fn(&bonfire_layout::ParallelDims) -> Outcome,
) {
    for dims in layouts() {
        let what = format!("plain Burn{label} vs {dims}");
        let got = train(&dims);
        assert_eq!(got.losses.len(), steps, "{what}: losses");
        let closeness = common::assert_same_run(&what, &got, reference, tol);
        println!("{what}: {closeness}");
    }
}

fn check(optim: OptimizerKind) {
    let f = fixture();
    let lr = common::gpt_lr(optim);
    let reference = plain_burn(&f.model, &f.batches, optim, &[lr; STEPS]);
    assert_eq!(reference.params.len(), 16 * common::gpt_cfg().n_layers + 5);
    let label = format!(" {}", optim.name());
    every_layout_equals(&label, &reference, (STEPS, tolerance(optim, lr)), |dims| {
        common::train_layout(&f.model, &f.batches, dims, optim, STEPS)
    });
}

#[test]
fn sgd_layouts_equal_plain_burn() {
    check(OptimizerKind::Sgd);
}

#[test]
fn adamw_layouts_equal_plain_burn() {
    check(OptimizerKind::AdamW);
}

// ---------------------------------------------------------------------------------------
// The learning-rate schedule (issue 46): warmup then cosine decay, against plain Burn stepped
// at the contract's rates written out here (not Bonfire's `LrSchedule`)
// ---------------------------------------------------------------------------------------

/// Steps of the scheduled runs: 2 of warmup, then 2 of cosine decay to a tenth of the peak.
const SCHEDULED: usize = 4;

/// The contract's rates for W = 2, S = 4, cosine to lr/10: lr·1/2, lr·2/2, then
/// f = 0 and f = 1/2 of the decay (min + (lr − min)·(1 + cos πf)/2).
fn contract_rates(lr: f64) -> Vec<f64> {
    let min = lr / 10.0;
    let cosine = |f: f64| min + (lr - min) * (1.0 + (std::f64::consts::PI * f).cos()) / 2.0;
    vec![lr / 2.0, lr, cosine(0.0), cosine(0.5)]
}

/// The scheduled runs' batches: `SCHEDULED` global batches of `ROWS` (seed 9).
fn scheduled_batches() -> &'static Batches {
    static BATCHES: OnceLock<Batches> = OnceLock::new();
    BATCHES.get_or_init(|| common::random_batches(&common::gpt_cfg(), SCHEDULED, ROWS, 9))
}

/// Warmup 2, then cosine decay to `lr`/10 (Bonfire's side of [`contract_rates`]).
fn schedule(lr: f64) -> bonfire_train::LrSchedule {
    bonfire_train::LrSchedule {
        warmup: 2,
        decay: bonfire_train::Decay::Cosine,
        min_lr: lr / 10.0,
    }
}

fn check_scheduled(optim: OptimizerKind) {
    let (model, batches) = (&fixture().model, scheduled_batches());
    let lr = common::gpt_lr(optim);
    let reference = plain_burn(model, batches, optim, &contract_rates(lr));
    let config = bonfire_train::FitConfig {
        schedule: schedule(lr),
        ..bonfire_train::FitConfig::new(SCHEDULED, lr)
    };
    let label = format!(" (scheduled) {} warmup 2 cosine", optim.name());
    let tol = tolerance(optim, lr);
    every_layout_equals(&label, &reference, (SCHEDULED, tol), |dims| {
        bonfire_examples::harness::train_with(model, batches, dims, optim, &config)
            .unwrap_or_else(|e| panic!("{dims}{label}: {e}"))
            .0
    });
}

#[test]
fn sgd_layouts_follow_the_schedule_as_plain_burn() {
    check_scheduled(OptimizerKind::Sgd);
}

#[test]
fn adamw_layouts_follow_the_schedule_as_plain_burn() {
    check_scheduled(OptimizerKind::AdamW);
}

/// A run scheduled over 4 steps, saved after 2 under dp=2 ZeRO-1 and resumed under tp=2,
/// equals the uninterrupted scheduled run on one device (itself plain Burn's, above): the
/// schedule's position is the step, not the steps since the start (a schedule restarted at
/// the resume would train step 2 at lr/2).
#[test]
fn a_resumed_run_continues_the_schedule() {
    let layout = |mesh: &str, zero| {
        LayoutArgs {
            zero,
            ..LayoutArgs::mesh(mesh)
        }
        .dims("dp=1")
        .unwrap()
    };
    let adamw = common::adamw(common::gpt_lr(OptimizerKind::AdamW));
    common::resume::check_resume_scheduled(
        "schedule",
        &fixture().model,
        scheduled_batches(),
        ROWS,
        (&layout("dp=2", 1), &layout("tp=2", 0)),
        (SCHEDULED, 2),
        adamw,
        schedule,
    );
}
