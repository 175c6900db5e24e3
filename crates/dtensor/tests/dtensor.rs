//! DTensor construction and gradients of programs on DTensors against the same programs
//! on one device.

mod common;
use bonfire_comm::ReduceOp;
use bonfire_dtensor::functional::copy_to_group;
use bonfire_dtensor::{DTensor, DeviceMesh, Placement, distribute_tensor};
use burn::tensor::Tensor;
use common::*;

const R: Placement = Placement::Replicate;
const PS: Placement = Placement::Partial(ReduceOp::Sum);
const PA: Placement = Placement::Partial(ReduceOp::Avg);
const fn s(d: usize) -> Placement {
    Placement::Shard(d)
}

fn combos(axes: usize, set: &[Placement]) -> Vec<Vec<Placement>> {
    let mut out: Vec<Vec<Placement>> = vec![vec![]];
    for _ in 0..axes {
        out = out
            .into_iter()
            .flat_map(|c| {
                set.iter().map(move |p| {
                    let mut c = c.clone();
                    c.push(*p);
                    c
                })
            })
            .collect();
    }
    out
}

/// distribute(src) → redistribute(dst) → full_tensor is the identity on the logical tensor,
/// so the gradient of `(out · w).sum()` with respect to the full input is `w` on every rank,
/// whatever the placements and whatever collectives ran in backward.
fn check_identity_gradients(mesh_shape: &[usize], shape: [usize; 2], set: &[Placement]) {
    let n: usize = mesh_shape.iter().product();
    let names: Vec<&str> = ["a", "b"][..mesh_shape.len()].to_vec();
    let all = combos(mesh_shape.len(), set);
    world(n, |pg| {
        let mesh = DeviceMesh::new(&pg, mesh_shape, &names).unwrap();
        let w = tensor(50, shape, &dev());
        for src in &all {
            for dst in &all {
                let x = leaf(3, shape);
                let d = distribute_tensor(x.clone(), &mesh, src).unwrap();
                let out = d.redistribute(dst).unwrap().full_tensor().unwrap();
                let grads = (out * w.clone()).sum().backward();
                let g = vec_of(x.grad(&grads).unwrap());
                assert_near_exact(
                    &g,
                    &vec_of(w.clone()),
                    &format!("{src:?} -> {dst:?} gradient"),
                );
            }
        }
    });
}

#[test]
fn redistribution_gradients_one_d() {
    for k in 1..=4 {
        check_identity_gradients(&[k], [4, 3], &[R, s(0), s(1), PS, PA]);
        check_identity_gradients(&[k], [3, 5], &[R, s(0), s(1), PS, PA]);
    }
}

#[test]
fn redistribution_gradients_two_d() {
    check_identity_gradients(&[2, 2], [4, 6], &[R, s(0), s(1), PS]);
    check_identity_gradients(&[2, 3], [5, 3], &[R, s(0), s(1), PA]);
}

/// Column-parallel then row-parallel matmul (Megatron MLP without the nonlinearity):
/// `Y = (X · A) · B` with `A` sharded by columns, `B` by rows; gradients of X, A and B must
/// equal the single-device ones.
#[test]
fn tensor_parallel_matmuls_match_single_device() {
    for k in 1..=4 {
        for hidden in [4, 5] {
            let (x0, a0, b0) = (leaf(1, [3, 4]), leaf(2, [4, hidden]), leaf(3, [hidden, 2]));
            let y = x0.clone().matmul(a0.clone()).matmul(b0.clone());
            let c = tensor(9, [3, 2], &dev());
            let grads = (y.clone() * c.clone()).sum().backward();
            let expected: Vec<Vec<f32>> = [&x0, &a0, &b0]
                .iter()
                .map(|t| vec_of(t.grad(&grads).unwrap()))
                .collect();
            let expected_y = vec_of(y);
            let got = world(k, |pg| {
                let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
                let (x, a, b) = (leaf(1, [3, 4]), leaf(2, [4, hidden]), leaf(3, [hidden, 2]));
                let xd = distribute_tensor(x.clone(), &mesh, &[R]).unwrap();
                let ad = distribute_tensor(a.clone(), &mesh, &[s(1)]).unwrap();
                let bd = distribute_tensor(b.clone(), &mesh, &[s(0)]).unwrap();
                // X (replicated) · A (column shard) = H sharded by columns; X's gradient is
                // the sum of every rank's contribution (Megatron's `f`).
                let x_local = copy_to_group(xd.to_local(), mesh.group("tp").unwrap());
                let h = x_local.matmul(ad.to_local());
                // H (column shard) · B (row shard) = partial sums of Y.
                let y_partial = h.matmul(bd.to_local());
                let yd = DTensor::from_local(y_partial, &mesh, &[PS]).unwrap();
                assert_eq!(yd.shape(), [3, 2]);
                let y = yd.full_tensor().unwrap();
                let c = tensor(9, [3, 2], &dev());
                let grads = (y.clone() * c).sum().backward();
                let g: Vec<Vec<f32>> = [&x, &a, &b]
                    .iter()
                    .map(|t| vec_of(t.grad(&grads).unwrap()))
                    .collect();
                (vec_of(y), g)
            });
            for (y, g) in got {
                assert_near_exact(&y, &expected_y, "tp forward");
                for (i, name) in ["x", "a", "b"].iter().enumerate() {
                    assert_near_exact(
                        &g[i],
                        &expected[i],
                        &format!("tp gradient of {name} (k={k})"),
                    );
                }
            }
        }
    }
}

#[test]
fn from_local_infers_uneven_and_nested_global_shapes() {
    // 2×3 mesh; dim 0 (7 rows) sharded on both axes, dim 1 (5) replicated.
    world(6, |pg| {
        let mesh = DeviceMesh::new(&pg, &[2, 3], &["dp", "tp"]).unwrap();
        let full = tensor(4, [7, 5], &dev());
        let d = distribute_tensor(full.clone(), &mesh, &[s(0), s(0)]).unwrap();
        let local = d.to_local();
        let again = DTensor::from_local(local.clone(), &mesh, &[s(0), s(0)]).unwrap();
        assert_eq!(again.shape(), [7, 5]);
        assert_eq!(again.spec().local_shape(), local.dims().to_vec());
        assert_eq!(vec_of(again.full_tensor().unwrap()), vec_of(full.clone()));
        // Sharded on different dims on the two axes.
        let d = distribute_tensor(full.clone(), &mesh, &[s(1), s(0)]).unwrap();
        let again = DTensor::from_local(d.to_local(), &mesh, &[s(1), s(0)]).unwrap();
        assert_eq!(again.shape(), [7, 5]);
        assert_eq!(vec_of(again.full_tensor().unwrap()), vec_of(full));
    });
}

#[test]
fn partial_from_local_reduces() {
    world(3, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "x").unwrap();
        let local = Tensor::<1>::from_floats([pg.rank() as f32, 1.0], &dev());
        let sum = DTensor::from_local(local.clone(), &mesh, &[PS]).unwrap();
        assert_eq!(vec_of(sum.full_tensor().unwrap()), vec![3.0, 3.0]);
        let avg = DTensor::from_local(local, &mesh, &[PA]).unwrap();
        assert_eq!(vec_of(avg.full_tensor().unwrap()), vec![1.0, 1.0]);
    });
}
