//! Activation checkpointing ([`bonfire_recompute::recompute()`]) of a region that leaves a
//! parameter without gradient on some rank, under the data-parallel wrappers' nodes between
//! a parameter and the region: DDP's gradient hooks and ZeRO-3's gathers. A
//! mixture-of-experts layer under expert parallelism whose rank's experts get no row
//! (`run_experts`' empty path touches them, times 0) checkpointed equals its plain forward
//! to the last bit, the idle experts' gradients zeros, leaves and hooks alike; a ZeRO-3
//! parameter a rank's region leaves out gets zeros through the tie, so its gather's
//! reduce-scatter runs on every rank. The tokens' exchanges run again in the recomputation.

// The dtensor suites' helpers (ranks as threads, integer-valued data), shared by path.
#[path = "../../dtensor/tests/common/mod.rs"]
mod common;

use bonfire_comm::ProcessGroup;
use bonfire_comm::testing::{Tolerance, assert_close};
use bonfire_dtensor::functional::all_gather_recomputable;
use bonfire_ep::{ExpertScope, permute, run_experts, unpermute};
use bonfire_module::graph::{GradHook, anchored, hooked_dispatch};
use bonfire_module::params::{fork, inventory};
use bonfire_module::{LayerHook, install_layer_hook, layer};
use bonfire_recompute::recomputations;
use bonfire_recompute::recompute;
use burn::module::{Module, Param, ParamId};
use burn::tensor::{Device, DispatchTensor, Int, Tensor, TensorData};
use common::{hollow, tensor, vec_of, world};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

/// Same operations on the same values: equal to the last bit.
const TOL: Tolerance = Tolerance::new(0.0, 0.0);

/// Experts in all, per token, the hidden width, tokens per rank.
const E: usize = 4;
const K: usize = 2;
const D: usize = 3;
const N: usize = 4;

/// One mixture-of-experts layer: routing weights `x·router`, and this rank's experts
/// (`E/ep` matrices `[D, D]`).
#[derive(Module, Debug)]
struct Moe {
    router: Param<Tensor<2>>,
    experts: Param<Tensor<3>>,
}

impl Moe {
    fn new(seed: usize, local: usize, device: &Device) -> Self {
        Self {
            router: Param::from_tensor(tensor(seed, [D, K], device) * 0.125),
            experts: Param::from_tensor(tensor(seed + 1, [local, D, D], device) * 0.25),
        }
    }
}

/// Every token goes to experts 2 and 3 (in either order): at ep = 2 rank 0's experts (0, 1)
/// get no row from any rank.
fn routes(n: usize) -> Vec<i64> {
    (0..n)
        .flat_map(|i| [2 + (i % 2) as i64, 3 - (i % 2) as i64])
        .collect()
}

/// The layer on `x` `[n, D]`; the experts run where the thread's [`ExpertScope`] puts them.
fn moe(m: &Moe, x: Tensor<2>) -> Tensor<2> {
    let n = x.dims()[0];
    let chosen = Tensor::<2, Int>::from_data(TensorData::new(routes(n), [n, K]), &x.device());
    let w = x.clone().matmul(m.router.val());
    let (grouped, perm) = permute(x, chosen, E);
    let rows = run_experts(grouped, perm.counts(), |i, rows| {
        rows.matmul(m.experts.val().narrow(0, i, 1).reshape([D, D]))
    })
    .unwrap();
    unpermute(rows, &perm, w)
}

/// Gradients as the hooks delivered them, summed per parameter.
type Delivered = Arc<Mutex<HashMap<ParamId, Vec<f32>>>>;

/// DDP's gradient hooks in miniature: every parameter of a layer hooked at the layer's
/// input; the gradients it delivers are summed by parameter.
#[derive(Default)]
struct Hooks(Delivered);

