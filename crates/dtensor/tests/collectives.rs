//! Every differentiable collective, forward and gradient, against the same program run on
//! one device, for world sizes 1..=8.

mod common;
use bonfire_comm::OpKind;
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::functional::*;
use bonfire_dtensor::{CommCounter, chunk_sizes};
use burn::tensor::Tensor;
use common::*;

const SIZES: std::ops::RangeInclusive<usize> = 1..=8;

fn weight<const D: usize>(rank: usize, dims: [usize; D]) -> Tensor<D> {
    tensor(100 + rank, dims, &dev())
}

fn grad_or_zeros<const D: usize>(x: &Tensor<D>, grads: &burn::tensor::Gradients) -> Vec<f32> {
    x.grad(grads)
        .map(vec_of)
        .unwrap_or_else(|| vec![0.0; x.dims().iter().product()])
}

/// Rank r has input `x_r` (seed r, shape `shape(r)`) and output `y_r = dist(x_r)`; the loss
/// is Σ_r (y_r · w_r).sum(). The reference computes every `y_r` from all inputs on one
/// device; outputs and input gradients must match.
fn check<const D: usize>(
    k: usize,
    what: &str,
    shape: impl Fn(usize) -> [usize; D] + Sync,
    dist: impl Fn(&ProcessGroup, Tensor<D>) -> Tensor<D> + Sync,
    reference: impl Fn(&[Tensor<D>]) -> Vec<Tensor<D>>,
) {
    let xs: Vec<Tensor<D>> = (0..k).map(|r| leaf(r, shape(r))).collect();
    let ys = reference(&xs);
    let out_dims: Vec<[usize; D]> = ys.iter().map(|y| y.dims()).collect();
    let loss = ys
        .iter()
        .enumerate()
        .map(|(r, y)| (y.clone() * weight(r, y.dims())).sum())
        .reduce(|a, b| a + b)
        .unwrap();
    let grads = loss.backward();
    let expected: Vec<(Vec<f32>, Vec<f32>)> = ys
        .into_iter()
        .zip(&xs)
        .map(|(y, x)| (vec_of(y), grad_or_zeros(x, &grads)))
        .collect();
    let got = world(k, |pg| {
        let r = pg.rank();
        let x = leaf(r, shape(r));
        let y = dist(&pg, x.clone());
        assert_eq!(y.dims(), out_dims[r], "{what}: output shape on rank {r}");
        let loss = (y.clone() * weight(r, out_dims[r])).sum();
        let grads = loss.backward();
        (vec_of(y), grad_or_zeros(&x, &grads))
    });
    for (r, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_near_exact(&g.0, &e.0, &format!("{what} k={k} rank {r} forward"));
        assert_near_exact(&g.1, &e.1, &format!("{what} k={k} rank {r} gradient"));
    }
}

fn sum_all<const D: usize>(xs: &[Tensor<D>]) -> Tensor<D> {
    xs.iter().cloned().reduce(|a, b| a + b).unwrap()
}

#[test]
fn all_reduce_sum_and_avg() {
    for k in SIZES {
        check(
            k,
            "all_reduce sum",
            |_| [2, 3],
            |pg, x| all_reduce(x, pg, ReduceOp::Sum),
            |xs| vec![sum_all(xs); xs.len()],
        );
        check(
            k,
            "all_reduce avg",
            |_| [3],
            |pg, x| all_reduce(x, pg, ReduceOp::Avg),
            |xs| vec![sum_all(xs) / xs.len() as f32; xs.len()],
        );
    }
}

#[test]
fn broadcast_and_reduce() {
    for k in SIZES {
        let root = k / 2;
        check(
            k,
            "broadcast",
            |_| [2, 2],
            |pg, x| broadcast(x, pg, root).unwrap(),
            |xs| vec![xs[root].clone(); xs.len()],
        );
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            check(
                k,
                "reduce",
                |_| [4],
                |pg, x| reduce(x, pg, op, root).unwrap(),
                |xs| {
                    let mut total = sum_all(xs);
                    if op == ReduceOp::Avg {
                        total = total / xs.len() as f32;
                    }
                    (0..xs.len())
                        .map(|r| {
                            if r == root {
                                total.clone()
                            } else {
                                total.zeros_like()
                            }
                        })
                        .collect()
                },
            );
        }
    }
}

