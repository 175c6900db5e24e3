//! Tensor-parallel styles on small modules: column-/row-wise linears, sequence-parallel
//! norms, vocab-parallel embeddings and prepared module inputs equal the unsharded module
//! (outputs and gradients), with the collectives each layer is expected to issue.

use bonfire_comm::OpKind;
use bonfire_comm::{ProcessGroup, ThreadWorld};
use bonfire_dtensor::{CommCounter, DeviceMesh, chunk_range};
use bonfire_tp::{
    ColwiseParallel, ParallelEmbedding, ParallelIo, ParallelLayerNorm, ParallelLinear,
    ParallelPlan, PrepareModuleInput, RowwiseParallel, SequenceParallel, StylePlacement,
    parallelize_module, sequence, sharded_params,
};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Int, Tensor, TensorData, activation::gelu};
use std::collections::BTreeMap;
use std::time::Duration;

fn dev() -> Device {
    Device::flex().autodiff()
}

fn world<R: Send>(n: usize, f: impl Fn(ProcessGroup) -> R + Sync) -> Vec<R> {
    ThreadWorld::new(n)
        .timeout(Duration::from_secs(60))
        .launch(f)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn vec_of<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// `|a − b| ≤ 5e-7·max(|a|, |b|) + 1e-7`: the largest difference measured is 4.8e-7 on a
/// gradient of magnitude 3.7 (summation order), a third of what this allows there.
fn assert_close(a: &[f32], b: &[f32], what: &str) {
    let tol = bonfire_comm::testing::Tolerance::new(5e-7, 1e-7);
    bonfire_comm::testing::assert_close(what, a, b, tol);
}

fn input(shape: [usize; 3], device: &Device) -> Tensor<3> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i * 37 % 17) as f32 - 8.0) / 7.0).collect();
    Tensor::from_data(TensorData::new(v, shape), device)
}

/// Every float parameter's path → (shape, gradient or value).
struct Collect<'a> {
    stack: Vec<String>,
    grads: Option<&'a burn::tensor::Gradients>,
    out: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}
impl ModuleVisitor for Collect<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.stack.push(name.into());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.stack.pop();
    }
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        let t = match self.grads {
            Some(g) => p.val().grad(g).expect("gradient").into_data(),
            None => p.val().into_data(),
        };
        let v = t.convert::<f32>().try_to_vec::<f32>().unwrap();
        self.out
            .insert(self.stack.join("."), (p.dims().to_vec(), v));
    }
}

fn collect<M: Module>(
    m: &M,
    grads: Option<&burn::tensor::Gradients>,
) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let mut c = Collect {
        stack: vec![],
        grads,
        out: BTreeMap::new(),
    };
    m.visit(&mut c);
    c.out
}

/// The whole tensor from this rank's shard (the library's host gather).
fn gather_host(v: &[f32], shape: &[usize], dim: usize, pg: &ProcessGroup) -> Vec<f32> {
    bonfire_module::params::unshard(v, shape, dim, pg).unwrap()
}

#[derive(Module, Debug)]
struct Mlp {
    norm: ParallelLayerNorm,
    up: ParallelLinear,
    down: ParallelLinear,
}

impl Mlp {
    fn new(d: usize, f: usize, device: &Device) -> Self {
        // A non-trivial norm so that its gradients are tested.
        let mut norm = ParallelLayerNorm::new(d, device);
        norm.weight = Param::from_tensor(
            Tensor::<1>::from_data(
                TensorData::new((0..d).map(|i| 1.0 + i as f32 / 10.0).collect(), [d]),
                device,
            )
            .require_grad(),
        );
        Self {
            norm,
            up: ParallelLinear::new(d, f, true, device),
            down: ParallelLinear::new(f, d, true, device),
        }
    }
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        x.clone()
            + self
                .down
                .forward(gelu(self.up.forward(self.norm.forward(x))))
    }
}

