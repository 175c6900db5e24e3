//! Whole parameters from any layout: a rank's values are its tensor-parallel shards of the
//! parameters of its pipeline stages; [`ModelLayout`] knows which model parameter each is and
//! along which dimension it is split, gathers the shards over tp and, under a pipeline,
//! assembles the stages' parameters over the world in the model's order. Under expert
//! parallelism the expert parameters are gathered over the ep group along their experts.

use crate::error::TrainError;
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_module::params::{self, ParamInfo, ParamValues};
use bonfire_tp::sharded_params;
use burn::module::Module;

/// The model's parameters as the ranks hold them: this rank's (tensor-parallel) inventory, in
/// model order, and the dimension each one is sharded along over tp.
#[derive(Debug, Clone)]
pub(crate) struct ModelLayout {
    pub infos: Vec<ParamInfo>,
    /// The model's state tensors (parameters without gradient), in model order: whole on
    /// every rank holding them (no plan shards them, no wrapper partitions them).
    pub buffers: Vec<ParamInfo>,
    shard_dims: Vec<Option<usize>>,
    /// Whether each parameter holds this rank's slice of the experts (dimension 0), split
    /// over `ep` ranks.
    experts: Vec<bool>,
    ep: usize,
}

impl ModelLayout {
    /// The layout of `model` as this rank holds it (after tensor parallelism).
    pub fn of<M: Module>(model: &M) -> Self {
        let infos = params::inventory(model);
        let sharded = sharded_params(model);
        let shard_dims = infos
            .iter()
            .map(|p| sharded.get(&p.path).copied())
            .collect();
        let experts = vec![false; infos.len()];
        Self {
            buffers: params::buffers(model),
            infos,
            shard_dims,
            experts,
            ep: 1,
        }
    }

    /// The layout with the parameters `ids` holding a slice of the experts out of `ep`.
    pub fn with_experts(
        mut self,
        ids: &std::collections::HashSet<burn::module::ParamId>,
        ep: usize,
    ) -> Self {
        self.experts = self.infos.iter().map(|p| ids.contains(&p.id)).collect();
        self.ep = ep;
        self
    }

    /// The dimension parameter `i` is split along over tp (`None`: replicated on tp).
    pub fn shard_dim(&self, i: usize) -> Option<usize> {
        self.shard_dims[i]
    }

    /// Whether parameter `i` holds a slice of the experts (split over ep along dimension 0).
    pub fn is_expert(&self, i: usize) -> bool {
        self.experts[i]
    }

    /// Every parameter's path and whole shape, in model order, on a tp axis of `tp` ranks.
    pub fn whole_params(&self, tp: usize) -> Vec<(String, Vec<usize>)> {
        (0..self.infos.len())
            .map(|i| (self.infos[i].path.clone(), self.whole_shape(i, tp)))
            .collect()
    }

    /// Parameter `i`'s whole shape.
    pub fn whole_shape(&self, i: usize, tp: usize) -> Vec<usize> {
        let mut shape = self.infos[i].shape.clone();
        if let Some(d) = self.shard_dims[i] {
            shape[d] *= tp;
        }
        if self.experts[i] {
            shape[0] *= self.ep;
        }
        shape
    }

    /// Parameter `i`'s whole values from this rank's `local` ones (a collective on `tp`
    /// where it is sharded, on `ep` for an expert parameter).
    fn whole(
        &self,
        i: usize,
        local: Vec<f32>,
        tp: &ProcessGroup,
        ep: Option<&ProcessGroup>,
    ) -> Result<Vec<f32>, TrainError> {
        match (self.shard_dims[i], ep) {
            (Some(dim), _) if tp.size() > 1 => {
                Ok(params::unshard(&local, &self.infos[i].shape, dim, tp)?)
            }
            (_, Some(ep)) if self.experts[i] => {
                Ok(params::unshard(&local, &self.infos[i].shape, 0, ep)?)
            }
            _ => Ok(local),
        }
    }

