//! The fused ops against their plain-Burn references: outputs and input gradients.

use super::cross_entropy::cross_entropy_forward;
use super::*;
use burn::backend::Flex;
use burn::tensor::activation::{gelu as burn_gelu, log_softmax, softmax};
use burn::tensor::{Device, Distribution};

/// `a` within `tol` of `b` element by element, relative where `|b| > 1`: an f32 op summed or
/// rounded in another order differs in proportion to its value (the inputs are drawn from the
/// device's generator, which the tests' threads share, so each run draws others: one gave
/// `silu_mul` outputs past 8, where one f32 step is 2⁻²⁰ ≈ 9.5 × 10⁻⁷, and an absolute
/// 2 × 10⁻⁶ failed it by 2.86 × 10⁻⁶ — three steps).
fn close<const D: usize>(what: &str, a: Tensor<D>, b: Tensor<D>, tol: f32) {
    let (a, b) = (
        a.into_data().try_to_vec::<f32>().unwrap(),
        b.into_data().try_to_vec::<f32>().unwrap(),
    );
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0, f32::max);
    assert!(
        worst <= tol,
        "{what}: largest difference {worst} (relative where |value| > 1) > {tol}"
    );
}

/// `f` and `reference` on the same tracked input: outputs and input gradients (of the
/// output weighted by a fixed random tensor) agree.
fn same_as<const D: usize, const E: usize>(
    input: Tensor<D>,
    f: impl Fn(Tensor<D>) -> Tensor<E>,
    reference: impl Fn(Tensor<D>) -> Tensor<E>,
    tol: f32,
) {
    let (a, b) = (input.clone().require_grad(), input.require_grad());
    let (ya, yb) = (f(a.clone()), reference(b.clone()));
    let w = Tensor::<E>::random(ya.shape(), Distribution::Normal(0.0, 1.0), &ya.device());
    close("forward", ya.clone(), yb.clone(), tol);
    let ga = (ya * w.clone()).sum().backward();
    let gb = (yb * w).sum().backward();
    close("gradient", a.grad(&ga).unwrap(), b.grad(&gb).unwrap(), tol);
}

fn device() -> Device {
    Device::flex().autodiff()
}

#[test]
fn causal_mask_built_on_the_device_is_the_host_one() {
    for (tq, tk) in [(1, 1), (5, 5), (3, 7), (8, 8), (16, 40)] {
        let built = softmax::causal_mask(tq, tk, &device()).into_data();
        let want = softmax::causal_mask_values(tq, tk);
        assert_eq!(built.shape(), want.shape(), "[{tq}, {tk}]");
        let (a, b) = (
            built.try_to_vec::<f32>().unwrap(),
            want.try_to_vec::<f32>().unwrap(),
        );
        assert_eq!(a, b, "[{tq}, {tk}]");
        assert!(
            a.iter().any(|x| x.is_infinite()) || tq * tk == 1,
            "[{tq}, {tk}] hides none"
        );
    }
}

#[test]
fn causal_softmax_is_masked_scaled_softmax() {
    let x = Tensor::<4>::random([2, 3, 5, 5], Distribution::Normal(0.0, 2.0), &device());
    let mask = |t: Tensor<4>| {
        let tri = Tensor::<2>::ones([5, 5], &t.device()).triu(1) * -1e30;
        t * 0.3 + tri.unsqueeze::<4>()
    };
    same_as(x, |t| causal_softmax(t, 0.3), |t| softmax(mask(t), 3), 1e-6);
}

#[test]
fn cross_entropy_is_mean_negative_log_likelihood() {
    let x = Tensor::<2>::random([6, 11], Distribution::Normal(0.0, 3.0), &device());
    let targets = Tensor::<1, Int>::from_data([0, 10, 3, 3, 7, 1], &device());
    let t = targets.clone();
    let reference = move |x: Tensor<2>| {
        log_softmax(x, 1)
            .gather(1, t.clone().reshape([6, 1]))
            .mean()
            .neg()
    };
    same_as(x, |x| cross_entropy(x, targets.clone()), reference, 1e-6);
}

