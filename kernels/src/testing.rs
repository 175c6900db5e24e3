//! The kernels' device suite: each CubeCL kernel against its plain-Burn fallback on one
//! device, as functions that take the device and panic on a mismatch. `tests/wgpu.rs` runs
//! them on Mesa's software Vulkan; the GPU kit (`cargo xtask gpu-kit`, docs/gpu.md) runs them
//! on CUDA. Bit for bit where a kernel does its fallback's arithmetic in the same order;
//! within a stated tolerance for AdamW (a compiler may fuse its multiply-adds).

use crate::{
    FusedAdamWConfig, fallback, pack_scaled, quantize_with_feedback, runs_kernels, unpack_scaled,
};
use burn::optim::Optimizer;
use burn::tensor::{DType, Device, Tensor, TensorData};

/// `t`'s values as f32 on the host.
pub fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap()
}

/// A 1-d f32 tensor of `values` on `device`.
pub fn tensor(values: &[f32], device: &Device) -> Tensor<1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// `n` values in [-3.5, 3.8) from a multiplicative hash of the index, varied by `seed`.
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) % 1000)
        .map(|x| x as f32 / 137.0 - 3.5)
        .collect()
}

/// Panics naming `what` unless the largest `|a − b|` is at most `bound` times the reference
/// `b`'s largest magnitude; returns that difference over the magnitude.
fn within(what: &str, a: &[f32], b: &[f32], bound: f32) -> f32 {
    assert_eq!(a.len(), b.len(), "{what}: sizes differ");
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(diff <= bound * scale, "{what}: {diff} of {scale}");
    diff / scale.max(1e-30)
}

/// What a kernel in `dtype` may differ from the f32 reference by, relative to its largest
/// magnitude: 1e-5 in f32, 4 roundings of a 16-bit type.
fn bound(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 4.0 * 2f32.powi(-11),
        _ => 4.0 * 2f32.powi(-8),
    }
}

/// Every check below on `device`, which must run the kernels (a CubeCL device); returns one
/// line per check.
pub fn run_all(device: &Device) -> Vec<String> {
    assert!(runs_kernels(device), "{device:?} does not run the kernels");
    let autodiff = device.clone().autodiff();
    assert!(runs_kernels(&autodiff), "{device:?} under autodiff");
    vec![
        pack_matches_fallback(device),
        quantize_matches_fallback(device),
        fused_adamw_matches_burns(device),
        attention_matches_fallback(device),
        fused_ops_match_reference(device),
        linear_cross_entropy_matches_reference(device),
    ]
}

/// Packing and unpacking a bucket (empty and odd-sized parts, three scales) equal the
/// fallback's exactly.
pub fn pack_matches_fallback(device: &Device) -> String {
    let lens = [1000, 3, 0, 4097];
    let parts: Vec<_> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| tensor(&values(n, i as u32), device))
        .collect();
    for scale in [1.0, 0.25, 1.0 / 3.0] {
        let kernel = pack_scaled(&parts, scale);
        let reference = fallback::pack_scaled(&parts, scale);
        assert_eq!(
            host(kernel.clone()),
            host(reference.clone()),
            "pack, scale {scale}"
        );
        let kernel = unpack_scaled(kernel, &lens, 3.0);
        let reference = fallback::unpack_scaled(reference, &lens, 3.0);
        assert_eq!(kernel.len(), lens.len(), "unpack: one tensor per part");
        for (k, r) in kernel.into_iter().zip(reference) {
            assert_eq!(host(k), host(r), "unpack, scale {scale}");
        }
    }
    "pack/unpack: equal to the fallback, 3 scales × 4 parts".into()
}

/// The 16-bit cast with error feedback equals the fallback's exactly, in every 16-bit type
/// the device stores (f16 at least), with and without a residual.
pub fn quantize_matches_fallback(device: &Device) -> String {
    let g = tensor(&values(3000, 11), device);
    let r = tensor(&values(3000, 13), device).mul_scalar(1e-3);
    // Mesa's lavapipe stores f16 but not bf16; a GPU may store both.
    assert!(crate::stores(device, DType::F16), "f16 storage");
    let stored: Vec<DType> = [DType::F16, DType::BF16]
        .into_iter()
        .filter(|&d| crate::stores(device, d))
        .collect();
    for &dtype in &stored {
        for residual in [None, Some(r.clone())] {
            let (kq, kr) = quantize_with_feedback(g.clone(), residual.clone(), 0.5, dtype);
            let (fq, fr) = fallback::quantize_with_feedback(g.clone(), residual, 0.5, dtype);
            assert_eq!(kq.dtype(), dtype);
            assert_eq!(host(kq), host(fq), "{dtype:?} values");
            assert_eq!(host(kr), host(fr), "{dtype:?} residual");
        }
    }
    format!("quantize with feedback: equal to the fallback in {stored:?}")
}

