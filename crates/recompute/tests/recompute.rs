//! Activation checkpointing ([`bonfire_recompute::recompute()`]): the gradients of the input
//! and of every parameter equal those of the plain forward to the last bit, on a plain
//! autodiff device and under Balanced checkpointing; the region really runs again in backward; layer hooks see
//! the region once; tensor-parallel collectives and ZeRO-3-style gathered parameters inside
//! a region give the same gradients, the gathers re-run in backward instead of being kept.

// The dtensor suites' helpers (ranks as threads, integer-valued data), shared by path.
#[path = "../../dtensor/tests/common/mod.rs"]
mod common;

use bonfire_comm::testing::{Tolerance, assert_close};
use bonfire_comm::{OpKind, ProcessGroup};
use bonfire_dtensor::CommCounter;
use bonfire_dtensor::functional::{all_gather_recomputable, copy_to_group, reduce_from_group};
use bonfire_module::graph::anchored;
use bonfire_module::params::{fork, inventory, take_flat_grads};
use bonfire_module::{LayerHook, install_layer_hook, layer};
use bonfire_recompute::recomputations;
use bonfire_recompute::recompute;
use burn::module::{Module, ParamId};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::activation::gelu;
use burn::tensor::{Device, DispatchTensor, Tensor};
use common::{hollow, tensor, vec_of, world};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Same operations on the same values, in the same order: equal to the last bit.
const TOL: Tolerance = Tolerance::new(0.0, 0.0);

#[derive(Module, Debug)]
struct Mlp {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Self {
            norm: LayerNormConfig::new(4).init(device),
            fc1: LinearConfig::new(4, 8).init(device),
            fc2: LinearConfig::new(8, 4).init(device),
        }
    }
}

/// A residual block whose layers run through `layer`, like the GPT's.
fn block(m: &Mlp, x: Tensor<2>) -> Tensor<2> {
    let h = layer(&m.norm, &x).forward(x.clone());
    let h = gelu(layer(&m.fc1, &x).forward(h));
    x.clone() + layer(&m.fc2, &x).forward(h)
}

#[derive(Module, Debug)]
struct Net {
    blocks: Vec<Mlp>,
}

fn net() -> Net {
    let device = Device::flex().autodiff();
    device.seed(5);
    Net {
        blocks: (0..3).map(|_| Mlp::new(&device)).collect(),
    }
}

/// What a run computed: loss, input gradient, every parameter's gradient (module order).
struct Run {
    loss: Vec<f32>,
    dx: Vec<f32>,
    params: Vec<Vec<f32>>,
}

impl Run {
    fn assert_eq(&self, want: &Run, what: &str) {
        assert_close(&format!("{what} loss"), &self.loss, &want.loss, TOL);
        assert_close(&format!("{what} dx"), &self.dx, &want.dx, TOL);
        assert_eq!(self.params.len(), want.params.len());
        for (i, (g, w)) in self.params.iter().zip(&want.params).enumerate() {
            assert_close(&format!("{what} param {i}"), g, w, TOL);
        }
    }
}

/// Gradients of `loss` for `x` and every parameter of `module` (empty for an unused one).
fn gradients<M: Module>(module: &M, x: &Tensor<2>, loss: Tensor<1>) -> Run {
    let grads = loss.backward();
    let dx = vec_of(x.grad(&grads).expect("the input gets a gradient"));
    let mut grads = GradientsParams::from_grads(grads, module);
    let params = take_flat_grads(module, &inventory(module), &mut grads)
        .into_iter()
        .map(|g| g.map(vec_of).unwrap_or_default())
        .collect();
    Run {
        loss: vec_of(loss),
        dx,
        params,
    }
}

/// Three blocks on `device` (fresh leaves of `net`), the blocks in `which` checkpointed.
fn run(net: &Net, device: &Device, which: &[usize]) -> Run {
    let net = fork(net.clone(), device);
    let x = tensor(1, [3, 4], device).require_grad();
    let mut h = x.clone() * 0.25;
    for (i, b) in net.blocks.iter().enumerate() {
        h = match which.contains(&i) {
            true => recompute(b, h, block),
            false => block(&layer(b, &h), h),
        };
    }
    let loss = (h.clone() * h).mean();
    gradients(&net, &x, loss)
}

#[test]
fn checkpoint_gives_the_gradients_of_the_plain_forward() {
    let net = net();
    let plain = Device::flex().autodiff();
    let balanced = Device::flex().autodiff().gradient_checkpointing();
    for device in [plain, balanced] {
        let want = run(&net, &device, &[]);
        for which in [&[0, 1, 2][..], &[0, 2], &[1]] {
            let got = run(&net, &device, which);
            got.assert_eq(&want, &format!("{device:?} checkpointed {which:?}"));
        }
    }
}

