//! The exact (erf) GELU and its derivative on host f32 buffers, written so that the compiler
//! vectorizes them (at the CPU's width: `host::map`/`host::zip` are `crate::simd`'s
//! `vectorized!`): no branches, no calls into `libm` but the baseline build's `fmaf` (every
//! polynomial step of the GELU is one fused multiply-add, see [`madd`]). `erf` is Abramowitz & Stegun
//! 7.1.26 (absolute error ≤ 1.5e-7; its Taylor series near 0), its `exp(−x²)` and the
//! derivative's `exp(−x²/2)` are the same value, computed once by range reduction
//! (`2^k · p(r)`, `|r| ≤ ln 2 / 2`, a degree-7 polynomial: relative error below 1e-7).
//! Both run on Flex's buffer directly: in place when the tensor is contiguous and not
//! shared, else into one new buffer (no copies through `TensorData`).

use super::backend::FusedBackend;
use super::host::{self, FlexTensor};
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1.5 · 2²³: adding it rounds to an integer, kept in the low mantissa bits.
const MAGIC: f32 = 12_582_912.0;
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1 / √(2π).
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `a · b + c`, rounded once where `FUSED` (one FMA instruction in the AVX2 and AVX-512
/// builds of the host passes, a call to `fmaf` — the same correctly rounded value, slower — in
/// the baseline build, so every build still computes the same bits), else twice.
#[inline(always)]
fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    match FUSED {
        true => a.mul_add(b, c),
        false => a * b + c,
    }
}

/// `e^x` for `x` in `[−87, 88]` (clamped there), its steps [`madd`]`::<FUSED>`.
#[inline(always)]
fn exp_with<const FUSED: bool>(x: f32) -> f32 {
    let m = madd::<FUSED>;
    let x = x.clamp(-87.0, 88.0);
    let t = m(x, LOG2E, MAGIC);
    let k = t - MAGIC;
    let r = m(-k, LN2_LO, m(-k, LN2_HI, x));
    let p = m(r, 1.0 / 5040.0, 1.0 / 720.0);
    let p = m(r, m(r, m(r, p, 1.0 / 120.0), 1.0 / 24.0), 1.0 / 6.0);
    let p = m(r, m(r, m(r, p, 0.5), 1.0), 1.0);
    let k = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    p * f32::from_bits(((k + 127) << 23) as u32)
}

/// `e^x` for `x` in `[−87, 88]` (clamped there), each step rounded twice: the exponential the
/// attention's softmax, the cross-entropy and SwiGLU's sigmoid share. Not fused: a fused one
/// moved two AdamW parity cases past their floor (rounding noise of near-zero gradients, which
/// AdamW's normalised step enlarges): ring attention cp = 4 against one device at 1.12 of its
/// tolerance, Qwen3-MoE under HSDP against transformers at 1.10 (0.17 and 0.64 with this one).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    exp_with::<false>(x)
}

/// `erf(x)` given `e = exp(−x²)`: its Taylor series below |x| = 0.5 (where 7.1.26's
/// `1 − …` loses digits to cancellation), 7.1.26 above; both computed, one selected.
#[inline(always)]
fn erf_with(x: f32, e: f32) -> f32 {
    let f = madd::<true>;
    let t = 1.0 / f(0.327_591_1, x.abs(), 1.0);
    let poly = f(t, f(t, 1.061_405_4, -1.453_152_1), 1.421_413_8);
    let poly = t * f(t, f(t, poly, -0.284_496_74), 0.254_829_6);
    let far = f(-poly, e, 1.0).copysign(x);
    let x2 = x * x;
    let s = f(
        x2,
        f(x2, f(x2, -1.0 / 1320.0, 1.0 / 216.0), -1.0 / 42.0),
        1.0 / 10.0,
    );
    let series = x * std::f32::consts::FRAC_2_SQRT_PI * f(x2, f(x2, s, -1.0 / 3.0), 1.0);
    if x.abs() < 0.5 { series } else { far }
}

/// `0.5 · x · (1 + erf(x / √2))`.
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    let e = exp_with::<true>(-0.5 * x * x);
    0.5 * x * (1.0 + erf_with(x * FRAC_1_SQRT_2, e))
}

/// `g · (Φ(x) + x · φ(x))`.
#[inline(always)]
pub(crate) fn gelu_grad(x: f32, g: f32) -> f32 {
    let e = exp_with::<true>(-0.5 * x * x);
    let cdf = 0.5 * (1.0 + erf_with(x * FRAC_1_SQRT_2, e));
    g * madd::<true>(x * INV_SQRT_2PI, e, cdf)
}

/// GELU of a Flex f32 tensor, in place when its buffer can be reused.
pub(crate) fn gelu_flex(x: FlexTensor) -> FlexTensor {
    host::map(x, gelu)
}

/// `grad · GELU′(x)` for Flex f32 tensors of one shape, into `grad`'s buffer when it can be
/// reused.
pub(crate) fn gelu_backward_flex(x: FlexTensor, grad: FlexTensor) -> FlexTensor {
    host::zip(grad, x, |g, x| gelu_grad(x, g))
}

#[derive(Debug)]
struct GeluBackward;

impl<B: FusedBackend> Backward<B, 1> for GeluBackward {
    /// The input `x`.
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, B::gelu_erf_backward(ops.state, grad));
        }
    }
}

/// The autodiff node of [`FusedBackend::gelu_erf`]: it keeps the input.
pub(super) fn gelu_autodiff<B: FusedBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    match GeluBackward
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let x = x.into_primitive();
            prep.finish(x.clone(), B::gelu_erf(x))
        }
        OpsKind::UnTracked(prep) => prep.finish(B::gelu_erf(x.into_primitive())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf in f64 from its Taylor series (|x| ≤ 4: ~1e-9 absolute after cancellation) and
    /// its continued fraction beyond.
    fn erf64(x: f64) -> f64 {
        if x.abs() > 4.0 {
            return x.signum() * (1.0 - (-x * x).exp() / (x.abs() * std::f64::consts::PI.sqrt()));
        }
        let (mut sum, mut term, mut n) = (0.0, x, 0.0);
        while term.abs() > 1e-18 || n < 3.0 {
            sum += term / (2.0 * n + 1.0);
            n += 1.0;
            term *= -x * x / n;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    fn grid() -> impl Iterator<Item = f32> {
        (-12_000..=12_000).map(|i| i as f32 * 1e-3)
    }

    #[test]
    fn exp_is_accurate() {
        for x in (-8_700..=8_800).map(|i| i as f32 * 1e-2) {
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            assert!(
                ((got - want) / want).abs() < 3e-7,
                "exp({x}) = {got}, not {want}"
            );
        }
    }

    #[test]
    fn gelu_matches_the_erf_definition() {
        for x in grid() {
            let xd = x as f64;
            let want = 0.5 * xd * (1.0 + erf64(xd / 2f64.sqrt()));
            let got = gelu(x) as f64;
            let tol = 2e-7 * xd.abs().max(1.0);
            assert!((got - want).abs() < tol, "gelu({x}) = {got}, not {want}");
        }
    }

    #[test]
    fn gelu_grad_matches_the_derivative() {
        for x in grid() {
            let xd = x as f64;
            let cdf = 0.5 * (1.0 + erf64(xd / 2f64.sqrt()));
            let pdf = (-0.5 * xd * xd).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let want = 1.5 * (cdf + xd * pdf);
            let got = gelu_grad(x, 1.5) as f64;
            let tol = 3e-7 * xd.abs().max(1.0);
            assert!((got - want).abs() < tol, "gelu'({x}) = {got}, not {want}");
        }
    }
}
