//! [`DTensor`]: a local Burn tensor plus how it is laid out across a [`DeviceMesh`].

use crate::debug::record;
use crate::mesh::coords_of;
use crate::redistribute;
use crate::{DTensorError, DeviceMesh, Placement, Result, chunk_range};
use bonfire_comm::OpKind;
use bonfire_comm::ReduceOp;
use burn::tensor::Tensor;

/// The layout of a distributed tensor: its mesh, one placement per mesh axis, and the
/// global (logical) shape.
#[derive(Debug, Clone, PartialEq)]
pub struct DTensorSpec {
    /// The mesh the tensor is distributed over.
    pub mesh: DeviceMesh,
    /// How the tensor is laid out along each mesh axis, in axis order.
    pub placements: Vec<Placement>,
    /// The global (logical) shape of the whole tensor.
    pub shape: Vec<usize>,
}

impl DTensorSpec {
    /// The `(offset, length)` of this rank's block along every dimension.
    pub fn local_blocks(&self) -> Vec<(usize, usize)> {
        blocks(
            &self.shape,
            &self.placements,
            self.mesh.shape(),
            self.mesh.coords(),
        )
    }

    /// The shape of this rank's local tensor.
    pub fn local_shape(&self) -> Vec<usize> {
        self.local_blocks().into_iter().map(|(_, n)| n).collect()
    }
}

/// The block of the global tensor held at mesh coordinates `coords`: Shard placements cut
/// their dimension in mesh-axis order (outer axis first), following torch.chunk.
fn blocks(
    shape: &[usize],
    placements: &[Placement],
    mesh_shape: &[usize],
    coords: &[usize],
) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = shape.iter().map(|&n| (0, n)).collect();
    for (axis, p) in placements.iter().enumerate() {
        if let Placement::Shard(d) = p {
            let (offset, len) = out[*d];
            let r = chunk_range(len, mesh_shape[axis], coords[axis]);
            out[*d] = (offset + r.start, r.len());
        }
    }
    out
}

/// Checks the placements for a tensor of rank `ndim` on `mesh`.
pub(crate) fn check_placements(
    placements: &[Placement],
    ndim: usize,
    mesh: &DeviceMesh,
) -> Result<()> {
    if placements.len() != mesh.ndim() {
        return Err(DTensorError::PlacementCount {
            placements: placements.len(),
            axes: mesh.ndim(),
        });
    }
    for (axis, p) in placements.iter().enumerate() {
        match p {
            Placement::Shard(dim) if *dim >= ndim => {
                return Err(DTensorError::InvalidShardDim {
                    dim: *dim,
                    ndim,
                    axis,
                });
            }
            Placement::Partial(op) if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) => {
                return Err(DTensorError::UnsupportedReduceOp {
                    op: *op,
                    what: "a Partial placement",
                });
            }
            _ => {}
        }
    }
    Ok(())
}

/// A distributed tensor: this rank's local `Tensor<D>` and its [`DTensorSpec`].
///
/// The logical (global) tensor is what the placements describe: `Shard(d)` on an axis means
/// the ranks of that axis hold the torch.chunk pieces of dimension `d`; `Replicate` that they
/// hold the same values; `Partial(op)` that the logical value is the reduction of theirs.
///
/// Gradients follow the logical program: after `backward()` on a replicated loss, the
/// gradient of a local tensor is this rank's block of the logical gradient (for
/// `Partial(Avg)`, divided by the axis size), so a program on `DTensor`s gets the gradients
/// of the same program run on one device.
#[derive(Debug, Clone)]
pub struct DTensor<const D: usize> {
    local: Tensor<D>,
    spec: DTensorSpec,
}

/// Splits `full` (the same tensor on every rank) across `mesh` with `placements`, without
/// communication: `Shard` keeps this rank's chunk, `Partial(Sum)` keeps the value on
/// coordinate 0 of the axis and zeros elsewhere, `Partial(Avg)` and `Replicate` keep it.
/// Differentiable.
pub fn distribute_tensor<const D: usize>(
    full: Tensor<D>,
    mesh: &DeviceMesh,
    placements: &[Placement],
) -> Result<DTensor<D>> {
    check_placements(placements, D, mesh)?;
    let shape = full.dims().to_vec();
    let replicated = DTensor {
        local: full,
        spec: DTensorSpec {
            mesh: mesh.clone(),
            placements: vec![Placement::Replicate; mesh.ndim()],
            shape,
        },
    };
    replicated.redistribute(placements)
}

