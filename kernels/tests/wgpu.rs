//! Each kernel against its plain-Burn fallback on the same wgpu device (on a machine without
//! a GPU, Mesa's software Vulkan): the device suite of [`bonfire_kernels::testing`], which the
//! GPU kit runs on CUDA. Run with `--features wgpu` (`cargo xtask test` does).

#![cfg(feature = "wgpu")]

use bonfire_kernels::testing;
use burn::tensor::{Device, DeviceKind};

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
    assert!(bonfire_kernels::runs_kernels(&device));
    assert!(bonfire_kernels::runs_kernels(&device.autodiff()));
}

#[test]
fn pack_and_unpack_match_the_fallback_exactly() {
    println!("{}", testing::pack_matches_fallback(&wgpu()));
}

#[test]
fn quantize_matches_the_fallback_exactly() {
    println!("{}", testing::quantize_matches_fallback(&wgpu()));
}

#[test]
fn fused_adamw_matches_burns_adamw() {
    println!("{}", testing::fused_adamw_matches_burns(&wgpu()));
}

#[test]
fn fused_attention_matches_the_reference() {
    println!("{}", testing::attention_matches_fallback(&wgpu()));
}

#[test]
fn fused_ops_match_the_reference() {
    println!("{}", testing::fused_ops_match_reference(&wgpu()));
}

#[test]
fn linear_cross_entropy_matches_the_reference() {
    println!(
        "{}",
        testing::linear_cross_entropy_matches_reference(&wgpu())
    );
}