#[test]
fn all_gather_even_and_uneven() {
    for k in SIZES {
        check(
            k,
            "all_gather dim 0",
            |_| [2, 3],
            |pg, x| all_gather(x, pg, 0).unwrap(),
            |xs| vec![Tensor::cat(xs.to_vec(), 0); xs.len()],
        );
        // Three leading rows: the ranks' pieces are reordered as 3 × k blocks in place.
        check(
            k,
            "all_gather dim 1",
            |_| [3, 2, 3],
            |pg, x| all_gather(x, pg, 1).unwrap(),
            |xs| vec![Tensor::cat(xs.to_vec(), 1); xs.len()],
        );
        let sizes: Vec<usize> = (0..k).map(|r| (r * 2 + 1) % 4).collect();
        let sizes = &sizes;
        check(
            k,
            "all_gather uneven",
            |r| [2, sizes[r], 3],
            |pg, x| all_gather_uneven(x, pg, 1, sizes).unwrap(),
            |xs| vec![Tensor::cat(xs.to_vec(), 1); xs.len()],
        );
    }
}

#[test]
fn all_gather_skips_the_placeholders_of_empty_pieces() {
    // A rank of size 0 passes a placeholder of length 1 along the dim (how ZeRO-3 gathers a
    // parameter some ranks own none of): not sent, and its gradient is zero. Also recomputed
    // under Balanced checkpointing, the way ZeRO-3 gathers.
    for k in 2..=8 {
        let sizes: Vec<usize> = (0..k)
            .map(|r| if r % 3 == 1 { 0 } else { r % 4 + 1 })
            .collect();
        let sizes = &sizes;
        let reference = |xs: &[Tensor<3>]| {
            let pieces: Vec<Tensor<3>> = (0..xs.len())
                .filter(|&r| sizes[r] > 0)
                .map(|r| xs[r].clone())
                .collect();
            vec![Tensor::cat(pieces, 1); xs.len()]
        };
        check(
            k,
            "all_gather with placeholders",
            |r| [2, sizes[r].max(1), 3],
            |pg, x| all_gather_uneven(x, pg, 1, sizes).unwrap(),
            reference,
        );
    }
    // Recomputed (Balanced checkpointing): the same values and gradients, gathered twice.
    let sizes = [2, 0, 3];
    let run = |checkpointing: bool| {
        world(3, move |pg| {
            let device = match checkpointing {
                true => dev().gradient_checkpointing(),
                false => dev(),
            };
            let r = pg.rank();
            let x = tensor(r, [sizes[r].max(1), 2], &device).require_grad();
            let counter = CommCounter::start();
            let y = all_gather_recomputable(x.clone(), &pg, 0, &sizes).unwrap();
            assert_eq!(y.dims(), [5, 2]);
            let loss = (y.clone().exp() * 0.5).sum();
            let grads = loss.backward();
            let gathers = counter.count(OpKind::AllGather);
            (vec_of(y), vec_of(x.grad(&grads).unwrap()), gathers)
        })
    };
    let (stored, recomputed) = (run(false), run(true));
    for r in 0..3 {
        assert_near_exact(&recomputed[r].0, &stored[r].0, "gathered");
        assert_near_exact(&recomputed[r].1, &stored[r].1, "gradient");
        assert_eq!((stored[r].2, recomputed[r].2), (1, 2), "all-gathers");
    }
    assert_eq!(stored[1].1, vec![0.0; 2], "the placeholder's gradient");
}

fn chunks<const D: usize>(t: Tensor<D>, dim: usize, sizes: &[usize]) -> Vec<Tensor<D>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&s| {
            let piece = if s == 0 {
                let mut dims = t.dims();
                dims[dim] = 0;
                Tensor::zeros(dims, &t.device())
            } else {
                t.clone().narrow(dim, start, s)
            };
            start += s;
            piece
        })
        .collect()
}

#[test]
fn reduce_scatter_even_and_uneven() {
    for k in SIZES {
        for (len, op) in [
            (2 * k, ReduceOp::Sum),
            (k + 3, ReduceOp::Sum),
            (2 * k + 1, ReduceOp::Avg),
        ] {
            let sizes = chunk_sizes(len, k);
            check(
                k,
                "reduce_scatter",
                |_| [3, len],
                |pg, x| reduce_scatter(x, pg, 1, op).unwrap(),
                |xs| {
                    let mut total = sum_all(xs);
                    if op == ReduceOp::Avg {
                        total = total / xs.len() as f32;
                    }
                    chunks(total, 1, &sizes)
                },
            );
        }
    }
}

#[test]
fn all_to_all_even_and_uneven() {
    for k in SIZES {
        for (rows, cols) in [(2 * k, 3), (k + 1, 2)] {
            // Split rows (dim 0), concatenate along columns (dim 1).
            let sizes = chunk_sizes(rows, k);
            check(
                k,
                "all_to_all",
                |_| [rows, cols],
                |pg, x| all_to_all(x, pg, 0, 1).unwrap(),
                |xs| {
                    (0..xs.len())
                        .map(|r| {
                            let pieces: Vec<_> = xs
                                .iter()
                                .map(|x| chunks(x.clone(), 0, &sizes)[r].clone())
                                .collect();
                            Tensor::cat(pieces, 1)
                        })
                        .collect()
                },
            );
        }
    }
}