#[test]
fn exp_is_burns_exp() {
    let x = Tensor::<3>::random([2, 7, 33], Distribution::Normal(0.0, 2.0), &device());
    same_as(x, exp, |x| x.exp(), 1e-5);
}

#[test]
fn gelu_is_burns_gelu() {
    let x = Tensor::<3>::random([2, 7, 33], Distribution::Normal(0.0, 3.0), &device());
    same_as(x, gelu, burn_gelu, 1e-6);
}

fn flex() -> Device {
    Device::flex()
}

#[test]
fn gelu_in_place_on_an_untracked_tensor_is_burns_gelu() {
    let x = Tensor::<2>::random([5, 131], Distribution::Normal(0.0, 3.0), &flex());
    close("forward", gelu(x.clone()), burn_gelu(x), 1e-6);
}

/// The host kernels run at the CPU's vector width (`crate::simd`), and every width computes
/// the scalar formula's values bit for bit: the GELU forward and backward of a Flex tensor
/// (AVX-512 or AVX2 where the CPU has them) against `gelu.rs`'s scalar functions called one
/// value at a time here (the baseline build).
#[test]
fn host_gelu_is_the_scalar_formula_bit_for_bit() {
    let x = Tensor::<2>::random([7, 1031], Distribution::Normal(0.0, 3.0), &device());
    let g = Tensor::<2>::random([7, 1031], Distribution::Normal(0.0, 1.0), &device());
    let bits = |t: Tensor<2>| -> Vec<u32> {
        let v = t.into_data().try_to_vec::<f32>().unwrap();
        v.iter().map(|v| v.to_bits()).collect()
    };
    let (xv, gv) = (bits(x.clone()), bits(g.clone()));
    let scalar: Vec<u32> = xv
        .iter()
        .map(|&v| std::hint::black_box(super::gelu::gelu(f32::from_bits(v))).to_bits())
        .collect();
    assert_eq!(bits(gelu(x.clone())), scalar);
    let xt = x.require_grad();
    let grads = (gelu(xt.clone()) * g).sum().backward();
    let scalar: Vec<u32> = (xv.iter().zip(&gv))
        .map(|(&v, &d)| {
            let (v, d) = (f32::from_bits(v), f32::from_bits(d));
            std::hint::black_box(super::gelu::gelu_grad(v, d)).to_bits()
        })
        .collect();
    assert_eq!(bits(xt.grad(&grads).unwrap()), scalar);
}

#[test]
fn cross_entropy_over_several_vocabulary_chunks() {
    let x = Tensor::<2>::random([3, 5003], Distribution::Normal(0.0, 4.0), &device());
    let targets = Tensor::<1, Int>::from_data([5002, 0, 2048], &device());
    let t = targets.clone();
    let reference = move |x: Tensor<2>| {
        log_softmax(x, 1)
            .gather(1, t.clone().reshape([3, 1]))
            .mean()
            .neg()
    };
    // A loss near 12: 6e-6 is 5e-7 relative (f32 sums of 5003 terms in two orders).
    same_as(x, |x| cross_entropy(x, targets.clone()), reference, 6e-6);
}

fn layer_norm_reference<const D: usize>(x: Tensor<D>, eps: f64) -> Tensor<D> {
    let (var, mean) = x.clone().var_mean_bias(D - 1);
    (x - mean) / (var + eps).sqrt()
}

#[test]
fn layer_norm_core_is_burns_layer_norm() {
    let x = Tensor::<3>::random([3, 5, 37], Distribution::Normal(0.5, 2.0), &device());
    same_as(
        x,
        |x| layer_norm_core(x, 1e-5),
        |x| layer_norm_reference(x, 1e-5),
        3e-6,
    );
}

