//! Redistribution between placements: a planner over placements alone, and an executor that
//! applies the plan to a local tensor with the differentiable collectives.
//!
//! The planner works axis by axis. Phase A walks the axes from the last to the first and
//! takes apart what must change: a `Shard` becomes `Replicate` (all-gather), another `Shard`
//! (all-to-all) or `Partial` (local zero padding); a `Partial` becomes `Replicate`
//! (all-reduce) or `Shard` (reduce-scatter). Phase B walks the axes from the first to the
//! last and builds what remains from `Replicate`: `Shard` by a local slice, `Partial` by a
//! local partition. Inner axes are taken apart before outer ones and built after them, so
//! a dimension sharded on several axes keeps torch's nesting (outer axis first). A direct
//! step (all-to-all, reduce-scatter) is used only when it yields that nesting; otherwise the
//! planner goes through `Replicate`.

use crate::collectives::functional::collective;
use crate::collectives::{CollectiveKind, CollectiveSpec};
use crate::{DeviceMesh, Placement, chunk_range, chunk_sizes};
use bonfire_comm::OpKind;
use bonfire_comm::ReduceOp;
use burn::tensor::Tensor;

/// One step of a redistribution, on one mesh axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// `Shard(dim)` → `Replicate`: all-gather.
    AllGather {
        /// The mesh axis the step runs on.
        axis: usize,
        /// The tensor dim that was sharded.
        dim: usize,
    },
    /// `Partial(op)` → `Replicate`: all-reduce.
    AllReduce {
        /// The mesh axis the step runs on.
        axis: usize,
        /// The partial placement's reduce op.
        op: ReduceOp,
    },
    /// `Partial(op)` → `Shard(dim)`: reduce-scatter.
    ReduceScatter {
        /// The mesh axis the step runs on.
        axis: usize,
        /// The partial placement's reduce op.
        op: ReduceOp,
        /// The tensor dim the result is sharded along.
        dim: usize,
    },
    /// `Shard(from)` → `Shard(to)`: all-to-all.
    AllToAll {
        /// The mesh axis the step runs on.
        axis: usize,
        /// The tensor dim sharded before.
        from: usize,
        /// The tensor dim sharded after.
        to: usize,
    },
    /// `Replicate` → `Shard(dim)`: local slice, no communication.
    Slice {
        /// The mesh axis the step runs on.
        axis: usize,
        /// The tensor dim the result is sharded along.
        dim: usize,
    },
    /// `Replicate` → `Partial(op)`: local partition (sum: coordinate 0 keeps the value, the
    /// others hold zeros; avg: every rank keeps it), no communication.
    Partition {
        /// The mesh axis the step runs on.
        axis: usize,
        /// The reduce op of the resulting partial placement.
        op: ReduceOp,
    },
    /// `Shard(dim)` → `Partial(op)`: local zero padding, no communication.
    Pad {
        /// The mesh axis the step runs on.
        axis: usize,
        /// The tensor dim that was sharded (and is padded back to full length).
        dim: usize,
        /// The reduce op of the resulting partial placement.
        op: ReduceOp,
    },
}

impl Step {
    /// The collective this step issues, if any.
    pub fn collective(&self) -> Option<OpKind> {
        match self {
            Step::AllGather { .. } => Some(OpKind::AllGather),
            Step::AllReduce { .. } => Some(OpKind::AllReduce),
            Step::ReduceScatter { .. } => Some(OpKind::ReduceScatter),
            Step::AllToAll { .. } => Some(OpKind::AllToAll),
            Step::Slice { .. } | Step::Partition { .. } | Step::Pad { .. } => None,
        }
    }
}

fn prefix(p: &[Placement], dim: usize, axis: usize) -> Vec<usize> {
    (0..axis)
        .filter(|&b| p[b] == Placement::Shard(dim))
        .collect()
}

fn stable(cur: &[Placement], tgt: &[Placement], axis: usize) -> bool {
    cur[axis] == tgt[axis]
        && match cur[axis] {
            Placement::Shard(d) => prefix(cur, d, axis) == prefix(tgt, d, axis),
            _ => true,
        }
}

/// Whether sharding `dim` on `axis` now gives the target's nesting: the outer axes shard
/// `dim` the same way now as in the target, and will not change.
fn direct_ok(cur: &[Placement], tgt: &[Placement], dim: usize, axis: usize) -> bool {
    (0..axis).all(|b| {
        let c = cur[b] == Placement::Shard(dim);
        let t = tgt[b] == Placement::Shard(dim);
        c == t && (!c || stable(cur, tgt, b))
    })
}