#[test]
fn send_and_recv() {
    for k in 2..=8 {
        let last = k - 1;
        let got = world(k, |pg| {
            let r = pg.rank();
            if r == 0 {
                let x = leaf(0, [2, 3]);
                let token = send(x.clone() * 3.0, &pg, last, 5).unwrap();
                let grads = token.backward();
                Some(vec_of(x.grad(&grads).unwrap()))
            } else if r == last {
                let y = recv(Tensor::<2>::zeros([2, 3], &dev()), &pg, 0, 5).unwrap();
                assert_eq!(vec_of(y.clone()), vec_of(tensor(0, [2, 3], &dev()) * 3.0));
                let loss = (y * weight(r, [2, 3])).sum();
                let _ = loss.backward();
                None
            } else {
                None
            }
        });
        // d/dx of (3x · w).sum() is 3w.
        let expected = vec_of(weight(last, [2, 3]) * 3.0);
        assert_near_exact(got[0].as_ref().unwrap(), &expected, "send/recv gradient");
    }
}

/// A replicated logical input `X` (the same on every rank): rank r computes
/// `y_r = dist(X)`, the loss is Σ_r (y_r · w_r).sum(), and every rank's gradient must be the
/// gradient of the logical `X`.
fn check_replicated_input<const D: usize>(
    k: usize,
    what: &str,
    shape: [usize; D],
    dist: impl Fn(&ProcessGroup, Tensor<D>) -> Tensor<D> + Sync,
    reference: impl Fn(Tensor<D>) -> Vec<Tensor<D>>,
) {
    let x = leaf(0, shape);
    let ys = reference(x.clone());
    let out_dims: Vec<[usize; D]> = ys.iter().map(|y| y.dims()).collect();
    let loss = ys
        .iter()
        .enumerate()
        .map(|(r, y)| (y.clone() * weight(r, y.dims())).sum())
        .reduce(|a, b| a + b)
        .unwrap();
    let expected_grad = vec_of(x.grad(&loss.backward()).unwrap());
    let got = world(k, |pg| {
        let r = pg.rank();
        let x = leaf(0, shape);
        let y = dist(&pg, x.clone());
        let loss = (y.clone() * weight(r, out_dims[r])).sum();
        let g = vec_of(x.grad(&loss.backward()).unwrap());
        (vec_of(y), g)
    });
    for (r, (y, g)) in got.iter().enumerate() {
        assert_near_exact(
            y,
            &vec_of(ys[r].clone()),
            &format!("{what} k={k} rank {r} forward"),
        );
        assert_near_exact(
            g,
            &expected_grad,
            &format!("{what} k={k} rank {r} gradient"),
        );
    }
}

/// Rank r has input `x_r`; `Y = dist(x_r)` is one replicated logical output and the loss
/// `(Y · w).sum()` is counted once.
fn check_replicated_output<const D: usize>(
    k: usize,
    what: &str,
    shape: [usize; D],
    dist: impl Fn(&ProcessGroup, Tensor<D>) -> Tensor<D> + Sync,
    reference: impl Fn(&[Tensor<D>]) -> Tensor<D>,
) {
    let xs: Vec<Tensor<D>> = (0..k).map(|r| leaf(r, shape)).collect();
    let y = reference(&xs);
    let dims = y.dims();
    let grads = (y.clone() * weight(0, dims)).sum().backward();
    let expected: Vec<Vec<f32>> = xs.iter().map(|x| grad_or_zeros(x, &grads)).collect();
    let expected_y = vec_of(y);
    let got = world(k, |pg| {
        let x = leaf(pg.rank(), shape);
        let y = dist(&pg, x.clone());
        let grads = (y.clone() * weight(0, dims)).sum().backward();
        (vec_of(y), grad_or_zeros(&x, &grads))
    });
    for (r, (y, g)) in got.iter().enumerate() {
        assert_near_exact(y, &expected_y, &format!("{what} k={k} rank {r} forward"));
        assert_near_exact(g, &expected[r], &format!("{what} k={k} rank {r} gradient"));
    }
}

#[test]
fn megatron_mappings_and_split_gather() {
    for k in SIZES {
        check_replicated_input(
            k,
            "copy_to_group",
            [2, 3],
            |pg, x| copy_to_group(x, pg),
            |x| vec![x; k],
        );
        let len = k + 2;
        let sizes = chunk_sizes(len, k);
        check_replicated_input(
            k,
            "split",
            [3, len],
            |pg, x| split(x, pg, 1).unwrap(),
            |x| chunks(x, 1, &sizes),
        );
        check_replicated_output(
            k,
            "reduce_from_group",
            [2, 3],
            |pg, x| reduce_from_group(x, pg),
            sum_all,
        );
        check_replicated_output(
            k,
            "gather",
            [2, 3],
            |pg, x| gather(x, pg, 1, None).unwrap(),
            |xs| Tensor::cat(xs.to_vec(), 1),
        );
    }
}

