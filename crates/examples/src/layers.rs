//! The three layer kinds of the GPT, storing parameters in PyTorch's layout so that the
//! module's parameter paths and shapes are exactly the parity contract's names (a Linear
//! weight is `[out_features, in_features]`; LayerNorm has `weight` and `bias`), and
//! safetensors files need no renaming or transposition.

use burn::module::{Module, Param};
use burn::tensor::{Device, Distribution, Int, Tensor};

/// `y = x Wᵀ + b`, with `weight` `[out, in]` (PyTorch layout).
#[derive(Module, Debug)]
pub struct Linear {
    pub weight: Param<Tensor<2>>,
    pub bias: Option<Param<Tensor<1>>>,
}

impl Linear {
    /// Normal(0, 0.02) weights and zero bias (GPT-2's initialization).
    pub fn new(d_in: usize, d_out: usize, bias: bool, device: &Device) -> Self {
        let weight = Tensor::random([d_out, d_in], Distribution::Normal(0.0, 0.02), device);
        Self {
            weight: Param::from_tensor(weight),
            bias: bias.then(|| Param::from_tensor(Tensor::zeros([d_out], device))),
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let w = self.weight.val().transpose().unsqueeze::<D>();
        let y = x.matmul(w);
        match &self.bias {
            Some(b) => y + b.val().unsqueeze::<D>(),
            None => y,
        }
    }
}

/// LayerNorm over the last dimension: biased variance, eps 1e-5, then `weight` and `bias`.
#[derive(Module, Debug)]
pub struct LayerNorm {
    pub weight: Param<Tensor<1>>,
    pub bias: Param<Tensor<1>>,
}

impl LayerNorm {
    pub const EPS: f64 = 1e-5;

    pub fn new(d: usize, device: &Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::ones([d], device)),
            bias: Param::from_tensor(Tensor::zeros([d], device)),
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let (var, mean) = x.clone().var_mean_bias(D - 1);
        let normed = (x - mean) / (var + Self::EPS).sqrt();
        normed * self.weight.val().unsqueeze::<D>() + self.bias.val().unsqueeze::<D>()
    }
}

/// A lookup table `[num, d]`.
#[derive(Module, Debug)]
pub struct Embedding {
    pub weight: Param<Tensor<2>>,
}

impl Embedding {
    pub fn new(num: usize, d: usize, device: &Device) -> Self {
        let weight = Tensor::random([num, d], Distribution::Normal(0.0, 0.02), device);
        Self {
            weight: Param::from_tensor(weight),
        }
    }

    /// Rows of the table for `ids` `[B, T]` → `[B, T, d]`.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = ids.dims();
        let d = self.weight.dims()[1];
        self.weight
            .val()
            .select(0, ids.reshape([b * t]))
            .reshape([b, t, d])
    }

    /// The first `t` rows, `[t, d]` (positions 0..t).
    pub fn first_rows(&self, t: usize) -> Tensor<2> {
        self.weight.val().narrow(0, 0, t)
    }
}