#[test]
fn rms_norm_core_is_burns_rms_norm() {
    let x = Tensor::<3>::random([3, 5, 37], Distribution::Normal(0.5, 2.0), &device());
    let reference = |x: Tensor<3>| {
        let rms = (x.clone().powi_scalar(2).mean_dim(2) + 1e-5).sqrt();
        x / rms
    };
    same_as(x, |x| rms_norm_core(x, 1e-5), reference, 3e-6);
}

#[test]
fn norm_cores_recomputed_under_balanced_checkpointing() {
    // ZeRO-3's strategy: the core is memory-bound and backward recomputes it from its input,
    // itself the output of memory-bound ops (recomputed in turn).
    let dev = Device::flex().autodiff().gradient_checkpointing();
    let x = Tensor::<3>::random([3, 5, 37], Distribution::Normal(0.5, 2.0), &dev);
    let shifted = |x: Tensor<3>| x.clone() * 1.5 + x.sin();
    same_as(
        x.clone(),
        |x| layer_norm_core(shifted(x), 1e-5),
        |x| layer_norm_reference(shifted(x), 1e-5),
        3e-6,
    );
    let rms = |x: Tensor<3>| x.clone() / (x.powi_scalar(2).mean_dim(2) + 1e-5).sqrt();
    same_as(
        x,
        |x| rms_norm_core(shifted(x), 1e-5),
        |x| rms(shifted(x)),
        3e-6,
    );
}

#[test]
fn norm_cores_on_a_strided_untracked_input() {
    let x = Tensor::<2>::random([37, 6], Distribution::Normal(0.0, 1.0), &flex()).transpose();
    close(
        "layer",
        layer_norm_core(x.clone(), 1e-5),
        layer_norm_reference(x, 1e-5),
        3e-6,
    );
}

#[test]
fn silu_mul_is_silu_times_up() {
    let x = Tensor::<3>::random([2, 5, 43], Distribution::Normal(0.0, 3.0), &device());
    let split = |x: Tensor<3>| (x.clone().narrow(0, 0, 1), x.narrow(0, 1, 1));
    let f = move |x: Tensor<3>| {
        let (g, u) = split(x);
        silu_mul(g, u)
    };
    let reference = move |x: Tensor<3>| {
        let (g, u) = split(x);
        burn::tensor::activation::silu(g) * u
    };
    same_as(x, f, reference, 2e-6);
}

#[test]
fn rope_is_the_rotation_of_its_definition() {
    let dev = device();
    let x = Tensor::<4>::random([2, 3, 7, 10], Distribution::Normal(0.0, 1.0), &dev);
    // Tables whose halves differ: the backward's transpose must pair them right.
    let cos = Tensor::<2>::random([7, 10], Distribution::Normal(0.0, 1.0), &dev);
    let sin = Tensor::<2>::random([7, 10], Distribution::Normal(0.0, 1.0), &dev);
    let (c, s) = (cos.clone(), sin.clone());
    let reference = move |x: Tensor<4>| {
        let x1 = x.clone().narrow(3, 0, 5);
        let x2 = x.clone().narrow(3, 5, 5);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        x * c.clone().unsqueeze::<4>() + rotated * s.clone().unsqueeze::<4>()
    };
    same_as(x, |x| rope(x, cos.clone(), sin.clone()), reference, 2e-6);
}

/// The host forward (online log-sum-exp over vocabulary chunks) equals the Burn-op forward
/// the op runs today: loss and every row's log-sum-exp, over three chunks.
#[test]
fn host_cross_entropy_forward_is_burns() {
    let (n, v) = (7, 5003);
    let logits = Tensor::<2>::random([n, v], Distribution::Normal(0.0, 3.0), &flex());
    let targets = Tensor::<1, Int>::random([n], Distribution::Uniform(0.0, v as f64), &flex());
    let l = host::FlexTensor::from_data(logits.into_data());
    let t = host::FlexTensor::from_data(targets.into_data());
    let (loss, lse) = cross_entropy::forward_flex(l.clone(), t.clone());
    let (want_loss, want_lse) = cross_entropy_forward::<Flex>(l, t);
    for (a, b) in [(loss, want_loss), (lse, want_lse)] {
        let (a, b) = (host::contiguous(a), host::contiguous(b));
        assert_eq!(host::values(&a).len(), host::values(&b).len());
        for (x, y) in host::values(&a).iter().zip(host::values(&b)) {
            assert!((x - y).abs() <= 6e-6, "{x} vs {y}");
        }
    }
}

