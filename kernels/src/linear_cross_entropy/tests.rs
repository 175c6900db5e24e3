//! [`linear_cross_entropy`] against the unfused head the models run (`matmul(h, Wᵀ)`, then
//! the fused cross-entropy on f32 logits): the loss and both gradients.

use super::*;
use burn::tensor::{Device, Distribution};

fn device() -> Device {
    Device::flex().autodiff()
}

/// `hidden` `[n, d]`, `weight` `[v, d]` (N(0, 1) and N(0, 0.3)) and targets `[n]` in `0..v`.
fn inputs(n: usize, d: usize, v: usize) -> (Tensor<2>, Tensor<2>, Tensor<1, Int>) {
    let dev = device();
    let h = Tensor::<2>::random([n, d], Distribution::Normal(0.0, 1.0), &dev);
    let w = Tensor::<2>::random([v, d], Distribution::Normal(0.0, 0.3), &dev);
    let t = Tensor::<1, Int>::from_data(
        burn::tensor::TensorData::new((0..n).map(|i| ((i * 7 + 3) % v) as i64).collect(), [n]),
        &dev,
    );
    (h, w, t)
}

/// The loss, `hidden`'s and `weight`'s gradients of `g · loss(h, w)` for `loss` the fused
/// head (`Some(chunk_rows)`) or the unfused one (`None`).
fn run(
    (h, w, t): &(Tensor<2>, Tensor<2>, Tensor<1, Int>),
    chunk_rows: Option<usize>,
    g: f32,
    dtype: DType,
) -> [Vec<f32>; 3] {
    let h = h.clone().cast(dtype).require_grad();
    let w = w.clone().cast(dtype).require_grad();
    let loss = match chunk_rows {
        Some(rows) => linear_cross_entropy(h.clone(), w.clone(), t.clone(), rows),
        None => {
            let logits = crate::matmul(h.clone(), w.clone().transpose()).cast(DType::F32);
            crate::cross_entropy(logits, t.clone())
        }
    };
    let grads = (loss.clone() * g).backward();
    let values = |x: Tensor<2>| x.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap();
    [
        loss.into_data().try_to_vec::<f32>().unwrap(),
        values(h.grad(&grads).unwrap()),
        values(w.grad(&grads).unwrap()),
    ]
}

/// `a` and `b` bit for bit, named `what`.
fn same_bits(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}[{i}]: {x} against {y}");
    }
}

#[test]
fn one_block_is_the_unfused_head_bit_for_bit() {
    let x = inputs(24, 16, 40);
    // g = 1 (a plain backward) and 0.25 (a power of two: scaling is exact on both sides).
    for g in [1.0, 0.25] {
        let unfused = run(&x, None, g, DType::F32);
        for rows in [24, 1000] {
            let fused = run(&x, Some(rows), g, DType::F32);
            for (what, (a, b)) in ["loss", "dh", "dW"].iter().zip(fused.iter().zip(&unfused)) {
                same_bits(&format!("{what} (g {g}, {rows} rows a block)"), a, b);
            }
        }
    }
}

/// Several blocks: each row's `dh` is a product over the same `V` terms (the same sum), the
/// weight's gradient sums the blocks' products and the loss the blocks' weighted means, so
/// both may differ from the unfused head's by the rounding of two f32 summation orders of the
/// same terms: at most `2γ_N Σ|terms|` each (`γ_N = N u / (1 − N u)`, `u = 2⁻²⁴`), with the
/// scaling by `g` (one rounding each side) on top.
#[test]
fn blocks_sum_to_the_unfused_head_within_rounding() {
    let (n, d, v) = (30, 12, 50);
    let x = inputs(n, d, v);
    let g = 0.3f32;
    let unfused = run(&x, None, g, DType::F32);
    let u = 2f32.powi(-24);
    let gamma = |k: usize| k as f32 * u / (1.0 - k as f32 * u);
    // |dlogits| and |h|, |W| of the unfused head, for the bounds' Σ|terms|.
    let (h, w, t) = (
        x.0.clone().inner(),
        x.1.clone().inner(),
        x.2.clone().inner(),
    );
    let logits = h.clone().matmul(w.clone().transpose());
    let onehot = t.one_hot::<2>(v).float();
    let dlogits =
        (burn::tensor::activation::softmax(logits.clone(), 1) - onehot).abs() * (g / n as f32);
    let dh_terms = dlogits
        .clone()
        .matmul(w.abs())
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let dw_terms = dlogits
        .transpose()
        .matmul(h.abs())
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    // The loss: its N per-row terms (lse − picked, each ≤ lse + |picked|) summed two ways.
    let lse = burn::tensor::activation::log_softmax(logits.clone(), 1).neg();
    let loss_terms: f32 = lse.abs().sum().into_scalar::<f32>() / n as f32;
    for rows in [1, 7, 16] {
        let fused = run(&x, Some(rows), g, DType::F32);
        let bound = |what: &str, a: &[f32], b: &[f32], terms: &[f32], k: usize| {
            for (i, ((x, y), s)) in a.iter().zip(b).zip(terms).enumerate() {
                let tol = 2.0 * gamma(k) * s + 2.0 * u * y.abs();
                assert!(
                    (x - y).abs() <= tol,
                    "{what}[{i}] ({rows} rows a block): {x} against {y}, bound {tol}"
                );
            }
        };
        bound("dh", &fused[1], &unfused[1], &dh_terms, v);
        bound("dW", &fused[2], &unfused[2], &dw_terms, n);
        bound(
            "loss",
            &fused[0],
            &unfused[0],
            &[loss_terms * g.max(1.0)],
            n + v,
        );
    }
}

/// Under bf16 compute (f32 softmax, bf16 products and gradients, as autocast runs the head):
/// one block is the unfused bf16 head bit for bit.
#[test]
fn bf16_one_block_is_the_unfused_head_bit_for_bit() {
    let x = inputs(16, 8, 24);
    let unfused = run(&x, None, 1.0, DType::BF16);
    let fused = run(&x, Some(16), 1.0, DType::BF16);
    for (what, (a, b)) in ["loss", "dh", "dW"].iter().zip(fused.iter().zip(&unfused)) {
        same_bits(what, a, b);
    }
}

/// Without gradients (an evaluation) the node keeps nothing and gives the same loss.
#[test]
fn untracked_loss_is_the_tracked_one() {
    let x = inputs(20, 8, 30);
    let tracked = run(&x, Some(6), 1.0, DType::F32);
    let (h, w, t) = x;
    let loss = linear_cross_entropy(h, w, t, 6)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    same_bits("loss", &loss, &tracked[0]);
}

#[test]
fn rows_within_a_budget() {
    assert_eq!(rows_within(1 << 20, 4096), 64);
    assert_eq!(rows_within(10, 4096), 1);
}

/// The device suite's check on Flex: against Burn's own ops (not this crate's product and
/// cross-entropy), by blocks of 8 over 37 rows.
#[test]
fn matches_burns_ops_on_flex() {
    println!(
        "{}",
        crate::testing::linear_cross_entropy_matches_reference(&Device::flex())
    );
}
