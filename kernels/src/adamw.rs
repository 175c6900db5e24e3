//! AdamW fused into one kernel over a flat tensor: the two moments, their bias corrections,
//! the decoupled weight decay and the update, read and written once per element (Burn's
//! `AdamW` runs a dozen element-wise ops, each a pass over memory).
//!
//! [`FusedAdamW`] is a Burn [`Optimizer`]: a `ModuleOptimizer` holds it like any other, its
//! state is Burn's own [`AdamWState`] (records and checkpoints move between the two), and off
//! a CubeCL device and off Flex f32 it *is* Burn's `AdamW` (the fallback). On Flex in f32 the
//! step is one pass over host slices — parameter, gradient and both moments, updated in
//! place where their buffers are not shared — with Burn's exact arithmetic (the same
//! operations in the same order, so the same f32 results).

use burn::config::Config;
use burn::optim::{AdamW, AdamWConfig, AdamWState, LearningRate, ModuleOptimizer, Optimizer};
use burn::tensor::{Device, Tensor};

/// Configuration of [`FusedAdamW`]; the defaults are those of Burn's `AdamWConfig`.
#[derive(Config, Debug)]
pub struct FusedAdamWConfig {
    /// Decay rate of the first moment (running mean of the gradient).
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// Decay rate of the second moment (running mean of the squared gradient).
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// Added to `√v̂` in the denominator of the update, so it never divides by zero.
    #[config(default = 1e-5)]
    pub epsilon: f32,
    /// Decoupled weight decay: `p ← p·(1 − lr·weight_decay)` before the update.
    #[config(default = 1e-4)]
    pub weight_decay: f32,
}

impl FusedAdamWConfig {
    /// The optimizer.
    pub fn build(&self) -> FusedAdamW {
        FusedAdamW {
            config: self.clone(),
            burn: self.burn().build(),
        }
    }

    /// The optimizer for a whole module.
    pub fn init(&self) -> ModuleOptimizer {
        ModuleOptimizer::from(self.build())
    }

    /// Burn's `AdamWConfig` with the same hyper-parameters.
    pub fn burn(&self) -> AdamWConfig {
        AdamWConfig::new()
            .with_beta_1(self.beta_1)
            .with_beta_2(self.beta_2)
            .with_epsilon(self.epsilon)
            .with_weight_decay(self.weight_decay)
    }
}

/// AdamW as one kernel on CubeCL devices, one host pass on Flex in f32, Burn's `AdamW`
/// elsewhere.
#[derive(Clone)]
pub struct FusedAdamW {
    config: FusedAdamWConfig,
    burn: AdamW,
}

impl Optimizer for FusedAdamW {
    type State<const D: usize> = AdamWState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        if host::covers(&tensor, &grad, &state) {
            let (tensor, state) = host::step(&self.config, lr, tensor, grad, state);
            return (tensor, Some(state));
        }
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if kernel::covers(&tensor, &grad) {
            let (tensor, state) = kernel::step(&self.config, lr, tensor, grad, state);
            return (tensor, Some(state));
        }
        self.burn.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdamW::to_device(state, device)
    }
}

pub(crate) mod fallback {
    use super::FusedAdamWConfig;
    use burn::optim::{AdamWState, LearningRate, Optimizer};
    use burn::tensor::Tensor;

    /// One AdamW step with Burn's own `AdamW` (what [`super::FusedAdamW`] runs off a CubeCL
    /// device, and the reference its kernel is tested against).
    pub fn adamw_step<const D: usize>(
        config: &FusedAdamWConfig,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamWState<D>>,
    ) -> (Tensor<D>, AdamWState<D>) {
        let (tensor, state) = config.burn().build().step(lr, tensor, grad, state);
        (tensor, state.expect("AdamW keeps state"))
    }
}

mod host {
    use super::FusedAdamWConfig;
    use crate::fused::host::{self as buf, flex_primitive as prim, is_flex_f32 as flex_f32};
    use crate::simd::vectorized;
    use burn::backend::Flex;
    use burn::optim::{AdamWState, AdaptiveMomentumState, LearningRate};
    use burn::tensor::Tensor;

    /// Whether the host pass handles the step: every tensor f32 on Flex, no AMSGrad maximum.
    pub(super) fn covers<const D: usize>(
        tensor: &Tensor<D>,
        grad: &Tensor<D>,
        state: &Option<AdamWState<D>>,
    ) -> bool {
        flex_f32(tensor)
            && flex_f32(grad)
            && state.as_ref().is_none_or(|s| {
                let m = &s.momentum;
                flex_f32(&m.moment_1) && flex_f32(&m.moment_2) && m.max_moment_2.is_none()
            })
    }

