//! Expert parallelism's primitives as the anchors test them: permuting tokens by expert and
//! un-permuting restores the hidden states exactly, its gradient the identity; a
//! mixture-of-experts layer at ep = 2 and 4 equals ep = 1 with the same weights — every
//! rank's output, its input gradient and every expert's weight gradient — with uneven loads
//! and an expert no token is routed to (on any rank). Integer-valued data and power-of-two
//! routing weights: every result is exact in f32.

// The dtensor suites' helpers (ranks as threads, integer-valued data), shared by path.
#[path = "../../dtensor/tests/common/mod.rs"]
mod common;

use bonfire_comm::ProcessGroup;
use bonfire_ep::{combine, dispatch, permute, unpermute};
use burn::tensor::{Int, Tensor, TensorData};
use common::*;

const E: usize = 8;
const K: usize = 2;
const D: usize = 3;

/// The experts two tokens `i` of rank `r` are routed to: uneven (expert 1 takes most),
/// expert 6 never, every other expert somewhere.
fn routes(r: usize, n: usize) -> Vec<i64> {
    (0..n)
        .flat_map(|i| {
            let first = [1, 1, 0, 2, 1, 3, 4, 5, 7][(i + 2 * r) % 9];
            let second = [1, 0, 7, 5][(i + r) % 4];
            let second = if second == first {
                (first + 2) % 6
            } else {
                second
            };
            [first as i64, second as i64]
        })
        .collect()
}

fn experts_of(r: usize, n: usize) -> Tensor<2, Int> {
    Tensor::from_data(TensorData::new(routes(r, n), [n, K]), &dev())
}

/// Routing weights 0.75 / 0.25 (exact).
fn weights(n: usize) -> Tensor<2> {
    let w: Vec<f32> = (0..n).flat_map(|_| [0.75, 0.25]).collect();
    Tensor::from_data(TensorData::new(w, [n, K]), &dev())
}

#[test]
fn permute_then_unpermute_restores_the_tokens_and_its_gradient_is_the_identity() {
    let n = 9;
    let x = leaf(1, [n, D]);
    let (grouped, perm) = permute(x.clone(), experts_of(0, n), E);
    assert_eq!(perm.counts().iter().sum::<usize>(), n * K);
    assert_eq!(perm.counts()[6], 0, "expert 6 gets no token");
    // Grouped by expert: each row equals the token it copies, experts in order.
    let ids = routes(0, n);
    let mut want = Vec::new();
    for e in 0..E as i64 {
        for (a, _) in ids.iter().enumerate().filter(|(_, x)| **x == e) {
            want.extend(vec_of(x.clone().narrow(0, a / K, 1)));
        }
    }
    assert_eq!(vec_of(grouped.clone()), want, "grouped rows");
    let back = unpermute(grouped, &perm, weights(n));
    assert_eq!(vec_of(back.clone()), vec_of(x.clone()), "restored");
    let g = tensor(5, [n, D], &dev());
    let grads = (back * g.clone()).sum().backward();
    assert_eq!(vec_of(x.grad(&grads).unwrap()), vec_of(g), "gradient");
}

/// The layer on `x` `[n, D]`: each token's experts `x·W_e`, weighted and summed; under
/// `ep` (a group) the rows travel to the experts' ranks. `w` holds this rank's experts.
fn layer(x: Tensor<2>, r: usize, w: &[Tensor<2>], ep: Option<&ProcessGroup>) -> Tensor<2> {
    let n = x.dims()[0];
    let (grouped, perm) = permute(x, experts_of(r, n), E);
    let (rows, plan) = match ep {
        Some(g) => {
            let (rows, plan) = dispatch(grouped, perm.counts(), g).unwrap();
            (rows, Some(plan))
        }
        None => (grouped, None),
    };
    let counts = plan
        .as_ref()
        .map_or(perm.counts().to_vec(), |p| p.counts().to_vec());
    assert_eq!(counts.len(), w.len());
    let mut out = Vec::new();
    let mut at = 0;
    for (c, w) in counts.iter().zip(w) {
        if *c > 0 {
            out.push(rows.clone().narrow(0, at, *c).matmul(w.clone()));
        }
        at += c;
    }
    let y = Tensor::cat(out, 0);
    let y = match &plan {
        Some(p) => combine(y, p).unwrap(),
        None => y,
    };
    unpermute(y, &perm, weights(n))
}

/// Rank `r`'s tokens (a different number on each rank) and output weights.
fn rank_data(r: usize) -> (Tensor<2>, Tensor<2>) {
    let n = 5 + 2 * r;
    (
        tensor(10 + r, [n, D], &dev()),
        tensor(20 + r, [n, D], &dev()),
    )
}

fn expert_weight(e: usize) -> Tensor<2> {
    tensor(40 + e, [D, D], &dev()) * 0.5
}

#[test]
fn a_moe_layer_under_expert_parallelism_equals_one_rank() {
    for ep in [2, 4] {
        // One device: every rank's tokens through all E experts.
        let w: Vec<Tensor<2>> = (0..E).map(|e| expert_weight(e).require_grad()).collect();
        let mut want = Vec::new();
        let mut loss = Tensor::<1>::zeros([1], &dev());
        for r in 0..ep {
            let (x, g) = rank_data(r);
            let x = x.require_grad();
            let y = layer(x.clone(), r, &w, None);
            loss = loss + (y.clone() * g).sum();
            want.push((x, vec_of(y)));
        }
        let grads = loss.backward();
        let zero = vec![0.0; D * D];
        let w_grad = |t: &Tensor<2>, grads| t.grad(grads).map_or(zero.clone(), vec_of);
        let want_w: Vec<Vec<f32>> = w.iter().map(|t| w_grad(t, &grads)).collect();
        assert_eq!(want_w[6], zero, "expert 6 has no token");
        let want_x: Vec<Vec<f32>> = want
            .iter()
            .map(|(x, _)| vec_of(x.grad(&grads).unwrap()))
            .collect();
        let ranks = world(ep, |pg| {
            let r = pg.rank();
            let local = E / ep;
            let w: Vec<Tensor<2>> = (r * local..(r + 1) * local)
                .map(|e| expert_weight(e).require_grad())
                .collect();
            let (x, g) = rank_data(r);
            let x = x.require_grad();
            let y = layer(x.clone(), r, &w, Some(&pg));
            let grads = (y.clone() * g).sum().backward();
            let zero = vec![0.0; D * D];
            let w_grads: Vec<Vec<f32>> = w
                .iter()
                .map(|t| t.grad(&grads).map_or(zero.clone(), vec_of))
                .collect();
            (vec_of(y), vec_of(x.grad(&grads).unwrap()), w_grads)
        });
        for (r, (y, x_grad, w_grads)) in ranks.into_iter().enumerate() {
            let what = format!("ep={ep} rank {r}");
            assert_eq!(y, want[r].1, "{what}: output");
            assert_eq!(x_grad, want_x[r], "{what}: input gradient");
            for (i, g) in w_grads.iter().enumerate() {
                let e = r * (E / ep) + i;
                assert_eq!(g, &want_w[e], "{what}: expert {e}'s weight gradient");
            }
        }
    }
}

#[test]
fn experts_that_do_not_split_over_ep_are_refused() {
    let errors = world(3, |pg| {
        let x = tensor(1, [4, D], &dev());
        let counts = vec![1, 1, 1, 1, 0, 0, 0, 0];
        dispatch(x, &counts, &pg).unwrap_err().to_string()
    });
    assert!(
        errors[0].contains("8 experts do not split over 3"),
        "{}",
        errors[0]
    );
}
