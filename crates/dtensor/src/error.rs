//! The error type of this crate.

use bonfire_comm::CommError;

/// Result alias for this crate.
pub type Result<T, E = DTensorError> = std::result::Result<T, E>;

/// Why a mesh, a distributed tensor or a differentiable collective could not be built or run.
///
/// Argument errors are detected before anything is exchanged, and identically on every rank
/// when every rank passes the same arguments. Failures of the communicator *inside* a Burn
/// operation (a timeout, a peer that died) cannot be returned through Burn's infallible
/// tensor API; they panic with the [`CommError`] message instead (see the crate docs).
#[derive(Debug, Clone, thiserror::Error)]
pub enum DTensorError {
    /// A mesh's shape does not cover its process group exactly.
    #[error("mesh of shape {shape:?} has {mesh_size} ranks but the process group has {group_size}")]
    MeshSizeMismatch {
        /// The requested mesh shape (ranks per axis).
        shape: Vec<usize>,
        /// The number of ranks the shape describes (the product of its axes).
        mesh_size: usize,
        /// The number of ranks in the process group.
        group_size: usize,
    },

    /// A mesh was described inconsistently (duplicate or empty axis name, zero-sized axis,
    /// as many names as axes…).
    #[error("invalid device mesh: {0}")]
    InvalidMesh(String),

    /// No mesh axis has this name.
    #[error("the mesh has no axis named `{name}` (axes: {axes:?})")]
    UnknownAxis {
        /// The axis name asked for.
        name: String,
        /// The mesh's axis names, in axis order.
        axes: Vec<String>,
    },

    /// A placement shards a dimension the tensor does not have.
    #[error("invalid shard dim {dim} for a tensor of rank {ndim} (placement on mesh axis {axis})")]
    InvalidShardDim {
        /// The tensor dimension the placement shards.
        dim: usize,
        /// The tensor's rank (number of dimensions).
        ndim: usize,
        /// The mesh axis the placement belongs to.
        axis: usize,
    },

    /// There must be exactly one placement per mesh axis.
    #[error("{placements} placements given for a mesh with {axes} axes")]
    PlacementCount {
        /// The number of placements given.
        placements: usize,
        /// The number of mesh axes.
        axes: usize,
    },

    /// A reduce op that a `Partial` placement or a differentiable collective does not support.
    #[error("unsupported reduce op {op} for {what}: only sum and avg are supported")]
    UnsupportedReduceOp {
        /// The rejected reduce op.
        op: bonfire_comm::ReduceOp,
        /// What it was given to (e.g. "a Partial placement", "a differentiable reduce").
        what: &'static str,
    },

    /// Local shapes do not fit the placements (`from_local`), or a tensor shape does not fit
    /// a collective's arguments.
    #[error("shape mismatch: {0}")]
    ShapeMismatch(String),

    /// Any other invalid argument (a root or peer out of range, a dim out of range…).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Ranks hold different parameter sets or shapes (see `bonfire_module::params::check_same`).
    #[error("ranks disagree on the model's parameters: {0}")]
    ParamMismatch(String),

    /// A communication call made outside a Burn operation failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}
