//! The GPT trained by plain Burn, the reference no Bonfire crate computes (issue 26, point 6;
//! `plain_burn.rs`, `recipe.rs`): the parity contract's math written with Burn tensor ops on
//! the parameters of the same `Gpt` module (its own `forward` is not plain Burn: every layer
//! runs through `bonfire_module::layer` and Bonfire's fused kernels), Burn's
//! `loss.backward()`, `GradientsParams`, and Burn's own `SgdConfig` / `AdamWConfig` — with
//! the training recipe's AdamW settings, Burn's parameter groups for 1-d parameters, and
//! clipping by the global norm written here with `GradientsParams` alone.

use bonfire_models::data::Batches;
use bonfire_models::gpt::Gpt;
use bonfire_tp::{ParallelLayerNorm, ParallelLinear};
use bonfire_train::parity::Outcome;
use bonfire_train::{OptimizerKind, OptimizerSpec};
use burn::module::{Module, ModuleVisitor, Param, ParamGroup, ParamId};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::collections::BTreeMap;

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
pub fn plain_loss(
    m: &Gpt,
    ids: Tensor<2, Int>,
    targets: Tensor<2, Int>,
    heads: usize,
) -> Tensor<1> {
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

pub fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
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

/// Burn's own optimizer as `spec` says: Burn's `AdamWConfig` with its settings and, with
/// `no_decay_1d`, a second group of Burn's (`ModuleOptimizer::with_group`) holding `model`'s
/// 1-d parameters, decayed by nothing — PyTorch's two parameter groups.
pub fn burn_optimizer(spec: &OptimizerSpec, model: &Gpt) -> ModuleOptimizer {
    let a = &spec.adamw;
    let adamw = |wd: f32| {
        AdamWConfig::new()
            .with_beta_1(a.betas.0)
            .with_beta_2(a.betas.1)
            .with_epsilon(a.epsilon)
            .with_weight_decay(wd)
    };
    match spec.kind {
        OptimizerKind::Sgd => SgdConfig::new().init(),
        OptimizerKind::AdamW if a.no_decay_1d => {
            let ids = named_params(model)
                .into_iter()
                .filter(|(_, shape, _)| shape.len() < 2)
                .map(|(_, _, id)| id)
                .collect();
            adamw(a.weight_decay).init().with_group(
                ParamGroup::from_ids(ids),
                adamw(0.0).build(),
                None,
            )
        }
        OptimizerKind::AdamW => adamw(a.weight_decay).init(),
    }
}

/// Every parameter's name, shape and id.
fn named_params(m: &Gpt) -> Vec<(String, Vec<usize>, ParamId)> {
    struct Ids(Vec<(Vec<usize>, ParamId)>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push((p.dims().to_vec(), p.id));
        }
    }
    let mut ids = Ids(Vec::new());
    m.visit(&mut ids);
    ids.0
        .into_iter()
        .enumerate()
        .map(|(i, (shape, id))| (i.to_string(), shape, id))
        .collect()
}

/// The global L2 norm of `grads` (every parameter of `m`, in f64 on the host) and, with
/// `max`, every gradient multiplied by min(1, max / (norm + 1e-6)) (PyTorch's
/// `clip_grad_norm_`), written with Burn's `GradientsParams` alone.
fn clip(m: &Gpt, grads: &mut GradientsParams, max: Option<f64>) -> f64 {
    struct SumSquares<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor for SumSquares<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let g = host(self.0.get::<D>(p.id).expect("a gradient"));
            self.1 += g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
        }
    }
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let g = self.0.remove::<D>(p.id).expect("a gradient");
            self.0.register::<D>(p.id, g * self.1);
        }
    }
    let mut sum = SumSquares(grads, 0.0);
    m.visit(&mut sum);
    let norm = sum.1.sqrt();
    if let Some(max) = max {
        let coef = max / (norm + 1e-6);
        if coef < 1.0 {
            m.visit(&mut Scale(grads, coef as f32));
        }
    }
    norm
}

/// What plain Burn trains with: the optimizer, step `s`'s rate `lrs[s]`, clipping.
pub struct Recipe {
    pub optim: OptimizerSpec,
    pub lrs: Vec<f64>,
    pub clip: Option<f64>,
}

/// Steps of plain Burn on the whole global batch as `recipe` says, as a harness result (each
/// step's gradient norm before clipping among it).
pub fn plain_burn(model: &Gpt, batches: &Batches, recipe: &Recipe) -> Outcome {
    let device = Device::flex().autodiff();
    let heads = super::gpt_cfg().n_heads;
    let mut model = model.clone().fork(&device);
    let mut optimizer = burn_optimizer(&recipe.optim, &model);
    let (mut losses, mut grad0, mut norms) = (Vec::new(), BTreeMap::new(), Vec::new());
    assert!(!recipe.lrs.is_empty());
    for (s, &lr) in recipe.lrs.iter().enumerate() {
        let (ids, targets) = batches.rows(s, 0, batches.batch, &device);
        let loss = plain_loss(&model, ids, targets, heads);
        losses.push(host(loss.clone().detach())[0]);
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        if s == 0 {
            grad0 = named(&model, Some(&grads))
                .into_iter()
                .map(|(n, _, g)| (n, g))
                .collect();
        }
        norms.push(clip(&model, &mut grads, recipe.clip));
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
        grad_norms: norms,
    }
}
