//! [`matmul`] against Burn's product: each [`Bf16Kernel`] the CPU has within one bf16
//! rounding of it (both sum in f32 and round once; only the order of the sums differs) in
//! every operand layout the models pass, values and gradients; without one, Burn's product
//! bit for bit.

use super::*;
use burn::tensor::{Device, Distribution};

fn device() -> Device {
    Device::flex().autodiff()
}

fn values(t: Tensor<2>) -> Vec<f32> {
    t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap()
}

/// `got` within one bf16 step (2⁻⁷ relative) of `want`, element by element, or bitwise
/// equal where no kernel runs (`exact`). Returns the largest difference in units of that step.
fn agree(what: &str, got: Tensor<2>, want: Tensor<2>, exact: bool) -> f32 {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let (got, want) = (values(got), values(want));
    if exact {
        assert_eq!(
            got, want,
            "{what}: without a bf16 kernel the product is Burn's"
        );
        return 0.0;
    }
    let scale = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        // One bf16 step of the element, floored at 2⁻¹⁶ of the largest (a sum that cancels
        // keeps the f32 error of its terms, not of its value).
        let step = (w.abs().max(scale / 512.0) / 128.0).max(f32::MIN_POSITIVE);
        let units = (g - w).abs() / step;
        assert!(units <= 1.0, "{what}: element {i} is {g}, Burn's {w}");
        worst = worst.max(units);
    }
    worst
}

fn random(shape: [usize; 2], seed: u64) -> Tensor<2> {
    let device = device();
    device.seed(seed);
    Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), &device).cast(DType::BF16)
}

/// `lhs · rhs` by `kernel` (`None`: [`matmul`], the process's choice), untracked.
fn product(kernel: Option<Bf16Kernel>, lhs: Tensor<2>, rhs: Tensor<2>) -> Tensor<2> {
    match kernel {
        None => matmul(lhs, rhs),
        Some(kernel) => {
            let flex = |t: Tensor<2>| t.inner().try_into_primitive::<Flex>().unwrap();
            Tensor::from_primitive::<Flex>(flex_bf16(kernel, &flex(lhs), &flex(rhs)))
        }
    }
}

/// Every shape class (below, at and past the blocks and their padding; the models' `688`) in
/// the layouts the linear layers pass: `x Wᵀ` (a transposed right operand), `dy W` (both
/// row-major), `dyᵀ x` (a transposed left one), and strided slices — by every kernel the CPU
/// has and by the process's choice.
#[test]
fn the_product_is_burns_within_one_bf16_step_in_every_layout() {
    let kernels = [Bf16Kernel::Amx, Bf16Kernel::Avx512Bf16];
    let runs: Vec<_> = kernels
        .into_iter()
        .filter(|k| k.available())
        .map(Some)
        .collect();
    let exact = bf16_kernel().is_none();
    for kernel in runs.iter().copied().chain([None]) {
        let mut worst = 0f32;
        let mut check = |what: &str, a: Tensor<2>, b: Tensor<2>| {
            let got = product(kernel, a.clone(), b.clone());
            worst = worst.max(agree(what, got, a.matmul(b), exact && kernel.is_none()));
        };
        for (m, k, n) in [
            (1, 1, 1),
            (3, 5, 7),
            (37, 70, 45),
            (64, 688, 96),
            (96, 256, 688),
        ] {
            let (x, w, dy) = (random([m, k], 1), random([n, k], 2), random([m, n], 3));
            let shape = format!("{kernel:?} m={m} k={k} n={n}");
            check(&shape, x.clone(), w.clone().transpose());
            check(&shape, dy.clone(), w.clone());
            check(&shape, dy.clone().transpose(), x.clone());
            // Views into a wider buffer: rows apart by more than their length, an offset.
            check(
                &shape,
                x.clone(),
                random([k, 2 * n], 4).slice([0..k, n..2 * n]),
            );
            let tall = random([2 * n, k], 10).slice([n..2 * n, 0..k]);
            check(&shape, x.clone(), tall.transpose());
            let rows = random([m, 2 * k], 11).slice([0..m, k..2 * k]);
            check(&shape, rows, w.clone().transpose());
            // A flipped view (a negative stride where Flex keeps one: copied contiguous first).
            check(&shape, x.clone().flip([0]), w.clone().transpose());
        }
        println!(
            "{kernel:?} (None: the process's, {:?}): largest {worst} bf16 steps",
            bf16_kernel()
        );
    }
}

