//! The GPT trained by plain Burn, the reference no Bonfire crate computes (issue 26, point 6;
//! `plain_burn.rs`, `recipe.rs`): the parity contract's math written with Burn tensor ops on
//! the parameters of the same `Gpt` module (its own `forward` is not plain Burn: every layer
//! runs through `bonfire_module::layer` and Bonfire's fused kernels), Burn's
//! `loss.backward()`, `GradientsParams`, and Burn's own `SgdConfig` / `AdamWConfig` — with
//! the training recipe's AdamW settings, Burn's parameter groups for 1-d parameters, and
//! clipping by the global norm written here with `GradientsParams` alone.

use bonfire_examples::cli::LayoutArgs;
use bonfire_models::data::{self, Batches, TokenBatch};
use bonfire_models::gpt::Gpt;
use bonfire_parallel::ParallelModel;
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

/// `(name, shape, values)` of every trained parameter of `m` — its module path, which is its
/// contract (transformers') name — or of its gradient in `grads`, read with Burn's own
/// visitor (a parameter that requires no gradient is state, and is left out).
fn named<M: Module>(m: &M, grads: Option<&GradientsParams>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    struct Named<'a> {
        path: Vec<String>,
        grads: Option<&'a GradientsParams>,
        out: Vec<(String, Vec<usize>, Vec<f32>)>,
    }
    impl ModuleVisitor for Named<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if !p.is_require_grad() {
                return;
            }
            let name = self.path.join(".");
            let v = match self.grads {
                Some(g) => host(
                    g.get::<D>(p.id)
                        .unwrap_or_else(|| panic!("no gradient: {name}")),
                ),
                None => host(p.val()),
            };
            self.out.push((name, p.dims().to_vec(), v));
        }
    }
    let mut v = Named {
        path: Vec::new(),
        grads,
        out: Vec::new(),
    };
    m.visit(&mut v);
    v.out
}

// ---------------------------------------------------------------------------------------
// The plain-Burn training loop
// ---------------------------------------------------------------------------------------

/// Burn's own optimizer as `spec` says: Burn's `AdamWConfig` with its settings and, with
/// `no_decay_1d`, a second group of Burn's (`ModuleOptimizer::with_group`) holding `model`'s
/// 1-d parameters, decayed by nothing — PyTorch's two parameter groups.
pub fn burn_optimizer<M: Module>(spec: &OptimizerSpec, model: &M) -> ModuleOptimizer {
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
fn named_params<M: Module>(m: &M) -> Vec<(String, Vec<usize>, ParamId)> {
    struct Ids(Vec<(Vec<usize>, ParamId)>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if !p.is_require_grad() {
                return; // state, no parameter
            }
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
fn clip<M: Module>(m: &M, grads: &mut GradientsParams, max: Option<f64>) -> f64 {
    struct SumSquares<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor for SumSquares<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if !p.is_require_grad() {
                return; // state, no parameter
            }
            let g = host(self.0.get::<D>(p.id).expect("a gradient"));
            self.1 += g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
        }
    }
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if !p.is_require_grad() {
                return; // state, no parameter
            }
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
    let heads = super::gpt_cfg().n_heads;
    plain_burn_with(model, batches, recipe, |m, ids, targets| {
        plain_loss(m, ids, targets, heads)
    })
}

/// [`plain_burn`] for any module whose plain-Burn loss is `loss` (its parameters named by
/// their module paths).
pub fn plain_burn_with<M: Module + Clone>(
    model: &M,
    batches: &Batches,
    recipe: &Recipe,
    loss: impl Fn(&M, Tensor<2, Int>, Tensor<2, Int>) -> Tensor<1>,
) -> Outcome {
    let device = Device::flex().autodiff();
    let mut model = model.clone().fork(&device);
    let mut optimizer = burn_optimizer(&recipe.optim, &model);
    let (mut losses, mut grad0, mut norms) = (Vec::new(), BTreeMap::new(), Vec::new());
    assert!(!recipe.lrs.is_empty());
    for (s, &lr) in recipe.lrs.iter().enumerate() {
        let (ids, targets) = batches.rows(s, 0, batches.batch, &device);
        let loss = loss(&model, ids, targets);
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
        ..Outcome::default()
    }
}

/// `model` trained 2 steps on `batches` by plain Burn (`loss`, Burn's backward and optimizers)
/// and by Bonfire in each of `cases`, SGD (lr 0.5) and AdamW (lr 0.01): every loss, step-0
/// gradient and parameter within SGD's suite tolerance, and AdamW's parameters within
/// `adamw_floor`·lr.
pub fn against_plain<M: ParallelModel<Batch = TokenBatch> + Sync>(
    what: &str,
    model: &M,
    batches: &data::Batches,
    cases: &[LayoutArgs],
    adamw_floor: f32,
    loss: impl Fn(&M, Tensor<2, Int>, Tensor<2, Int>) -> Tensor<1>,
) {
    against_plain_within(what, model, batches, cases, (super::SGD, adamw_floor), loss);
}

/// [`against_plain`] with SGD's tolerance `sgd`.
pub fn against_plain_within<M: ParallelModel<Batch = TokenBatch> + Sync>(
    what: &str,
    model: &M,
    batches: &data::Batches,
    cases: &[LayoutArgs],
    (sgd, adamw_floor): (bonfire_comm::testing::Tolerance, f32),
    loss: impl Fn(&M, Tensor<2, Int>, Tensor<2, Int>) -> Tensor<1>,
) {
    for (optim, lr) in [(OptimizerKind::Sgd, 0.5), (OptimizerKind::AdamW, 0.01)] {
        let recipe = Recipe {
            optim: optim.into(),
            lrs: vec![lr; 2],
            clip: None,
        };
        let want = plain_burn_with(model, batches, &recipe, &loss);
        let tol = match optim {
            OptimizerKind::Sgd => sgd,
            OptimizerKind::AdamW => {
                bonfire_comm::testing::Tolerance::new(1e-5, adamw_floor * lr as f32)
            }
        };
        for case in cases {
            let dims = case.dims("dp=1").unwrap();
            let name = format!("{what} {dims} {} vs plain Burn", optim.name());
            let got = bonfire_examples::harness::train(model, batches, &dims, optim, 2, lr)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let c = super::assert_same_run(&name, &got, &want, tol);
            println!("{name}: {c}");
        }
    }
}
