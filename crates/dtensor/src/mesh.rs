//! [`DeviceMesh`]: an n-dimensional grid of ranks with named axes.

use crate::{DTensorError, Result};
use bonfire_comm::ProcessGroup;
use std::sync::Arc;

/// An n-dimensional mesh over a process group, with named axes and a row-major rank layout
/// (rank = Σ coordᵢ · strideᵢ, the last axis varying fastest), like PyTorch's `DeviceMesh`.
///
/// Each axis has a sub-group — the ranks that differ from this one only along that axis —
/// in which collectives for that axis run ([`DeviceMesh::group`]). Creating a mesh creates
/// those groups, so every rank of the group must create the same meshes in the same order.
/// Cheap to clone.
#[derive(Clone)]
pub struct DeviceMesh {
    inner: Arc<Inner>,
}

struct Inner {
    group: ProcessGroup,
    shape: Vec<usize>,
    names: Vec<String>,
    coords: Vec<usize>,
    axis_groups: Vec<ProcessGroup>,
}

impl std::fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMesh")
            .field("shape", &self.inner.shape)
            .field("names", &self.inner.names)
            .field("coords", &self.inner.coords)
            .field("group", &self.inner.group.name())
            .finish()
    }
}

impl PartialEq for DeviceMesh {
    /// Meshes are equal when they are clones of one another.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

fn row_major(shape: &[usize], coords: &[usize]) -> usize {
    coords.iter().zip(shape).fold(0, |acc, (c, s)| acc * s + c)
}

/// The row-major coordinates of `rank` in a grid of `shape`.
pub(crate) fn coords_of(shape: &[usize], mut rank: usize) -> Vec<usize> {
    let mut coords = vec![0; shape.len()];
    for i in (0..shape.len()).rev() {
        coords[i] = rank % shape[i];
        rank /= shape[i];
    }
    coords
}

impl DeviceMesh {
    /// A mesh of the given shape over `group` (whose size must be the product of `shape`),
    /// with one name per axis, e.g. `DeviceMesh::new(&pg, &[2, 4], &["dp", "tp"])`.
    pub fn new(group: &ProcessGroup, shape: &[usize], names: &[&str]) -> Result<Self> {
        if shape.is_empty() {
            return Err(DTensorError::InvalidMesh(
                "a mesh needs at least one axis".into(),
            ));
        }
        if names.len() != shape.len() {
            return Err(DTensorError::InvalidMesh(format!(
                "{} names for {} axes",
                names.len(),
                shape.len()
            )));
        }
        for (i, name) in names.iter().enumerate() {
            if name.is_empty() {
                return Err(DTensorError::InvalidMesh(format!(
                    "axis {i} has an empty name"
                )));
            }
            if names[..i].contains(name) {
                return Err(DTensorError::InvalidMesh(format!(
                    "duplicate axis name `{name}` in {names:?}"
                )));
            }
        }
        if let Some(i) = shape.iter().position(|&s| s == 0) {
            return Err(DTensorError::InvalidMesh(format!("axis {i} has size 0")));
        }
        let size: usize = shape.iter().product();
        if size != group.size() {
            return Err(DTensorError::MeshSizeMismatch {
                shape: shape.to_vec(),
                mesh_size: size,
                group_size: group.size(),
            });
        }
        let coords = coords_of(shape, group.rank());
        let mut axis_groups = Vec::with_capacity(shape.len());
        for axis in 0..shape.len() {
            let ranks: Vec<usize> = (0..shape[axis])
                .map(|j| {
                    let mut c = coords.clone();
                    c[axis] = j;
                    row_major(shape, &c)
                })
                .collect();
            axis_groups.push(subgroup(group, &ranks)?);
        }
        Ok(Self {
            inner: Arc::new(Inner {
                group: group.clone(),
                shape: shape.to_vec(),
                names: names.iter().map(|s| s.to_string()).collect(),
                coords,
                axis_groups,
            }),
        })
    }

    /// A one-axis mesh over the whole group.
    pub fn one_d(group: &ProcessGroup, name: &str) -> Result<Self> {
        Self::new(group, &[group.size()], &[name])
    }