fn weights(shape: [usize; 3], device: &Device) -> Tensor<3> {
    input(shape, device).cos()
}

/// The MLP on `tp` ranks with or without sequence parallelism equals the unsharded MLP:
/// output, every parameter gradient (gathered) and the collective counts per layer.
fn mlp_parity(tp: usize, sp: bool) {
    mlp_parity_on(tp, sp, dev(), false)
}

fn mlp_parity_on(tp: usize, sp: bool, device: Device, recompute: bool) {
    let (b, t, d, f) = (2, 4, 8, 16);
    let model = Mlp::new(d, f, &device);
    let x = input([b, t, d], &device);
    let w = weights([b, t, d], &device);
    let y_ref = model.forward(x.clone());
    let grads = (y_ref.clone() * w.clone()).sum().backward();
    let want_y = vec_of(y_ref);
    let want_g = collect(&model, Some(&grads));

    world(tp, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
        let plan = if sp {
            ParallelPlan::new()
                .add("norm", SequenceParallel::default())
                .add(
                    "up",
                    ColwiseParallel::default().input_layout(StylePlacement::Shard(1)),
                )
                .add(
                    "down",
                    RowwiseParallel::default().output_layout(StylePlacement::Shard(1)),
                )
        } else {
            ParallelPlan::new()
                .add("up", ColwiseParallel::default())
                .add("down", RowwiseParallel::default())
        };
        let local = parallelize_module(model.clone().fork(&device), &mesh, "tp", &plan).unwrap();
        let shards = sharded_params(&local);
        assert_eq!(shards.get("up.weight"), Some(&0));
        assert_eq!(shards.get("up.bias"), Some(&0));
        assert_eq!(shards.get("down.weight"), Some(&1));
        assert_eq!(shards.get("down.bias"), None);
        assert_eq!(local.up.weight.dims(), [f / tp, d]);

        let (x, w) = if sp {
            let r = chunk_range(t, tp, pg.rank());
            (
                x.clone().narrow(1, r.start, r.len()),
                w.clone().narrow(1, r.start, r.len()),
            )
        } else {
            (x.clone(), w.clone())
        };
        let counter = CommCounter::start();
        let y = local.forward(x);
        let fwd = counter.counts();
        // The loss of the logical (replicated) program: under SP each rank holds a part of
        // the sum, all-reduced with a "reduce from group" (identity backward).
        let part = (y.clone() * w).sum();
        let loss = if sp {
            bonfire_dtensor::functional::reduce_from_group(part, &pg)
        } else {
            part
        };
        counter.reset();
        let grads = loss.backward();
        let mut bwd = counter.counts();
        let reduces = bwd.remove(&OpKind::AllReduce);
        if sp {
            assert_eq!(reduces, Some(3), "norm weight, norm bias, down.bias");
        } else {
            assert_eq!(reduces, Some(1), "the column-wise input's gradient");
        }
        drop(counter);
        if sp {
            // up: one all-gather of the sequence; down: one reduce-scatter; the loss's sum.
            assert_eq!(fwd.get(&OpKind::AllGather), Some(&1));
            assert_eq!(fwd.get(&OpKind::ReduceScatter), Some(&1));
            assert_eq!(fwd.get(&OpKind::AllReduce), None);
            // Backward: the duals (reduce-scatter for the gather, all-gather for the scatter),
            // and under Balanced checkpointing the sequence gather again (recomputed instead
            // of kept).
            assert_eq!(bwd.get(&OpKind::ReduceScatter), Some(&1));
            let regather = usize::from(recompute);
            assert_eq!(bwd.get(&OpKind::AllGather), Some(&(1 + regather)));
        } else {
            // One all-reduce for the row-wise output in forward; one for the column-wise
            // input's gradient in backward.
            assert_eq!(fwd.get(&OpKind::AllReduce), Some(&1));
            assert_eq!(fwd.len(), 1, "{fwd:?}");
            assert!(bwd.is_empty(), "{bwd:?}");
        }
        let y = if sp {
            sequence::sequence_gather(y.detach(), &pg, 1)
        } else {
            y
        };
        assert_close(&vec_of(y), &want_y, "output");
        for (name, (shape, g)) in collect(&local, Some(&grads)) {
            let g = match shards.get(&name) {
                Some(&dim) => gather_host(&g, &shape, dim, &pg),
                None => g,
            };
            assert_close(&g, &want_g[&name].1, &format!("grad {name}"));
        }
    });
}

