//! Every redistribution pair on 1-d and 2-d meshes, even and uneven: exact round trips and
//! the exact collectives issued; property tests over random meshes, shapes and chains of
//! placements (round trip, collectives, gradient).

mod common;
use bonfire_comm::OpKind;
use bonfire_comm::ReduceOp;
use bonfire_dtensor::redistribute::plan;
use bonfire_dtensor::{CommCounter, DeviceMesh, Placement, distribute_tensor};
use common::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

const R: Placement = Placement::Replicate;
const PS: Placement = Placement::Partial(ReduceOp::Sum);
const PA: Placement = Placement::Partial(ReduceOp::Avg);
const fn s(d: usize) -> Placement {
    Placement::Shard(d)
}

/// The collective of a one-axis transition, from the table.
fn one_axis_cost(src: Placement, dst: Placement) -> Option<OpKind> {
    use Placement::*;
    match (src, dst) {
        (a, b) if a == b => None,
        (Shard(_), Replicate) => Some(OpKind::AllGather),
        (Partial(_), Replicate) => Some(OpKind::AllReduce),
        (Partial(_), Shard(_)) => Some(OpKind::ReduceScatter),
        (Replicate, Shard(_)) => None,
        (Shard(_), Shard(_)) => Some(OpKind::AllToAll),
        (Replicate, Partial(_)) | (Shard(_), Partial(_)) => None,
        (Partial(_), Partial(_)) => Some(OpKind::AllReduce),
        (Replicate, Replicate) => None,
    }
}

fn counts_of(ops: impl IntoIterator<Item = Option<OpKind>>) -> BTreeMap<OpKind, usize> {
    let mut m = BTreeMap::new();
    for op in ops.into_iter().flatten() {
        *m.entry(op).or_insert(0) += 1;
    }
    m
}

/// Whether every axis's transition involves only dims that no other axis shards: then the
/// cost is the sum of the one-axis costs.
fn independent(src: &[Placement], dst: &[Placement]) -> bool {
    (0..src.len()).all(|a| {
        let dims: Vec<usize> = [src[a], dst[a]]
            .iter()
            .filter_map(|p| p.shard_dim())
            .collect();
        (0..src.len())
            .filter(|&b| b != a)
            .all(|b| dims.iter().all(|&d| src[b] != s(d) && dst[b] != s(d)))
    })
}

/// Runs every (src, dst) pair on a mesh of `mesh_shape` for a tensor of `shape`; checks the
/// round trip (full tensor, and local blocks for non-partial targets) and the collectives.
fn check_all_pairs(mesh_shape: &[usize], shape: [usize; 2], placements: &[Placement]) {
    let n: usize = mesh_shape.iter().product();
    let names: Vec<&str> = ["a", "b", "c"][..mesh_shape.len()].to_vec();
    let mut combos: Vec<Vec<Placement>> = vec![vec![]];
    for _ in mesh_shape {
        combos = combos
            .into_iter()
            .flat_map(|c| {
                placements.iter().map(move |p| {
                    let mut c = c.clone();
                    c.push(*p);
                    c
                })
            })
            .collect();
    }
    world(n, |pg| {
        let mesh = DeviceMesh::new(&pg, mesh_shape, &names).unwrap();
        let device = dev();
        let full = tensor(7, shape, &device);
        let expected = vec_of(full.clone());
        for src in &combos {
            let a = distribute_tensor(full.clone(), &mesh, src).unwrap();
            for dst in &combos {
                let counter = CommCounter::start();
                let b = a.redistribute(dst).unwrap();
                let counts = counter.counts();
                drop(counter);
                let planned = counts_of(plan(src, dst).iter().map(|s| s.collective()));
                assert_eq!(counts, planned, "{src:?} -> {dst:?}: issued vs planned");
                if independent(src, dst) {
                    let table = counts_of((0..src.len()).map(|i| one_axis_cost(src[i], dst[i])));
                    assert_eq!(counts, table, "{src:?} -> {dst:?}: issued vs table");
                }
                assert!(counts.values().sum::<usize>() <= 2 * src.len());
                assert_eq!(b.shape(), shape);
                if !dst.iter().any(|p| p.is_partial()) {
                    let direct = distribute_tensor(full.clone(), &mesh, dst).unwrap();
                    assert_eq!(
                        vec_of(b.local().clone()),
                        vec_of(direct.to_local()),
                        "{src:?} -> {dst:?}: local block"
                    );
                }
                let back = vec_of(b.full_tensor().unwrap());
                assert_eq!(back, expected, "{src:?} -> {dst:?}: round trip");
            }
        }
    });
}