#[test]
fn checkpoint_recomputes_the_region_in_backward() {
    let device = Device::flex().autodiff();
    device.seed(1);
    let m = Mlp::new(&device);
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let x = tensor(2, [2, 4], &device).require_grad();
    let before = recomputations();
    let y = recompute(&m, x.clone(), move |m, x| {
        counted.fetch_add(1, Ordering::Relaxed);
        block(m, x)
    });
    assert_eq!(
        calls.load(Ordering::Relaxed),
        1,
        "forward runs the region once"
    );
    let loss = y.sum();
    let grads = loss.backward();
    assert_eq!(calls.load(Ordering::Relaxed), 2, "backward runs it again");
    assert_eq!(recomputations(), before + 1, "this thread's one region");
    assert!(x.grad(&grads).is_some());
    assert!(m.fc1.weight.val().grad(&grads).is_some());
}

/// `recomputations` counts per thread: work that recomputes nothing reads 0, even while a
/// region is recomputed on another thread meanwhile (a test beside it in the same binary).
#[test]
fn recomputations_count_only_this_threads_backward() {
    let before = recomputations();
    let beside = std::thread::spawn(|| {
        let device = Device::flex().autodiff();
        device.seed(1);
        let m = Mlp::new(&device);
        let x = tensor(2, [2, 4], &device).require_grad();
        let start = recomputations();
        let _ = recompute(&m, x, block).sum().backward();
        recomputations() - start
    })
    .join()
    .unwrap();
    assert_eq!(beside, 1, "the other thread recomputed its region");
    let device = Device::flex().autodiff();
    device.seed(1);
    let m = Mlp::new(&device);
    let x = tensor(2, [2, 4], &device).require_grad();
    let _ = block(&m, x).sum().backward();
    assert_eq!(
        recomputations(),
        before,
        "no recomputation of this thread's own"
    );
}

#[test]
fn checkpoint_leaves_unused_parameters_without_gradient() {
    let device = Device::flex().autodiff();
    device.seed(3);
    let m = Mlp::new(&device);
    let x = tensor(6, [2, 4], &device).require_grad();
    let only_fc1 = |m: &Mlp, x: Tensor<2>| m.fc1.forward(x).narrow(1, 0, 4);
    let plain = only_fc1(&m, x.clone()).sum().backward();
    let grads = recompute(&m, x.clone(), only_fc1).sum().backward();
    assert!(m.norm.gamma.val().grad(&grads).is_none());
    assert!(m.fc2.weight.val().grad(&grads).is_none());
    let w = m.fc1.weight.val();
    assert_eq!(
        vec_of(w.grad(&grads).unwrap()),
        vec_of(w.grad(&plain).unwrap())
    );
    assert_eq!(
        vec_of(x.grad(&grads).unwrap()),
        vec_of(x.grad(&plain).unwrap())
    );
}

#[test]
fn checkpoint_outside_autodiff_is_the_plain_forward() {
    let device = Device::flex();
    device.seed(2);
    let m = Mlp::new(&device);
    let x = tensor(3, [2, 4], &device);
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let y = recompute(&m, x.clone(), move |m, x| {
        counted.fetch_add(1, Ordering::Relaxed);
        block(m, x)
    });
    assert_eq!(vec_of(y), vec_of(block(&m, x)));
    assert_eq!(calls.load(Ordering::Relaxed), 1);
}

/// Counts the layers entered and wraps each parameter in an identity that records that its
/// gradient passed (a stand-in for DDP's gradient hooks, anchored at the layer's input).
#[derive(Default)]
struct Counting {
    entered: RefCell<usize>,
    wrapped: RefCell<usize>,
}

impl LayerHook for Counting {
    fn enter(&self, _ids: &[ParamId], _input: Option<&DispatchTensor>) {
        *self.entered.borrow_mut() += 1;
    }
    fn wraps(&self, _id: ParamId) -> bool {
        true
    }
    fn wrap(
        &self,
        _id: ParamId,
        value: DispatchTensor,
        input: Option<&DispatchTensor>,
    ) -> DispatchTensor {
        *self.wrapped.borrow_mut() += 1;
        let anchor = input.expect("a float input");
        let v: Tensor<1> = Tensor::from_dispatch(value);
        anchored(v, anchor).into_dispatch()
    }
}

#[test]
fn checkpoint_enters_the_region_as_one_layer() {
    let net = net();
    let device = Device::flex().autodiff();
    let want = run(&net, &device, &[]);
    let hook = Rc::new(Counting::default());
    let guard = install_layer_hook(hook.clone());
    let got = run(&net, &device, &[0, 1, 2]);
    drop(guard);
    got.assert_eq(&want, "under a layer hook");
    // One layer per block, and the block's 6 parameters wrapped once each: the `layer`
    // calls inside the region (3 per block, twice) were plain clones.
    assert_eq!(*hook.entered.borrow(), 3);
    assert_eq!(*hook.wrapped.borrow(), 18);
}

