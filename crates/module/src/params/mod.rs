//! A module's parameters as the data-parallel strategies see them (DDP, ZeRO): a flat,
//! ordered inventory (visit order, dotted paths, shapes), the parameters and their gradients
//! as one flat tensor on their device in that order ([`flat`], [`assign_flat`],
//! [`take_flat_grads`], [`grads_from_parts`]), and host copies for the user (exports, counted
//! by the transfer ledger). It lives here, below the strategies, so that they share one
//! definition of "the parameter order" — the order every rank must agree on — and one way of
//! agreeing on it ([`sync_from_root`]: every rank checks it holds the same parameters, then
//! takes the root's values, broadcast on the device). [`seeded`] draws a model's parameters
//! reproducibly, whatever draws beside it ([`normal`]: draws from an explicit generator there).

mod draw;
mod flat;
mod sync;

pub use draw::{normal, seeded};
pub use flat::{assign_flat, flat, grads_from_flat, grads_from_parts, take_flat_grads};

pub use sync::{check_same, model_device, sync_from_root, sync_from_root_with};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use std::collections::HashMap;

/// One trainable parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamInfo {
    /// The parameter's Burn id.
    pub id: ParamId,
    /// Dotted path, e.g. `blocks.0.attn.q.weight`.
    pub path: String,
    /// The parameter tensor's dims.
    pub shape: Vec<usize>,
}

impl ParamInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A parameter's values on the host, whole, under its dotted path: what a wrapper hands back
/// when asked for a model's parameters or gradients (to compare, export or evaluate).
#[derive(Debug, Clone, PartialEq)]
pub struct ParamValues {
    /// Dotted path, e.g. `blocks.0.attn.q.weight`.
    pub path: String,
    /// The parameter tensor's dims.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub values: Vec<f32>,
}

/// `flat` (values of every parameter of `infos`, concatenated in order) cut into named
/// parameters.
pub fn named(infos: &[ParamInfo], flat: &[f32]) -> Vec<ParamValues> {
    let offsets = offsets_of(infos);
    infos
        .iter()
        .enumerate()
        .map(|(i, p)| ParamValues {
            path: p.path.clone(),
            shape: p.shape.clone(),
            values: flat[offsets[i]..offsets[i + 1]].to_vec(),
        })
        .collect()
}

/// Every float parameter that requires a gradient, in the module's visit order.
pub fn inventory<M: Module>(module: &M) -> Vec<ParamInfo> {
    floats(module, |trainable| trainable)
}

/// Every float parameter that requires no gradient — a model's state, not trained (DeepSeek's
/// balancing bias) — in the module's visit order: the wrappers and the optimizer leave them
/// alone; checkpoints, exports and imports carry them.
pub fn buffers<M: Module>(module: &M) -> Vec<ParamInfo> {
    floats(module, |trainable| !trainable)
}

/// Every float parameter, trained or state ([`inventory`] and [`buffers`] together), in the
/// module's visit order: what a whole model's file holds.
pub fn all_tensors<M: Module>(module: &M) -> Vec<ParamInfo> {
    floats(module, |_| true)
}

/// The state tensors of `module` ([`buffers`]) with their values on the host (an export).
pub fn buffer_values<M: Module>(module: &M) -> Vec<(ParamInfo, Vec<f32>)> {
    let infos = buffers(module);
    if infos.is_empty() {
        return Vec::new();
    }
    let values = named(&infos, &flatten_values(module, &infos));
    infos
        .into_iter()
        .zip(values)
        .map(|(info, p)| (info, p.values))
        .collect()
}

/// `module` with its state tensors ([`buffers`], in that order) set to `values` (same ids,
/// devices and dtypes: an import).
pub fn assign_buffers<M: Module>(module: M, values: &[Vec<f32>]) -> M {
    struct Assign<'a> {
        index: HashMap<ParamId, usize>,
        values: &'a [Vec<f32>],
    }
    impl ModuleMapper for Assign<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&i) = self.index.get(&param.id) else {
                return param;
            };
            let (id, old, mapper) = param.consume();
            let (dims, dtype, device) = (old.dims(), old.dtype(), old.device());
            drop(old);
            let reason = bonfire_dtensor::plane::ledger::Reason::Export;
            let values = self.values[i].clone();
            let new = bonfire_dtensor::plane::from_host(values, dims, &device, reason);
            Param::from_mapped_value(id, new.cast(dtype), mapper)
        }
    }
    let infos = buffers(&module);
    assert_eq!(infos.len(), values.len(), "one value per state tensor");
    module.map(&mut Assign {
        index: index_of(&infos),
        values,
    })
}