/// One autodiff node whose backward runs the same product: the input's and the weight's
/// gradients of `x Wᵀ` are Burn's within one bf16 step; with a constant weight only the
/// input gets one.
#[test]
fn its_gradients_are_burns() {
    let (m, k, n) = (40, 72, 48);
    // Drawn once: the device's generator is shared by the tests' threads.
    let (g, x0, w0) = (random([m, n], 7), random([m, k], 5), random([n, k], 6));
    let grads = |product: fn(Tensor<2>, Tensor<2>) -> Tensor<2>, track_w: bool| {
        let x = x0.clone().require_grad();
        let mut w = w0.clone();
        if track_w {
            w = w.require_grad();
        }
        let y = product(x.clone(), w.clone().transpose());
        let grads = (y.cast(DType::F32) * g.clone().cast(DType::F32))
            .sum()
            .backward();
        (x.grad(&grads).unwrap(), w.grad(&grads))
    };
    let burn = |a: Tensor<2>, b: Tensor<2>| a.matmul(b);
    let (dx, dw) = grads(matmul, true);
    let (want_dx, want_dw) = grads(burn, true);
    let exact = bf16_kernel().is_none();
    agree("dx", dx, want_dx, exact);
    agree("dW", dw.unwrap(), want_dw.unwrap(), exact);
    let (dx, dw) = grads(matmul, false);
    agree("dx, constant W", dx, grads(burn, false).0, exact);
    assert!(dw.is_none(), "a constant weight got a gradient");
}

/// f32 is Burn's product itself (the same `gemm` call into an output not zero-filled first),
/// bit for bit, in every layout the layers pass, an empty inner dimension included, and so are
/// its gradients.
#[test]
fn f32_is_burns_product_and_gradients() {
    let f32 = |shape: [usize; 2], seed| random(shape, seed).cast(DType::F32);
    let (x, w, dy) = (f32([33, 65], 8), f32([17, 65], 9), f32([33, 17], 10));
    let cases = [
        (x.clone(), w.clone().transpose()),
        (dy.clone(), w.clone()),
        (dy.clone().transpose(), x.clone()),
        (
            x.clone().slice([3..30, 5..60]),
            w.clone().slice([2..9, 5..60]).transpose(),
        ),
        (x.clone().flip([0]), w.clone().transpose()),
        (
            x.clone().slice([0..33, 0..0]),
            w.clone().slice([0..17, 0..0]).transpose(),
        ),
    ];
    for (a, b) in cases {
        let want = values(a.clone().matmul(b.clone()));
        assert_eq!(values(matmul(a, b)), want);
    }
    let grads = |product: fn(Tensor<2>, Tensor<2>) -> Tensor<2>| {
        let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
        let grads = (product(x.clone(), w.clone().transpose()) * dy.clone())
            .sum()
            .backward();
        (
            values(x.grad(&grads).unwrap()),
            values(w.grad(&grads).unwrap()),
        )
    };
    assert_eq!(grads(matmul), grads(|a, b| a.matmul(b)));
}

/// A linear layer's `x Wᵀ`: `W`'s gradient comes contiguous, like `W`, where `W` is no wider
/// than tall (the product's backward writes the gradient of the column-major `Wᵀ` column-major);
/// a wider `W` keeps Burn's transposed view (`gemm`'s workspace), and a row-major right operand's
/// gradient stays row-major — in f32 and, where the CPU has a [`bf16_kernel`], bf16 (without
/// one, bf16 takes Burn's matmul and its layouts), with the values checked above.
#[test]
fn a_weights_gradient_is_laid_out_like_the_weight() {
    let contiguous = |t: Tensor<2>| {
        let t = t.inner().try_into_primitive::<Flex>().unwrap();
        t.layout().is_contiguous()
    };
    let mut dtypes = vec![DType::F32];
    dtypes.extend(bf16_kernel().map(|_| DType::BF16));
    for dtype in dtypes {
        let x = random([40, 72], 5).cast(dtype).require_grad();
        let w = random([48, 72], 6).cast(dtype).require_grad();
        let wide = random([96, 72], 8).cast(dtype).require_grad();
        let b = random([72, 48], 7).cast(dtype).require_grad();
        let y = matmul(x.clone(), w.clone().transpose()) + matmul(x.clone(), b.clone());
        let y = y.sum() + matmul(x.clone(), wide.clone().transpose()).sum();
        let grads = y.cast(DType::F32).backward();
        assert!(
            contiguous(w.grad(&grads).unwrap()),
            "{dtype:?}: W's gradient"
        );
        assert!(
            contiguous(b.grad(&grads).unwrap()),
            "{dtype:?}: B's gradient"
        );
        assert!(
            !contiguous(wide.grad(&grads).unwrap()),
            "{dtype:?}: the wide W's gradient"
        );
    }
}