/// [`add_bias`] against Burn's broadcast add, with and without Balanced checkpointing (which
/// recomputes the output for the square's backward): the output and `x`'s gradient bit for
/// bit (one add; the gradient passed through), the bias's gradient within f32 summation order
/// — for `x` a fresh tensor (added in place), `x` shared (written to a new buffer), and row
/// counts that are not multiples of the four rows the sum takes a step.
#[test]
fn add_bias_is_burns_broadcast_add() {
    for checkpointing in [false, true] {
        let device = match checkpointing {
            true => device().gradient_checkpointing(),
            false => device(),
        };
        for dims in [[2, 7, 33], [3, 50, 40], [1, 1, 5]] {
            let x = Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let b = Tensor::<1>::random([dims[2]], Distribution::Normal(0.0, 1.0), &device);
            let w = Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let run = |add: &dyn Fn(Tensor<3>, Tensor<1>) -> Tensor<3>| {
                let (x, b) = (x.clone().require_grad(), b.clone().require_grad());
                let fresh = add(x.clone() * 2.0, b.clone());
                let shared = add(x.clone(), b.clone());
                let loss = (fresh.clone() * fresh.clone() * w.clone()).sum()
                    + (shared.clone() * w.clone()).sum();
                let grads = loss.backward();
                let values = |t: Tensor<3>| t.into_data().try_to_vec::<f32>().unwrap();
                let outputs = [values(fresh), values(shared)];
                (outputs, x.grad(&grads).unwrap(), b.grad(&grads).unwrap())
            };
            let (got, gx, gb) = run(&|x, b| add_bias(x, b));
            let (want, wx, wb) = run(&|x, b| x + b.unsqueeze());
            let what = format!("{dims:?} checkpointing={checkpointing}");
            assert_eq!(got, want, "{what}: outputs");
            close(&format!("{what}: x's gradient"), gx, wx, 0.0);
            // The bias's gradient sums, per column, the two adds' output gradients over the
            // rows (`2·fresh·w` and `w`, the same f32 values in both runs) in another order than
            // Burn's: each sum of n = 2·rows terms lies within γₙ·Σ|terms| of the exact one
            // (γₙ = n·u/(1 − n·u), u = 2⁻²⁴), so the two within twice that — a bound that holds
            // for any draw and any order (a relative 1e-5 was 1.03× short on one AVX2 draw).
            let n = (2 * dims[0] * dims[1]) as f64;
            let gamma = n * 2f64.powi(-24) / (1.0 - n * 2f64.powi(-24));
            let w = w.clone().into_data().try_to_vec::<f32>().unwrap();
            let mut magnitude = vec![0f64; dims[2]];
            for (i, (f, w)) in got[0].iter().zip(&w).enumerate() {
                magnitude[i % dims[2]] += f64::from((2.0 * f * w).abs() + w.abs());
            }
            let (gb, wb) = (
                gb.into_data().try_to_vec::<f32>().unwrap(),
                wb.into_data().try_to_vec::<f32>().unwrap(),
            );
            for (c, s) in magnitude.iter().enumerate() {
                let diff = f64::from((gb[c] - wb[c]).abs());
                assert!(
                    diff <= 2.0 * gamma * s,
                    "{what}: the bias's gradient [{c}]: {} vs {} (|diff| {diff:e} > {:e})",
                    gb[c],
                    wb[c],
                    2.0 * gamma * s
                );
            }
        }
    }
}