/// The steps that turn placements `src` into `dst` (one placement per mesh axis each).
pub fn plan(src: &[Placement], dst: &[Placement]) -> Vec<Step> {
    assert_eq!(src.len(), dst.len(), "one placement per mesh axis");
    let mut cur = src.to_vec();
    let mut steps = Vec::new();
    for axis in (0..cur.len()).rev() {
        if stable(&cur, dst, axis) {
            continue;
        }
        match (cur[axis], dst[axis]) {
            (Placement::Shard(from), Placement::Shard(to))
                if from != to && direct_ok(&cur, dst, to, axis) =>
            {
                steps.push(Step::AllToAll { axis, from, to });
            }
            (Placement::Shard(dim), Placement::Partial(op)) => {
                steps.push(Step::Pad { axis, dim, op });
            }
            (Placement::Shard(dim), _) => steps.push(Step::AllGather { axis, dim }),
            (Placement::Partial(op), Placement::Shard(dim)) if direct_ok(&cur, dst, dim, axis) => {
                steps.push(Step::ReduceScatter { axis, op, dim });
            }
            (Placement::Partial(op), _) => steps.push(Step::AllReduce { axis, op }),
            (Placement::Replicate, _) => continue,
        }
        cur[axis] = after(*steps.last().unwrap());
    }
    for axis in 0..cur.len() {
        if cur[axis] == dst[axis] {
            continue;
        }
        debug_assert_eq!(cur[axis], Placement::Replicate);
        let step = match dst[axis] {
            Placement::Shard(dim) => Step::Slice { axis, dim },
            Placement::Partial(op) => Step::Partition { axis, op },
            Placement::Replicate => unreachable!(),
        };
        steps.push(step);
        cur[axis] = after(step);
    }
    debug_assert_eq!(cur, dst);
    steps
}

fn after(step: Step) -> Placement {
    match step {
        Step::AllGather { .. } | Step::AllReduce { .. } => Placement::Replicate,
        Step::ReduceScatter { dim, .. } | Step::Slice { dim, .. } => Placement::Shard(dim),
        Step::AllToAll { to, .. } => Placement::Shard(to),
        Step::Partition { op, .. } | Step::Pad { op, .. } => Placement::Partial(op),
    }
}

/// The size of `dim` at the level of `axis`: the global size cut by the outer axes that
/// shard it in `placements`, at this rank's coordinates.
fn level_size(
    shape: &[usize],
    placements: &[Placement],
    mesh: &DeviceMesh,
    dim: usize,
    axis: usize,
) -> usize {
    let mut size = shape[dim];
    for (b, p) in placements.iter().enumerate().take(axis) {
        if *p == Placement::Shard(dim) {
            size = chunk_range(size, mesh.shape()[b], mesh.coords()[b]).len();
        }
    }
    size
}

/// Applies `plan(src, dst)` to this rank's local tensor of a distributed tensor of global
/// shape `shape` on `mesh`.
pub(crate) fn execute<const D: usize>(
    mut local: Tensor<D>,
    mesh: &DeviceMesh,
    shape: &[usize],
    src: &[Placement],
    dst: &[Placement],
) -> Tensor<D> {
    let mut cur = src.to_vec();
    for step in plan(src, dst) {
        let (axis, kind) = match step {
            Step::AllGather { axis, dim } => {
                let lvl = level_size(shape, &cur, mesh, dim, axis);
                let sizes = chunk_sizes(lvl, mesh.shape()[axis]);
                (axis, Some(CollectiveKind::Gather { dim, sizes }))
            }
            Step::AllReduce { axis, op } => (axis, Some(CollectiveKind::ReduceFromGroup { op })),
            Step::ReduceScatter { axis, op, dim } => {
                let sizes = chunk_sizes(local.dims()[dim], mesh.shape()[axis]);
                (axis, Some(CollectiveKind::ReduceScatter { dim, sizes, op }))
            }
            Step::AllToAll { axis, from, to } => {
                let k = mesh.shape()[axis];
                let cat_sizes = chunk_sizes(level_size(shape, &cur, mesh, from, axis), k);
                let split_sizes = chunk_sizes(local.dims()[to], k);
                let kind = CollectiveKind::AllToAll {
                    split_dim: to,
                    split_sizes,
                    cat_dim: from,
                    cat_sizes,
                };
                (axis, Some(kind))
            }
            Step::Slice { axis, dim } => {
                let sizes = chunk_sizes(local.dims()[dim], mesh.shape()[axis]);
                (axis, Some(CollectiveKind::Split { dim, sizes }))
            }
            Step::Partition { axis, op } => {
                let keep = mesh.coords()[axis] == 0;
                (axis, Some(CollectiveKind::Partition { op, keep }))
            }
            Step::Pad { axis, dim, op } => {
                let k = mesh.shape()[axis];
                let lvl = level_size(shape, &cur, mesh, dim, axis);
                let range = chunk_range(lvl, k, mesh.coords()[axis]);
                let pad = CollectiveKind::Pad {
                    dim,
                    offset: range.start,
                    len: lvl,
                };
                local = collective(local, CollectiveSpec::new(mesh.axis_group(axis), pad));
                if op == ReduceOp::Avg {
                    local = local * (k as f32);
                }
                (axis, None)
            }
        };
        if let Some(kind) = kind {
            let spec = CollectiveSpec::new(mesh.axis_group(axis), kind);
            local = collective(local, spec);
        }
        cur[axis] = after(step);
    }
    local
}
