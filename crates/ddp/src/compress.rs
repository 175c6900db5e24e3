//! Gradient compression for the all-reduce, with error feedback.
//!
//! Each bucket is sent in 16 bits (half the bytes of f32). What rounding loses is kept per
//! bucket (the *residual*) and added to the next step's gradient before rounding, so the
//! error does not accumulate over training (error feedback, as in 1-bit SGD / PowerSGD).
//! The gradient is divided by the world size before rounding (as PyTorch's fp16 hook does)
//! so the 16-bit sum cannot overflow.

use crate::timing::Stamp;
use bonfire_comm::{Element, ProcessGroup, ReduceOp, Work, bf16, f16};

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

impl Compression {
    /// Starts the all-reduce (average) of `buf` on `pg`'s communication thread; `residual`
    /// is this bucket's error-feedback state (ignored without compression).
    pub(crate) fn launch(
        self,
        pg: &ProcessGroup,
        mut buf: Vec<f32>,
        residual: &mut Vec<f32>,
        stamp: Stamp,
    ) -> Work<Vec<f32>> {
        let n = pg.size() as f32;
        match self {
            Compression::None => pg.run_async(move |pg| {
                stamp.start();
                let r = pg.all_reduce(&mut buf, ReduceOp::Avg).map(|_| buf);
                stamp.end();
                r
            }),
            Compression::Bf16 => {
                let q = quantize(&buf, residual, n, bf16::from_f32, bf16::to_f32);
                sum_quantized(pg, buf, q, stamp, bf16::to_f32)
            }
            Compression::Fp16 => {
                let q = quantize(&buf, residual, n, f16::from_f32, f16::to_f32);
                sum_quantized(pg, buf, q, stamp, f16::to_f32)
            }
        }
    }
}

/// Sums the already-scaled 16-bit `q` over `pg` on its communication thread and widens the
/// result back into `buf` (the average, since `q` was divided by the world size).
fn sum_quantized<H: Element>(
    pg: &ProcessGroup,
    mut buf: Vec<f32>,
    mut q: Vec<H>,
    stamp: Stamp,
    widen: fn(H) -> f32,
) -> Work<Vec<f32>> {
    pg.run_async(move |pg| {
        stamp.start();
        pg.all_reduce(&mut q, ReduceOp::Sum)?;
        buf.iter_mut().zip(&q).for_each(|(o, &v)| *o = widen(v));
        stamp.end();
        Ok(buf)
    })
}

/// Rounds `g / n + residual` to 16 bits and keeps what was lost in `residual`.
fn quantize<H: Copy>(
    g: &[f32],
    residual: &mut Vec<f32>,
    n: f32,
    to: impl Fn(f32) -> H,
    from: impl Fn(H) -> f32,
) -> Vec<H> {
    if residual.len() != g.len() {
        *residual = vec![0.0; g.len()];
    }
    g.iter()
        .zip(residual.iter_mut())
        .map(|(&x, r)| {
            let v = x / n + *r;
            let q = to(v);
            *r = v - from(q);
            q
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_feedback_keeps_the_running_sum_exact() {
        // Sending the same small gradient repeatedly: without feedback bf16 rounding biases
        // every step the same way; with it the sum of what was sent tracks the true sum.
        let g = vec![1.0 + 1.0 / 512.0; 4];
        let mut residual = Vec::new();
        let mut sent = 0.0f32;
        for _ in 0..100 {
            let q = quantize(&g, &mut residual, 1.0, bf16::from_f32, bf16::to_f32);
            sent += q[0].to_f32();
        }
        let truth = 100.0 * g[0];
        assert!((sent - truth).abs() <= 0.01, "{sent} vs {truth}");
    }
}
