//! The parameters expert parallelism splits: [`shard_experts`] keeps a rank's `E/ep` experts
//! of every parameter stacked by expert (dimension 0), and [`expert_subgroup`] tells a
//! data-parallel engine which parameters those are and over which ranks their gradients are
//! reduced — the ranks holding the same experts, not the whole dp × cp group.

use bonfire_comm::ProcessGroup;
use bonfire_dtensor::{DTensorError, Result};
use bonfire_module::Subgroup;
use bonfire_module::params::inventory;
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::Tensor;
use std::collections::HashSet;

/// The [`Subgroup`] of a rank's expert parameters `ids` (from [`shard_experts`]): the ranks
/// that hold the same experts are `replicas` (the expert-data-parallel group, `dp·cp/ep`
/// ranks), and a data-parallel engine reduces the experts' gradients over them.
///
/// A rank's expert gradient already sums every token routed to its experts from the whole
/// ep group (the exchange's backward brings them back), so the mean over all `dp·cp`
/// data-parallel ranks is the sum over `replicas` divided by `dp·cp`: their average scaled
/// by `1/ep` ([`Subgroup::grad_scale`]).
pub fn expert_subgroup(ids: HashSet<ParamId>, replicas: ProcessGroup, ep: usize) -> Subgroup {
    Subgroup {
        ids,
        replicas,
        grad_scale: 1.0 / ep as f32,
    }
}

/// Whether `path` is `prefix` or inside it.
fn under(path: &str, prefix: &str) -> bool {
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('.'))
}

/// The ids and expert counts of `module`'s parameters under any of the module paths
/// `experts` (each stacked by expert along dimension 0).
fn expert_params<M: Module>(module: &M, experts: &[String]) -> Vec<(ParamId, String, usize)> {
    inventory(module)
        .into_iter()
        .filter(|p| experts.iter().any(|e| under(&p.path, e)))
        .map(|p| (p.id, p.path, p.shape.first().copied().unwrap_or(0)))
        .collect()
}

/// Checks that every parameter under the module paths `experts` splits over `ep` ranks
/// (its experts, dimension 0, divisible by `ep`) and that there is one; returns how many
/// parameters there are.
pub fn check_experts<M: Module>(module: &M, experts: &[String], ep: usize) -> Result<usize> {
    let found = expert_params(module, experts);
    if found.is_empty() {
        return Err(DTensorError::InvalidArgument(format!(
            "no parameter under the expert modules {experts:?}"
        )));
    }
    if let Some((_, path, e)) = found.iter().find(|(_, _, e)| e % ep != 0) {
        return Err(DTensorError::InvalidArgument(format!(
            "`{path}` holds {e} experts, which do not split over ep={ep}: give a number of \
             experts divisible by ep"
        )));
    }
    Ok(found.len())
}

/// `module` with every parameter under the module paths `experts` cut to rank `rank`'s
/// experts out of `ep` (`rank·E/ep .. (rank+1)·E/ep` along dimension 0; same ids), and
/// their ids. Call [`check_experts`] first.
pub fn shard_experts<M: Module>(
    module: M,
    experts: &[String],
    rank: usize,
    ep: usize,
) -> (M, HashSet<ParamId>) {
    struct Narrow {
        cut: std::collections::HashMap<ParamId, usize>,
        rank: usize,
    }
    impl ModuleMapper for Narrow {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&local) = self.cut.get(&param.id) else {
                return param;
            };
            let (id, old, mapper) = param.consume();
            let require_grad = old.is_require_grad();
            let mut new = old.narrow(0, self.rank * local, local).detach();
            if require_grad {
                new = new.require_grad();
            }
            Param::from_mapped_value(id, new, mapper)
        }
    }
    let cut: std::collections::HashMap<ParamId, usize> = expert_params(&module, experts)
        .into_iter()
        .map(|(id, _, e)| (id, e / ep))
        .collect();
    let ids = cut.keys().copied().collect();
    (module.map(&mut Narrow { cut, rank }), ids)
}
