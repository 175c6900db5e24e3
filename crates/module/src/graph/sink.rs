//! The one gradient-sink hook of the data-parallel wrappers: during a wrapper's forward, every
//! parameter of a layer the model enters through [`crate::layer`] with a float input carries a
//! [`hooked`](super::hooked) gradient hook anchored at that input, which hands the layer's
//! finished gradient to the step's [`GradSink`] right after the layer's backward, while the
//! earlier layers still compute.
//!
//! DDP's sink puts gradients into all-reduce buckets, ZeRO-2's into reduce-scatter buckets;
//! both launch a bucket as soon as all its parameters have arrived. Layers entered with token
//! ids (no float anchor) and models that never call `layer` get no hooks: their gradients are
//! taken from Burn's `Gradients` after backward.

use super::{GradHook, hooked_dispatch};
use crate::LayerHook;
use burn::module::ParamId;
use burn::tensor::{DispatchTensor, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Where one step's hooked gradients go. `param` is the parameter's index in the wrapper's
/// inventory.
pub trait GradSink: Send + 'static {
    /// A hook on `param` was attached in forward: one more gradient to wait for.
    fn expect(&mut self, param: usize);
    /// Backward delivered (one use of) `param`'s gradient, flattened, on the device it was
    /// computed on.
    fn deposit(&mut self, param: usize, grad: Tensor<1>);
}

/// One step's sink, shared between the wrapper and the hooks of its forward; the wrapper
/// takes it out (leaving `None`) when it finishes the step, so a hook firing later (a stale
/// graph) has nowhere to go.
pub type SharedSink<S> = Arc<Mutex<Option<S>>>;

/// The [`LayerHook`] that attaches gradient hooks feeding a [`GradSink`]. It also counts the
/// layers entered, so a wrapper can tell a model that shows it no layers.
pub struct SinkHook<S: GradSink> {
    sink: SharedSink<S>,
    index: Arc<HashMap<ParamId, usize>>,
    layers: Arc<AtomicUsize>,
}

impl<S: GradSink> SinkHook<S> {
    /// Hooks for the parameters of `index` (id → inventory position), feeding `sink`;
    /// `layers` counts the layers entered with a float input.
    pub fn new(
        sink: SharedSink<S>,
        index: Arc<HashMap<ParamId, usize>>,
        layers: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            sink,
            index,
            layers,
        }
    }
}

impl<S: GradSink> LayerHook for SinkHook<S> {
    fn enter(&self, _ids: &[ParamId], input: Option<&DispatchTensor>) {
        if input.is_some() {
            self.layers.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn wraps(&self, id: ParamId) -> bool {
        self.index.contains_key(&id)
    }

    fn wrap(
        &self,
        id: ParamId,
        value: DispatchTensor,
        input: Option<&DispatchTensor>,
    ) -> DispatchTensor {
        let (Some(anchor), Some(&param)) = (input, self.index.get(&id)) else {
            return value;
        };
        match self.sink.lock().unwrap().as_mut() {
            Some(sink) => sink.expect(param),
            None => return value,
        }
        let sink = self.sink.clone();
        let hook = GradHook::new(move |grad| {
            if let Some(s) = sink.lock().unwrap().as_mut() {
                s.deposit(param, grad);
            }
        });
        hooked_dispatch(value, anchor.clone(), hook)
    }
}
