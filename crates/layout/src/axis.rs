//! [`Axis`]: the parallel axes of a training mesh, in mesh order.

use std::fmt;

/// A parallel axis of a layout. A new mesh axis is a variant here, its name, its place in
/// [`Axis::ALL`], and its rules in [`crate::ParallelDims::validate`]; an axis that borrows
/// its ranks from others (ep) is in [`Axis::BORROWED`] instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    /// Pipeline parallelism: the model cut into stages.
    Pp,
    /// HSDP's replicas (FSDP2/torchtitan's `dp_replicate`): outside dp, each replica holds the
    /// same ZeRO shards as its peers and trains on its own rows of the batch; each shard's
    /// gradient is all-reduced across the replicas after ZeRO's reduce-scatter within dp.
    /// Without ZeRO it is plain DDP over dp_replicate × dp × cp.
    DpReplicate,
    /// Data parallelism (DDP, or ZeRO stage 1–3): replicas on rows of the batch.
    Dp,
    /// Context parallelism: every sequence split over the axis, attention a ring over it;
    /// parameters are data-parallel over dp × cp.
    Cp,
    /// Tensor parallelism (± sequence and loss parallelism): layers split.
    Tp,
    /// Expert parallelism: a mixture of experts' E experts split over groups of `ep`
    /// consecutive ranks of the flattened dp × cp group (torchtitan's way: ep borrows its
    /// ranks, it adds none), tokens exchanged all-to-all; not a dimension of the mesh.
    Ep,
}

impl Axis {
    /// Every axis, in mesh order (outermost first): pp outermost, tp innermost, cp next to
    /// it (torchtitan's order; consecutive ranks share a tp group, the fastest links, then
    /// the ring of a cp group); dp_replicate outside dp (torchtitan's order: a ZeRO shard
    /// group on the nearer ranks, the replicas' all-reduce across the farther links).
    pub const ALL: [Axis; 5] = [Axis::Pp, Axis::DpReplicate, Axis::Dp, Axis::Cp, Axis::Tp];

    /// The axes that borrow their ranks from the mesh's (no dimension of their own).
    pub const BORROWED: [Axis; 1] = [Axis::Ep];

    /// How many axes there are, mesh and borrowed.
    pub const COUNT: usize = Axis::ALL.len() + Axis::BORROWED.len();

    /// The axis's name on the mesh and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Pp => "pp",
            Axis::DpReplicate => "dp_replicate",
            Axis::Dp => "dp",
            Axis::Cp => "cp",
            Axis::Tp => "tp",
            Axis::Ep => "ep",
        }
    }

    /// The axis called `name`.
    pub fn parse(name: &str) -> Option<Axis> {
        Axis::ALL
            .into_iter()
            .chain(Axis::BORROWED)
            .find(|a| a.name() == name)
    }

    /// The axis's position in [`Axis::ALL`] (its dimension of the mesh); the borrowed axes
    /// follow.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_indices_follow_mesh_order() {
        for (i, a) in Axis::ALL.into_iter().enumerate() {
            assert_eq!((Axis::parse(a.name()), a.index()), (Some(a), i));
        }
        assert_eq!(Axis::parse("xp"), None);
        assert_eq!((Axis::parse("ep"), Axis::Ep.index()), (Some(Axis::Ep), 5));
    }
}
