//! DDP's [`LayerHook`]: how the layers a model enters through [`bonfire_dtensor::layer`] get
//! their gradients reduced while backward is still running.
//!
//! A model writes `bonfire_dtensor::layer(&self.attn, &x).forward(x)`. Inside
//! [`crate::DistributedDataParallel::forward`] each parameter of that copy carries a gradient
//! hook anchored at `x` (see [`bonfire_dtensor::graph`]), which fires right after the layer's backward
//! and hands the gradient to the step's bucket. Layers entered with token ids as input (no
//! float anchor) and models that never call `layer` still train correctly under DDP; their
//! gradients are reduced after backward.

use crate::reducer::SharedReducer;
use bonfire_dtensor::graph::{GradHook, hooked_dispatch};
use bonfire_dtensor::{LayerHook, LayerHookGuard, install_layer_hook};
use burn::module::ParamId;
use burn::tensor::DispatchTensor;
use std::rc::Rc;

/// Makes `reducer` the target of the layers entered on this thread until the guard drops.
pub(crate) fn activate(reducer: SharedReducer) -> LayerHookGuard {
    install_layer_hook(Rc::new(AnchorHook { reducer }))
}

struct AnchorHook {
    reducer: SharedReducer,
}

impl LayerHook for AnchorHook {
    fn wraps(&self, id: ParamId) -> bool {
        let guard = self.reducer.lock().unwrap();
        guard.as_ref().is_some_and(|r| r.index.contains_key(&id))
    }

    fn wrap(
        &self,
        id: ParamId,
        value: DispatchTensor,
        input: Option<&DispatchTensor>,
    ) -> DispatchTensor {
        let Some(anchor) = input else {
            return value;
        };
        let index = {
            let mut guard = self.reducer.lock().unwrap();
            let Some(r) = guard.as_mut() else {
                return value;
            };
            let Some(&i) = r.index.get(&id) else {
                return value;
            };
            r.expect(i);
            i
        };
        let reducer = self.reducer.clone();
        let hook = GradHook::f32(move |grad| {
            // A hook firing after its step finished (a stale graph) has nowhere to go.
            if let Some(r) = reducer.lock().unwrap().as_mut() {
                r.deposit(index, &grad);
            }
        });
        hooked_dispatch(value, anchor.clone(), hook)
    }
}