#[test]
fn mlp_tp2() {
    mlp_parity(2, false);
}
#[test]
fn mlp_tp4() {
    mlp_parity(4, false);
}
#[test]
fn mlp_tp2_sequence_parallel() {
    mlp_parity(2, true);
}
#[test]
fn mlp_tp4_sequence_parallel() {
    mlp_parity(4, true);
}
#[test]
fn mlp_tp2_sequence_parallel_recomputed_gather() {
    mlp_parity_on(2, true, dev().gradient_checkpointing(), true);
}

#[derive(Module, Debug)]
struct Embed {
    tok: ParallelEmbedding,
}

#[test]
fn vocab_parallel_embedding_matches() {
    let device = dev();
    let (v, d) = (12, 4);
    let model = Embed {
        tok: ParallelEmbedding::new(v, d, &device),
    };
    let ids = Tensor::<2, Int>::from_data(
        TensorData::new(vec![0i64, 5, 11, 3, 7, 6, 2, 9], [2, 4]),
        &device,
    );
    let w = weights([2, 4, d], &device);
    let y = model.tok.forward(ids.clone());
    let grads = (y.clone() * w.clone()).sum().backward();
    let want_y = vec_of(y);
    let want_g = collect(&model, Some(&grads));
    for (tp, out) in [
        (2, StylePlacement::Replicate),
        (3, StylePlacement::Replicate),
        (2, StylePlacement::Shard(1)),
    ] {
        world(tp, |pg| {
            let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
            let plan = ParallelPlan::new().add("tok", RowwiseParallel::vocab_embedding(out));
            let local =
                parallelize_module(model.clone().fork(&device), &mesh, "tp", &plan).unwrap();
            assert_eq!(local.tok.weight.dims(), [v / tp, d]);
            let counter = CommCounter::start();
            let y = local.tok.forward(ids.clone());
            let expect = if out == StylePlacement::Replicate {
                OpKind::AllReduce
            } else {
                OpKind::ReduceScatter
            };
            assert_eq!(counter.count(expect), 1);
            assert_eq!(counter.total(), 1);
            let (y, w) = if out == StylePlacement::Replicate {
                (y, w.clone())
            } else {
                let r = chunk_range(4, tp, pg.rank());
                (y, w.clone().narrow(1, r.start, r.len()))
            };
            let grads = (y.clone() * w).sum().backward();
            let y = if out == StylePlacement::Replicate {
                y
            } else {
                sequence::sequence_gather(y.detach(), &pg, 1)
            };
            assert_close(&vec_of(y), &want_y, "embedding output");
            let (shape, g) = &collect(&local, Some(&grads))["tok.weight"];
            assert_close(
                &gather_host(g, shape, 0, &pg),
                &want_g["tok.weight"].1,
                "grad",
            );
        });
    }
}

#[derive(Module, Debug)]
struct Attn {
    io: ParallelIo,
    q: ParallelLinear,
    k: ParallelLinear,
}

impl Attn {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = self.io.input(x);
        self.q.forward(x.clone()) * self.k.forward(x)
    }
}

#[derive(Module, Debug)]
struct Net {
    blocks: Vec<Attn>,
}

