//! Plans: wildcard matching, the errors reported before anything is sharded, and
//! `loss_parallel` (vocab-parallel cross-entropy) against the gathered cross-entropy.

use bonfire_comm::OpKind;
use bonfire_comm::{ProcessGroup, ThreadWorld};
use bonfire_dtensor::{CommCounter, DeviceMesh};
use bonfire_tp::{
    ColwiseParallel, ParallelError, ParallelLayerNorm, ParallelLinear, ParallelPlan,
    PrepareModuleInput, RowwiseParallel, SequenceParallel, StylePlacement, loss_parallel,
    parallelize_module, path_matches,
};
use burn::module::Module;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::time::Duration;

fn world<R: Send>(n: usize, f: impl Fn(ProcessGroup) -> R + Sync) -> Vec<R> {
    ThreadWorld::new(n)
        .timeout(Duration::from_secs(60))
        .launch(f)
        .unwrap_or_else(|e| panic!("{e}"))
}

#[derive(Module, Debug)]
struct Layer {
    ln: ParallelLayerNorm,
    fc: ParallelLinear,
    plain: burn::nn::Linear,
}

#[derive(Module, Debug)]
struct Model {
    layers: Vec<Layer>,
}

fn model(device: &Device) -> Model {
    let layer = || Layer {
        ln: ParallelLayerNorm::new(6, device),
        fc: ParallelLinear::new(6, 6, true, device),
        plain: burn::nn::LinearConfig::new(6, 6).init(device),
    };
    Model {
        layers: vec![layer(), layer()],
    }
}

#[test]
fn wildcards() {
    assert!(path_matches("blocks.*.attn.q", "blocks.0.attn.q"));
    assert!(path_matches("blocks.*.attn.q", "blocks.11.attn.q"));
    assert!(!path_matches("blocks.*.attn.q", "blocks.0.attn.q.weight"));
    assert!(!path_matches("blocks.*.attn.q", "blocks.0.attn.k"));
    assert!(path_matches("blocks.*.mlp.fc*", "blocks.3.mlp.fc2"));
    assert!(path_matches("*", "head"));
    assert!(!path_matches("*", "blocks.0"));
    assert!(path_matches("a*c", "abbc"));
    assert!(!path_matches("a*c", "abcd"));
}

fn apply(tp: usize, plan: ParallelPlan) -> Result<(), ParallelError> {
    let device = Device::flex();
    let m = model(&device);
    world(tp, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
        parallelize_module(m.clone(), &mesh, "tp", &plan).map(|_| ())
    })
    .into_iter()
    .next()
    .unwrap()
}

#[test]
fn clear_errors_before_sharding() {
    let err = |tp, plan| apply(tp, plan).unwrap_err().to_string();
    // A pattern that matches nothing, with examples of real paths.
    let e = err(
        2,
        ParallelPlan::new().add("blocks.*.fc", ColwiseParallel::default()),
    );
    assert!(
        e.contains("`blocks.*.fc` matches no module") && e.contains("layers"),
        "{e}"
    );
    // A style on a module that cannot take it.
    let e = err(
        2,
        ParallelPlan::new().add("layers.*.ln", ColwiseParallel::default()),
    );
    assert!(
        e.contains("ColwiseParallel cannot be applied to `layers.0.ln`"),
        "{e}"
    );
    assert!(e.contains("ParallelLayerNorm"), "{e}");
    let e = err(
        2,
        ParallelPlan::new().add("layers.*.fc", SequenceParallel::default()),
    );
    assert!(e.contains("SequenceParallel cannot be applied"), "{e}");
    // A burn::nn::Linear is not parallel-aware: refused rather than silently sharded.
    let e = err(
        2,
        ParallelPlan::new().add("layers.0.plain", RowwiseParallel::default()),
    );
    assert!(
        e.contains("`layers.0.plain`") && e.contains("Linear"),
        "{e}"
    );
    // A parameter is not a module.
    let e = err(
        2,
        ParallelPlan::new().add("layers.0.fc.weight", ColwiseParallel::default()),
    );
    assert!(e.contains("a parameter"), "{e}");
    // Dims that do not divide.
    let e = err(
        4,
        ParallelPlan::new().add("layers.*.fc", ColwiseParallel::default()),
    );
    assert!(
        e.contains("layers.0.fc.weight") && e.contains("out_features (6)") && e.contains("4"),
        "{e}"
    );
    let e = err(
        4,
        ParallelPlan::new().add("layers.1.fc", RowwiseParallel::default()),
    );
    assert!(e.contains("in_features (6)"), "{e}");
    // Two styles for one module.
    let e = err(
        2,
        ParallelPlan::new()
            .add("layers.*.fc", ColwiseParallel::default())
            .add("layers.1.fc", RowwiseParallel::default()),
    );
    assert!(
        e.contains("matched by `layers.*.fc` and `layers.1.fc`"),
        "{e}"
    );
    // Unsupported layouts.
    let e = err(
        2,
        ParallelPlan::new().add(
            "layers.0.fc",
            ColwiseParallel::default().use_local_output(false),
        ),
    );
    assert!(e.contains("use_local_output"), "{e}");
    let e = err(
        2,
        ParallelPlan::new().add(
            "layers.0.fc",
            RowwiseParallel::default().output_layout(StylePlacement::Shard(-1)),
        ),
    );
    assert!(e.contains("output layout"), "{e}");
    // PrepareModuleInput needs a ParallelIo field.
    let e = err(
        2,
        ParallelPlan::new().add(
            "layers.0",
            PrepareModuleInput {
                input_layout: StylePlacement::Shard(1),
                desired_input_layout: StylePlacement::Replicate,
            },
        ),
    );
    assert!(e.contains("ParallelIo"), "{e}");
    // Unknown mesh axis.
    let device = Device::flex();
    let m = model(&device);
    let e = world(1, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "dp").unwrap();
        parallelize_module(m.clone(), &mesh, "tp", &ParallelPlan::new())
            .unwrap_err()
            .to_string()
    });
    assert!(e[0].contains("no axis named `tp`"), "{}", e[0]);
    // A valid plan applies.
    apply(
        2,
        ParallelPlan::new()
            .add("layers.*.fc", ColwiseParallel::default())
            .add("layers.*.ln", SequenceParallel::default()),
    )
    .unwrap();
}

