//! Layer scopes ([`bonfire_module::layer`]) and the graph anchor
//! ([`bonfire_module::graph::anchored`]).

use bonfire_module::graph::anchored;
use bonfire_module::{LayerHook, install_layer_hook, layer};
use burn::module::{Param, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, DispatchTensor, Int, Tensor};
use std::cell::RefCell;
use std::rc::Rc;

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

#[test]
fn without_a_hook_a_layer_is_a_clone() {
    let device = Device::flex().autodiff();
    let lin = LinearConfig::new(3, 2).init(&device);
    let x = Tensor::<2>::ones([1, 3], &device);
    let copy = layer(&lin, &x);
    assert_eq!(copy.weight.id, lin.weight.id);
    assert_eq!(values(copy.forward(x.clone())), values(lin.forward(x)));
}

/// Supplies a constant for every lazy parameter and records what it was asked.
#[derive(Default)]
struct Supplier {
    entered: RefCell<Vec<(Vec<ParamId>, bool)>>,
    supplied: RefCell<usize>,
}

impl LayerHook for Supplier {
    fn enter(&self, ids: &[ParamId], input: Option<&DispatchTensor>) {
        self.entered
            .borrow_mut()
            .push((ids.to_vec(), input.is_some()));
    }
    fn supply(&self, _id: ParamId) -> Option<Tensor<1>> {
        *self.supplied.borrow_mut() += 1;
        let device = Device::flex().autodiff();
        Some(Tensor::<1>::ones([6], &device) * 0.5)
    }
}

/// A 3→2 linear layer (no bias) whose weight holds no value yet.
fn lazy_linear(device: &Device) -> Linear {
    let mut lin = LinearConfig::new(3, 2).with_bias(false).init(device);
    let id = lin.weight.id;
    lin.weight = Param::uninitialized(
        id,
        |_, _| panic!("a supplied parameter must not be initialized from the module"),
        device.clone(),
        true,
        [3, 2].into(),
    );
    lin
}

#[test]
fn a_hook_supplies_lazy_parameters_once_per_layer() {
    let device = Device::flex().autodiff();
    let lin = lazy_linear(&device);
    let hook = Rc::new(Supplier::default());
    let guard = install_layer_hook(hook.clone());

    let x = Tensor::<2>::ones([1, 3], &device);
    let copy = layer(&lin, &x);
    // 0.5 · (1 + 1 + 1) in both outputs.
    assert_eq!(values(copy.forward(x.clone())), vec![1.5, 1.5]);
    // A nested scope leaves the supplied (initialized) parameter alone.
    let nested = layer(&copy, &x);
    assert_eq!(values(nested.forward(x.clone())), vec![1.5, 1.5]);
    assert_eq!(*hook.supplied.borrow(), 1);
    // Token ids are no anchor.
    let ids = Tensor::<2, Int>::zeros([1, 3], &device);
    let _ = layer(&lin, &ids);
    let entered = hook.entered.borrow().clone();
    assert_eq!(entered[0], (vec![lin.weight.id], true));
    assert_eq!(entered[1], (vec![], true));
    assert_eq!(entered[2], (vec![lin.weight.id], false));
    // The module itself never held a value.
    assert!(!lin.weight.is_initialized());

    drop(guard);
    let fresh = LinearConfig::new(3, 2).init(&device);
    let _ = layer(&fresh, &x);
    assert_eq!(
        hook.entered.borrow().len(),
        3,
        "the hook is gone with its guard"
    );
}

fn anchored_gradients(device: Device) -> (Vec<f32>, bool) {
    let w = Tensor::<1>::from_floats([1.0, 2.0, 3.0], &device).require_grad();
    let a = Tensor::<1>::from_floats([4.0, 5.0], &device).require_grad();
    // The anchor is itself computed, so that it sits deep in the graph.
    let deep = a.clone().exp().sin() * 2.0;
    let placed = anchored(w.clone() * 1.0, &deep.clone().into_dispatch());
    let loss = (placed.powi_scalar(2)).sum() + deep.sum();
    let grads = loss.backward();
    let gw = values(w.grad(&grads).unwrap());
    // The anchor's leaf gets its gradient only through `deep.sum()`.
    let ga = values(a.grad(&grads).unwrap());
    let expected: Vec<f32> = [4.0f32, 5.0]
        .iter()
        .map(|&v| 2.0 * v.exp().cos() * v.exp())
        .collect();
    let errors: Vec<f32> = ga
        .iter()
        .zip(&expected)
        .map(|(g, e)| (g - e).abs() / e.abs().max(1.0))
        .collect();
    // Measured: 0 (the same f32 functions); 1e-6 leaves a few units in the last place.
    let anchor_ok = ga.len() == expected.len() && errors.iter().all(|&d| d < 1e-6);
    (gw, anchor_ok)
}

#[test]
fn anchored_is_an_identity_whose_gradient_passes_through() {
    for device in [
        Device::flex().autodiff(),
        Device::flex().autodiff().gradient_checkpointing(),
    ] {
        let (gw, anchor_ok) = anchored_gradients(device);
        assert_eq!(gw, vec![2.0, 4.0, 6.0]);
        assert!(
            anchor_ok,
            "no gradient reaches the anchor through `anchored`"
        );
    }
}
