//! Gradient compression for the all-reduce, with error feedback, on the device.
//!
//! Each bucket is cast to 16 bits on its device (half the bytes of f32 to carry). What rounding
//! loses is kept per bucket (the *residual*, a device tensor) and added to the next step's
//! gradient before rounding, so the error does not accumulate over training (error feedback,
//! as in 1-bit SGD / PowerSGD). The gradient is divided by the world size before rounding (as
//! PyTorch's fp16 hook does) so the 16-bit sum cannot overflow.

use crate::error::DdpError;
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::plane::{self, PendingTensor};
use bonfire_dtensor::timing::Span;
use burn::tensor::{DType, Device, Tensor};

/// How gradients travel in the all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Full f32 (exact average).
    #[default]
    None,
    /// bfloat16 with error feedback: 8 bits of mantissa, f32's range.
    Bf16,
    /// IEEE half with error feedback: 11 bits of mantissa, range ±65504.
    Fp16,
}

/// A bucket's all-reduce in flight.
pub(crate) struct InFlight {
    pending: PendingTensor<1>,
    /// Whether the result is 16-bit, to widen back to f32.
    widen: bool,
}

impl InFlight {
    /// The averaged f32 bucket on the device, and when the communication thread ran it.
    pub(crate) fn wait(self) -> Result<(Tensor<1>, Span), DdpError> {
        let (t, ran) = self.pending.wait_timed()?;
        let t = if self.widen { t.cast(DType::F32) } else { t };
        Ok((t, Span::from(ran)))
    }
}

impl Compression {
    /// The 16-bit type buckets are rounded to (`None` without compression).
    fn dtype(self) -> Option<DType> {
        match self {
            Compression::None => None,
            Compression::Bf16 => Some(DType::BF16),
            Compression::Fp16 => Some(DType::F16),
        }
    }

    /// An error, before anything is built, where a device of the model cannot store the
    /// compressed type (Mesa's software Vulkan has no bf16, for one).
    pub(crate) fn check_device(self, devices: &[Device]) -> Result<(), DdpError> {
        let Some(dtype) = self.dtype() else {
            return Ok(());
        };
        match devices.iter().find(|d| !bonfire_kernels::stores(d, dtype)) {
            Some(device) => Err(DdpError::Usage(format!(
                "compression {self:?}: the model's device {device:?} cannot store {dtype:?}; \
                 choose another Compression"
            ))),
            None => Ok(()),
        }
    }

    /// Starts the all-reduce (average) of the flat `bucket` on `pg`'s communication thread;
    /// `residual` is this bucket's error-feedback state (unused without compression).
    pub(crate) fn launch(
        self,
        pg: &ProcessGroup,
        bucket: Tensor<1>,
        residual: &mut Option<Tensor<1>>,
    ) -> InFlight {
        let Some(dtype) = self.dtype() else {
            return InFlight {
                pending: plane::all_reduce_async(bucket, ReduceOp::Avg, pg),
                widen: false,
            };
        };
        let q = quantize(bucket, residual, pg.size(), dtype);
        InFlight {
            pending: plane::all_reduce_async(q, ReduceOp::Sum, pg),
            widen: true,
        }
    }
}

/// Rounds `g / n + residual` to `dtype` and keeps what was lost in `residual` (one kernel on
/// a CubeCL device, see `bonfire_kernels::quantize_with_feedback`).
fn quantize(g: Tensor<1>, residual: &mut Option<Tensor<1>>, n: usize, dtype: DType) -> Tensor<1> {
    let previous = residual.take().filter(|r| r.dims() == g.dims());
    let (q, lost) = bonfire_kernels::quantize_with_feedback(g, previous, 1.0 / n as f32, dtype);
    *residual = Some(lost);
    q
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    #[test]
    fn error_feedback_keeps_the_running_sum_exact() {
        // Sending the same small gradient repeatedly: without feedback bf16 rounding biases
        // every step the same way; with it the sum of what was sent tracks the true sum.
        let device = Device::flex();
        let g = Tensor::<1>::full([4], 1.0 + 1.0 / 512.0, &device);
        let mut residual = None;
        let mut sent = 0.0f32;
        for _ in 0..100 {
            let q = quantize(g.clone(), &mut residual, 1, DType::BF16);
            sent += bonfire_module::params::to_host(q.cast(DType::F32))[0];
        }
        let truth = 100.0 * (1.0 + 1.0 / 512.0);
        assert!((sent - truth).abs() <= 0.01, "{sent} vs {truth}");
    }
}