/// The float parameters whose `require_grad` `keep` accepts, in visit order.
fn floats<M: Module>(module: &M, keep: fn(bool) -> bool) -> Vec<ParamInfo> {
    struct Inventory {
        path: Vec<String>,
        out: Vec<ParamInfo>,
        keep: fn(bool) -> bool,
    }
    impl ModuleVisitor for Inventory {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !(self.keep)(param.is_require_grad()) {
                return;
            }
            self.out.push(ParamInfo {
                id: param.id,
                path: self.path.join("."),
                shape: param.lazy_shape().to_vec(),
            });
        }
    }
    let mut v = Inventory {
        path: Vec::new(),
        out: Vec::new(),
        keep,
    };
    module.visit(&mut v);
    v.out
}

/// A tensor's values as `f32` on the host, to hand to the user (counted in the transfer
/// ledger as an export where the device is not host memory).
pub fn to_host<const D: usize>(tensor: Tensor<D>) -> Vec<f32> {
    bonfire_dtensor::plane::to_host(tensor, bonfire_dtensor::plane::ledger::Reason::Export)
}

/// The values of every parameter of `infos`, concatenated in order, on the host (an export:
/// see [`flat`] for the device tensor).
pub fn flatten_values<M: Module>(module: &M, infos: &[ParamInfo]) -> Vec<f32> {
    to_host(flat(module, infos))
}

/// `module` with every parameter of `infos` replaced by its slice of the host values `flat`
/// (same device, same `require_grad`, same [`ParamId`]): an import, see [`assign_flat`] for a
/// device tensor.
pub fn assign_values<M: Module>(module: M, infos: &[ParamInfo], flat: &[f32]) -> M {
    let Some(device) = model_device(&module) else {
        return module;
    };
    let reason = bonfire_dtensor::plane::ledger::Reason::Export;
    let t = bonfire_dtensor::plane::from_host(flat.to_vec(), [flat.len()], &device, reason);
    assign_flat(module, infos, &t)
}

/// `module` with fresh autodiff leaves on `device` (same ids and `require_grad`), like
/// [`Module::fork`], except that the parameters also take `device`'s gradient-checkpointing
/// strategy: `fork` keeps the strategy a parameter was created with, so a model built on a
/// plain autodiff device and forked onto a checkpointing one would still mix strategies with
/// inputs created there (Burn panics on such an operation).
pub fn fork<M: Module>(module: M, device: &burn::tensor::Device) -> M {
    struct Fork<'a>(&'a burn::tensor::Device);
    impl ModuleMapper for Fork<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, old, mapper) = param.consume();
            let require_grad = old.is_require_grad();
            let mut new =
                bonfire_dtensor::autodiff::with_context_of(old.to_device(self.0).detach(), self.0);
            if require_grad {
                new = new.require_grad();
            }
            Param::from_mapped_value(id, new, mapper)
        }
    }
    module.map(&mut Fork(device))
}

/// The whole row-major tensor from this rank's shard `values` (of local `shape`), split
/// evenly along `dim` over `group`: an all-gather then an interleave — the host form of
/// `DTensor::full_tensor`, to export tensor-parallel parameters and gradients. A collective.
pub fn unshard(
    values: &[f32],
    shape: &[usize],
    dim: usize,
    group: &bonfire_comm::ProcessGroup,
) -> bonfire_dtensor::Result<Vec<f32>> {
    let n = group.size();
    let mut all = vec![0f32; values.len() * n];
    group.all_gather(values, &mut all)?;
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim..].iter().product();
    let mut full = Vec::with_capacity(all.len());
    for o in 0..outer {
        for r in 0..n {
            let part = &all[r * values.len()..(r + 1) * values.len()];
            full.extend_from_slice(&part[o * inner..(o + 1) * inner]);
        }
    }
    Ok(full)
}

/// Parameter id → its position in `infos`.
pub fn index_of(infos: &[ParamInfo]) -> HashMap<ParamId, usize> {
    infos.iter().enumerate().map(|(i, p)| (p.id, i)).collect()
}

/// Start offset of every parameter in the flat vector (plus the total at the end).
pub fn offsets_of(infos: &[ParamInfo]) -> Vec<usize> {
    let mut offsets = Vec::with_capacity(infos.len() + 1);
    let mut at = 0;
    offsets.push(0);
    for p in infos {
        at += p.numel();
        offsets.push(at);
    }
    offsets
}