    /// One step, Burn's `AdamW` arithmetic element by element.
    pub(super) fn step<const D: usize>(
        config: &FusedAdamWConfig,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamWState<D>>,
    ) -> (Tensor<D>, AdamWState<D>) {
        let time = state.as_ref().map_or(1, |s| s.momentum.time + 1);
        let n = tensor.shape().num_elements();
        let shape = tensor.dims().to_vec();
        let mut p = buf::writable(prim(tensor));
        let g = buf::contiguous(prim(grad));
        let (mut m, mut v) = match state {
            Some(s) => (
                buf::writable(prim(s.momentum.moment_1)),
                buf::writable(prim(s.momentum.moment_2)),
            ),
            None => (
                buf::from_vec(vec![0.0; n], shape.clone()),
                buf::from_vec(vec![0.0; n], shape),
            ),
        };
        let pv = buf::owned(&mut p).expect("writable");
        let mv = buf::owned(&mut m).expect("writable");
        let vv = buf::owned(&mut v).expect("writable");
        update(pv, mv, vv, buf::values(&g), &Step::new(config, lr, time));
        let momentum = AdaptiveMomentumState::new(
            time,
            Tensor::from_primitive::<Flex>(m),
            Tensor::from_primitive::<Flex>(v),
        );
        (Tensor::from_primitive::<Flex>(p), AdamWState::new(momentum))
    }

    /// One step's constants, as Burn's `AdamW` computes them.
    struct Step {
        b1: f32,
        b2: f32,
        f1: f32,
        f2: f32,
        bias_1: f32,
        bias_2: f32,
        eps: f32,
        /// `1 − lr·λ`, or `None` without weight decay.
        decay: Option<f32>,
        lr: f32,
    }

    impl Step {
        /// Step `time`'s constants (1-based) at learning rate `lr`.
        fn new(config: &FusedAdamWConfig, lr: LearningRate, time: usize) -> Self {
            let (b1, b2) = (config.beta_1, config.beta_2);
            let decay_rate = lr * config.weight_decay as f64;
            Self {
                b1,
                b2,
                f1: 1.0 - b1,
                f2: 1.0 - b2,
                bias_1: 1f32 - b1.powi(time as i32),
                bias_2: 1f32 - b2.powi(time as i32),
                eps: config.epsilon,
                decay: (decay_rate != 0.0).then_some((1.0 - decay_rate) as f32),
                lr: lr as f32,
            }
        }
    }