/// `PrepareModuleInput` (sequence-sharded → replicated) on a module with a `ParallelIo`
/// field: one all-gather in forward; `blocks.*.q` wildcards match every block.
#[test]
fn prepare_module_input_and_wildcards() {
    let device = dev();
    let (b, t, d) = (1, 4, 4);
    let mk = || Attn {
        io: ParallelIo::new(),
        q: ParallelLinear::new(d, d, true, &device),
        k: ParallelLinear::new(d, d, false, &device),
    };
    let net = Net {
        blocks: vec![mk(), mk()],
    };
    let x = input([b, t, d], &device);
    let w = weights([b, t, d], &device);
    let run = |net: &Net, x: Tensor<3>| net.blocks.iter().fold(x, |x, blk| blk.forward(x));
    let grads = (run(&net, x.clone()) * w.clone()).sum().backward();
    let want = collect(&net, Some(&grads));
    world(2, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
        let plan = ParallelPlan::new()
            .add(
                "blocks.*",
                PrepareModuleInput {
                    input_layout: StylePlacement::Shard(1),
                    desired_input_layout: StylePlacement::Replicate,
                },
            )
            .add("blocks.*.[qk]", ColwiseParallel::default())
            .add("blocks.*.q", ColwiseParallel::default());
        // `[qk]` is not a wildcard: it matches nothing.
        let err = parallelize_module(net.clone().fork(&device), &mesh, "tp", &plan).unwrap_err();
        assert!(err.to_string().contains("blocks.*.[qk]"), "{err}");
        let plan = ParallelPlan::new()
            .add(
                "blocks.*",
                PrepareModuleInput {
                    input_layout: StylePlacement::Shard(1),
                    desired_input_layout: StylePlacement::Replicate,
                },
            )
            .add(
                "blocks.*.q",
                ColwiseParallel::default().output_layout(StylePlacement::Replicate),
            )
            .add(
                "blocks.*.k",
                ColwiseParallel::default().output_layout(StylePlacement::Replicate),
            );
        let local = parallelize_module(net.clone().fork(&device), &mesh, "tp", &plan).unwrap();
        assert_eq!(sharded_params(&local).len(), 6);
        let blk = &local.blocks[0];
        let xs = x.clone().narrow(1, 2 * pg.rank(), 2);
        let counter = CommCounter::start();
        let y = blk.forward(xs.clone());
        // io: one gather of the sequence; q and k: one gather of features each.
        assert_eq!(counter.count(OpKind::AllGather), 3);
        assert_eq!(counter.total(), 3);
        drop(counter);
        let _ = y;
        // The whole net: block 0 takes the sharded input; block 1's input is already
        // replicated, so its io must not be prepared: re-plan block 1 only.
        let plan = ParallelPlan::new()
            .add(
                "blocks.0",
                PrepareModuleInput {
                    input_layout: StylePlacement::Shard(1),
                    desired_input_layout: StylePlacement::Replicate,
                },
            )
            .add(
                "blocks.*.q",
                ColwiseParallel::default().output_layout(StylePlacement::Replicate),
            )
            .add(
                "blocks.*.k",
                ColwiseParallel::default().output_layout(StylePlacement::Replicate),
            );
        let local = parallelize_module(net.clone().fork(&device), &mesh, "tp", &plan).unwrap();
        let shards = sharded_params(&local);
        let grads = (run(&local, xs) * w.clone()).sum().backward();
        for (name, (shape, g)) in collect(&local, Some(&grads)) {
            let g = match shards.get(&name) {
                Some(&dim) => gather_host(&g, &shape, dim, &pg),
                None => g,
            };
            assert_close(&g, &want[&name].1, &format!("grad {name}"));
        }
    });
}

#[derive(Module, Debug)]
struct Rms {
    norm: bonfire_tp::ParallelRmsNorm,
}

