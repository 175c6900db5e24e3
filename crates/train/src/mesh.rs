//! [`RankMesh`]: a rank's place in a layout — the layout, its mesh `[pp, dp_replicate, dp,
//! cp, tp]`, the device — and what follows from it: the groups of each axis, the data
//! replica, the expert groups, the context cut of a batch.

use crate::error::TrainError;
use bonfire_comm::ProcessGroup;
use bonfire_cp::{ContextScope, ContextSplit};
use bonfire_layout::ParallelDims;
use bonfire_parallel::Replica;
use burn::tensor::Device;

/// How a model's batches are cut for context parallelism (its
/// `ParallelModel::{sequence_length, context_batch}`).
pub(crate) struct ContextCut<B> {
    pub seq: fn(&B) -> Option<usize>,
    pub cut: fn(&B, &ContextSplit, usize) -> B,
}

impl<B> Clone for ContextCut<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for ContextCut<B> {}

/// A rank's place in a layout: the layout, its mesh `[pp, dp_replicate, dp, cp, tp]`, and the device it
/// computes on.
pub struct RankMesh {
    pub(crate) dims: ParallelDims,
    pub(crate) mesh: bonfire_dtensor::DeviceMesh,
    pub(crate) device: Device,
    /// The loss scale of the next forward/backward (dynamic loss scaling).
    pub(crate) loss_scale: f32,
    /// Gradient accumulation: the parts each replica's rows are cut into, forward and
    /// backward one at a time, reduced once (1: none).
    pub(crate) grad_accum: usize,
    /// Under expert parallelism: the ep group (consecutive ranks of dp × cp splitting the
    /// experts) and the ranks holding the same experts.
    pub(crate) experts: Option<ExpertGroups>,
}

/// Expert parallelism's two groups, carved from the flattened dp × cp group as
/// `[dp·cp/ep, ep]`, ep innermost.
#[derive(Debug, Clone)]
pub(crate) struct ExpertGroups {
    /// The ranks that split the experts and exchange tokens.
    pub ep: ProcessGroup,
    /// The ranks that hold the same experts (their gradients are reduced together).
    pub replicas: ProcessGroup,
}

impl RankMesh {
    /// The mesh `[pp, dp_replicate, dp, cp, tp]`.
    pub fn mesh(&self) -> &bonfire_dtensor::DeviceMesh {
        &self.mesh
    }
    /// The group of this rank's slice along `axis`.
    pub fn group(&self, axis: bonfire_layout::Axis) -> &ProcessGroup {
        self.mesh
            .group(axis.name())
            .expect("every axis is on the mesh")
    }
    /// This rank's coordinate on `axis`.
    pub fn coord(&self, axis: bonfire_layout::Axis) -> usize {
        self.mesh
            .coord(axis.name())
            .expect("every axis is on the mesh")
    }
    /// This rank's data-parallel replica: which rows of a global batch it trains on
    /// (dp_replicate × dp replicas, dp_replicate outermost; cp ranks share their replica's
    /// rows).
    pub fn data_replica(&self) -> Replica {
        Replica {
            index: self.coord(bonfire_layout::Axis::DpReplicate) * self.dims.dp()
                + self.coord(bonfire_layout::Axis::Dp),
            count: self.dims.data_replicas(),
        }
    }

    /// The mesh the dp wrapper averages gradients over, one axis named `dp`: dp alone, or
    /// the data-parallel axes flattened (context-parallel ranks hold the same parameters and
    /// see different tokens, so they reduce gradients together): dp × cp under ZeRO — HSDP's
    /// shard group, its replicas reduced apart ([`replicate_group`](Self::replicate_group)) —
    /// and dp_replicate × dp × cp under DDP.
    pub(crate) fn replica_mesh(&self) -> Result<bonfire_dtensor::DeviceMesh, TrainError> {
        use bonfire_layout::Axis;
        let axes: &[Axis] = if self.dims.is_hsdp() {
            &[Axis::Dp, Axis::Cp]
        } else {
            &[Axis::DpReplicate, Axis::Dp, Axis::Cp]
        };
        let names: Vec<&str> = axes
            .iter()
            .filter(|&&a| self.dims.degree(a) > 1)
            .map(|a| a.name())
            .collect();
        if names.is_empty() || names == [Axis::Dp.name()] {
            return Ok(self.mesh.clone());
        }
        let flat = self.mesh.submesh(&names)?;
        Ok(bonfire_dtensor::DeviceMesh::one_d(
            flat.world(),
            Axis::Dp.name(),
        )?)
    }