/// A replicated norm, column-parallel `fc1` and row-parallel `fc2` by hand (Megatron's `f`
/// and `g`).
fn tp_block(m: &Mlp, x: Tensor<2>, group: &ProcessGroup) -> Tensor<2> {
    let h = copy_to_group(m.norm.forward(x.clone()), group);
    let h = gelu(m.fc1.forward(h));
    x + reduce_from_group(m.fc2.forward(h), group)
}

#[test]
fn checkpoint_recomputes_tensor_parallel_collectives() {
    let runs = world(2, |pg| {
        let device = Device::flex().autodiff();
        device.seed(7 + pg.rank() as u64);
        let net = Net {
            blocks: (0..2).map(|_| Mlp::new(&device)).collect(),
        };
        let go = |ac: bool| {
            let net = fork(net.clone(), &device);
            let x = tensor(4, [3, 4], &device).require_grad();
            let mut h = x.clone() * 0.5;
            for b in &net.blocks {
                let g = pg.clone();
                h = match ac {
                    true => recompute(b, h, move |m, x| tp_block(m, x, &g)),
                    false => tp_block(b, h, &pg),
                };
            }
            let counter = CommCounter::start();
            let run = gradients(&net, &x, (h.clone() * h).sum());
            (run, counter.count(OpKind::AllReduce))
        };
        let (want, plain_reduces) = go(false);
        let (got, ac_reduces) = go(true);
        got.assert_eq(&want, &format!("rank {}", pg.rank()));
        // Backward: one all-reduce per block (f's), plus each block's forward again (g's).
        assert_eq!((plain_reduces, ac_reduces), (2, 4));
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
        let mut entering = self.entering.borrow_mut();
        for id in ids {
            let piece = &self.pieces.iter().find(|(p, _)| p == id).unwrap().1;
            let n = piece.dims()[0];
            let placed = anchored(piece.clone(), anchor);
            entering.push(all_gather_recomputable(placed, &self.pg, 0, &[n, n]).unwrap());
        }
    }
    fn supply(&self, _id: ParamId) -> Option<Tensor<1>> {
        Some(self.entering.borrow_mut().remove(0))
    }
}

#[test]
fn checkpoint_regathers_parameters_instead_of_keeping_them() {
    let runs = world(2, |pg| {
        let device = Device::flex().autodiff().gradient_checkpointing();
        device.seed(11);
        let m = fork(Mlp::new(&Device::flex().autodiff()), &device);
        let infos = inventory(&m);
        let full = bonfire_module::params::flat(&m, &infos);
        let go = |ac: bool| {
            // This rank's half of each parameter, a leaf.
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
            let x = tensor(5, [2, 4], &device).require_grad();
            let y = match ac {
                true => recompute(&lazy, x.clone(), block),
                false => block(&layer(&lazy, &x), x.clone()),
            };
            drop(guard);
            let counter = CommCounter::start();
            let grads = (y.clone() * y).sum().backward();
            let gathers = counter.count(OpKind::AllGather);
            let dx = vec_of(x.grad(&grads).unwrap());
            let dpieces: Vec<Vec<f32>> = pieces
                .iter()
                .map(|(_, p)| vec_of(p.grad(&grads).unwrap()))
                .collect();
            (dx, dpieces, gathers)
        };
        let (want_dx, want_p, plain_gathers) = go(false);
        let (dx, dp, ac_gathers) = go(true);
        assert_close("dx", &dx, &want_dx, TOL);
        for (g, w) in dp.iter().zip(&want_p) {
            assert_close("shard gradient", g, w, TOL);
        }
        // Every parameter is gathered again in backward, with or without checkpointing:
        // none was kept from forward.
        assert_eq!((plain_gathers, ac_gathers), (6, 6));
    });
    assert_eq!(runs.len(), 2);
}

/// The same on Burn's wgpu backend (the `Cube` implementation; Mesa's software Vulkan on a
/// machine without a GPU).
#[cfg(feature = "wgpu")]
#[test]
fn checkpoint_on_wgpu_gives_the_gradients_of_the_plain_forward() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: set before this test reads the environment on another thread.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    let net = net();
    let wgpu = Device::wgpu(burn::tensor::DeviceKind::Cpu);
    for device in [
        wgpu.clone().autodiff(),
        wgpu.autodiff().gradient_checkpointing(),
    ] {
        let want = run(&net, &device, &[]);
        run(&net, &device, &[0, 2]).assert_eq(&want, &format!("{device:?}"));
    }
}