impl LayerHook for Hooks {
    fn wraps(&self, _id: ParamId) -> bool {
        true
    }
    fn wrap(
        &self,
        id: ParamId,
        value: DispatchTensor,
        input: Option<&DispatchTensor>,
    ) -> DispatchTensor {
        let delivered = self.0.clone();
        let hook = GradHook::new(move |grad| {
            let grad = vec_of(grad);
            let mut delivered = delivered.lock().unwrap();
            let sum = delivered.entry(id).or_insert_with(|| vec![0.0; grad.len()]);
            sum.iter_mut().zip(&grad).for_each(|(s, g)| *s += g);
        });
        hooked_dispatch(value, input.expect("a float input").clone(), hook)
    }
}

/// What one rank's run gave: the input's gradient and each parameter's (module order;
/// `None`: none, through a hook or on the leaf).
#[derive(Debug, PartialEq)]
struct Grads {
    dx: Vec<f32>,
    params: Vec<Option<Vec<f32>>>,
}

/// The layer on this rank's tokens at ep = 2, checkpointed or not, with DDP's hooks or
/// none, the expert scope entered for forward and backward as the trainer does.
fn moe_step(pg: &ProcessGroup, m: &Moe, device: &Device, ac: bool, hooks: bool) -> Grads {
    let m = fork(m.clone(), device);
    let _scope = ExpertScope { group: pg.clone() }.enter();
    let delivered = Delivered::default();
    let guard = hooks.then(|| install_layer_hook(Rc::new(Hooks(delivered.clone()))));
    let x = tensor(3 + pg.rank(), [N, D], device).require_grad();
    let y = match ac {
        true => recompute(&m, x.clone(), moe),
        false => moe(&layer(&m, &x), x.clone()),
    };
    drop(guard);
    let grads = (y * tensor(9 + pg.rank(), [N, D], device)).sum().backward();
    let delivered = delivered.lock().unwrap();
    let params = match hooks {
        true => inventory(&m)
            .iter()
            .map(|p| delivered.get(&p.id).cloned())
            .collect(),
        false => vec![
            m.router.val().grad(&grads).map(vec_of),
            m.experts.val().grad(&grads).map(vec_of),
        ],
    };
    Grads {
        dx: vec_of(x.grad(&grads).unwrap()),
        params,
    }
}

/// A missing gradient as what the wrappers make of it: zeros.
fn or_zeros(g: &Option<Vec<f32>>, n: usize) -> Vec<f32> {
    g.clone().unwrap_or_else(|| vec![0.0; n])
}

#[test]
fn checkpointed_experts_with_no_row_get_zero_gradients() {
    let runs = world(2, |pg| {
        let plain = Device::flex().autodiff();
        let balanced = Device::flex().autodiff().gradient_checkpointing();
        let m = Moe::new(5 + 2 * pg.rank(), E / 2, &plain);
        let numels = [D * K, E / 2 * D * D];
        for device in [plain, balanced] {
            let what = format!("rank {} {device:?}", pg.rank());
            // Leaves: the same gradients, zeros for the idle experts (touched on no row).
            let want = moe_step(&pg, &m, &device, false, false);
            let before = recomputations();
            let got = moe_step(&pg, &m, &device, true, false);
            assert_eq!(recomputations(), before + 1, "{what}: recomputed");
            assert_eq!(got, want, "{what}: leaves");
            let experts = want.params[1].as_ref().expect("the experts are touched");
            assert_eq!(
                experts.iter().all(|&v| v == 0.0),
                pg.rank() == 0,
                "{what}: idle"
            );
            // Hooks: every hook fires, the idle experts' with zeros.
            let want = moe_step(&pg, &m, &device, false, true);
            let got = moe_step(&pg, &m, &device, true, true);
            assert_close(&format!("{what} dx"), &got.dx, &want.dx, TOL);
            for (i, (g, w)) in got.params.iter().zip(&want.params).enumerate() {
                let g = g.as_ref().expect("every hook fires");
                assert_close(
                    &format!("{what} param {i}"),
                    g,
                    &or_zeros(w, numels[i]),
                    TOL,
                );
            }
            let idle = pg.rank() == 0;
            assert!(!idle || got.params[1].as_ref().unwrap().iter().all(|&v| v == 0.0));
        }
    });
    assert_eq!(runs.len(), 2);
}