    /// Every parameter whole, from every parameter's local values in model order (replicas:
    /// each rank holds all of them; under expert parallelism `ep` gathers the experts).
    pub fn whole_all(
        &self,
        local: Vec<ParamValues>,
        tp: &ProcessGroup,
        ep: Option<&ProcessGroup>,
    ) -> Result<Vec<ParamValues>, TrainError> {
        self.check_count(local.len(), self.infos.len())?;
        local
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                Ok(ParamValues {
                    path: self.infos[i].path.clone(),
                    shape: self.whole_shape(i, tp.size()),
                    values: self.whole(i, p.values, tp, ep)?,
                })
            })
            .collect()
    }

    /// Every parameter whole when each rank holds some of them (`local[k]` is model parameter
    /// `indices[k]`): gathered over tp (and the experts over `ep`), then summed over `world`
    /// with one contribution per parameter (`contributes` on exactly one rank holding it). A
    /// collective on all of them.
    pub fn whole_assembled(
        &self,
        local: Vec<ParamValues>,
        indices: &[usize],
        contributes: bool,
        tp: &ProcessGroup,
        ep: Option<&ProcessGroup>,
        world: &ProcessGroup,
    ) -> Result<Vec<ParamValues>, TrainError> {
        self.check_count(local.len(), indices.len())?;
        let tp_size = tp.size();
        let sizes: Vec<usize> = (0..self.infos.len())
            .map(|i| self.whole_shape(i, tp_size).iter().product())
            .collect();
        let mut pieces = Vec::with_capacity(indices.len());
        for (p, &i) in local.into_iter().zip(indices) {
            pieces.push((i, self.whole(i, p.values, tp, ep)?));
        }
        let summed = sum_over_world(&sizes, pieces, contributes, world)?;
        Ok(summed
            .into_iter()
            .enumerate()
            .map(|(i, values)| ParamValues {
                path: self.infos[i].path.clone(),
                shape: self.whole_shape(i, tp_size),
                values,
            })
            .collect())
    }

    /// The model's state tensors whole, in model order, from this rank's `local` ones
    /// (`local[k]` is state tensor `indices[k]`): as they are when the rank holds every one
    /// (`world` `None`), else summed over the world with one contribution per tensor (the
    /// flag on exactly one rank holding it). A collective on the world then.
    pub fn whole_buffers(
        &self,
        local: Vec<Vec<f32>>,
        indices: &[usize],
        world: Option<(&ProcessGroup, bool)>,
    ) -> Result<Vec<ParamValues>, TrainError> {
        self.check_count(local.len(), indices.len())?;
        let named = |i: usize, values: Vec<f32>| ParamValues {
            path: self.buffers[i].path.clone(),
            shape: self.buffers[i].shape.clone(),
            values,
        };
        let pieces = indices.iter().copied().zip(local);
        let Some((world, contributes)) = world else {
            return Ok(pieces.map(|(i, v)| named(i, v)).collect());
        };
        let sizes: Vec<usize> = self.buffers.iter().map(ParamInfo::numel).collect();
        let summed = sum_over_world(&sizes, pieces.collect(), contributes, world)?;
        Ok(summed
            .into_iter()
            .enumerate()
            .map(|(i, v)| named(i, v))
            .collect())
    }

    fn check_count(&self, got: usize, want: usize) -> Result<(), TrainError> {
        if got == want {
            Ok(())
        } else {
            Err(TrainError::Model(format!(
                "the wrapper holds {got} parameters where the layout expects {want}"
            )))
        }
    }
}

/// Tensors of `sizes` (every one of the model's) from the ranks that hold them: this rank's
/// `pieces` (tensor index, whole values) placed in one flat vector when it `contributes`
/// (zeros elsewhere) and summed over `world`, so that each tensor is the one rank's that
/// contributes it. A collective on `world`.
fn sum_over_world(
    sizes: &[usize],
    pieces: Vec<(usize, Vec<f32>)>,
    contributes: bool,
    world: &ProcessGroup,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let mut offsets = vec![0usize];
    for n in sizes {
        offsets.push(offsets.last().unwrap() + n);
    }
    let mut flat = vec![0.0f32; *offsets.last().unwrap()];
    if contributes {
        for (i, values) in pieces {
            flat[offsets[i]..offsets[i + 1]].copy_from_slice(&values);
        }
    }
    world.all_reduce(&mut flat, ReduceOp::Sum)?;
    Ok(offsets
        .windows(2)
        .map(|w| flat[w[0]..w[1]].to_vec())
        .collect())
}
