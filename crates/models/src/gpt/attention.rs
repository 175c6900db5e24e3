//! Causal multi-head self-attention with separate `q`, `k`, `v`, `o` projections.

use bonfire_kernels::Mask;
use bonfire_tp::ParallelLinear;
use burn::module::Module;
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Tensor};

/// Causal multi-head self-attention over `[B, T, d]` activations: `q`, `k`, `v`, `o` are
/// `d → d` projections with biases.
#[derive(Module, Debug)]
pub struct GptAttention {
    /// The query projection `d → d`.
    pub q: ParallelLinear,
    /// The key projection `d → d`.
    pub k: ParallelLinear,
    /// The value projection `d → d`.
    pub v: ParallelLinear,
    /// The output projection `d → d`, applied to the merged heads.
    pub o: ParallelLinear,
    n_heads: usize,
}

impl GptAttention {
    /// `n_heads` heads over width `d` (`d` divisible by `n_heads`), GPT-2 initialization.
    pub fn new(d: usize, n_heads: usize, device: &Device) -> Self {
        Self {
            q: ParallelLinear::new(d, d, true, device),
            k: ParallelLinear::new(d, d, true, device),
            v: ParallelLinear::new(d, d, true, device),
            o: ParallelLinear::new(d, d, true, device),
            n_heads,
        }
    }

    /// `x` `[B, T, d]` → `[B, T, d]`; head j uses features j·d/h .. (j+1)·d/h.
    ///
    /// Under tensor parallelism `q`, `k`, `v` are column-wise, so this rank's projections
    /// hold whole heads (`h / tp` of them, in order) and `o` is row-wise over the same
    /// features; with sequence parallelism `x` is this rank's piece of the sequence and the
    /// projections return the whole sequence. The head count is read from the local widths.
    /// Under a context-parallel scope the sequence is this rank's chunks and attention is
    /// ring attention over the whole sequence.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let d = x.dims()[2];
        let dh = d / self.n_heads;
        let q = self.q.forward(x.clone());
        let k = self.k.forward(x.clone());
        let v = self.v.forward(x);
        let (q, k, v) = (split_heads(q, dh), split_heads(k, dh), split_heads(v, dh));
        let y = bonfire_cp::attention(q, k, v, None, causal_attention);
        self.o.forward(merge_heads(y))
    }

    /// The number of heads of the whole layer.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }
}

/// `[B, T, h·dh]` → `[B, h, T, dh]`: head j is features j·dh .. (j+1)·dh.
pub fn split_heads(y: Tensor<3>, dh: usize) -> Tensor<4> {
    let [b, t, local] = y.dims();
    y.reshape([b, t, local / dh, dh]).swap_dims(1, 2)
}

/// `[B, h, T, dh]` → `[B, T, h·dh]` (the inverse of [`split_heads`]).
pub fn merge_heads(y: Tensor<4>) -> Tensor<3> {
    let [b, h, t, dh] = y.dims();
    y.swap_dims(1, 2).reshape([b, t, h * dh])
}

/// Causal scaled dot-product attention of `q` `[B, h, T, dh]` over `k`, `v`
/// `[B, h_kv, T, dh]`: `softmax(q kᵀ / √dh + mask) v`, a query attending to keys at or before
/// it, query head `j` with kv head `j / (h / h_kv)` (grouped-query attention; `h_kv = h` for
/// the GPT).
///
/// In f32 the whole of it is one fused op ([`bonfire_kernels::attention`]: tiles of keys, an
/// online softmax, no `T × T` matrix kept, one autodiff node, the kv heads never repeated).
/// On a CubeCL device 16-bit types run it fused too (the kernels accumulate in f32). On Flex
/// they stay Burn's ops — `q kᵀ`, the scale, the mask and the softmax rounding
/// after each, then `p v` — with the kv heads repeated (`h_kv < h` is refused otherwise): a
/// fused op's different rounding moves the bf16 tensor-parallel AdamW parity suite
/// (`tests/mixed_precision.rs`) past its empirical bound (0.24 against 0.2, measured with the
/// fused softmax).
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    windowed_attention(q, k, v, None)
}

/// [`causal_attention`] with each query limited to a sliding `window` of `W` positions when
/// one is given (Mistral's: query `i` sees keys `i − W < j ≤ i`): in f32 the fused op skips the
/// keys before a query's window; in 16-bit types the mask adds [`bonfire_kernels::MASKED`]
/// there too.
pub fn windowed_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    window: Option<usize>,
) -> Tensor<4> {
    let [_, h, t, dh] = q.dims();
    let dtype = q.dtype();
    let mask = Mask::CAUSAL.with_window(window);
    if bonfire_kernels::attention::fused_takes(&q, &k, &v) {
        return bonfire_kernels::attention(q, k, v, 1.0 / (dh as f64).sqrt(), mask);
    }
    let (k, v) = bonfire_kernels::fallback::repeat_kv_heads(k, v, h);
    let scores = q.matmul(k.swap_dims(2, 3));
    let mask = mask.bias(t, t, &scores.device());
    softmax(
        scores / (dh as f64).sqrt() + mask.cast(dtype).unsqueeze::<4>(),
        3,
    )
    .matmul(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{DType, Distribution};

    /// The 16-bit path applies the window as the fused f32 op does: bf16 within bf16's
    /// rounding of the f32 result, and far from the unwindowed one.
    #[test]
    fn sixteen_bit_windows_match_the_fused_op() {
        let device = Device::flex();
        device.seed(5);
        let normal =
            |shape: [usize; 4]| Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let (q, k, v) = (
            normal([2, 4, 10, 8]),
            normal([2, 2, 10, 8]),
            normal([2, 2, 10, 8]),
        );
        let f32_out = windowed_attention(q.clone(), k.clone(), v.clone(), Some(3));
        let bf16 = |x: &Tensor<4>| x.clone().cast(DType::BF16);
        let half = windowed_attention(bf16(&q), bf16(&k), bf16(&v), Some(3)).cast(DType::F32);
        let full = causal_attention(q, k, v);
        let gap = |a: &Tensor<4>, b: &Tensor<4>| {
            let d = (a.clone() - b.clone()).abs().max().into_data();
            d.convert::<f32>().try_to_vec::<f32>().unwrap()[0]
        };
        assert!(gap(&half, &f32_out) < 3e-2, "{}", gap(&half, &f32_out));
        assert!(gap(&full, &f32_out) > 0.3, "{}", gap(&full, &f32_out));
    }
}
