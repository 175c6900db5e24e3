//! Bonfire's device kernels: what Burn's tensor ops do slowly or in several passes on a
//! device, written once in CubeCL.
//!
//! - [`pack_scaled`] / [`unpack_scaled`]: a bucket's gradients copied into one flat tensor
//!   (and back out) with a scale factor applied on the way, one pass per part.
//! - [`quantize_with_feedback`]: a gradient scaled, plus the error-feedback residual, cast to
//!   bf16 or fp16, with the new residual (what rounding lost), in one pass.
//! - [`FusedAdamW`]: Burn's AdamW as one kernel over a flat tensor (a Burn [`Optimizer`]
//!   whose state is Burn's own `AdamWState`, so records and checkpoints are interchangeable).
//! - [`FusedSgd`]: Burn's SGD (weight decay included) as one in-place pass on Flex in f32,
//!   its state Burn's `SgdState`.
//! - [`fused`]: differentiable ops with a hand-written backward for a transformer's
//!   element-wise and row hot spots — [`causal_softmax`], [`cross_entropy`], [`gelu`],
//!   [`layer_norm_core`], [`rms_norm_core`], [`silu_mul`], [`rope`] — one autodiff node each
//!   instead of Burn's five to ten (on Flex in f32, host kernels the compiler vectorizes).
//! - [`attention`]: fused scaled dot-product attention (full, causal or a sliding window:
//!   [`Mask`]; grouped-query), one autodiff node with a flash-attention-2 backward; on Flex in
//!   f32 tiled host kernels with an online softmax and no `T × T` matrix.
//! - [`linear_cross_entropy`]: a language model's head and its loss as one node, by blocks of
//!   rows, so that the `[N, V]` logits and their gradient never exist whole.
//! - [`matmul`]: the linear layers' 2-d product, in bf16 on Flex through the CPU's bf16
//!   instructions where it has them ([`bf16_kernel`]: AMX, or AVX-512 BF16 on request; Burn's
//!   product elsewhere and in f32), one autodiff node.
//!
//! Every op takes and returns Burn tensors. On a CubeCL device (features `wgpu`, `cuda`) it
//! launches its kernel on the tensors' own buffers; on every other device, for a dtype the
//! kernel does not cover, or a 16-bit type the device cannot store, it runs its plain-Burn
//! fallback ([`fallback`]), which is also the reference each kernel is tested against.
//!
//! [`Optimizer`]: burn::optim::Optimizer

mod adamw;
pub mod attention;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod cube;
mod device;
mod flex_buffer;
pub mod fused;
mod host_alloc;
mod linear_cross_entropy;
mod matmul;
mod pack;
mod quantize;
mod sgd;
mod simd;
pub mod testing;

pub use adamw::{FusedAdamW, FusedAdamWConfig};
pub use attention::{MASKED, Mask, attention, attention_with_lse};
pub use device::{base_device, is_flex};
pub use fused::{
    add_bias, causal_softmax, cross_entropy, exp, gelu, layer_norm_core, log_sum_exp,
    rms_norm_core, rope, silu_mul,
};
pub use host_alloc::keep_freed_memory;
pub use linear_cross_entropy::{LinearCrossEntropyBackend, linear_cross_entropy, rows_within};
pub use matmul::{
    Bf16Kernel, LinearBackend, ProductBackend, bf16_kernel, contiguous, linear, matmul,
};
pub use pack::{pack_scaled, unpack_scaled};
pub use quantize::quantize_with_feedback;
pub use sgd::{FusedSgd, FusedSgdConfig};

/// The plain-Burn implementations: what every op runs off a CubeCL device, and the
/// reference its kernel is tested against.
pub mod fallback {
    pub use crate::adamw::fallback::adamw_step;
    pub use crate::attention::fallback::{attention, attention_with_lse, repeat_kv_heads};
    pub use crate::pack::fallback::{pack_scaled, unpack_scaled};
    pub use crate::quantize::fallback::quantize_with_feedback;
}

use burn::tensor::{DType, Device};

/// Whether ops on `device`'s tensors run Bonfire's CubeCL kernels (a CubeCL device in a build
/// with its runtime's feature), rather than their plain-Burn fallbacks.
pub fn runs_kernels(device: &Device) -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        cube::is_cube(device)
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = device;
        false
    }
}

/// Whether the fused kernels compute `dtype` on `device` as one node (else their callers keep
/// Burn's ops): f32 everywhere; f16 and bf16 on a CubeCL device that stores them, whose
/// kernels load the 16-bit values and compute in f32. Flex's fused paths are f32 only (in 16
/// bits their fallback is Burn's ops inside one node: the models use those ops directly).
pub fn fuses(device: &Device, dtype: DType) -> bool {
    match dtype {
        DType::F32 => true,
        DType::F16 | DType::BF16 => runs_kernels(device) && stores(device, dtype),
        _ => false,
    }
}

/// Whether `device` can hold tensors of `dtype` and convert them to and from f32: always off
/// a CubeCL device; on one, what its runtime reports (Vulkan drivers often lack bf16, and a
/// cast Burn lowers to an unsupported type returns garbage rather than an error).
pub fn stores(device: &Device, dtype: DType) -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if cube::is_cube(device) {
        return cube::stores(device, dtype);
    }
    let _ = (device, dtype);
    true
}