/// Five steps of the fused AdamW stay within 1e-6 (relative, floor 1) of Burn's AdamW, with
/// the same step count and state shapes.
pub fn fused_adamw_matches_burns(device: &Device) -> String {
    let config = FusedAdamWConfig::new()
        .with_beta_2(0.95)
        .with_epsilon(1e-6)
        .with_weight_decay(0.1);
    let fused = config.build();
    let shape = [37, 29];
    let mut p_fused = Tensor::<2>::from_data(TensorData::new(values(37 * 29, 1), shape), device);
    let mut p_burn = p_fused.clone();
    let (mut s_fused, mut s_burn) = (None, None);
    for step in 0..5u32 {
        let g = Tensor::<2>::from_data(TensorData::new(values(37 * 29, 100 + step), shape), device);
        let (p, s) = fused.step(1e-2, p_fused, g.clone(), s_fused);
        (p_fused, s_fused) = (p, s);
        let (p, s) = fallback::adamw_step(&config, 1e-2, p_burn, g, s_burn);
        (p_burn, s_burn) = (p, Some(s));
    }
    let (a, b) = (host(p_fused), host(p_burn));
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-6,
        "fused AdamW vs Burn's after 5 steps: {worst:e}"
    );
    let (sa, sb) = (s_fused.unwrap().momentum, s_burn.unwrap().momentum);
    assert_eq!(sa.time, sb.time);
    assert_eq!(sa.moment_1.dims(), sb.moment_1.dims());
    format!("fused AdamW: within {worst:e} of Burn's AdamW after 5 steps (bound 1e-6)")
}

/// The fused attention's kernels against the plain-Burn reference on `device` (the
/// materialized masked softmax, Burn's autodiff): output, log-sum-exp and the gradients of
/// `q`, `k`, `v` — of the output weighted by a fixed tensor plus the log-sum-exp weighted by
/// another — within 1e-5 of the reference's largest magnitude, for grouped kv heads, causal
/// and full masks, fewer queries than keys, sliding windows (at an offset too); and a query
/// that sees no key gets output 0 and log-sum-exp −∞ with finite gradients.
pub fn attention_matches_fallback(device: &Device) -> String {
    use crate::{Mask, attention_with_lse};
    let device = &device.clone().autodiff();
    let cases = [
        (4, 2, 37, 37, Mask::CAUSAL),
        (2, 2, 20, 20, Mask::FULL),
        (4, 1, 5, 37, Mask::CAUSAL),
        (2, 1, 40, 40, Mask::CAUSAL.with_window(Some(5))),
        (2, 1, 37, 37, Mask::CAUSAL.with_window(Some(50)).at(40)),
    ];
    let leaf = |shape: [usize; 4], seed: u32| {
        let n = shape.iter().product();
        let v: Vec<f32> = values(n, seed).iter().map(|x| x * 0.5).collect();
        Tensor::<4>::from_data(TensorData::new(v, shape), device).require_grad()
    };
    let mut worst = 0.0f32;
    for (h, h_kv, tq, tk, mask) in cases {
        let dh = 16;
        let scale = 1.0 / (dh as f64).sqrt();
        let run = |reference: bool| {
            let [q, k, v] = [
                leaf([2, h, tq, dh], 1),
                leaf([2, h_kv, tk, dh], 2),
                leaf([2, h_kv, tk, dh], 3),
            ];
            let (w, wl) = (leaf([2, h, tq, dh], 4).detach(), leaf([2, h, tq, 1], 5));
            let (out, lse) = match reference {
                true => crate::attention::fallback::attention_with_lse(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    scale,
                    mask,
                ),
                false => attention_with_lse(q.clone(), k.clone(), v.clone(), scale, mask),
            };
            let lse = lse.unsqueeze_dim::<4>(3);
            let g = ((out.clone() * w).sum() + (lse.clone() * wl.detach()).sum()).backward();
            let grads = [&q, &k, &v].map(|x| host(x.grad(&g).expect("a gradient")));
            [
                host(out),
                host(lse),
                grads[0].clone(),
                grads[1].clone(),
                grads[2].clone(),
            ]
        };
        let (ours, reference) = (run(false), run(true));
        for (name, (a, b)) in ["out", "lse", "dq", "dk", "dv"]
            .iter()
            .zip(ours.iter().zip(&reference))
        {
            let case = format!("h {h} h_kv {h_kv} tq {tq} tk {tk} {mask:?}");
            let what = format!("attention {name} ({case})");
            worst = worst.max(within(&what, a, b, bound(DType::F32)));
        }
    }
    // Queries at 40..47 over keys 0..37 with W = 8: from the fifth on they see no key.
    let mask = Mask::CAUSAL.with_window(Some(8)).at(40);
    let [q, k, v] = [
        leaf([1, 2, 8, 16], 6),
        leaf([1, 1, 37, 16], 7),
        leaf([1, 1, 37, 16], 8),
    ];
    let (out, lse) = attention_with_lse(q.clone(), k.clone(), v.clone(), 0.25, mask);
    let (o, l) = (host(out.clone()), host(lse.clone()));
    for (row, &x) in l.iter().enumerate() {
        let sees = row % 8 < 4;
        assert_eq!(x.is_finite(), sees, "lse of row {row}: {x}");
        let zero = o[row * 16..(row + 1) * 16].iter().all(|&y| y == 0.0);
        assert_eq!(zero, !sees, "output of row {row}");
    }
    let g = out.sum().backward();
    for x in [&q, &k, &v] {
        assert!(
            host(x.grad(&g).expect("a gradient"))
                .iter()
                .all(|g| g.is_finite())
        );
    }
    let halves = attention_16bit_matches(device);
    format!(
        "fused attention: within {worst:e} of the reference (bound 1e-5), 5 masks; no-key rows \
         0 and −∞; {halves}"
    )
}