#[test]
fn one_d_every_pair_even_and_uneven() {
    let placements = [R, s(0), s(1), PS, PA];
    for k in 1..=4 {
        check_all_pairs(&[k], [4, 6], &placements);
        check_all_pairs(&[k], [3, 5], &placements);
    }
    check_all_pairs(&[5], [2, 7], &placements); // empty shards
}

#[test]
fn two_d_every_pair_even() {
    check_all_pairs(&[2, 2], [4, 8], &[R, s(0), s(1), PS]);
}

#[test]
fn two_d_every_pair_uneven() {
    check_all_pairs(&[2, 3], [3, 5], &[R, s(0), s(1), PS, PA]);
}

#[test]
fn three_d_every_pair_uneven() {
    check_all_pairs(&[2, 2, 2], [3, 5], &[R, s(0), s(1), PS]);
}

#[test]
fn one_d_table_counts() {
    // The transitions of the documentation table, on 4 ranks.
    let cases = [
        (s(0), R, Some(OpKind::AllGather)),
        (PS, R, Some(OpKind::AllReduce)),
        (PS, s(1), Some(OpKind::ReduceScatter)),
        (R, s(0), None),
        (s(0), s(1), Some(OpKind::AllToAll)),
        (R, PS, None),
        (s(1), PS, None),
    ];
    world(4, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "x").unwrap();
        let full = tensor(1, [8, 4], &dev());
        for (src, dst, op) in cases {
            let a = distribute_tensor(full.clone(), &mesh, &[src]).unwrap();
            let counter = CommCounter::start();
            let _b = a.redistribute(&[dst]).unwrap();
            assert_eq!(counter.total(), op.is_some() as usize, "{src} -> {dst}");
            if let Some(op) = op {
                assert_eq!(counter.count(op), 1, "{src} -> {dst}");
            }
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, .. ProptestConfig::default() })]

    #[test]
    fn random_redistributions_round_trip(
        mesh_shape in prop_oneof![
            (1usize..=5).prop_map(|k| vec![k]),
            ((1usize..=3), (1usize..=2)).prop_map(|(a, b)| vec![a, b]),
            ((1usize..=2), (1usize..=2), (1usize..=2)).prop_map(|(a, b, c)| vec![a, b, c]),
        ],
        dims in proptest::collection::vec(1usize..=7, 3),
        seed in 0usize..100,
        picks in proptest::collection::vec((0usize..4, 0usize..3), 9),
    ) {
        let ndim = mesh_shape.len();
        let shape = [dims[0], dims[1], dims[2]];
        let pick = |(kind, dim): (usize, usize)| match kind {
            0 => R,
            1 => s(dim),
            2 => PS,
            _ => PA,
        };
        // Chain of three placements: src -> mid -> dst.
        let chain: Vec<Vec<Placement>> = picks
            .chunks(ndim)
            .take(3)
            .map(|c| c.iter().map(|&p| pick(p)).collect())
            .collect();
        let n: usize = mesh_shape.iter().product();
        let names: Vec<&str> = ["a", "b", "c"][..ndim].to_vec();
        world(n, |pg| {
            let mesh = DeviceMesh::new(&pg, &mesh_shape, &names).unwrap();
            let full = tensor(seed, shape, &dev()).require_grad();
            let expected = vec_of(full.clone());
            let mut t = distribute_tensor(full.clone(), &mesh, &chain[0]).unwrap();
            for w in chain.windows(2) {
                let counter = CommCounter::start();
                t = t.redistribute(&w[1]).unwrap();
                let planned = counts_of(plan(&w[0], &w[1]).iter().map(|s| s.collective()));
                assert_eq!(counter.counts(), planned);
                assert_eq!(t.local().dims().to_vec(), t.spec().local_shape());
            }
            let back = t.full_tensor().unwrap();
            assert_near_exact(&vec_of(back.clone()), &expected, "round trip");
            // The chain is the identity on the logical tensor: its gradient is the weight.
            let w = tensor(seed + 1, shape, &dev());
            let grads = (back * w.clone()).sum().backward();
            assert_near_exact(&vec_of(full.grad(&grads).unwrap()), &vec_of(w), "gradient");
        });
    }
}