/// ZeRO-3 in miniature: every lazy parameter is all-gathered (recomputably) from this
/// rank's half, anchored at the layer's input.
struct Gather {
    pieces: Vec<(ParamId, Tensor<1>)>,
    pg: ProcessGroup,
    entering: RefCell<Vec<Tensor<1>>>,
}

impl LayerHook for Gather {
    fn enter(&self, ids: &[ParamId], input: Option<&DispatchTensor>) {
        let anchor = input.expect("a float input");
        for id in ids {
            let piece = &self.pieces.iter().find(|(p, _)| p == id).unwrap().1;
            let n = piece.dims()[0];
            let placed = anchored(piece.clone(), anchor);
            let full = all_gather_recomputable(placed, &self.pg, 0, &[n, n]).unwrap();
            self.entering.borrow_mut().push(full);
        }
    }
    fn supply(&self, _id: ParamId) -> Option<Tensor<1>> {
        Some(self.entering.borrow_mut().remove(0))
    }
}

/// Two square maps; `b` may be left out.
#[derive(Module, Debug)]
struct Pair {
    a: Param<Tensor<2>>,
    b: Param<Tensor<2>>,
}

/// `x·a + x·b`; without `b`, `x·a` (`zero_b`: `x·a + (x·b)·0`, the same gradients with `b`
/// in the graph).
fn pair(m: &Pair, x: Tensor<2>, use_b: bool, zero_b: bool) -> Tensor<2> {
    let y = x.clone().matmul(m.a.val());
    match (use_b, zero_b) {
        (true, _) => y + x.matmul(m.b.val()),
        (false, true) => y + x.matmul(m.b.val()) * 0.0,
        (false, false) => y,
    }
}

/// Rank 1 leaves `b` out of its checkpointed region, rank 0 uses it: both ranks' ties hold
/// the gathered `b`, so both run its reduce-scatter (rank 1 with zeros). The shards'
/// gradients equal a plain forward in which rank 1 uses `b` times 0.
#[test]
fn a_gathered_parameter_one_rank_leaves_out_is_reduced_on_every_rank() {
    let runs = world(2, |pg| {
        let device = Device::flex().autodiff().gradient_checkpointing();
        device.seed(13);
        let m = fork(
            Pair {
                a: Param::from_tensor(tensor(1, [4, 4], &Device::flex().autodiff())),
                b: Param::from_tensor(tensor(2, [4, 4], &Device::flex().autodiff())),
            },
            &device,
        );
        let infos = inventory(&m);
        let full = bonfire_module::params::flat(&m, &infos);
        let use_b = pg.rank() == 0;
        let go = |ac: bool| {
            let mut at = 0;
            let pieces: Vec<(ParamId, Tensor<1>)> = infos
                .iter()
                .map(|p| {
                    let half = p.numel() / 2;
                    let mine = full.clone().narrow(0, at + pg.rank() * half, half);
                    at += p.numel();
                    (p.id, mine.detach().require_grad())
                })
                .collect();
            let hook = Rc::new(Gather {
                pieces: pieces.clone(),
                pg: pg.clone(),
                entering: RefCell::new(Vec::new()),
            });
            let guard = install_layer_hook(hook);
            let lazy = hollow(m.clone());
            let x = tensor(5 + pg.rank(), [2, 4], &device).require_grad();
            let y = match ac {
                true => recompute(&lazy, x.clone(), move |m, x| pair(m, x, use_b, false)),
                false => pair(&layer(&lazy, &x), x.clone(), use_b, true),
            };
            drop(guard);
            let grads = (y.clone() * y).sum().backward();
            let dx = vec_of(x.grad(&grads).unwrap());
            let shards: Vec<Vec<f32>> = pieces
                .iter()
                .map(|(_, p)| vec_of(p.grad(&grads).expect("every shard gets a gradient")))
                .collect();
            (dx, shards)
        };
        let (want_dx, want) = go(false);
        let (dx, got) = go(true);
        assert_close("dx", &dx, &want_dx, TOL);
        for (g, w) in got.iter().zip(&want) {
            assert_close("shard gradient", g, w, TOL);
        }
    });
    assert_eq!(runs.len(), 2);
}
