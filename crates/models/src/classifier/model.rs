//! A second model, written the ordinary Burn way: a small MLP classifier of `burn::nn` layers
//! with `#[derive(Module)]`. Nothing of Bonfire is in this file; the one thing the trainer
//! needs (the loss of a batch) is given from outside, in `classifier_parallel.rs`.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Int, Tensor};

/// Three linear layers with ReLUs: `inputs → hidden → hidden → classes`.
#[derive(Module, Debug)]
pub struct Classifier {
    /// `inputs → hidden`.
    pub fc1: Linear,
    /// `hidden → hidden`.
    pub fc2: Linear,
    /// `hidden → classes` (the logits).
    pub fc3: Linear,
    /// The activation after `fc1` and `fc2`.
    pub relu: Relu,
}

impl Classifier {
    /// The three layers with Burn's default initialization, on `device`.
    pub fn new(inputs: usize, hidden: usize, classes: usize, device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(inputs, hidden).init(device),
            fc2: LinearConfig::new(hidden, hidden).init(device),
            fc3: LinearConfig::new(hidden, classes).init(device),
            relu: Relu::new(),
        }
    }

    /// Logits `[B, classes]` for inputs `[B, inputs]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let x = self.relu.forward(self.fc1.forward(x));
        let x = self.relu.forward(self.fc2.forward(x));
        self.fc3.forward(x)
    }

    /// Mean cross-entropy of the logits against class labels `[B]`.
    pub fn loss(&self, x: Tensor<2>, labels: Tensor<1, Int>) -> Tensor<1> {
        let logits = self.forward(x);
        let device = logits.device();
        CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits, labels)
    }
}

/// A synthetic task for it: `n` points in `inputs` dimensions around `classes` centres
/// (centre c is `+2` on coordinate `c % inputs`), labelled by their centre; the same for the
/// same `seed`.
pub fn blobs(
    n: usize,
    inputs: usize,
    classes: usize,
    seed: u64,
    device: &Device,
) -> (Tensor<2>, Tensor<1, Int>) {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut uniform = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut x = Vec::with_capacity(n * inputs);
    let mut y = Vec::with_capacity(n);
    for i in 0..n {
        let c = i % classes;
        for d in 0..inputs {
            let centre = if d == c % inputs { 2.0 } else { 0.0 };
            x.push(centre + uniform() - 0.5);
        }
        y.push(c as i64);
    }
    let x = Tensor::from_data(burn::tensor::TensorData::new(x, [n, inputs]), device);
    let y = Tensor::from_data(burn::tensor::TensorData::new(y, [n]), device);
    (x, y)
}