impl<const D: usize> DTensor<D> {
    /// Wraps this rank's `local` tensor, inferring the global shape from every rank's local
    /// shape and checking that they fit the placements (one all-gather of the shapes over the
    /// mesh; every rank must call it). Fails on every rank alike if some rank's shape does
    /// not fit.
    pub fn from_local(
        local: Tensor<D>,
        mesh: &DeviceMesh,
        placements: &[Placement],
    ) -> Result<Self> {
        check_placements(placements, D, mesh)?;
        let mine: Vec<i64> = local.dims().iter().map(|&n| n as i64).collect();
        let mut all = vec![0i64; D * mesh.size()];
        record(OpKind::AllGather);
        mesh.world().all_gather(&mine, &mut all)?;
        let dims_of = |rank: usize| -> Vec<usize> {
            all[rank * D..(rank + 1) * D]
                .iter()
                .map(|&n| n as usize)
                .collect()
        };
        // A dimension's global size is the sum of the blocks of the ranks at coordinate 0 on
        // every axis that does not shard it (those blocks tile it exactly once).
        let mut shape = vec![0usize; D];
        for rank in 0..mesh.size() {
            let coords = coords_of(mesh.shape(), rank);
            let dims = dims_of(rank);
            for (d, size) in shape.iter_mut().enumerate() {
                let tiles = placements
                    .iter()
                    .enumerate()
                    .all(|(a, p)| *p == Placement::Shard(d) || coords[a] == 0);
                if tiles {
                    *size += dims[d];
                }
            }
        }
        for rank in 0..mesh.size() {
            let coords = coords_of(mesh.shape(), rank);
            let expected: Vec<usize> = blocks(&shape, placements, mesh.shape(), &coords)
                .into_iter()
                .map(|(_, n)| n)
                .collect();
            let actual = dims_of(rank);
            if expected != actual {
                return Err(DTensorError::ShapeMismatch(format!(
                    "rank {rank} (mesh coordinates {coords:?}) has a local tensor of shape \
                     {actual:?}, but placements {placements:?} of a global shape {shape:?} \
                     give it {expected:?}"
                )));
            }
        }
        Ok(Self {
            local,
            spec: DTensorSpec {
                mesh: mesh.clone(),
                placements: placements.to_vec(),
                shape,
            },
        })
    }

    /// Wraps this rank's `local` tensor of a distributed tensor of global `shape`, checking
    /// only this rank's local shape (no communication).
    pub fn from_local_with_shape(
        local: Tensor<D>,
        mesh: &DeviceMesh,
        placements: &[Placement],
        shape: [usize; D],
    ) -> Result<Self> {
        check_placements(placements, D, mesh)?;
        let spec = DTensorSpec {
            mesh: mesh.clone(),
            placements: placements.to_vec(),
            shape: shape.to_vec(),
        };
        let expected = spec.local_shape();
        if local.dims().as_slice() != expected.as_slice() {
            return Err(DTensorError::ShapeMismatch(format!(
                "the local tensor has shape {:?}, but placements {placements:?} of a global \
                 shape {shape:?} give this rank {expected:?}",
                local.dims()
            )));
        }
        Ok(Self { local, spec })
    }

    /// This rank's local tensor.
    pub fn to_local(self) -> Tensor<D> {
        self.local
    }
    /// A reference to this rank's local tensor.
    pub fn local(&self) -> &Tensor<D> {
        &self.local
    }
    /// The layout.
    pub fn spec(&self) -> &DTensorSpec {
        &self.spec
    }
    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.spec.mesh
    }
    /// One placement per mesh axis.
    pub fn placements(&self) -> &[Placement] {
        &self.spec.placements
    }
    /// The global shape.
    pub fn shape(&self) -> [usize; D] {
        let mut out = [0; D];
        out.copy_from_slice(&self.spec.shape);
        out
    }

    /// The same logical tensor with new placements, using the cheapest collectives (see
    /// [`crate::redistribute::plan`]). Differentiable.
    pub fn redistribute(&self, placements: &[Placement]) -> Result<Self> {
        check_placements(placements, D, &self.spec.mesh)?;
        let local = redistribute::execute(
            self.local.clone(),
            &self.spec.mesh,
            &self.spec.shape,
            &self.spec.placements,
            placements,
        );
        Ok(Self {
            local,
            spec: DTensorSpec {
                mesh: self.spec.mesh.clone(),
                placements: placements.to_vec(),
                shape: self.spec.shape.clone(),
            },
        })
    }

    /// The whole logical tensor on every rank (redistributes to `Replicate` on every axis).
    pub fn full_tensor(&self) -> Result<Tensor<D>> {
        let replicate = vec![Placement::Replicate; self.spec.mesh.ndim()];
        Ok(self.redistribute(&replicate)?.to_local())
    }
}