    /// The size of every axis.
    pub fn shape(&self) -> &[usize] {
        &self.inner.shape
    }
    /// The axis names.
    pub fn names(&self) -> &[String] {
        &self.inner.names
    }
    /// Number of axes.
    pub fn ndim(&self) -> usize {
        self.inner.shape.len()
    }
    /// Number of ranks in the mesh.
    pub fn size(&self) -> usize {
        self.inner.group.size()
    }
    /// This rank's index in the mesh (row-major), equal to its rank in [`DeviceMesh::world`].
    pub fn rank(&self) -> usize {
        self.inner.group.rank()
    }
    /// This rank's coordinate on every axis.
    pub fn coords(&self) -> &[usize] {
        &self.inner.coords
    }
    /// The group the mesh covers.
    pub fn world(&self) -> &ProcessGroup {
        &self.inner.group
    }

    /// The index of the axis called `name`.
    pub fn axis(&self, name: &str) -> Result<usize> {
        self.inner
            .names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| DTensorError::UnknownAxis {
                name: name.into(),
                axes: self.inner.names.clone(),
            })
    }
    /// The size of the axis called `name`.
    pub fn axis_size(&self, name: &str) -> Result<usize> {
        Ok(self.inner.shape[self.axis(name)?])
    }
    /// This rank's coordinate on the axis called `name`.
    pub fn coord(&self, name: &str) -> Result<usize> {
        Ok(self.inner.coords[self.axis(name)?])
    }
    /// The group of this rank's slice along the axis called `name`: the ranks whose
    /// coordinates differ from this rank's only on that axis, ranked by their coordinate.
    pub fn group(&self, name: &str) -> Result<&ProcessGroup> {
        Ok(&self.inner.axis_groups[self.axis(name)?])
    }
    /// The group of this rank's slice along axis `axis` (by index).
    pub fn axis_group(&self, axis: usize) -> &ProcessGroup {
        &self.inner.axis_groups[axis]
    }

    /// The mesh of this rank's slice over the named axes (in the given order), the other
    /// coordinates fixed to this rank's; e.g. `mesh.submesh(&["tp"])`. Every rank must call
    /// it with the same names.
    pub fn submesh(&self, names: &[&str]) -> Result<DeviceMesh> {
        let axes: Vec<usize> = names.iter().map(|n| self.axis(n)).collect::<Result<_>>()?;
        if names.is_empty() {
            return Err(DTensorError::InvalidMesh(
                "a sub-mesh needs at least one axis".into(),
            ));
        }
        for (i, a) in axes.iter().enumerate() {
            if axes[..i].contains(a) {
                return Err(DTensorError::InvalidMesh(format!(
                    "duplicate axis name `{}` in {names:?}",
                    names[i]
                )));
            }
        }
        let shape: Vec<usize> = axes.iter().map(|&a| self.inner.shape[a]).collect();
        let size: usize = shape.iter().product();
        let ranks: Vec<usize> = (0..size)
            .map(|i| {
                let sub = coords_of(&shape, i);
                let mut c = self.inner.coords.clone();
                for (k, &a) in axes.iter().enumerate() {
                    c[a] = sub[k];
                }
                row_major(&self.inner.shape, &c)
            })
            .collect();
        let group = if axes.len() == 1 {
            self.inner.axis_groups[axes[0]].clone()
        } else {
            subgroup(&self.inner.group, &ranks)?
        };
        let coords = axes.iter().map(|&a| self.inner.coords[a]).collect();
        Ok(Self {
            inner: Arc::new(Inner {
                group,
                shape,
                names: names.iter().map(|s| s.to_string()).collect(),
                coords,
                axis_groups: axes
                    .iter()
                    .map(|&a| self.inner.axis_groups[a].clone())
                    .collect(),
            }),
        })
    }
}

/// `group` itself when `ranks` is all of it in order, else a new sub-group.
fn subgroup(group: &ProcessGroup, ranks: &[usize]) -> Result<ProcessGroup> {
    if ranks.len() == group.size() && ranks.iter().enumerate().all(|(i, &r)| i == r) {
        Ok(group.clone())
    } else {
        Ok(group.new_group(ranks)?)
    }
}
