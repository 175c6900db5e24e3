//! A parameter used by two pipeline stages — a tied embedding and head (Llama 3.2, small
//! Qwens) — kept as **one parameter**: the stage of its first use owns it (its wrapper
//! reduces, clips, steps and saves it, as any other); a later stage that also multiplies by
//! it *borrows* it for the step.
//!
//! - The borrowing piece holds the module as a [`Borrowed`]: invisible to visitors and
//!   mappers, so no wrapper sees a second parameter (no inventory entry, no optimizer state,
//!   no checkpoint entry); without a pipeline (one piece list on one rank, activation
//!   checkpointing) it is the very same parameter, and autodiff sums both uses.
//! - Under a pipeline the engine [`lend`]s the owner's current values to the borrowing rank
//!   before the step's forwards; the layer reads them through [`table`] — a fresh autodiff
//!   leaf per forward while training —, each backward's gradient of those leaves is
//!   [`collect`]ed, and after the last micro-batch the engine hands their sum back to the
//!   owner ([`take_gradient`]), which adds it to its own gradient before the dp reduction.
//!
//! Lent values live per thread (a rank's thread runs its own stages), until the
//! [`LendGuard`] drops.

use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
    Param, ParamId,
};
use burn::tensor::{Device, Gradients, Tensor};
use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;

/// A module that a pipeline piece uses but does not own (see the module docs): its parameters
/// are hidden from every [`ModuleVisitor`] and [`ModuleMapper`].
#[derive(Clone, Debug)]
pub struct Borrowed<M>(M);

impl<M> Borrowed<M> {
    /// Borrows `module`, the owner's own (a clone of its parameters: same ids).
    pub fn new(module: M) -> Self {
        Self(module)
    }

    /// The borrowed module, as it was when borrowed (under a pipeline its values are stale:
    /// read them through [`table`]).
    pub fn module(&self) -> &M {
        &self.0
    }
}

impl<M: Module> Module for Borrowed<M> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.0.collect_devices(devices)
    }
    fn fork(self, device: &Device) -> Self {
        Self(self.0.fork(device))
    }
    fn to_device(self, device: &Device) -> Self {
        Self(self.0.to_device(device))
    }
    fn train(self) -> Self {
        Self(self.0.train())
    }
    fn valid(&self) -> Self {
        Self(self.0.valid())
    }
    fn materialize(self) -> Self {
        self
    }
    fn visit<V: ModuleVisitor>(&self, _visitor: &mut V) {}
    fn map<Mm: ModuleMapper>(self, _mapper: &mut Mm) -> Self {
        self
    }
}

impl<M: Module> ModuleDisplayDefault for Borrowed<M> {
    fn content(&self, content: Content) -> Option<Content> {
        content.add_formatted(&"Borrowed").optional()
    }
}
impl<M: Module> ModuleDisplay for Borrowed<M> {}

/// What the engine lent for one parameter on this thread.
struct Lent {
    value: Tensor<2>,
    /// Training: each read is a fresh leaf whose gradient [`collect`] keeps.
    track: bool,
    leaves: Vec<Tensor<2>>,
    grad: Option<Tensor<2>>,
}

thread_local! {
    static LENT: RefCell<HashMap<ParamId, Lent>> = RefCell::new(HashMap::new());
}

/// Lends `value` (the owner's current values of parameter `id`, detached, on this rank's
/// device) to this thread's [`table`] reads until the guard drops; with `track`, each read is
/// a fresh autodiff leaf and their gradients are summed ([`collect`], [`take_gradient`]).
pub fn lend(id: ParamId, value: Tensor<2>, track: bool) -> LendGuard {
    let lent = Lent {
        value,
        track,
        leaves: Vec::new(),
        grad: None,
    };
    LENT.with(|l| l.borrow_mut().insert(id, lent));
    LendGuard(id)
}

/// Returns a lent parameter when dropped (see [`lend`]).
#[must_use = "the value is lent until the guard drops"]
#[derive(Debug)]
pub struct LendGuard(ParamId);

impl Drop for LendGuard {
    fn drop(&mut self) {
        LENT.with(|l| l.borrow_mut().remove(&self.0));
    }
}

/// The values a layer multiplies by for the parameter `param`: what the engine lent for it
/// on this thread (a fresh leaf per call while training), else the parameter itself.
pub fn table(param: &Param<Tensor<2>>) -> Tensor<2> {
    let lent = LENT.with(|l| {
        let mut l = l.borrow_mut();
        let lent = l.get_mut(&param.id)?;
        let value = lent.value.clone();
        if !lent.track {
            return Some(value);
        }
        let leaf = value.detach().require_grad();
        lent.leaves.push(leaf.clone());
        Some(leaf)
    });
    lent.unwrap_or_else(|| param.val())
}

/// Takes the gradients of the lent leaves out of one backward's `grads` and adds them to
/// each parameter's sum (a forward's leaves get gradients from its own backward only).
pub fn collect(grads: &mut Gradients) {
    LENT.with(|l| {
        for lent in l.borrow_mut().values_mut() {
            let leaves = std::mem::take(&mut lent.leaves);
            for leaf in leaves {
                match leaf.grad_remove(grads) {
                    Some(g) => {
                        lent.grad = Some(match lent.grad.take() {
                            Some(sum) => sum + g,
                            None => g,
                        })
                    }
                    None => lent.leaves.push(leaf),
                }
            }
        }
    });
}

/// The sum of the gradients [`collect`]ed for lent parameter `id` since it was lent (`None`
/// when no backward reached it).
pub fn take_gradient(id: ParamId) -> Option<Tensor<2>> {
    LENT.with(|l| {
        l.borrow_mut()
            .get_mut(&id)
            .and_then(|lent| lent.grad.take())
    })
}

/// Parameter `id` of `module` (a clone, lazy where the module's is), if it holds a 2-d float
/// parameter with that id.
pub fn find<M: Module>(module: &M, id: ParamId) -> Option<Param<Tensor<2>>> {
    struct Find {
        id: ParamId,
        found: Option<Param<Tensor<2>>>,
    }
    impl ModuleVisitor for Find {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.id == self.id && self.found.is_none() {
                let any: &dyn Any = param;
                self.found = any.downcast_ref::<Param<Tensor<2>>>().cloned();
            }
        }
    }
    let mut f = Find { id, found: None };
    module.visit(&mut f);
    f.found
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    #[test]
    fn borrowed_modules_are_invisible_and_lent_reads_collect_their_gradients() {
        let dev = Device::flex().autodiff();
        let p = Param::from_tensor(Tensor::<2>::ones([2, 3], &dev)).set_require_grad(true);
        let borrowed = Borrowed::new(p.clone());
        assert!(crate::params::inventory(&borrowed).is_empty());
        assert!(find(&borrowed, p.id).is_none());
        assert!(find(&p, p.id).is_some());
        // Not lent: the parameter itself.
        assert_eq!(table(&p).into_data(), p.val().into_data());
        let lent = Tensor::<2>::from_data(TensorData::new(vec![2f32; 6], [2, 3]), &dev);
        let guard = lend(p.id, lent, true);
        // Two forwards (micro-batches), two backwards: the gradients summed.
        for k in [1f32, 3.0] {
            let y = table(borrowed.module()).mul_scalar(k).sum();
            collect(&mut y.backward());
        }
        let g = take_gradient(p.id).expect("gradient");
        assert_eq!(g.into_data().try_into_vec::<f32>().unwrap(), vec![4f32; 6]);
        drop(guard);
        assert_eq!(table(&p).into_data(), p.val().into_data());
    }
}