#[test]
fn counts_include_backward() {
    world(4, |pg| {
        let counter = CommCounter::start();
        let x = leaf(pg.rank(), [2, 3]);
        let y = all_gather(x.clone(), &pg, 0).unwrap();
        let z = all_reduce(y, &pg, ReduceOp::Sum);
        assert_eq!(counter.count(OpKind::AllGather), 1);
        assert_eq!(counter.count(OpKind::AllReduce), 1);
        let _ = z.sum().backward();
        assert_eq!(counter.count(OpKind::AllReduce), 2);
        assert_eq!(counter.count(OpKind::ReduceScatter), 1);
        assert_eq!(counter.total(), 4);
    });
}

#[test]
fn recomputed_all_gather_is_regathered_in_backward() {
    // (mark recomputable, use the Balanced checkpointing strategy)
    let run = |recompute: bool, checkpointing: bool| {
        world(2, move |pg| {
            let device = if checkpointing {
                dev().gradient_checkpointing()
            } else {
                dev()
            };
            let x = tensor(pg.rank(), [2, 3], &device).require_grad();
            let counter = CommCounter::start();
            let y = if recompute {
                all_gather_recomputable(x.clone(), &pg, 0, &[2, 2]).unwrap()
            } else {
                all_gather(x.clone(), &pg, 0).unwrap()
            };
            // exp keeps its input for backward: the gathered tensor.
            let loss = (y.exp() * 0.5).sum();
            let grads = loss.backward();
            let gathers = counter.count(OpKind::AllGather);
            let scatters = counter.count(OpKind::ReduceScatter);
            (vec_of(x.grad(&grads).unwrap()), gathers, scatters)
        })
    };
    let stored = run(false, false);
    for (recompute, checkpointing, gathers) in [(true, true, 2), (true, false, 1), (false, true, 1)]
    {
        let out = run(recompute, checkpointing);
        for r in 0..2 {
            assert_near_exact(&out[r].0, &stored[r].0, "gradient");
            assert_eq!(stored[r].1, 1);
            assert_eq!(
                out[r].1, gathers,
                "all-gathers (recompute {recompute}, checkpointing {checkpointing})"
            );
            assert_eq!(out[r].2, 1, "one reduce-scatter in backward");
        }
    }
}

#[test]
fn all_reduce_max_and_min() {
    for k in SIZES {
        check(
            k,
            "all_reduce max",
            |_| [2, 3],
            |pg, x| all_reduce(x, pg, ReduceOp::Max),
            |xs| {
                let m = xs.iter().cloned().reduce(|a, b| a.max_pair(b)).unwrap();
                vec![m; xs.len()]
            },
        );
        check(
            k,
            "all_reduce min",
            |_| [5],
            |pg, x| all_reduce(x, pg, ReduceOp::Min),
            |xs| {
                let m = xs.iter().cloned().reduce(|a, b| a.min_pair(b)).unwrap();
                vec![m; xs.len()]
            },
        );
    }
}

#[test]
fn all_reduce_max_splits_the_gradient_between_ties() {
    let out = world(4, |pg| {
        // Ranks 1 and 3 tie for the maximum (5) of the first element; rank 2 holds the
        // maximum (9) of the second.
        let first = [1.0, 5.0, 2.0, 5.0][pg.rank()];
        let second = [0.0, 1.0, 9.0, 3.0][pg.rank()];
        let x = Tensor::<1>::from_floats([first, second], &dev()).require_grad();
        let y = all_reduce(x.clone(), &pg, ReduceOp::Max);
        let grads = (y * 2.0).sum().backward();
        vec_of(x.grad(&grads).unwrap())
    });
    // Every rank's loss contributes 2 per element: a total gradient of 8.
    assert_eq!(
        out,
        vec![
            vec![0.0, 0.0],
            vec![4.0, 0.0],
            vec![0.0, 8.0],
            vec![4.0, 0.0]
        ]
    );
}

#[test]
#[should_panic(expected = "no gradient")]
fn product_all_reduce_is_rejected_on_tracked_tensors() {
    world(1, |pg| {
        let x = leaf(0, [2]);
        let _ = all_reduce(x, &pg, ReduceOp::Product);
    });
}

#[test]
fn max_all_reduce_runs_on_untracked_tensors() {
    let out = world(3, |pg| {
        let x = tensor(pg.rank(), [4], &dev());
        vec_of(all_reduce(x, &pg, ReduceOp::Max))
    });
    let expected: Vec<f32> = (0..4)
        .map(|i| (0..3).map(|r| values(r, 4)[i]).fold(f32::MIN, f32::max))
        .collect();
    assert!(out.iter().all(|v| v == &expected));
}