/// [`contiguous`] gives a transposed view's values row-major, bit for bit what Burn's copy
/// gives, for shapes on and off the blocks (the blocked transpose where the CPU has AVX-512 or
/// AVX, Burn's copy elsewhere), and a row-major tensor unchanged.
#[test]
fn contiguous_copies_a_transposed_view_row_major() {
    for [m, n] in [[16, 16], [37, 21], [64, 48], [2, 131], [300, 17]] {
        let stored = Tensor::<2>::random([n, m], Distribution::Normal(0.0, 1.0), &Device::flex());
        let view = stored.clone().transpose();
        let prim = view.clone().try_into_primitive::<Flex>().unwrap();
        assert!(
            Flex::is_column_major(&prim),
            "[{m}, {n}]: a column-major view"
        );
        let got = contiguous(view.clone());
        assert!(
            got.clone()
                .try_into_primitive::<Flex>()
                .unwrap()
                .is_contiguous()
        );
        assert_eq!(values(got), values(view.clone()), "[{m}, {n}]");
        assert_eq!(
            values(contiguous(stored.clone())),
            values(stored),
            "[{n}, {m}] row-major"
        );
    }
}

/// Every transpose width the CPU has writes each value where a plain loop does, for shapes on
/// and off its blocks (edges of 1 to 15 rows and columns, one block, none); a CPU with neither
/// AVX nor AVX-512 has nothing to check, and the test says so rather than pass.
#[cfg(target_arch = "x86_64")]
#[test]
fn every_transpose_width_writes_the_transposed_matrix() {
    let widths = transpose::Width::available();
    assert!(
        !widths.is_empty(),
        "no AVX on this x86-64 CPU: nothing checked"
    );
    for width in widths {
        for [rows, cols] in [
            [16, 16],
            [8, 8],
            [37, 21],
            [64, 48],
            [2, 131],
            [300, 17],
            [7, 9],
        ] {
            let src: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
            let mut out = vec![std::mem::MaybeUninit::new(f32::NAN); rows * cols];
            transpose::transpose_f32(width, &src, rows, cols, &mut out);
            for (r, c) in (0..rows).flat_map(|r| (0..cols).map(move |c| (r, c))) {
                // SAFETY: filled with NaN above; a value left unwritten fails the comparison.
                let got = unsafe { out[c * rows + r].assume_init() };
                assert_eq!(
                    got,
                    src[r * cols + c],
                    "{width:?} [{rows}, {cols}] at ({r}, {c})"
                );
            }
        }
    }
}

/// [`linear`] is [`matmul`] then [`crate::add_bias`] bit for bit — the output and the
/// gradients of `x`, `W` and `b` — with and without Balanced checkpointing (under which the
/// two-node way keeps the product and recomputes the add for the square's backward), in f32
/// and, where the CPU has a kernel, bf16; `W`'s gradient contiguous like `W`; a frozen bias
/// and an untracked input get no gradient.
#[test]
fn linear_is_the_product_then_the_bias() {
    let mut dtypes = vec![DType::F32];
    dtypes.extend(bf16_kernel().map(|_| DType::BF16));
    for checkpointing in [false, true] {
        for dtype in dtypes.iter().copied() {
            let on = |t: Tensor<2>| match checkpointing {
                true => t.to_device(&device().gradient_checkpointing()),
                false => t,
            };
            let x = on(random([37, 72], 11).cast(dtype));
            let w = on(random([48, 72], 12).cast(dtype));
            let b = on(random([1, 48], 13).cast(dtype)).reshape([48]);
            let dy = on(random([37, 48], 14).cast(DType::F32));
            let run = |f: &dyn Fn(Tensor<2>, Tensor<2>, Tensor<1>) -> Tensor<2>| {
                let (x, w, b) = (
                    x.clone().require_grad(),
                    w.clone().require_grad(),
                    b.clone().require_grad(),
                );
                let y = f(x.clone(), w.clone().transpose(), b.clone()).cast(DType::F32);
                let grads = ((y.clone() * y.clone()) * dy.clone()).sum().backward();
                let wg = w.grad(&grads).unwrap();
                let laid = wg.clone().inner().try_into_primitive::<Flex>().unwrap();
                assert!(laid.layout().is_contiguous(), "{dtype:?}: W's gradient");
                let bg = b.grad(&grads).unwrap().reshape([1, 48]);
                let got = [y, x.grad(&grads).unwrap(), wg, bg];
                got.map(values)
            };
            let got = run(&|x, w, b| linear(x, w, b));
            let want = run(&|x, w, b| crate::add_bias(matmul(x, w), b));
            let what = format!("{dtype:?} checkpointing={checkpointing}");
            for (i, name) in ["output", "x's gradient", "W's gradient", "b's gradient"]
                .iter()
                .enumerate()
            {
                assert_eq!(got[i], want[i], "{what}: {name}");
            }
            // Neither a frozen bias nor an untracked input gets a gradient.
            let w_only = w.clone().require_grad();
            let grads = linear(x.clone(), w_only.clone().transpose(), b.clone())
                .cast(DType::F32)
                .sum()
                .backward();
            assert!(w_only.grad(&grads).is_some(), "{what}: W tracked");
            assert!(
                x.grad(&grads).is_none() && b.grad(&grads).is_none(),
                "{what}"
            );
        }
    }
}