/// The kernels in each 16-bit type the device stores against the f32 reference on the same
/// rounded inputs: output and gradients within 4 units of the type's rounding (2⁻¹¹ for f16,
/// 2⁻⁸ for bf16) of the reference's largest magnitude — the kernels accumulate in f32, so
/// what remains is the rounding of their results and of the reference's inputs' gradients.
fn attention_16bit_matches(device: &Device) -> String {
    use crate::{Mask, attention};
    let stored: Vec<DType> = [DType::F16, DType::BF16]
        .into_iter()
        .filter(|&d| crate::stores(device, d))
        .collect();
    let mut out = Vec::new();
    for dtype in stored {
        // A rounding unit of the type: the bound is four.
        let unit = bound(dtype) / 4.0;
        let leaf = |shape: [usize; 4], seed: u32| {
            let n = shape.iter().product();
            let v: Vec<f32> = values(n, seed).iter().map(|x| x * 0.5).collect();
            Tensor::<4>::from_data(TensorData::new(v, shape), device).cast(dtype)
        };
        let mask = Mask::CAUSAL.with_window(Some(9));
        let [q, k, v] = [
            leaf([2, 4, 21, 16], 1),
            leaf([2, 2, 21, 16], 2),
            leaf([2, 2, 21, 16], 3),
        ];
        let w = leaf([2, 4, 21, 16], 4).cast(DType::F32);
        let run = |ty: DType, reference: bool| {
            let [q, k, v] = [&q, &k, &v].map(|t| t.clone().cast(ty).require_grad());
            let o = match reference {
                true => crate::attention::fallback::attention(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    0.25,
                    mask,
                ),
                false => attention(q.clone(), k.clone(), v.clone(), 0.25, mask),
            };
            assert_eq!(o.dtype(), ty);
            let g = (o.clone().cast(DType::F32) * w.clone()).sum().backward();
            let grads = [&q, &k, &v].map(|x| host(x.grad(&g).expect("a gradient")));
            [
                host(o),
                grads[0].clone(),
                grads[1].clone(),
                grads[2].clone(),
            ]
        };
        let (ours, reference) = (run(dtype, false), run(DType::F32, true));
        let mut worst = 0.0f32;
        for (name, (a, b)) in ["out", "dq", "dk", "dv"]
            .iter()
            .zip(ours.iter().zip(&reference))
        {
            let what = format!("attention {dtype:?} {name}");
            worst = worst.max(within(&what, a, b, bound(dtype)) / unit);
        }
        out.push(format!("{dtype:?} within {worst:.2} roundings"));
    }
    out.join(", ")
}

