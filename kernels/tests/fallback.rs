//! The ops on Burn's CPU device (Flex), where they run their plain-Burn fallbacks (packing: a
//! one-pass host copy), against
//! values computed here element by element; and `FusedAdamW` against Burn's `AdamW` through a
//! `ModuleOptimizer`, records included.

mod common;

use bonfire_kernels::{
    FusedAdamWConfig, pack_scaled, quantize_with_feedback, runs_kernels, unpack_scaled,
};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{DType, Device, Tensor, TensorData};
use common::{host, tensor, values};
use half::{bf16, f16};

#[test]
fn flex_runs_the_fallbacks() {
    assert!(!runs_kernels(&Device::flex()));
    assert!(!runs_kernels(&Device::flex().autodiff()));
}

#[test]
fn pack_and_unpack_scale_every_element_once() {
    let device = Device::flex();
    let parts = [values(5, 1), values(0, 2), values(7, 3)];
    let tensors: Vec<_> = parts.iter().map(|p| tensor(p, &device)).collect();
    // Flex packs in one host pass: the same values as Burn's `cat` then `mul_scalar`.
    for scale in [1.0, 1.0 / 3.0] {
        let reference = bonfire_kernels::fallback::pack_scaled(&tensors, scale);
        assert_eq!(host(pack_scaled(&tensors, scale)), host(reference));
    }
    let flat = pack_scaled(&tensors, 0.5);
    let expected: Vec<f32> = parts.iter().flatten().map(|x| x * 0.5).collect();
    assert_eq!(host(flat.clone()), expected);
    let back = unpack_scaled(flat, &[5, 0, 7], 2.0);
    assert_eq!(back.len(), parts.len(), "one tensor per part");
    for (b, p) in back.into_iter().zip(&parts) {
        assert_eq!(&host(b), p);
    }
}

#[test]
fn quantize_keeps_what_rounding_lost() {
    let device = Device::flex();
    let g = values(64, 7);
    let r = values(64, 9).iter().map(|x| x * 1e-3).collect::<Vec<_>>();
    for dtype in [DType::BF16, DType::F16] {
        let (q, residual) =
            quantize_with_feedback(tensor(&g, &device), Some(tensor(&r, &device)), 0.25, dtype);
        assert_eq!(q.dtype(), dtype);
        let (q, residual) = (host(q), host(residual));
        for i in 0..g.len() {
            let v = g[i] * 0.25 + r[i];
            let rounded = match dtype {
                DType::BF16 => bf16::from_f32(v).to_f32(),
                _ => f16::from_f32(v).to_f32(),
            };
            assert_eq!(q[i], rounded, "{dtype:?} element {i}");
            assert_eq!(residual[i], v - rounded, "{dtype:?} residual {i}");
        }
    }
}

#[test]
fn fused_adamw_is_burns_adamw_and_shares_its_records() {
    let device = Device::flex().autodiff();
    let config = FusedAdamWConfig::new()
        .with_beta_2(0.95)
        .with_epsilon(1e-6)
        .with_weight_decay(0.1);
    let model: Linear = LinearConfig::new(6, 4).init(&device);
    let x = Tensor::<2>::from_data(TensorData::new(values(12, 5), [2, 6]), &device);
    let train = |mut m: Linear, optim: &mut ModuleOptimizer, steps: usize| {
        for _ in 0..steps {
            let loss = m.forward(x.clone()).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &m);
            m = optim.step(1e-2, m, grads);
        }
        m
    };
    let mut fused = config.init();
    let mut burn = config.burn().init();
    let a = train(model.clone(), &mut fused, 3);
    let b = train(model.clone(), &mut burn, 3);
    assert_eq!(
        host(a.weight.val().flatten::<1>(0, 1)),
        host(b.weight.val().flatten::<1>(0, 1))
    );
    // Burn's AdamW resumes from the fused optimizer's record, and the reverse.
    let mut resumed = config
        .burn()
        .init()
        .from_bytes(fused.into_bytes().unwrap())
        .unwrap();
    let mut back = config
        .init()
        .from_bytes(burn.into_bytes().unwrap())
        .unwrap();
    let a = train(a, &mut resumed, 2);
    let b = train(b, &mut back, 2);
    assert_eq!(
        host(a.weight.val().flatten::<1>(0, 1)),
        host(b.weight.val().flatten::<1>(0, 1))
    );
}
