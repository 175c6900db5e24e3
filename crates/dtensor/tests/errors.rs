//! Clear errors: invalid shard dims, mismatched local shapes, mesh/world mismatches.

mod common;
use bonfire_comm::ReduceOp;
use bonfire_dtensor::functional::*;
use bonfire_dtensor::{DTensor, DTensorError, DeviceMesh, Placement, distribute_tensor};
use burn::tensor::Tensor;
use common::*;

#[test]
fn mesh_size_must_match_the_world() {
    world(4, |pg| {
        let err = DeviceMesh::new(&pg, &[2, 3], &["dp", "tp"]).unwrap_err();
        assert!(matches!(
            err,
            DTensorError::MeshSizeMismatch {
                mesh_size: 6,
                group_size: 4,
                ..
            }
        ));
        assert!(
            err.to_string()
                .contains("has 6 ranks but the process group has 4"),
            "{err}"
        );
    });
}

#[test]
fn mesh_axis_names_must_be_valid() {
    world(4, |pg| {
        let err = DeviceMesh::new(&pg, &[2, 2], &["dp", "dp"]).unwrap_err();
        assert!(
            err.to_string().contains("duplicate axis name `dp`"),
            "{err}"
        );
        let err = DeviceMesh::new(&pg, &[2, 2], &["dp"]).unwrap_err();
        assert!(matches!(err, DTensorError::InvalidMesh(_)));
        let err = DeviceMesh::new(&pg, &[4, 0], &["a", "b"]).unwrap_err();
        assert!(matches!(err, DTensorError::InvalidMesh(_)));
        let mesh = DeviceMesh::new(&pg, &[2, 2], &["dp", "tp"]).unwrap();
        let err = mesh.group("pp").unwrap_err();
        assert!(matches!(err, DTensorError::UnknownAxis { .. }));
        assert!(err.to_string().contains("no axis named `pp`"), "{err}");
        assert!(mesh.submesh(&["tp", "tp"]).is_err());
    });
}

#[test]
fn invalid_shard_dim() {
    world(2, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "x").unwrap();
        let full = tensor(0, [4, 2], &dev());
        let err = distribute_tensor(full.clone(), &mesh, &[Placement::Shard(2)]).unwrap_err();
        assert!(
            matches!(
                err,
                DTensorError::InvalidShardDim {
                    dim: 2,
                    ndim: 2,
                    axis: 0
                }
            ),
            "{err}"
        );
        let d = distribute_tensor(full.clone(), &mesh, &[Placement::Shard(0)]).unwrap();
        assert!(d.redistribute(&[Placement::Shard(5)]).is_err());
        let err = DTensor::from_local(full.clone(), &mesh, &[Placement::Shard(3)]).unwrap_err();
        assert!(matches!(err, DTensorError::InvalidShardDim { .. }));
        let err = distribute_tensor(full.clone(), &mesh, &[Placement::Replicate; 2]).unwrap_err();
        assert!(matches!(
            err,
            DTensorError::PlacementCount {
                placements: 2,
                axes: 1
            }
        ));
        let err = distribute_tensor(full, &mesh, &[Placement::Partial(ReduceOp::Max)]).unwrap_err();
        assert!(matches!(err, DTensorError::UnsupportedReduceOp { .. }));
    });
}

#[test]
fn from_local_rejects_mismatched_local_shapes() {
    let errors = world(3, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "x").unwrap();
        // 7 rows over 3 ranks chunk as [3, 3, 1], not [3, 2, 2]: rank 1 is wrong.
        let rows = [3, 2, 2][pg.rank()];
        let local = tensor(0, [rows, 4], &dev());
        let err = DTensor::from_local(local, &mesh, &[Placement::Shard(0)]).unwrap_err();
        // Replicated dims must agree too.
        let cols = if pg.rank() == 1 { 5 } else { 4 };
        let local = tensor(0, [2, cols], &dev());
        let err2 = DTensor::from_local(local, &mesh, &[Placement::Shard(0)]).unwrap_err();
        (err.to_string(), err2.to_string())
    });
    for (e1, e2) in errors {
        assert!(
            e1.contains("shape mismatch") && e1.contains("rank 1"),
            "{e1}"
        );
        assert!(e2.contains("shape mismatch"), "{e2}");
    }
    world(2, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "x").unwrap();
        let err = DTensor::from_local_with_shape(
            Tensor::<2>::zeros([3, 2], &dev()),
            &mesh,
            &[Placement::Shard(0)],
            [4, 2],
        )
        .unwrap_err();
        assert!(err.to_string().contains("give this rank [2, 2]"), "{err}");
    });
}

#[test]
fn functional_arguments_are_checked() {
    world(2, |pg| {
        let x = tensor(0, [2, 3], &dev());
        assert!(matches!(
            all_gather(x.clone(), &pg, 2),
            Err(DTensorError::InvalidArgument(_))
        ));
        assert!(broadcast(x.clone(), &pg, 2).is_err());
        assert!(reduce(x.clone(), &pg, ReduceOp::Max, 0).is_err());
        assert!(all_gather_uneven(x.clone(), &pg, 0, &[2]).is_err());
        assert!(matches!(
            all_gather_uneven(x.clone(), &pg, 0, &[1, 1]),
            Err(DTensorError::ShapeMismatch(_))
        ));
        assert!(reduce_scatter_uneven(x.clone(), &pg, 1, &[1, 1], ReduceOp::Sum).is_err());
        assert!(reduce_scatter(x.clone(), &pg, 1, ReduceOp::Product).is_err());
        assert!(send(x.clone(), &pg, 7, 0).is_err());
        assert!(recv(x, &pg, 9, 0).is_err());
    });
}