/// SwiGLU's `silu_mul`, RoPE and the two norms' cores (their kernels) against the same math in
/// Burn's tensor ops with Burn's autodiff on `device`: output and every input gradient (of the
/// output weighted by a fixed tensor) within 1e-5 of the reference's largest magnitude in f32,
/// on shapes with odd row widths; and in each 16-bit type the device stores within 4
/// roundings of the f32 reference on the same rounded inputs.
pub fn fused_ops_match_reference(device: &Device) -> String {
    use burn::tensor::activation::sigmoid;
    let device = &device.clone().autodiff();
    let leaf = |shape: [usize; 4], seed: u32| {
        let n = shape.iter().product();
        Tensor::<4>::from_data(TensorData::new(values(n, seed), shape), device)
    };
    let table = |seed: u32| {
        let v: Vec<f32> = values(7 * 6, seed).iter().map(|x| x.sin()).collect();
        Tensor::<2>::from_data(TensorData::new(v, [7, 6]), device)
    };
    let (cos, sin) = (table(20), table(21));
    let rotate = |x: Tensor<4>| {
        let half = x.dims()[3] / 2;
        let (a, b) = (x.clone().narrow(3, 0, half), x.narrow(3, half, half));
        Tensor::cat(vec![b.neg(), a], 3)
    };
    let norm = |x: Tensor<4>, centered: bool| {
        let x = match centered {
            true => x.clone() - x.mean_dim(3),
            false => x,
        };
        x.clone() / (x.clone() * x).mean_dim(3).add_scalar(1e-5).sqrt()
    };
    type Op<'a> = Box<dyn Fn(&[Tensor<4>], bool) -> Tensor<4> + 'a>;
    let ops: Vec<(&str, [usize; 4], usize, Op)> = vec![
        (
            "silu_mul",
            [2, 3, 5, 37],
            2,
            Box::new(|x: &[Tensor<4>], ours: bool| match ours {
                true => crate::silu_mul(x[0].clone(), x[1].clone()),
                false => x[0].clone() * sigmoid(x[0].clone()) * x[1].clone(),
            }),
        ),
        (
            "rope",
            [2, 3, 7, 6],
            1,
            Box::new(|x: &[Tensor<4>], ours: bool| {
                let (c, s) = (
                    cos.clone().cast(x[0].dtype()),
                    sin.clone().cast(x[0].dtype()),
                );
                match ours {
                    true => crate::rope(x[0].clone(), c, s),
                    false => {
                        let (c, s) = (c.unsqueeze::<4>(), s.unsqueeze::<4>());
                        x[0].clone() * c + rotate(x[0].clone()) * s
                    }
                }
            }),
        ),
        (
            "rms_norm_core",
            [2, 3, 5, 37],
            1,
            Box::new(|x: &[Tensor<4>], ours: bool| match ours {
                true => crate::rms_norm_core(x[0].clone(), 1e-5),
                false => norm(x[0].clone(), false),
            }),
        ),
        (
            "layer_norm_core",
            [2, 3, 5, 37],
            1,
            Box::new(|x: &[Tensor<4>], ours: bool| match ours {
                true => crate::layer_norm_core(x[0].clone(), 1e-5),
                false => norm(x[0].clone(), true),
            }),
        ),
    ];
    let stored: Vec<DType> = [DType::F16, DType::BF16]
        .into_iter()
        .filter(|&d| crate::stores(device, d))
        .collect();
    let mut worst = 0.0f32;
    for (name, shape, inputs, op) in &ops {
        let w = leaf(*shape, 9);
        let run = |dtype: DType, ours: bool| {
            let xs: Vec<Tensor<4>> = (0..*inputs)
                .map(|i| leaf(*shape, i as u32).cast(dtype).cast(DType::F32))
                .map(|x| x.cast(if ours { dtype } else { DType::F32 }).require_grad())
                .collect();
            let y = op(&xs, ours);
            let g = (y.clone().cast(DType::F32) * w.clone()).sum().backward();
            let mut out = vec![host(y)];
            out.extend(xs.iter().map(|x| host(x.grad(&g).expect("a gradient"))));
            out
        };
        for dtype in std::iter::once(DType::F32).chain(stored.iter().copied()) {
            for (k, (a, b)) in run(dtype, true).iter().zip(&run(dtype, false)).enumerate() {
                let ratio = within(&format!("{name} {dtype:?} #{k}"), a, b, bound(dtype));
                if dtype == DType::F32 {
                    worst = worst.max(ratio);
                }
            }
        }
    }
    let ce = cross_entropy_matches_reference(device, &stored);
    format!(
        "fused silu_mul, rope, rms/layer norm: within {worst:e} of Burn's ops in f32 (bound \
         1e-5), and in {stored:?} within 4 roundings; {ce}"
    )
}

