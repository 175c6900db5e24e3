//! What activation checkpointing keeps, measured by a counting allocator (this binary's
//! global allocator; one test, so nothing else allocates meanwhile): the peak heap of a
//! forward and backward through a stack of blocks, with every block checkpointed, is a
//! fraction of the plain one's (only each block's input is kept); and under Balanced
//! checkpointing with ZeRO-3-style gathered parameters, a checkpointed stack does not keep
//! the gathered parameters from forward to backward (they are gathered again, one block at
//! a time), so its peak stays far below the whole model's parameters.

// The dtensor suites' helpers (ranks as threads, integer-valued data), shared by path.
#[path = "../../dtensor/tests/common/mod.rs"]
mod common;

use bonfire_comm::ProcessGroup;
use bonfire_comm::testing::rank_alloc::{self, RankAllocator};
use bonfire_dtensor::functional::all_gather_recomputable;
use bonfire_module::graph::anchored;
use bonfire_module::params::{flat, fork, inventory};
use bonfire_module::{LayerHook, install_layer_hook, layer};
use bonfire_recompute::recompute;
use burn::module::{Module, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, DispatchTensor, Distribution, Tensor};
use std::cell::RefCell;
use std::rc::Rc;

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

/// The heap's peak while `f` runs, above what was live when it started.
fn peak_of(f: impl FnOnce()) -> usize {
    let base = rank_alloc::process_live();
    rank_alloc::reset_process_peak();
    f();
    rank_alloc::process_peak().saturating_sub(base)
}

#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

fn block(m: &Mlp, x: Tensor<2>) -> Tensor<2> {
    let h = gelu(layer(&m.fc1, &x).forward(x.clone()));
    let h = gelu(h.clone()) * h;
    x.clone() + layer(&m.fc2, &x).forward(h)
}

fn stack(d: usize, d_ff: usize, n: usize, device: &Device) -> Vec<Mlp> {
    (0..n)
        .map(|_| Mlp {
            fc1: LinearConfig::new(d, d_ff).init(device),
            fc2: LinearConfig::new(d_ff, d).init(device),
        })
        .collect()
}

/// Forward and backward of `x` through `blocks`, checkpointed or not: the bytes the
/// forward left for backward (live when backward starts, above the start).
fn train_step(blocks: &[Mlp], x: Tensor<2>, ac: bool) -> usize {
    let base = rank_alloc::process_live();
    let x = x.require_grad();
    let mut h = x.clone();
    for b in blocks {
        h = match ac {
            true => recompute(b, h, block),
            false => block(&layer(b, &h), h),
        };
    }
    let loss = h.powi_scalar(2).mean();
    let held = rank_alloc::process_live().saturating_sub(base);
    let grads = loss.backward();
    assert!(x.grad(&grads).is_some());
    held
}

/// ZeRO-3 in miniature (a group of one): every value-less parameter is gathered,
/// recomputably, from a leaf holding it, anchored at the layer's input.
struct Gather {
    pieces: Vec<(ParamId, Tensor<1>)>,
    pg: ProcessGroup,
    entering: RefCell<Vec<Tensor<1>>>,
}

impl LayerHook for Gather {
    fn enter(&self, ids: &[ParamId], input: Option<&DispatchTensor>) {
        for id in ids {
            let piece = &self.pieces.iter().find(|(p, _)| p == id).unwrap().1;
            let n = piece.dims()[0];
            let placed = anchored(piece.clone(), input.unwrap());
            let gathered = all_gather_recomputable(placed, &self.pg, 0, &[n]).unwrap() * 1.0;
            self.entering.borrow_mut().push(gathered);
        }
    }
    fn supply(&self, _id: ParamId) -> Option<Tensor<1>> {
        Some(self.entering.borrow_mut().remove(0))
    }
}

#[test]
fn checkpointing_keeps_block_inputs_only_and_no_gathered_parameters() {
    // Activations dominate: 8 blocks, 512 rows, d 64, d_ff 256.
    let device = Device::flex().autodiff();
    let blocks = stack(64, 256, 8, &device);
    let x = Tensor::<2>::random([512, 64], Distribution::Default, &device);
    let mut held = [0; 2];
    let plain = peak_of(|| held[0] = train_step(&blocks, x.clone(), false));
    let ac = peak_of(|| held[1] = train_step(&blocks, x.clone(), true));
    println!("activations: peak {plain} B plain, {ac} B checkpointed; held {held:?} B");
    assert!(ac * 3 < plain, "checkpointed {ac} B vs plain {plain} B");
    // Each block keeps its input (512·64 f32) and nothing else.
    assert!(held[1] < 8 * 512 * 64 * 4 * 3 / 2, "{held:?}");

    // Parameters dominate: 8 blocks of 2·256·1024 weights (2 MiB each), 4 rows, gathered.
    common::world(1, |pg| {
        let device = Device::flex().autodiff().gradient_checkpointing();
        let blocks = fork(stack(256, 1024, 8, &Device::flex().autodiff()), &device);
        let infos = inventory(&blocks);
        let all = flat(&blocks, &infos);
        let mut at = 0;
        let pieces: Vec<(ParamId, Tensor<1>)> = infos
            .iter()
            .map(|p| {
                let piece = all.clone().narrow(0, at, p.numel()).detach().require_grad();
                at += p.numel();
                (p.id, piece)
            })
            .collect();
        drop(all);
        let lazy = common::hollow(blocks);
        let x = Tensor::<2>::random([4, 256], Distribution::Default, &device);
        let model_bytes = 4 * infos.iter().map(|p| p.numel()).sum::<usize>();
        for ac in [false, true] {
            let hook = Rc::new(Gather {
                pieces: pieces.clone(),
                pg: pg.clone(),
                entering: RefCell::new(Vec::new()),
            });
            let mut held = 0;
            let peak = peak_of(|| {
                let _guard = install_layer_hook(hook.clone());
                held = train_step(&lazy, x.clone(), ac);
            });
            println!(
                "gathered: checkpointed {ac}, held {held} B, peak {peak} B, model {model_bytes} B"
            );
            // Forward leaves at most a block's gathered parameters (2 MiB) behind, not the
            // model's; backward's peak is the pieces' gradients (a model's worth) and a
            // block or two.
            assert!(
                held < model_bytes / 4,
                "held {held} B ({model_bytes} B model)"
            );
            assert!(
                peak < model_bytes * 3 / 2,
                "{peak} B ({model_bytes} B model)"
            );
        }
    });
}
