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
