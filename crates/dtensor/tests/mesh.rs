//! DeviceMesh layout, axis groups and sub-meshes.

mod common;
use bonfire_comm::ReduceOp;
use bonfire_dtensor::DeviceMesh;
use common::*;

#[test]
fn two_d_mesh_coordinates_and_axis_groups() {
    let out = world(6, |pg| {
        let mesh = DeviceMesh::new(&pg, &[2, 3], &["dp", "tp"]).unwrap();
        assert_eq!(mesh.shape(), &[2, 3]);
        assert_eq!(mesh.ndim(), 2);
        assert_eq!(mesh.size(), 6);
        assert_eq!(mesh.rank(), pg.rank());
        let coords = mesh.coords().to_vec();
        assert_eq!(coords, vec![pg.rank() / 3, pg.rank() % 3]);
        assert_eq!(mesh.coord("tp").unwrap(), pg.rank() % 3);
        let tp = mesh.group("tp").unwrap();
        let dp = mesh.group("dp").unwrap();
        assert_eq!((tp.size(), dp.size()), (3, 2));
        assert_eq!(tp.rank(), coords[1]);
        assert_eq!(dp.rank(), coords[0]);
        // Sum of world ranks along each axis.
        let mut v = [pg.rank() as f32];
        tp.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let mut w = [pg.rank() as f32];
        dp.all_reduce(&mut w, ReduceOp::Sum).unwrap();
        (v[0], w[0], tp.world_ranks(), dp.world_ranks())
    });
    for (rank, (tp_sum, dp_sum, tp_ranks, dp_ranks)) in out.into_iter().enumerate() {
        let row = rank / 3;
        let col = rank % 3;
        assert_eq!(tp_sum, (3 * row * 3 + 3) as f32); // 3row + 3row+1 + 3row+2
        assert_eq!(dp_sum, (col + col + 3) as f32);
        assert_eq!(tp_ranks, vec![3 * row, 3 * row + 1, 3 * row + 2]);
        assert_eq!(dp_ranks, vec![col, col + 3]);
    }
}

#[test]
fn three_d_submeshes() {
    world(8, |pg| {
        let mesh = DeviceMesh::new(&pg, &[2, 2, 2], &["pp", "dp", "tp"]).unwrap();
        let sub = mesh.submesh(&["dp", "tp"]).unwrap();
        assert_eq!(sub.shape(), &[2, 2]);
        assert_eq!(sub.names(), &["dp".to_string(), "tp".to_string()]);
        assert_eq!(sub.coords(), &mesh.coords()[1..]);
        assert_eq!(sub.rank(), pg.rank() % 4);
        let pp = mesh.coord("pp").unwrap();
        assert_eq!(
            sub.world().world_ranks(),
            (4 * pp..4 * pp + 4).collect::<Vec<_>>()
        );
        assert_eq!(
            sub.group("tp").unwrap().world_ranks(),
            mesh.group("tp").unwrap().world_ranks()
        );
        let one = mesh.submesh(&["pp"]).unwrap();
        assert_eq!(one.size(), 2);
        assert_eq!(one.rank(), pp);
        // Reordered axes: row-major in the given order.
        let swapped = mesh.submesh(&["tp", "dp"]).unwrap();
        let c = mesh.coords();
        assert_eq!(swapped.rank(), c[2] * 2 + c[1]);
        let mut v = [1.0f32];
        sub.world().all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v[0], 4.0);
    });
}

#[test]
fn one_d_mesh_reuses_the_group() {
    world(3, |pg| {
        let mesh = DeviceMesh::one_d(&pg, "x").unwrap();
        assert_eq!(mesh.group("x").unwrap().world_ranks(), pg.world_ranks());
        assert_eq!(mesh.axis("x").unwrap(), 0);
    });
}