fn cross_entropy(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let [b, t, v] = logits.dims();
    let logp = log_softmax(logits.reshape([b * t, v]), 1);
    logp.gather(1, targets.reshape([b * t, 1])).mean().neg()
}

/// loss_parallel on vocab shards = cross-entropy on the full logits, gradients included,
/// with an all-gather and an all-reduce of `B·T` floats in forward and none in backward.
#[test]
fn loss_parallel_matches_cross_entropy() {
    let device = Device::flex().autodiff();
    let (b, t, v) = (2, 3, 12);
    let vals: Vec<f32> = (0..b * t * v)
        .map(|i| ((i * 29 % 23) as f32 - 11.0) / 3.0)
        .collect();
    let logits = Tensor::<3>::from_data(TensorData::new(vals, [b, t, v]), &device);
    let targets =
        Tensor::<2, Int>::from_data(TensorData::new(vec![0i64, 11, 5, 6, 3, 9], [b, t]), &device);
    let full = logits.clone().require_grad();
    let loss = cross_entropy(full.clone(), targets.clone());
    let want_loss = loss.clone().into_scalar::<f32>();
    let want_grad = full.grad(&loss.backward()).unwrap();
    for tp in [2, 3, 4] {
        world(tp, |pg| {
            let vl = v / tp;
            let local = logits
                .clone()
                .narrow(2, pg.rank() * vl, vl)
                .detach()
                .require_grad();
            let counter = CommCounter::start();
            let loss = loss_parallel(local.clone(), targets.clone(), &pg);
            assert_eq!(counter.count(OpKind::AllGather), 1);
            assert_eq!(counter.count(OpKind::AllReduce), 1);
            assert_eq!(counter.total(), 2);
            counter.reset();
            let got = loss.clone().into_scalar::<f32>();
            assert!(
                (got - want_loss).abs() <= 1e-6 * want_loss.abs().max(1.0),
                "{got} vs {want_loss}"
            );
            let grads = loss.backward();
            assert_eq!(counter.total(), 0, "no collective in backward");
            let g = local.grad(&grads).unwrap();
            let want = want_grad.clone().narrow(2, pg.rank() * vl, vl);
            g.into_data().assert_approx_eq::<f32>(
                &want.into_data(),
                burn::tensor::Tolerance::absolute(1e-6),
            );
        });
    }
}

/// The conversions from Burn's own layers compute the same function.
#[test]
fn from_burn_layers() {
    use bonfire_tp::ParallelEmbedding;
    let device = Device::flex();
    let lin = burn::nn::LinearConfig::new(5, 3).init(&device);
    let emb = burn::nn::EmbeddingConfig::new(7, 4).init(&device);
    let x = Tensor::<2>::from_data(
        TensorData::new((0..10).map(|i| i as f32 / 3.0).collect::<Vec<_>>(), [2, 5]),
        &device,
    );
    let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![0i64, 6, 3, 2], [2, 2]), &device);
    let tol = burn::tensor::Tolerance::<f32>::absolute(1e-6);
    ParallelLinear::from_burn(lin.clone())
        .forward(x.clone())
        .into_data()
        .assert_approx_eq::<f32>(&lin.forward(x).into_data(), tol);
    ParallelEmbedding::from_burn(emb.clone())
        .forward(ids.clone())
        .into_data()
        .assert_approx_eq::<f32>(&emb.forward(ids).into_data(), tol);
}
