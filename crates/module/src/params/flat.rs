//! A module's parameters as one flat tensor on their device, and back: what data-parallel
//! wrappers broadcast, average and shard without leaving the device.

use super::{ParamInfo, index_of, offsets_of};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use std::collections::HashMap;

/// Every parameter of `infos`, flattened and concatenated in order, on the parameters' device
/// (detached: a value, not a node of any graph).
pub fn flat<M: Module>(module: &M, infos: &[ParamInfo]) -> Tensor<1> {
    struct Collect {
        index: HashMap<ParamId, usize>,
        parts: Vec<Option<Tensor<1>>>,
    }
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(&i) = self.index.get(&param.id) {
                self.parts[i] = Some(param.val().detach().flatten::<1>(0, D - 1));
            }
        }
    }
    let mut c = Collect {
        index: index_of(infos),
        parts: vec![None; infos.len()],
    };
    module.visit(&mut c);
    let parts: Vec<Tensor<1>> = c
        .parts
        .into_iter()
        .map(|p| p.expect("every parameter of the inventory is in the module"))
        .collect();
    Tensor::cat(parts, 0)
}

/// `module` with every parameter of `infos` replaced by its slice of `flat` (same id, same
/// `require_grad`; the autodiff strategy of `flat`'s device).
pub fn assign_flat<M: Module>(module: M, infos: &[ParamInfo], flat: &Tensor<1>) -> M {
    struct Assign<'a> {
        index: HashMap<ParamId, usize>,
        offsets: Vec<usize>,
        infos: &'a [ParamInfo],
        flat: &'a Tensor<1>,
    }
    impl ModuleMapper for Assign<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&i) = self.index.get(&param.id) else {
                return param;
            };
            let (id, old, mapper) = param.consume();
            let require_grad = old.is_require_grad();
            drop(old);
            let (start, end) = (self.offsets[i], self.offsets[i + 1]);
            let dims: [usize; D] = self.infos[i].shape.clone().try_into().expect("rank");
            let mut new = self
                .flat
                .clone()
                .narrow(0, start, end - start)
                .reshape(dims);
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

/// The optimizer's gradients of `module` from a flat gradient tensor laid out like [`flat`]
/// (each parameter's slice, reshaped, registered under its id).
pub fn grads_from_flat<M: Module>(
    module: &M,
    infos: &[ParamInfo],
    flat: &Tensor<1>,
) -> GradientsParams {
    let offsets = offsets_of(infos);
    grads_from_parts(module, infos, |i| {
        Some(
            flat.clone()
                .narrow(0, offsets[i], offsets[i + 1] - offsets[i]),
        )
    })
}

/// The optimizer's gradients of `module`: `part(i)` is parameter i's flat gradient (or
/// `None`), reshaped and registered under its id.
pub fn grads_from_parts<M: Module>(
    module: &M,
    infos: &[ParamInfo],
    part: impl FnMut(usize) -> Option<Tensor<1>>,
) -> GradientsParams {
    struct Build<'a, F> {
        index: HashMap<ParamId, usize>,
        infos: &'a [ParamInfo],
        part: F,
        out: GradientsParams,
    }
    impl<F: FnMut(usize) -> Option<Tensor<1>>> ModuleVisitor for Build<'_, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(&i) = self.index.get(&param.id)
                && let Some(g) = (self.part)(i)
            {
                let dims: [usize; D] = self.infos[i].shape.clone().try_into().expect("rank");
                self.out.register::<D>(param.id, g.reshape(dims));
            }
        }
    }
    let mut b = Build {
        index: index_of(infos),
        infos,
        part,
        out: GradientsParams::new(),
    };
    module.visit(&mut b);
    b.out
}

/// Takes the gradient of each parameter of `infos` out of `grads`, flattened, on its device
/// (`None` where a parameter got no gradient).
pub fn take_flat_grads<M: Module>(
    module: &M,
    infos: &[ParamInfo],
    grads: &mut GradientsParams,
) -> Vec<Option<Tensor<1>>> {
    struct Take<'a> {
        index: HashMap<ParamId, usize>,
        grads: &'a mut GradientsParams,
        out: Vec<Option<Tensor<1>>>,
    }
    impl ModuleVisitor for Take<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(&i) = self.index.get(&param.id)
                && let Some(g) = self.grads.remove::<D>(param.id)
            {
                self.out[i] = Some(g.flatten::<1>(0, D - 1));
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
