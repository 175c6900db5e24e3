//! Grouping a batch's (token, choice) assignments by expert and back: [`permute`] copies each
//! token once per expert it is routed to, the rows of expert 0 first (in token order), then
//! expert 1's…; [`unpermute`] sums each token's rows back, weighted. Both differentiable (a
//! row gather and a scatter-add); the order is computed on the device, and only the counts
//! per expert — the sizes an all-to-all needs — are read to the host.

use bonfire_dtensor::plane::{self, ledger::Reason};
use burn::tensor::{IndexingUpdateOp, Int, Tensor};

/// Where each row of a permuted batch came from.
#[derive(Debug, Clone)]
pub struct TokenPermutation {
    /// `[N·k]`: the token each grouped row copies.
    rows: Tensor<1, Int>,
    /// `[N·k]`: the assignment (`token · k + choice`) of each grouped row.
    order: Tensor<1, Int>,
    /// Rows per expert, in expert order (`Σ = N·k`).
    counts: Vec<usize>,
    /// `N`, the tokens of the batch.
    tokens: usize,
}

impl TokenPermutation {
    /// Rows per expert, in expert order.
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }
}

/// `x` `[N, d]`'s rows grouped by the experts `experts` `[N, k]` routes them to (each token
/// once per choice; within an expert, in token order), and how to undo it. Every expert id
/// must be below `num_experts`.
pub fn permute(
    x: Tensor<2>,
    experts: Tensor<2, Int>,
    num_experts: usize,
) -> (Tensor<2>, TokenPermutation) {
    let [n, k] = experts.dims();
    assert_eq!(x.dims()[0], n, "{} tokens, routing for {n}", x.dims()[0]);
    let device = x.device();
    let m = n * k;
    let flat = experts.reshape([m]);
    let counts = flat
        .clone()
        .one_hot::<2>(num_experts)
        .sum_dim(0)
        .reshape([num_experts]);
    let counts = plane::counts_to_host(counts, Reason::Routing);
    // Unique keys (expert, assignment): the order is the same whatever the sort's stability.
    let keys = flat * m as i64 + Tensor::<1, Int>::arange(0..m as i64, &device);
    let order = keys.argsort(0);
    let rows = order.clone().div_scalar(k as i64);
    let grouped = x.select(0, rows.clone());
    let perm = TokenPermutation {
        rows,
        order,
        counts,
        tokens: n,
    };
    (grouped, perm)
}

/// Each token's rows of `grouped` (`[N·k, d]`, in [`permute`]'s order) weighted by its
/// routing weights `weights` `[N, k]` and summed: `[N, d]`.
pub fn unpermute(grouped: Tensor<2>, perm: &TokenPermutation, weights: Tensor<2>) -> Tensor<2> {
    let [m, d] = grouped.dims();
    assert_eq!(
        m,
        perm.order.dims()[0],
        "{m} rows for a permutation of {}",
        perm.order.dims()[0]
    );
    let w = weights.reshape([m]).select(0, perm.order.clone());
    let weighted = grouped * w.unsqueeze_dim::<2>(1);
    let zeros = Tensor::<2>::zeros([perm.tokens, d], &weighted.device()).cast(weighted.dtype());
    zeros.select_assign(0, perm.rows.clone(), weighted, IndexingUpdateOp::Add)
}
