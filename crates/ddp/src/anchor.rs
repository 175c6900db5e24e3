//! [`anchor`]: how a model tells DDP where its layers are, so gradients can be reduced while
//! backward is still running.
//!
//! A model calls `let layer = bonfire_ddp::anchor(&self.layer, &x);` and then runs
//! `layer.forward(x)`. Outside a DDP step this is a cheap clone. Inside
//! [`crate::DistributedDataParallel::forward`] each parameter of the returned copy carries a
//! gradient hook anchored at `x` (see [`crate::hook`]), which fires right after the layer's
//! backward and hands the gradient to the step's bucket. Models that never call `anchor` still
//! train correctly under DDP; they only lose the overlap.

use crate::hook::{GradHook, hooked};
use crate::reducer::SharedReducer;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, Tensor};
use std::cell::RefCell;
use std::sync::Arc;

thread_local! {
    /// The reducer of the DDP step running its forward on this (rank) thread.
    static ACTIVE: RefCell<Option<SharedReducer>> = const { RefCell::new(None) };
}

/// Makes `reducer` the target of [`anchor`] on this thread until the guard drops.
pub(crate) fn activate(reducer: SharedReducer) -> ActiveGuard {
    ACTIVE.with(|a| *a.borrow_mut() = Some(reducer));
    ActiveGuard
}

pub(crate) struct ActiveGuard;

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        ACTIVE.with(|a| *a.borrow_mut() = None);
    }
}

/// `module`, with DDP gradient hooks anchored at `input` when a DDP step is recording on this
/// thread (otherwise an ordinary clone). Call it on each layer (or block) with that layer's
/// input, and run the returned copy.
pub fn anchor<M: Module, const A: usize>(module: &M, input: &Tensor<A>) -> M {
    let Some(reducer) = ACTIVE.with(|a| a.borrow().clone()) else {
        return module.clone();
    };
    let mut mapper = AnchorMapper {
        reducer,
        anchor: input.clone(),
    };
    module.clone().map(&mut mapper)
}

struct AnchorMapper<const A: usize> {
    reducer: SharedReducer,
    anchor: Tensor<A>,
}

impl<const A: usize> ModuleMapper for AnchorMapper<A> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let index = {
            let mut guard = self.reducer.lock().unwrap();
            let Some(r) = guard.as_mut() else {
                return param;
            };
            let i = r.index.get(&param.id).copied();
            if let Some(i) = i
                && param.is_require_grad()
            {
                r.expect(i);
                Some(i)
            } else {
                None
            }
        };
        let Some(i) = index else {
            return param;
        };
        let reducer = self.reducer.clone();
        let hook = GradHook(Arc::new(move |data| {
            let grad = if data.dtype() == DType::F32 {
                data.try_into_vec::<f32>().expect("f32 gradient")
            } else {
                data.convert::<f32>()
                    .try_into_vec::<f32>()
                    .expect("f32 gradient")
            };
            // A hook firing after its step finished (a stale graph) has nowhere to go.
            if let Some(r) = reducer.lock().unwrap().as_mut() {
                r.deposit(i, &grad);
            }
        }));
        let (id, value, mapper) = param.consume();
        Param::from_mapped_value(id, hooked(value, &self.anchor, hook), mapper)
    }
}