    vectorized! {
        /// Burn's `AdamW` arithmetic on every element: the moments, then the parameter.
        fn update(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], s: &Step) {
            let n = p.len();
            let (m, v, g) = (&mut m[..n], &mut v[..n], &g[..n]);
            for i in 0..n {
                m[i] = m[i] * s.b1 + g[i] * s.f1;
                v[i] = v[i] * s.b2 + g[i] * g[i] * s.f2;
                let delta = (m[i] / s.bias_1) / ((v[i] / s.bias_2).sqrt() + s.eps);
                let decayed = match s.decay {
                    Some(decay) => p[i] * decay,
                    None => p[i],
                };
                p[i] = decayed - delta * s.lr;
            }
        }
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernel {
    use super::FusedAdamWConfig;
    use crate::cube::{self, empty, from_cube, grid, to_cube};
    use burn::optim::{AdamWState, AdaptiveMomentumState, LearningRate};
    use burn::tensor::{DType, Tensor};
    use cubecl::prelude::*;

    /// Whether the kernel handles the step: f32 tensors on a CubeCL device.
    pub(super) fn covers<const D: usize>(tensor: &Tensor<D>, grad: &Tensor<D>) -> bool {
        tensor.dtype() == DType::F32
            && grad.dtype() == DType::F32
            && cube::is_cube(&tensor.device())
    }

    /// The step's scalars, computed on the host as Burn's `AdamW` computes them.
    #[derive(CubeLaunch, CubeType, Clone, Copy)]
    struct Scalars {
        lr: f32,
        beta_1: f32,
        beta_2: f32,
        epsilon: f32,
        /// `1 − lr·weight_decay`.
        decay: f32,
        /// `1 − β1ᵗ`, `1 − β2ᵗ`.
        bias_1: f32,
        bias_2: f32,
    }

    #[cube(launch_unchecked)]
    #[allow(clippy::too_many_arguments)]
    fn adamw(
        param: &[f32],
        grad: &[f32],
        m: &[f32],
        v: &[f32],
        param_out: &mut [f32],
        m_out: &mut [f32],
        v_out: &mut [f32],
        s: Scalars,
        #[comptime] first: bool,
    ) {
        let i = ABSOLUTE_POS;
        if i < param.len() {
            let g = grad[i];
            let mut m1 = g * (1.0 - s.beta_1);
            let mut v1 = g * g * (1.0 - s.beta_2);
            if !first {
                m1 += m[i] * s.beta_1;
                v1 += v[i] * s.beta_2;
            }
            m_out[i] = m1;
            v_out[i] = v1;
            let m_hat = m1 / s.bias_1;
            let v_hat = v1 / s.bias_2;
            let delta = m_hat / (v_hat.sqrt() + s.epsilon);
            param_out[i] = param[i] * s.decay - delta * s.lr;
        }
    }

    pub(super) fn step<const D: usize>(
        config: &FusedAdamWConfig,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamWState<D>>,
    ) -> (Tensor<D>, AdamWState<D>) {
        let dims = tensor.dims();
        let time = state.as_ref().map_or(1, |s| s.momentum.time + 1);
        let decay_rate = lr * config.weight_decay as f64;
        let scalars = ScalarsLaunch::new(
            lr as f32,
            config.beta_1,
            config.beta_2,
            config.epsilon,
            (1.0 - decay_rate) as f32,
            1f32 - config.beta_1.powi(time as i32),
            1f32 - config.beta_2.powi(time as i32),
        );
        let param = to_cube(tensor);
        let grad = to_cube(grad);
        let first = state.is_none();
        // Before the first step the kernel never reads the moments: `grad` stands in.
        let (m, v) = match state {
            Some(s) => (to_cube(s.momentum.moment_1), to_cube(s.momentum.moment_2)),
            None => (grad.clone(), grad.clone()),
        };
        let n = cube::len(&param);
        let shape = param.meta.shape().clone();
        let outs = [(); 3].map(|_| empty(&param, shape.clone(), DType::F32));
        let (count, dim) = grid(&param.client, n);
        let client = param.client.clone();
        // SAFETY: all seven buffers hold `n` elements; each unit touches its own `i < n`.
        unsafe {
            adamw::launch_unchecked(
                &client,
                count,
                dim,
                param.into_buffer_arg(),
                grad.into_buffer_arg(),
                m.into_buffer_arg(),
                v.into_buffer_arg(),
                outs[0].clone().into_buffer_arg(),
                outs[1].clone().into_buffer_arg(),
                outs[2].clone().into_buffer_arg(),
                scalars,
                first,
            );
        }
        let [p, m, v] = outs.map(from_cube::<D>);
        debug_assert_eq!(p.dims(), dims);
        let momentum = AdaptiveMomentumState::new(time, m, v);
        (p, AdamWState::new(momentum))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    /// Several steps of the host pass against Burn's `AdamW`, each from the other's state:
    /// identical parameters and moments (the same f32 operations in the same order).
    #[test]
    fn host_adamw_is_burns_adamw_over_several_steps() {
        let device = Device::flex();
        let config = FusedAdamWConfig::new().with_weight_decay(0.01);
        let (fused, burn) = (config.build(), config.burn().build());
        let mut a = Tensor::<2>::random([7, 37], Distribution::Normal(0.0, 1.0), &device);
        let mut b = a.clone();
        let (mut sa, mut sb) = (None, None);
        for step in 0..4 {
            let g = Tensor::<2>::random([7, 37], Distribution::Normal(0.0, 1.0), &device);
            (a, sa) = fused.step(1e-2, a, g.clone(), sa);
            (b, sb) = burn.step(1e-2, b, g, sb);
            let same = |x: &Tensor<2>, y: &Tensor<2>| {
                x.clone()
                    .into_data()
                    .assert_eq(&y.clone().into_data(), true)
            };
            same(&a, &b);
            let (ma, mb) = (
                &sa.as_ref().unwrap().momentum,
                &sb.as_ref().unwrap().momentum,
            );
            same(&ma.moment_1, &mb.moment_1);
            same(&ma.moment_2, &mb.moment_2);
            assert_eq!(ma.time, step + 1);
            // Records are interchangeable: swap the states every step.
            std::mem::swap(&mut sa, &mut sb);
        }
    }
}