/// RMSNorm: unsharded it is Burn's `RmsNorm`; sequence-parallel on 2 ranks it gives the
/// same output and weight gradient (one all-reduce of the weight's gradient in backward).
#[test]
fn rms_norm_unsharded_and_sequence_parallel() {
    let device = dev();
    let (b, t, d) = (2, 4, 6);
    let model = Rms {
        norm: bonfire_tp::ParallelRmsNorm::new(d, &device),
    };
    let burn_norm = burn::nn::RmsNormConfig::new(d).init(&device);
    let x = input([b, t, d], &device);
    let w = weights([b, t, d], &device);
    let y = model.norm.forward(x.clone());
    y.clone().into_data().assert_approx_eq::<f32>(
        &burn_norm.forward(x.clone()).into_data(),
        burn::tensor::Tolerance::absolute(1e-6),
    );
    let grads = (y.clone() * w.clone()).sum().backward();
    let want_y = vec_of(y);
    let want_g = collect(&model, Some(&grads));
    world(2, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
        let plan = ParallelPlan::new().add("norm", SequenceParallel::default());
        let local = parallelize_module(model.clone().fork(&device), &mesh, "tp", &plan).unwrap();
        let r = chunk_range(t, 2, pg.rank());
        let y = local.norm.forward(x.clone().narrow(1, r.start, r.len()));
        let loss = bonfire_dtensor::functional::reduce_from_group(
            (y.clone() * w.clone().narrow(1, r.start, r.len())).sum(),
            &pg,
        );
        let counter = CommCounter::start();
        let grads = loss.backward();
        assert_eq!(counter.count(OpKind::AllReduce), 1);
        drop(counter);
        let y = sequence::sequence_gather(y.detach(), &pg, 1);
        assert_close(&vec_of(y), &want_y, "rms output");
        let (_, g) = &collect(&local, Some(&grads))["norm.weight"];
        assert_close(g, &want_g["norm.weight"].1, "rms weight grad");
    });
}

/// A style's placement is a DTensor placement once the activation's rank is known.
#[test]
fn style_placements_are_dtensor_placements() {
    use bonfire_dtensor::Placement;
    assert_eq!(StylePlacement::Shard(-1).placement(3), Placement::Shard(2));
    assert_eq!(StylePlacement::Shard(1).placement(3), Placement::Shard(1));
    assert_eq!(StylePlacement::Replicate.placement(2), Placement::Replicate);
    assert_eq!(StylePlacement::Partial.placement(2), Placement::PARTIAL_SUM);
    assert!(StylePlacement::Shard(-1).same_as(&StylePlacement::Shard(2), 3));
}

/// A vocab-parallel embedding as a tied head: its logits all-gathered (`Replicate`, the
/// default) equal the whole table's; under loss parallelism (`logits_layout(Shard(-1))`) each
/// rank keeps its vocabulary shard of them, gathered by no collective, and names its group.
#[test]
fn a_tied_head_gathers_or_keeps_its_logits_sharded() {
    let device = dev();
    let (v, d, tp) = (12, 4, 2);
    let model = Embed {
        tok: ParallelEmbedding::new(v, d, &device),
    };
    let x = input([2, 3, d], &device);
    let want = vec_of(model.tok.tied_head(x.clone()));
    for logits in [StylePlacement::Replicate, StylePlacement::Shard(-1)] {
        world(tp, |pg| {
            let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
            let style =
                RowwiseParallel::vocab_embedding(StylePlacement::Replicate).logits_layout(logits);
            let plan = ParallelPlan::new().add("tok", style);
            let local =
                parallelize_module(model.clone().fork(&device), &mesh, "tp", &plan).unwrap();
            let counter = CommCounter::start();
            let y = local.tok.tied_head(x.clone());
            let sharded = logits == StylePlacement::Shard(-1);
            assert_eq!(counter.count(OpKind::AllGather), usize::from(!sharded));
            assert_eq!(local.tok.logits_shard_group().is_some(), sharded);
            let y = match sharded {
                true => {
                    assert_eq!(y.dims(), [2, 3, v / tp]);
                    let (shape, values) = (y.dims().to_vec(), vec_of(y));
                    gather_host(&values, &shape, 2, &pg)
                }
                false => vec_of(y),
            };
            assert_close(&y, &want, "tied logits");
        });
    }
}