/// The cross-entropy's kernels (the loss, and the logits' gradient from the kept log-sum-exp)
/// against `log_softmax` and a gather in Burn's ops with Burn's autodiff, over 37 rows of a
/// 1,001-word vocabulary: within 1e-5 of the largest magnitude in f32, 4 roundings in `halves`.
fn cross_entropy_matches_reference(device: &Device, halves: &[DType]) -> String {
    use burn::tensor::Int;
    use burn::tensor::activation::log_softmax;
    let (n, v) = (37, 1001);
    let logits = Tensor::<2>::from_data(TensorData::new(values(n * v, 30), [n, v]), device);
    let ids: Vec<i64> = (0..n).map(|i| ((i * 7919) % v) as i64).collect();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), device);
    let mut worst = 0.0f32;
    for dtype in std::iter::once(DType::F32).chain(halves.iter().copied()) {
        let bound = bound(dtype);
        let rounded = logits.clone().cast(dtype).cast(DType::F32);
        let run = |ours: bool| {
            let x = match ours {
                true => rounded.clone().cast(dtype),
                false => rounded.clone(),
            }
            .require_grad();
            let loss = match ours {
                true => crate::cross_entropy(x.clone(), targets.clone()),
                false => {
                    let picked =
                        log_softmax(x.clone(), 1).gather(1, targets.clone().unsqueeze_dim(1));
                    picked.mean().neg()
                }
            };
            let g = loss.clone().backward();
            [host(loss), host(x.grad(&g).expect("a gradient"))]
        };
        for (k, (a, b)) in run(true).iter().zip(&run(false)).enumerate() {
            let ratio = within(&format!("cross_entropy {dtype:?} #{k}"), a, b, bound);
            if dtype == DType::F32 {
                worst = worst.max(ratio);
            }
        }
    }
    format!("cross-entropy within {worst:e} in f32")
}

/// The head with its loss by blocks ([`crate::linear_cross_entropy`]: 37 rows of width 24, a
/// 1,001-word vocabulary, blocks of 8 rows) against Burn's ops with Burn's autodiff (the
/// product, `log_softmax`, a gather): the loss and both gradients within 1e-5 of their largest
/// magnitude in f32, and in each 16-bit type the device stores within 4 roundings of the f32
/// reference on the same rounded inputs.
pub fn linear_cross_entropy_matches_reference(device: &Device) -> String {
    use burn::tensor::Int;
    use burn::tensor::activation::log_softmax;
    let device = &device.clone().autodiff();
    let (n, d, v) = (37, 24, 1001);
    let leaf = |shape: [usize; 2], seed: u32, scale: f32| {
        let x: Vec<f32> = values(shape[0] * shape[1], seed)
            .iter()
            .map(|x| x * scale)
            .collect();
        Tensor::<2>::from_data(TensorData::new(x, shape), device)
    };
    let (hidden, weight) = (leaf([n, d], 40, 1.0), leaf([v, d], 41, 0.1));
    let ids: Vec<i64> = (0..n).map(|i| ((i * 7919) % v) as i64).collect();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), device);
    let halves = [DType::F16, DType::BF16]
        .into_iter()
        .filter(|&d| crate::stores(device, d));
    let mut worst = 0.0f32;
    for dtype in std::iter::once(DType::F32).chain(halves) {
        let run = |ours: bool| {
            let at = if ours { dtype } else { DType::F32 };
            let rounded = |x: &Tensor<2>| x.clone().cast(dtype).cast(DType::F32).cast(at);
            let (h, w) = (
                rounded(&hidden).require_grad(),
                rounded(&weight).require_grad(),
            );
            let loss = match ours {
                true => crate::linear_cross_entropy(h.clone(), w.clone(), targets.clone(), 8),
                false => {
                    let logits = h.clone().matmul(w.clone().transpose());
                    let picked = log_softmax(logits, 1).gather(1, targets.clone().unsqueeze_dim(1));
                    picked.mean().neg()
                }
            };
            let g = loss.clone().backward();
            [
                host(loss),
                host(h.grad(&g).expect("dh")),
                host(w.grad(&g).expect("dW")),
            ]
        };
        for (k, (a, b)) in run(true).iter().zip(&run(false)).enumerate() {
            let ratio = within(
                &format!("linear_cross_entropy {dtype:?} #{k}"),
                a,
                b,
                bound(dtype),
            );
            if dtype == DType::F32 {
                worst = worst.max(ratio);
            }
        }
    }
    format!("linear cross-entropy by blocks within {worst:e} of Burn's ops in f32")
}
