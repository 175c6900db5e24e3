//! SGD's update in one pass over a parameter: `p ← p − lr·(g + λ·p)` read and written once
//! per element, in place where the parameter's buffer is not shared (Burn's `Sgd` runs two to
//! four element-wise ops, each a pass over memory and a new buffer).
//!
//! [`FusedSgd`] is a Burn [`Optimizer`] whose state is Burn's own [`SgdState`] (records move
//! between the two). The host pass covers Flex in f32 without momentum — the bench's and the
//! harness's SGD; with momentum (whose velocity `burn-optim` keeps private), on another device
//! or another dtype the step *is* Burn's `Sgd` (the fallback).

use burn::config::Config;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{LearningRate, ModuleOptimizer, Optimizer, Sgd, SgdConfig, SgdState};
use burn::tensor::{Device, Tensor};

/// Configuration of [`FusedSgd`]; the defaults are those of Burn's `SgdConfig` (no weight
/// decay, no momentum).
#[derive(Config, Debug)]
pub struct FusedSgdConfig {
    /// L2 penalty added to the gradient: `g + weight_decay·p`.
    pub weight_decay: Option<f32>,
    /// Momentum (Burn's `Sgd` runs the step when it is set).
    pub momentum: Option<MomentumConfig>,
}

impl FusedSgdConfig {
    /// The optimizer.
    pub fn build(&self) -> FusedSgd {
        FusedSgd {
            config: self.clone(),
            burn: self.burn().build(),
        }
    }

    /// The optimizer for a whole module.
    pub fn init(&self) -> ModuleOptimizer {
        ModuleOptimizer::from(self.build())
    }

    /// Burn's `SgdConfig` with the same hyper-parameters.
    pub fn burn(&self) -> SgdConfig {
        SgdConfig::new()
            .with_weight_decay(self.weight_decay.map(WeightDecayConfig::new))
            .with_momentum(self.momentum.clone())
    }
}

/// SGD as one host pass on Flex in f32 without momentum, Burn's `Sgd` otherwise.
#[derive(Clone)]
pub struct FusedSgd {
    config: FusedSgdConfig,
    burn: Sgd,
}

impl Optimizer for FusedSgd {
    type State<const D: usize> = SgdState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        if self.config.momentum.is_none() && host::covers(&tensor, &grad) {
            let tensor = host::step(self.config.weight_decay, lr, tensor, grad);
            return (tensor, Some(SgdState::new(None)));
        }
        self.burn.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        Sgd::to_device(state, device)
    }
}

mod host {
    use crate::fused::host::{self as buf, flex_primitive as prim, is_flex_f32};
    use burn::backend::Flex;
    use burn::optim::LearningRate;
    use burn::tensor::Tensor;

    /// Whether the host pass handles the step: both tensors f32 on Flex.
    pub(super) fn covers<const D: usize>(tensor: &Tensor<D>, grad: &Tensor<D>) -> bool {
        is_flex_f32(tensor) && is_flex_f32(grad)
    }

    /// One step, Burn's `Sgd` arithmetic element by element: `g ← λ·p + g` (with weight
    /// decay), then `p − g·lr` (`lr` rounded to f32 as Burn's `mul_scalar` does).
    pub(super) fn step<const D: usize>(
        weight_decay: Option<f32>,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
    ) -> Tensor<D> {
        let lr = lr as f32;
        let g = buf::contiguous(prim(grad));
        let p = match weight_decay {
            None => buf::zip(prim(tensor), g, |p, g| p - g * lr),
            Some(w) => buf::zip(prim(tensor), g, |p, g| p - (p * w + g) * lr),
        };
        Tensor::from_primitive::<Flex>(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    /// Several steps of the host pass against Burn's `Sgd`, with and without weight decay:
    /// identical parameters (the same f32 operations in the same order); with momentum the
    /// step is Burn's, state and all.
    #[test]
    fn host_sgd_is_burns_sgd_over_several_steps() {
        let device = Device::flex();
        let configs = [
            FusedSgdConfig::new(),
            FusedSgdConfig::new().with_weight_decay(Some(0.05)),
            FusedSgdConfig::new().with_momentum(Some(MomentumConfig::new())),
        ];
        for config in configs {
            let (fused, burn) = (config.build(), config.burn().build());
            let mut a = Tensor::<2>::random([7, 37], Distribution::Normal(0.0, 1.0), &device);
            let mut b = a.clone();
            let (mut sa, mut sb) = (None, None);
            for _ in 0..3 {
                let g = Tensor::<2>::random([7, 37], Distribution::Normal(0.0, 1.0), &device);
                (a, sa) = fused.step(3e-2, a, g.clone(), sa);
                (b, sb) = burn.step(3e-2, b, g, sb);
                a.clone()
                    .into_data()
                    .assert_eq(&b.clone().into_data(), true);
                let momentum = |s: &Option<SgdState<2>>| s.as_ref().unwrap().momentum.is_some();
                assert_eq!(momentum(&sa), momentum(&sb), "{config:?}");
            }
        }
    }

    /// A parameter whose buffer is shared (a clone held elsewhere) is not written over.
    #[test]
    fn a_shared_parameter_is_left_as_it_was() {
        let device = Device::flex();
        let p = Tensor::<1>::from_floats([1.0, 2.0, 3.0], &device);
        let kept = p.clone();
        let g = Tensor::<1>::from_floats([1.0, 1.0, 1.0], &device);
        let (out, _) = FusedSgdConfig::new().build().step(0.5, p, g, None);
        out.into_data().assert_eq(
            &Tensor::<1>::from_floats([0.5, 1.5, 2.5], &device).into_data(),
            true,
        );
        kept.into_data().assert_eq(
            &Tensor::<1>::from_floats([1.0, 2.0, 3.0], &device).into_data(),
            true,
        );
    }
}
