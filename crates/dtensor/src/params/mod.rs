//! A module's parameters as the data-parallel strategies see them (DDP, ZeRO): a flat,
//! ordered inventory (visit order, dotted paths, shapes), and host copies of values and
//! gradients in that order. It lives here, below the strategies, so that they share one
//! definition of "the parameter order" — the order every rank must agree on — and one way of
//! agreeing on it ([`sync`]: every rank checks it holds the same parameters, then takes the
//! root's values).

mod sync;

pub use sync::{check_same, model_device, sync_from_root};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use std::collections::HashMap;

/// One trainable parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamInfo {
    pub id: ParamId,
    /// Dotted path, e.g. `blocks.0.attn.q.weight`.
    pub path: String,
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
    struct Inventory {
        path: Vec<String>,
        out: Vec<ParamInfo>,
    }
    impl ModuleVisitor for Inventory {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
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
    };
    module.visit(&mut v);
    v.out
}

/// A tensor's values as `f32` on the host.
pub fn to_host<const D: usize>(tensor: Tensor<D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("an f32 tensor")
}

/// The values of every parameter of `infos`, concatenated in order.
pub fn flatten_values<M: Module>(module: &M, infos: &[ParamInfo]) -> Vec<f32> {
    struct Values<'a> {
        index: HashMap<ParamId, usize>,
        offsets: Vec<usize>,
        out: &'a mut [f32],
    }
    impl ModuleVisitor for Values<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(&i) = self.index.get(&param.id) {
                let v = to_host(param.val());
                self.out[self.offsets[i]..self.offsets[i] + v.len()].copy_from_slice(&v);
            }
        }
    }
    let offsets = offsets_of(infos);
    let mut out = vec![0.0; offsets.last().copied().unwrap_or(0)];
    module.visit(&mut Values {
        index: index_of(infos),
        offsets,
        out: &mut out,
    });
    out
}

/// `module` with every parameter of `infos` replaced by its slice of `flat` (same device,
/// same `require_grad`, same [`ParamId`]).
pub fn assign_values<M: Module>(module: M, infos: &[ParamInfo], flat: &[f32]) -> M {
    struct Assign<'a> {
        index: HashMap<ParamId, usize>,
        offsets: Vec<usize>,
        infos: &'a [ParamInfo],
        flat: &'a [f32],
    }
    impl ModuleMapper for Assign<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&i) = self.index.get(&param.id) else {
                return param;
            };
            let (id, old, mapper) = param.consume();
            let device = old.device();
            let require_grad = old.is_require_grad();
            let values = self.flat[self.offsets[i]..self.offsets[i + 1]].to_vec();
            let data = TensorData::new(values, self.infos[i].shape.clone());
            let mut new = Tensor::<D>::from_data(data, &device);
            if require_grad {
                new = new.require_grad();
            }
            Param::from_mapped_value(id, new, mapper)
        }
    }
    module.map(&mut Assign {
        index: index_of(infos),
        offsets: offsets_of(infos),
        infos,
        flat,
    })
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
            let mut new = old.to_device(self.0).detach();
            if let Some(strategy) = self.0.gradient_checkpointing_strategy() {
                new = new
                    .autodiff()
                    .with_gradient_checkpointing_strategy(strategy);
            }
            if require_grad {
                new = new.require_grad();
            }
            Param::from_mapped_value(id, new, mapper)
        }
    }
    module.map(&mut Fork(device))
}

/// Takes the gradient of each parameter of `infos` out of `grads` onto the host
/// (`None` where a parameter got no gradient).
pub fn take_grads<M: Module>(
    module: &M,
    infos: &[ParamInfo],
    grads: &mut GradientsParams,
) -> Vec<Option<Vec<f32>>> {
    struct Take<'a> {
        index: HashMap<ParamId, usize>,
        grads: &'a mut GradientsParams,
        out: Vec<Option<Vec<f32>>>,
    }
    impl ModuleVisitor for Take<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(&i) = self.index.get(&param.id)
                && let Some(g) = self.grads.remove::<D>(param.id)
            {
                self.out[i] = Some(to_host(g));
            }
        }
    }
    let mut take = Take {
        index: index_of(infos),
        grads,
        out: vec![None; infos.len()],
    };
    module.visit(&mut take);
    take.out
}

/// Gradients for the optimizer, built from host buffers (`values(i)` is parameter i's).
pub fn grads_from_host<'a, M: Module>(
    module: &M,
    infos: &[ParamInfo],
    values: impl Fn(usize) -> &'a [f32],
) -> GradientsParams {
    struct Build<'a, F> {
        index: HashMap<ParamId, usize>,
        infos: &'a [ParamInfo],
        values: F,
        out: GradientsParams,
    }
    impl<'b, F: Fn(usize) -> &'b [f32]> ModuleVisitor for Build<'_, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(&i) = self.index.get(&param.id) {
                let device = param.lazy_device().inner();
                let data = TensorData::new((self.values)(i).to_vec(), self.infos[i].shape.clone());
                self.out
                    .register::<D>(param.id, Tensor::<D>::from_data(data, &device));
            }
        }
    }
    let mut build = Build {
        index: index_of(infos),
        infos,
        values,
        out: GradientsParams::new(),
    };
    module.visit(&mut build);
    build.out
}

/// The whole row-major tensor from this rank's shard `values` (of local `shape`), split
/// evenly along `dim` over `group`: an all-gather then an interleave — the host form of
/// `DTensor::full_tensor`, to export tensor-parallel parameters and gradients. A collective.
pub fn unshard(
    values: &[f32],
    shape: &[usize],
    dim: usize,
    group: &bonfire_comm::ProcessGroup,
) -> crate::Result<Vec<f32>> {
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
