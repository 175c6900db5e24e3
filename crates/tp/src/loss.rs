//! [`loss_parallel`]: cross-entropy on vocabulary-sharded logits without gathering them.

use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::functional;
use burn::tensor::{Int, Tensor};

/// Mean over all positions of `−log softmax(logits)[target]`, where `local_logits`
/// `[B, T, V/n]` is this rank's contiguous slice of the vocabulary (rank `r` holds columns
/// `r·V/n .. (r+1)·V/n`, the output of a column-wise LM head) and `targets` `[B, T]` are
/// global ids, the same on every rank. Every rank gets the same loss; the gradient with
/// respect to the local logits is this rank's slice of `softmax − onehot` (divided by `B·T`).
///
/// Communication: three all-reduces of `B·T` floats in forward — the max (on detached
/// data, no gradient), the sum of exponentials and the target logit (both sums, whose
/// backward is the identity: Megatron's "reduce from group") — and none in backward.
/// The `[B·T, V]` logits are never materialized on one rank.
pub fn loss_parallel(
    local_logits: Tensor<3>,
    targets: Tensor<2, Int>,
    group: &ProcessGroup,
) -> Tensor<1> {
    // In fp32 whatever the logits' dtype (half-precision logits are upcast, as autocast does).
    let local_logits = local_logits.cast(burn::tensor::DType::F32);
    let [b, t, v] = local_logits.dims();
    let n = b * t;
    let logits = local_logits.reshape([n, v]);
    let offset = (group.rank() * v) as i64;

    // 1. The global max per position, as a constant (softmax is shift-invariant).
    let local_max = logits.clone().detach().max_dim(1);
    let max = functional::all_reduce(local_max, group, ReduceOp::Max);
    let shifted = logits - max;

    // 2. Σ exp over the whole vocabulary.
    let sum_exp = functional::reduce_from_group(shifted.clone().exp().sum_dim(1), group);

    // 3. The target's (shifted) logit, from the rank that owns it.
    let targets = targets.reshape([n, 1]);
    let owned = targets
        .clone()
        .greater_equal_elem(offset)
        .bool_and(targets.clone().lower_elem(offset + v as i64));
    // Targets owned by another rank point at column 0 (masked out below).
    let local_target = (targets - offset).mask_fill(owned.clone().bool_not(), 0);
    let picked = shifted.gather(1, local_target) * owned.float();
    let picked = functional::reduce_from_group(picked, group);

    (sum_exp.log() - picked).mean()
}

/// Every rank's vocabulary slice is the same size: `Err` unless `vocab` divides over `parts`.
pub fn check_vocab(vocab: usize, parts: usize) -> Result<(), String> {
    super::sequence::check_divisible(vocab, parts, "vocabulary size")
}
