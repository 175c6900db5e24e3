//! Layer scopes: the one call through which a model shows its layers to the data-parallel
//! wrappers, without depending on any of them.
//!
//! A model writes
//!
//! ```ignore
//! let x = x.clone() + bonfire_module::layer(&self.attn, &x).forward(x);
//! ```
//!
//! instead of `self.attn.forward(x)`. Outside a wrapper [`layer`] is a cheap clone of the
//! module. Inside one, the wrapper's [`LayerHook`] decides what the copy's parameters hold:
//!
//! - DDP wraps each parameter in a gradient hook anchored at the layer's input, so the
//!   layer's gradients leave for their bucket as soon as its backward is done.
//! - ZeRO stage 3 fills the copy with parameters all-gathered for this layer alone. When the
//!   model drops the copy (at the end of the statement above), the gathered values go with
//!   it: the forward holds one layer's full parameters at a time, not the whole model's.
//!
//! Hooks are installed per thread (each rank thread runs its own model), for the duration of
//! a wrapper's forward, with [`install_layer_hook`].

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{DispatchTensor, Int, Tensor};
use std::cell::RefCell;
use std::rc::Rc;

/// What a data-parallel wrapper does to the layers a model enters through [`layer`].
///
/// Every method has a do-nothing default, so a hook implements only what it needs.
pub trait LayerHook {
    /// A layer is entered; `ids` are its float parameters that hold no value yet (lazily
    /// materialized ones), in module order — the ones [`supply`](Self::supply) is asked for.
    /// `input` is the layer's input when it is a float tensor (an anchor in the autodiff
    /// graph, see [`crate::graph::anchored`]), `None` for token ids.
    fn enter(&self, ids: &[ParamId], input: Option<&DispatchTensor>) {
        let _ = (ids, input);
    }

    /// The value parameter `id` takes in this layer's copy, flattened to 1-d, or `None` to
    /// leave it alone. Asked only for parameters that hold no value yet.
    fn supply(&self, id: ParamId) -> Option<Tensor<1>> {
        let _ = id;
        None
    }

    /// Whether [`wrap`](Self::wrap) transforms parameter `id`.
    fn wraps(&self, id: ParamId) -> bool {
        let _ = id;
        false
    }

    /// Parameter `id`'s value for this layer, transformed; `input` is the layer's input
    /// when it is a float tensor (an anchor in the autodiff graph), `None` for token ids.
    fn wrap(
        &self,
        id: ParamId,
        value: DispatchTensor,
        input: Option<&DispatchTensor>,
    ) -> DispatchTensor {
        let _ = (id, input);
        value
    }
}

thread_local! {
    static HOOKS: RefCell<Vec<Rc<dyn LayerHook>>> = const { RefCell::new(Vec::new()) };
}

/// Makes `hook` see every [`layer`] entered on this thread until the guard drops. Hooks
/// nest; the innermost one is asked first for a parameter's value.
pub fn install_layer_hook(hook: Rc<dyn LayerHook>) -> LayerHookGuard {
    HOOKS.with(|h| h.borrow_mut().push(hook.clone()));
    LayerHookGuard { hook }
}

/// Runs `f` with this thread's layer hooks set aside: every [`layer`] entered inside is a
/// plain clone (activation checkpointing runs a region whose parameters are already hooked or
/// gathered this way, see `bonfire_recompute::recompute`). The hooks are back when `f` returns or
/// panics.
pub fn without_layer_hooks<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(Vec<Rc<dyn LayerHook>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            HOOKS.with(|h| {
                let mut hooks = h.borrow_mut();
                // Hooks installed inside `f` and not removed stay, innermost last.
                let inner = std::mem::take(&mut *hooks);
                *hooks = std::mem::take(&mut self.0);
                hooks.extend(inner);
            });
        }
    }
    let _restore = Restore(HOOKS.with(|h| std::mem::take(&mut *h.borrow_mut())));
    f()
}

/// Removes its hook from the thread's hooks when dropped.
#[must_use = "the hook is removed when the guard drops"]
pub struct LayerHookGuard {
    hook: Rc<dyn LayerHook>,
}

impl Drop for LayerHookGuard {
    fn drop(&mut self) {
        HOOKS.with(|h| h.borrow_mut().retain(|x| !Rc::ptr_eq(x, &self.hook)));
    }
}

/// A layer's input as [`layer`] sees it: a float activation anchors hooks in the graph;
/// token ids do not.
pub trait LayerInput {
    /// The input as a graph anchor for the hooks: the tensor itself when it is a float
    /// activation, `None` for token ids.
    fn anchor(&self) -> Option<DispatchTensor>;
}

impl<const D: usize> LayerInput for Tensor<D> {
    fn anchor(&self) -> Option<DispatchTensor> {
        Some(self.clone().into_dispatch())
    }
}

impl<const D: usize> LayerInput for Tensor<D, Int> {
    fn anchor(&self) -> Option<DispatchTensor> {
        None
    }
}

/// `module`, as the layer the model is about to run on `input`: an ordinary clone unless a
/// wrapper's [`LayerHook`] is installed on this thread (see the module docs). Run the
/// returned copy and let it drop when the layer is done.
pub fn layer<M: Module, I: LayerInput>(module: &M, input: &I) -> M {
    let hooks: Vec<Rc<dyn LayerHook>> = HOOKS.with(|h| h.borrow().clone());
    if hooks.is_empty() {
        return module.clone();
    }
    let anchor = input.anchor();
    let mut pending = Pending(Vec::new());
    module.visit(&mut pending);
    for hook in &hooks {
        hook.enter(&pending.0, anchor.as_ref());
    }
    module.clone().map(&mut LayerMapper {
        hooks: &hooks,
        anchor: anchor.as_ref(),
    })
}

/// The float parameters that hold no value yet.
struct Pending(Vec<ParamId>);

impl ModuleVisitor for Pending {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_initialized() {
            self.0.push(param.id);
        }
    }
}

struct LayerMapper<'a> {
    hooks: &'a [Rc<dyn LayerHook>],
    anchor: Option<&'a DispatchTensor>,
}

impl LayerMapper<'_> {
    fn wrapped<const D: usize>(&self, id: ParamId, mut value: Tensor<D>) -> Tensor<D> {
        for hook in self.hooks.iter().filter(|h| h.wraps(id)) {
            value = Tensor::from_dispatch(hook.wrap(id, value.into_dispatch(), self.anchor));
        }
        value
    }
}

impl ModuleMapper for LayerMapper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let id = param.id;
        let supplied = if param.is_initialized() {
            None
        } else {
            self.hooks.iter().rev().find_map(|h| h.supply(id))
        };
        if let Some(flat) = supplied {
            let dims: [usize; D] = param.lazy_shape().to_vec().try_into().expect("rank");
            drop(param);
            // An initialized parameter: a nested `layer` call leaves it as it is.
            return Param::initialized(id, self.wrapped(id, flat.reshape(dims)));
        }
        if !self.hooks.iter().any(|h| h.wraps(id)) || !param.is_require_grad() {
            return param;
        }
        let (id, value, mapper) = param.consume();
        Param::from_mapped_value(id, self.wrapped(id, value), mapper)
    }
}