    /// Expert parallelism's groups of `dims` (`None` at ep = 1). A collective on the world.
    pub(crate) fn expert_groups(&self) -> Result<Option<ExpertGroups>, TrainError> {
        let ep = self.dims.ep();
        if ep == 1 {
            return Ok(None);
        }
        let flat = self.replica_mesh()?;
        let flat = flat.group(bonfire_layout::Axis::Dp.name())?;
        let (me, n) = (flat.rank(), flat.size());
        // Fresh groups even where one has the dp wrapper's members (ep = dp·cp): the
        // exchanges in backward must not share a sequence with the wrapper's bucket
        // all-reduces, which start whenever a bucket is ready.
        let first = me / ep * ep;
        let ep_ranks: Vec<usize> = (first..first + ep).collect();
        let replica_ranks: Vec<usize> = (me % ep..n).step_by(ep).collect();
        Ok(Some(ExpertGroups {
            ep: flat.new_group(&ep_ranks)?,
            replicas: flat.new_group(&replica_ranks)?,
        }))
    }

    /// The expert-parallel scope a forward and backward run in (`None` at ep = 1).
    pub(crate) fn expert_scope(&self) -> Option<bonfire_ep::ExpertGuard> {
        let groups = self.experts.as_ref()?;
        Some(
            bonfire_ep::ExpertScope {
                group: groups.ep.clone(),
            }
            .enter(),
        )
    }

    /// HSDP's replica group: the ranks holding this rank's ZeRO shards (its dp_replicate
    /// slice); `None` without HSDP.
    pub(crate) fn replicate_group(&self) -> Option<&ProcessGroup> {
        self.dims
            .is_hsdp()
            .then(|| self.group(bonfire_layout::Axis::DpReplicate))
    }

    /// Averages `value` (a loss already averaged over the dp wrapper's group) over HSDP's
    /// replicas too, so that it is the mean over the whole global batch. A collective on the
    /// replica group (nothing without HSDP).
    pub(crate) fn average_replicas(&self, value: &mut [f32]) -> Result<(), TrainError> {
        if let Some(g) = self.replicate_group() {
            g.all_reduce(value, bonfire_comm::ReduceOp::Avg)?;
        }
        Ok(())
    }

    /// With a cp axis: this rank's chunks of every sequence of `batch` and the context scope
    /// its forward and backward must run in (ring attention, the chunks' positions); without
    /// one, the batch itself.
    pub(crate) fn context<B: Clone>(
        &self,
        batch: &B,
        cut: ContextCut<B>,
    ) -> (B, Option<bonfire_cp::ScopeGuard>) {
        let cp = self.dims.cp();
        if cp == 1 {
            return (batch.clone(), None);
        }
        let seq = (cut.seq)(batch).expect("checked: the batch has sequences");
        let split = ContextSplit::for_training(seq, cp).expect("checked: the sequence cuts");
        let local = (cut.cut)(batch, &split, self.coord(bonfire_layout::Axis::Cp));
        let group = self.group(bonfire_layout::Axis::Cp).clone();
        (local, Some(ContextScope { group, split }.enter()))
    }

    /// `rows` (this replica's) cut into the [`grad_accum`](Self::grad_accum) equal
    /// consecutive parts, as (start, len); refused unless they divide evenly.
    pub(crate) fn accumulation_parts(
        &self,
        rows: usize,
    ) -> Result<Vec<(usize, usize)>, TrainError> {
        let k = self.grad_accum.max(1);
        if !rows.is_multiple_of(k) {
            return Err(TrainError::Recipe(format!(
                "--grad-accum {k}: each replica's {rows} rows do not split into {k} equal parts"
            )));
        }
        Ok((0..k).map(|i| (i * rows / k, rows / k)).collect())
    }

    /// Whether `local_finite` holds on every rank of the world (a collective).
    pub(crate) fn all_finite(&self, local_finite: bool) -> Result<bool, TrainError> {
        let mut bad = [u8::from(!local_finite)];
        self.mesh
            .world()
            .all_reduce(&mut bad, bonfire_comm::ReduceOp::Max)?;
        Ok(bad[0] == 0)
    }

    /// This rank's place in the dp wrapper's group (see [`replica_mesh`](Self::replica_mesh)).
    pub(crate) fn wrapper_rank(&self) -> usize {
        use bonfire_layout::Axis;
        let shard = self.coord(Axis::Dp) * self.dims.cp() + self.coord(Axis::Cp);
        match self.dims.is_hsdp() {
            true => shard,
            false => self.coord(Axis::DpReplicate) * self.dims.dp() * self.dims.cp() + shard,
        }
    }
}
