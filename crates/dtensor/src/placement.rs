//! Placements of a distributed tensor on one mesh axis, and the torch.chunk sharding rule.

use bonfire_comm::ReduceOp;
use std::fmt;

/// How a [`DTensor`](crate::DTensor) is laid out along one axis of its mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Split along tensor dimension `dim`, following [`chunk_sizes`] (torch.chunk): rank `r`
    /// of the axis holds chunk `r`.
    Shard(usize),
    /// Every rank of the axis holds the whole (mesh-axis-level) tensor.
    Replicate,
    /// Every rank holds a partial value; the logical tensor is their reduction with this op
    /// (only [`ReduceOp::Sum`] and [`ReduceOp::Avg`] are supported).
    Partial(ReduceOp),
}

impl Placement {
    /// `Partial(Sum)`, the partial placement produced by e.g. a row-parallel matmul.
    pub const PARTIAL_SUM: Placement = Placement::Partial(ReduceOp::Sum);

    /// Whether this is `Shard(_)`.
    pub fn is_shard(&self) -> bool {
        matches!(self, Placement::Shard(_))
    }
    /// The sharded dimension, if this is `Shard(dim)`.
    pub fn shard_dim(&self) -> Option<usize> {
        match self {
            Placement::Shard(d) => Some(*d),
            _ => None,
        }
    }
    /// Whether this is `Replicate`.
    pub fn is_replicate(&self) -> bool {
        matches!(self, Placement::Replicate)
    }
    /// Whether this is `Partial(_)`.
    pub fn is_partial(&self) -> bool {
        matches!(self, Placement::Partial(_))
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "S({d})"),
            Placement::Replicate => write!(f, "R"),
            Placement::Partial(op) => write!(f, "P({op})"),
        }
    }
}

/// The range of chunk `index` when `len` elements are split in `parts` chunks the way
/// torch.chunk does: ⌈len / parts⌉ elements per chunk, the last non-empty chunk holds the
/// remainder and later chunks are empty.
///
/// ```
/// use bonfire_dtensor::chunk_range;
/// assert_eq!(chunk_range(5, 4, 1), 2..4);
/// assert_eq!(chunk_range(5, 4, 2), 4..5);
/// assert_eq!(chunk_range(5, 4, 3), 5..5);
/// ```
pub fn chunk_range(len: usize, parts: usize, index: usize) -> std::ops::Range<usize> {
    assert!(parts > 0 && index < parts, "chunk {index} of {parts}");
    let per = len.div_ceil(parts);
    let start = (index * per).min(len);
    let end = (start + per).min(len);
    start..end
}

/// The sizes of all `parts` chunks of `len` elements (see [`chunk_range`]).
///
/// ```
/// use bonfire_dtensor::chunk_sizes;
/// assert_eq!(chunk_sizes(10, 4), vec![3, 3, 3, 1]);
/// assert_eq!(chunk_sizes(2, 4), vec![1, 1, 0, 0]);
/// ```
pub fn chunk_sizes(len: usize, parts: usize) -> Vec<usize> {
    (0..parts)
        .map(|i| chunk_range(len, parts, i).len())
        .collect()
}
