//! Each kernel against its plain-Burn fallback on the same wgpu device (on a machine without
//! a GPU, Mesa's software Vulkan): bit-for-bit where the kernel does the fallback's arithmetic
//! in the same order, within a stated tolerance for AdamW (a compiler may fuse its
//! multiply-adds). Run with `--features wgpu` (`cargo xtask test` does).

#![cfg(feature = "wgpu")]

mod common;

use bonfire_kernels::{
    FusedAdamWConfig, fallback, pack_scaled, quantize_with_feedback, runs_kernels, unpack_scaled,
};
use burn::optim::Optimizer;
use burn::tensor::{DType, Device, DeviceKind, Tensor, TensorData};
use common::{host, tensor, values};

fn wgpu() -> Device {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: set before any thread of this test binary reads the environment.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    Device::wgpu(DeviceKind::Cpu)
}

#[test]
fn wgpu_runs_the_kernels() {
    let device = wgpu();
    assert!(runs_kernels(&device));
    assert!(runs_kernels(&device.autodiff()));
}

#[test]
fn pack_and_unpack_match_the_fallback_exactly() {
    let device = wgpu();
    let parts: Vec<_> = [1000, 3, 0, 4097]
        .iter()
        .enumerate()
        .map(|(i, &n)| tensor(&values(n, i as u32), &device))
        .collect();
    let lens = [1000, 3, 0, 4097];
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
        for (k, r) in kernel.into_iter().zip(reference) {
            assert_eq!(host(k), host(r), "unpack, scale {scale}");
        }
    }
}

#[test]
fn quantize_matches_the_fallback_exactly() {
    let device = wgpu();
    let g = tensor(&values(3000, 11), &device);
    let r = tensor(&values(3000, 13), &device).mul_scalar(1e-3);
    // Mesa's lavapipe stores f16 but not bf16; a GPU may store both.
    assert!(bonfire_kernels::stores(&device, DType::F16));
    let stored = [DType::F16, DType::BF16].into_iter();
    for dtype in stored.filter(|&d| bonfire_kernels::stores(&device, d)) {
        for residual in [None, Some(r.clone())] {
            let (kq, kr) = quantize_with_feedback(g.clone(), residual.clone(), 0.5, dtype);
            let (fq, fr) = fallback::quantize_with_feedback(g.clone(), residual, 0.5, dtype);
            assert_eq!(kq.dtype(), dtype);
            assert_eq!(host(kq), host(fq), "{dtype:?} values");
            assert_eq!(host(kr), host(fr), "{dtype:?} residual");
        }
    }
}

#[test]
fn fused_adamw_matches_burns_adamw() {
    let device = wgpu();
    let config = FusedAdamWConfig::new()
        .with_beta_2(0.95)
        .with_epsilon(1e-6)
        .with_weight_decay(0.1);
    let fused = config.build();
    let shape = [37, 29];
    let mut p_fused = Tensor::<2>::from_data(TensorData::new(values(37 * 29, 1), shape), &device);
    let mut p_burn = p_fused.clone();
    let (mut s_fused, mut s_burn) = (None, None);
    for step in 0..5u32 {
        let g =
            Tensor::<2>::from_data(TensorData::new(values(37 * 29, 100 + step), shape), &device);
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
    eprintln!("fused AdamW vs Burn's AdamW after 5 steps: largest relative difference {worst:e}");
    assert!(worst <= 1e-6, "{worst:e}");
    let (sa, sb) = (s_fused.unwrap().momentum, s_burn.unwrap().momentum);
    assert_eq!(sa.time, sb.time);
    assert_eq!(sa.moment_1.dims(), sb.moment_1.dims());
}
