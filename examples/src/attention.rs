//! Causal multi-head self-attention with separate `q`, `k`, `v`, `o` projections.

use crate::layers::Linear;
use burn::module::Module;
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Tensor, TensorData};

#[derive(Module, Debug)]
pub struct Attention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    n_heads: usize,
}

impl Attention {
    pub fn new(d: usize, n_heads: usize, device: &Device) -> Self {
        Self {
            q: Linear::new(d, d, true, device),
            k: Linear::new(d, d, true, device),
            v: Linear::new(d, d, true, device),
            o: Linear::new(d, d, true, device),
            n_heads,
        }
    }

    /// `x` `[B, T, d]` → `[B, T, d]`; head j uses features j·d/h .. (j+1)·d/h.
    ///
    /// Under tensor parallelism `q`, `k`, `v` are column-wise, so this rank's projections
    /// hold whole heads (`h / tp` of them, in order) and `o` is row-wise over the same
    /// features; with sequence parallelism `x` is this rank's piece of the sequence and the
    /// projections return the whole sequence. The head count is read from the local widths.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let d = x.dims()[2];
        let dh = d / self.n_heads;
        let q = self.q.forward(x.clone());
        let [b, t, local] = q.dims();
        let h = local / dh;
        let split = |y: Tensor<3>| y.reshape([b, t, h, dh]).swap_dims(1, 2); // [B, h, T, dh]
        let q = split(q);
        let k = split(self.k.forward(x.clone()));
        let v = split(self.v.forward(x));
        let scores = q.matmul(k.swap_dims(2, 3)) / (dh as f64).sqrt();
        let mask = causal_mask(t, &scores.device());
        let mask = mask.cast(scores.dtype());
        let scores = scores + mask.unsqueeze::<4>();
        let attn = softmax(scores, 3);
        let y = attn.matmul(v).swap_dims(1, 2).reshape([b, t, local]);
        self.o.forward(y)
    }

    /// The number of heads of the whole layer.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }
}

/// `[T, T]`: 0 where key ≤ query, −∞ where key > query (excluded from the softmax).
fn causal_mask(t: usize, device: &Device) -> Tensor<2> {
    let values: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_data(TensorData::new(values, [t, t]), device)
}
