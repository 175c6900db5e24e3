//! [`loss_parallel`]: cross-entropy on vocabulary-sharded logits without gathering them.

use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::autodiff::with_context_of;
use bonfire_dtensor::functional;
use burn::tensor::{Int, Tensor};

/// Mean over all positions of `−log softmax(logits)[target]`, where `local_logits`
/// `[B, T, V/n]` is this rank's contiguous slice of the vocabulary (rank `r` holds columns
/// `r·V/n .. (r+1)·V/n`, the output of a column-wise LM head) and `targets` `[B, T]` are
/// global ids, the same on every rank. Every rank gets the same loss; the gradient with
/// respect to the local logits is this rank's slice of `softmax − onehot` (divided by `B·T`).
///
/// The work on the `[B·T, V/n]` logits is two passes forward and one backward, the fused
/// cross-entropy's ([`bonfire_kernels::cross_entropy`]) and its log-sum-exp's: each rank's
/// rows' log-sum-exp over its columns, all-gathered (`B·T` floats a rank), gives each row the
/// log-sum-exp of the other ranks' columns as one more column, constant; the fused
/// cross-entropy over `[local | others]`, its target the local column where this rank owns
/// it and the extra column where another does, has the global log-sum-exp and so exactly the
/// gradient above. Its value differs by each row's `others − target logit` where another rank
/// owns the target: the loss returned is the global one (the log-sum-exps and the target
/// logits, all-reduced from their owners, combined the same way on every rank) carrying that
/// gradient. Until 2026-12-05 this was Burn's ops — the max, the shift, `exp`, the sum, the
/// gather and their backward: some ten passes over the logits. Communication: an all-gather
/// and an all-reduce of `B·T` floats in forward, none in backward. The `[B·T, V]` logits are
/// never materialized on one rank.
pub fn loss_parallel(
    local_logits: Tensor<3>,
    targets: Tensor<2, Int>,
    group: &ProcessGroup,
) -> Tensor<1> {
    // In fp32 whatever the logits' dtype (half-precision logits are upcast, as autocast does).
    let local_logits = local_logits.cast(burn::tensor::DType::F32);
    let [b, t, v] = local_logits.dims();
    let (n, ranks, rank) = (b * t, group.size(), group.rank());
    let logits = local_logits.reshape([n, v]);
    if ranks == 1 {
        return bonfire_kernels::cross_entropy(logits, targets.reshape([n]));
    }
    let device = logits.device();

    // 1. Every rank's log-sum-exp of each row over its columns, `[ranks, n]`, no gradient.
    let local = bonfire_kernels::log_sum_exp(logits.clone()).reshape([1, n]);
    let every = functional::all_gather(with_context_of(local, &device), group, 0)
        .expect("dim 0 of a 2-d tensor");
    // 2. The other ranks' columns as one: their log-sum-exp, this rank's row left out.
    let hole = Tensor::full([1, n], f32::NEG_INFINITY, &device);
    let others = log_sum_exp_over_ranks(every.clone().slice_assign([rank..rank + 1, 0..n], hole));
    // 3. The fused cross-entropy over `[local | others]`: the target's local column where this
    //    rank owns it, else the extra column.
    let offset = (rank * v) as i64;
    let targets = targets.reshape([n]);
    let owned = targets
        .clone()
        .greater_equal_elem(offset)
        .bool_and(targets.clone().lower_elem(offset + v as i64));
    let local_target = (targets - offset).mask_fill(owned.clone().bool_not(), v as i64);
    let extended = Tensor::cat(vec![logits.clone(), others.reshape([n, 1])], 1);
    let here = bonfire_kernels::cross_entropy(extended, local_target.clone());
    // 4. The global loss, the same on every rank: the log-sum-exp over every rank's less the
    //    target logits, all-reduced from their owners; `here` carries the gradient.
    let column = local_target.clamp_max(v as i64 - 1).reshape([n, 1]);
    let picked = logits.detach().gather(1, column).reshape([n]);
    let picked = functional::all_reduce(
        picked.mask_fill(owned.bool_not(), 0.0),
        group,
        ReduceOp::Sum,
    );
    let global = (log_sum_exp_over_ranks(every) - picked).mean();
    let shift = global - here.clone().detach();
    here + shift
}

/// `log Σ_r exp(x[r, ·])` over the rows of `x` `[ranks, n]` (−∞ rows add nothing).
fn log_sum_exp_over_ranks(x: Tensor<2>) -> Tensor<1> {
    let max = x.clone().max_dim(0);
    let n = max.dims()[1];
    (x - max.clone())
        .exp()
        .sum_dim(0)
        .log()
        .add(max)
        .reshape([n])
}

/// Every rank's vocabulary slice is the same size: `Err` unless `vocab` divides over `parts`.
pub fn check_vocab(vocab: usize, parts: usize) -> Result<(), String> {
    super::sequence::check_divisible(vocab, parts, "vocabulary size")
}
