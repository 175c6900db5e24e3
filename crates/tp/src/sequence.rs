//! StylePlacement transitions of activations inside a tensor-parallel region, and the
//! sequence-parallel helpers built on them.
//!
//! Gradient convention (Megatron's): the gradient of a `Replicate` activation is the full
//! gradient on every rank, so `Shard → Replicate` is an all-gather whose backward keeps this
//! rank's piece, and `Replicate → Shard` is a local split whose backward all-gathers.
//!
//! These functions run inside `forward`, where Burn's API is infallible: a sequence that does
//! not divide evenly over the group panics with a clear message (check it up front with
//! [`check_divisible`]).

use super::style::StylePlacement;
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::functional;
use burn::tensor::Tensor;

/// `Err` naming `what` unless `len` is divisible by the group size.
pub fn check_divisible(len: usize, parts: usize, what: &str) -> Result<(), String> {
    if parts == 0 || !len.is_multiple_of(parts) {
        return Err(format!(
            "{what} ({len}) is not divisible by the tensor-parallel size {parts}"
        ));
    }
    Ok(())
}

fn must_divide<const D: usize>(x: &Tensor<D>, dim: usize, group: &ProcessGroup, what: &str) {
    if let Err(e) = check_divisible(x.dims()[dim], group.size(), what) {
        panic!(
            "bonfire-dtensor parallel: {e} (dim {dim} of a tensor of shape {:?})",
            x.dims()
        );
    }
}

/// Converts `x` from layout `from` to layout `to` over `group` (see the module docs for the
/// gradients). Supported: any → itself; `Shard(a)` → `Replicate` (all-gather);
/// `Replicate` → `Shard(a)` (local split); `Partial` → `Replicate` (all-reduce);
/// `Partial` → `Shard(a)` (reduce-scatter); `Shard(a)` → `Shard(b)` (all-to-all).
pub fn relayout<const D: usize>(
    x: Tensor<D>,
    from: StylePlacement,
    to: StylePlacement,
    group: &ProcessGroup,
) -> Tensor<D> {
    if from.same_as(&to, D) || group.size() == 1 && from != StylePlacement::Partial {
        return x;
    }
    match (from.shard_dim(D), to.shard_dim(D), from, to) {
        (Some(a), None, _, StylePlacement::Replicate) => {
            functional::gather(x, group, a, None).expect("valid dim")
        }
        (None, Some(b), StylePlacement::Replicate, _) => {
            must_divide(&x, b, group, "the sharded dim");
            functional::split(x, group, b).expect("valid dim")
        }
        (None, None, StylePlacement::Partial, StylePlacement::Replicate) => {
            functional::reduce_from_group(x, group)
        }
        (None, Some(b), StylePlacement::Partial, _) => {
            must_divide(&x, b, group, "the sharded dim");
            functional::reduce_scatter(x, group, b, ReduceOp::Sum).expect("valid dim")
        }
        (Some(a), Some(b), _, _) => {
            must_divide(&x, b, group, "the sharded dim");
            functional::all_to_all(x, group, b, a).expect("valid dims")
        }
        _ => panic!("bonfire-dtensor parallel: no layout transition from {from:?} to {to:?}"),
    }
}

/// Whether `from` → `to` is a transition [`relayout`] supports.
pub fn supported_transition(from: StylePlacement, to: StylePlacement) -> bool {
    !matches!(
        (from, to),
        (_, StylePlacement::Partial) if from != StylePlacement::Partial
    )
}

/// Enters a sequence-parallel region from a replicated activation: keeps this rank's piece
/// of `seq_dim` (no communication; backward all-gathers the gradient).
pub fn sequence_shard<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    seq_dim: usize,
) -> Tensor<D> {
    relayout(
        x,
        StylePlacement::Replicate,
        StylePlacement::Shard(seq_dim as isize),
        group,
    )
}

/// Leaves a sequence-parallel region: all-gathers `seq_dim` to a replicated activation
/// (backward keeps this rank's piece of the gradient).
pub fn sequence_gather<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    seq_dim: usize,
) -> Tensor<D> {
    relayout(
        x,
        StylePlacement::Shard(seq_dim as isize),
        StylePlacement::Replicate,
        group,
    )
}

/// A replicated parameter used on sequence-sharded activations: identity forward, all-reduce
/// of its (partial) gradient in backward, so that every rank gets the full gradient.
pub fn replicated_param<const D: usize>(p: Tensor<D>, group: &ProcessGroup) -> Tensor<D> {
    functional::copy_to_group(p, group)
}
