//! Differentiable collectives on `Tensor<D>`.
//!
//! Each function validates its arguments (returning [`DTensorError`] before anything is
//! exchanged), then runs one [`CollectiveBackend`] operation. On an autodiff device the
//! result is differentiable: its backward runs the dual collective on the same group (see
//! [`CollectiveSpec::dual`]), so every rank must call `backward()` on graphs that contain the
//! same collectives in the same order — a rank whose output does not reach its loss makes
//! its peers wait (and time out).
//!
//! Sizes along a dimension follow torch.chunk ([`crate::chunk_sizes`]) unless given.

use super::{CollectiveBackend, CollectiveKind, CollectiveSpec};
use crate::{DTensorError, Result, chunk_sizes};
use bonfire_comm::{ProcessGroup, ReduceOp};
use burn::backend::Dispatch;
use burn::tensor::Tensor;

/// Runs `spec` on `tensor` with no validation (the typed functions below validate).
pub fn collective<const D: usize>(tensor: Tensor<D>, spec: CollectiveSpec) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CollectiveBackend>::collective(
        tensor.into_dispatch(),
        spec,
    ))
}

fn check_dim<const D: usize>(dim: usize) -> Result<()> {
    if dim >= D {
        return Err(DTensorError::InvalidArgument(format!(
            "dim {dim} is out of range for a tensor of rank {D}"
        )));
    }
    Ok(())
}

fn check_rank(group: &ProcessGroup, rank: usize, what: &str) -> Result<()> {
    if rank >= group.size() {
        return Err(DTensorError::InvalidArgument(format!(
            "{what} {rank} is out of range for a group of {} ranks",
            group.size()
        )));
    }
    Ok(())
}

fn check_sizes(group: &ProcessGroup, sizes: &[usize]) -> Result<()> {
    if sizes.len() != group.size() {
        return Err(DTensorError::InvalidArgument(format!(
            "{} sizes given for a group of {} ranks",
            sizes.len(),
            group.size()
        )));
    }
    Ok(())
}

fn check_local(local: usize, sizes: &[usize], me: usize, dim: usize) -> Result<()> {
    if sizes[me] != local {
        return Err(DTensorError::ShapeMismatch(format!(
            "this rank's tensor has {local} elements along dim {dim} but sizes[{me}] = {}",
            sizes[me]
        )));
    }
    Ok(())
}

fn check_total(len: usize, sizes: &[usize], dim: usize) -> Result<()> {
    if sizes.iter().sum::<usize>() != len {
        return Err(DTensorError::ShapeMismatch(format!(
            "the tensor has {len} elements along dim {dim} but the sizes {sizes:?} add up to {}",
            sizes.iter().sum::<usize>()
        )));
    }
    Ok(())
}

fn check_op(op: ReduceOp, what: &'static str) -> Result<()> {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => Ok(()),
        _ => Err(DTensorError::UnsupportedReduceOp { op, what }),
    }
}

fn run<const D: usize>(tensor: Tensor<D>, group: &ProcessGroup, kind: CollectiveKind) -> Tensor<D> {
    collective(tensor, CollectiveSpec::new(group, kind))
}

/// Every rank gets the reduction of all ranks' tensors. Backward: all-reduce of the
/// gradients with the same op for `Sum` and `Avg`; for `Max` and `Min`, the summed gradient
/// goes to the ranks holding the extremum, split evenly between ties (like `torch.amax`; two
/// all-reduces in backward). `Product` is accepted only for tensors that do not require
/// gradients (the operation panics on a tracked tensor).
pub fn all_reduce<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    op: ReduceOp,
) -> Tensor<D> {
    run(tensor, group, CollectiveKind::AllReduce { op })
}

/// Every rank gets `root`'s tensor. Backward: the gradients are summed on `root`; the other
/// ranks' inputs get zero gradients.
pub fn broadcast<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    root: usize,
) -> Result<Tensor<D>> {
    check_rank(group, root, "root")?;
    Ok(run(tensor, group, CollectiveKind::Broadcast { root }))
}

/// `root` gets the reduction (sum or avg) of every rank's tensor; the others get zeros.
/// Backward: `root`'s gradient is broadcast to every rank.
pub fn reduce<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    op: ReduceOp,
    root: usize,
) -> Result<Tensor<D>> {
    check_rank(group, root, "root")?;
    check_op(op, "a differentiable reduce")?;
    Ok(run(tensor, group, CollectiveKind::Reduce { op, root }))
}

/// Concatenates every rank's tensor along `dim` (all of the same shape). Backward:
/// reduce-scatter (sum) of the gradients.
pub fn all_gather<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(dim)?;
    let sizes = vec![tensor.dims()[dim]; group.size()];
    all_gather_uneven(tensor, group, dim, &sizes)
}

/// Concatenates every rank's tensor along `dim`, rank `r` contributing `sizes[r]` elements
/// along it (other dims equal). Backward: uneven reduce-scatter (sum). A rank of size 0 may
/// pass a tensor of length 1 along `dim` (a placeholder, not sent; its gradient is zero).
pub fn all_gather_uneven<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    sizes: &[usize],
) -> Result<Tensor<D>> {
    let kind = all_gather_kind(&tensor, group, dim, sizes)?;
    Ok(run(tensor, group, kind))
}

/// The all-gather of `tensor` along `dim` with `sizes` per rank, validated.
fn all_gather_kind<const D: usize>(
    tensor: &Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    sizes: &[usize],
) -> Result<CollectiveKind> {
    check_dim::<D>(dim)?;
    check_sizes(group, sizes)?;
    if sizes.iter().sum::<usize>() == 0 {
        return Err(DTensorError::InvalidArgument(format!(
            "an all-gather of sizes {sizes:?} gathers nothing"
        )));
    }
    // A rank of size 0 may pass a placeholder of length 1 ([`CollectiveKind::AllGather`]).
    let me = group.rank();
    let local = tensor.dims()[dim];
    if !(sizes[me] == 0 && local == 1) {
        check_local(local, sizes, me, dim)?;
    }
    Ok(CollectiveKind::AllGather {
        dim,
        sizes: sizes.to_vec(),
    })
}

/// Splits the tensor along `dim` in torch.chunk pieces; rank `r` gets the reduction (sum or
/// avg) of every rank's piece `r`. Backward: all-gather (divided by the size for avg).
pub fn reduce_scatter<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    op: ReduceOp,
) -> Result<Tensor<D>> {
    check_dim::<D>(dim)?;
    let sizes = chunk_sizes(tensor.dims()[dim], group.size());
    reduce_scatter_uneven(tensor, group, dim, &sizes, op)
}

/// [`reduce_scatter`] with explicit piece sizes along `dim`.
pub fn reduce_scatter_uneven<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    sizes: &[usize],
    op: ReduceOp,
) -> Result<Tensor<D>> {
    check_dim::<D>(dim)?;
    check_sizes(group, sizes)?;
    check_total(tensor.dims()[dim], sizes, dim)?;
    check_op(op, "a differentiable reduce-scatter")?;
    let sizes = sizes.to_vec();
    Ok(run(
        tensor,
        group,
        CollectiveKind::ReduceScatter { dim, sizes, op },
    ))
}

/// Splits the tensor along `split_dim` in torch.chunk pieces, sends piece `s` to rank `s`,
/// and concatenates the pieces received along `cat_dim` (every rank's tensor has the same
/// shape). Backward: the inverse all-to-all.
pub fn all_to_all<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    split_dim: usize,
    cat_dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(split_dim)?;
    check_dim::<D>(cat_dim)?;
    let dims = tensor.dims();
    let split_sizes = chunk_sizes(dims[split_dim], group.size());
    let cat_sizes = if split_dim == cat_dim {
        vec![split_sizes[group.rank()]; group.size()]
    } else {
        vec![dims[cat_dim]; group.size()]
    };
    all_to_all_uneven(tensor, group, split_dim, &split_sizes, cat_dim, &cat_sizes)
}

/// All-to-all with explicit sizes: piece `s` of `split_sizes[s]` elements along `split_dim`
/// goes to rank `s`; the piece from rank `r` has `cat_sizes[r]` elements along `cat_dim`.
pub fn all_to_all_uneven<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    split_dim: usize,
    split_sizes: &[usize],
    cat_dim: usize,
    cat_sizes: &[usize],
) -> Result<Tensor<D>> {
    check_dim::<D>(split_dim)?;
    check_dim::<D>(cat_dim)?;
    check_sizes(group, split_sizes)?;
    check_sizes(group, cat_sizes)?;
    let dims = tensor.dims();
    check_total(dims[split_dim], split_sizes, split_dim)?;
    if split_dim != cat_dim {
        check_local(dims[cat_dim], cat_sizes, group.rank(), cat_dim)?;
    }
    Ok(run(
        tensor,
        group,
        CollectiveKind::AllToAll {
            split_dim,
            split_sizes: split_sizes.to_vec(),
            cat_dim,
            cat_sizes: cat_sizes.to_vec(),
        },
    ))
}

/// Sends the tensor to `dst`. Returns a one-element zero token: add it to this rank's loss
/// (or call `backward()` on it) so that backward receives the tensor's gradient from `dst`.
pub fn send<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    dst: usize,
    tag: u64,
) -> Result<Tensor<1>> {
    check_rank(group, dst, "destination")?;
    let spec = CollectiveSpec::new(group, CollectiveKind::Send { dst, tag });
    Ok(Tensor::from_dispatch(
        <Dispatch as CollectiveBackend>::collective(tensor.into_dispatch(), spec),
    ))
}

/// Receives a tensor shaped like `template` from `src`. On an autodiff device the result is
/// tracked, and backward sends its gradient back to `src`.
pub fn recv<const D: usize>(
    template: Tensor<D>,
    group: &ProcessGroup,
    src: usize,
    tag: u64,
) -> Result<Tensor<D>> {
    check_rank(group, src, "source")?;
    let template = if template.device().is_autodiff() {
        template.detach().require_grad()
    } else {
        template
    };
    Ok(run(template, group, CollectiveKind::Recv { src, tag }))
}

/// One step around the ring of `group`: returns the tensor of the previous rank (rank − 1,
/// mod the size) and hands this rank's to the next; every rank's tensor has the same shape.
/// Backward sends each gradient back to the rank its tensor came from (ring attention's K/V
/// blocks and their dK/dV).
pub fn ring_shift<const D: usize>(tensor: Tensor<D>, group: &ProcessGroup, tag: u64) -> Tensor<D> {
    run(tensor, group, CollectiveKind::Shift { offset: 1, tag })
}

/// [`ring_shift`] in two halves, so that the transfer runs while the caller computes: posts
/// this rank's tensor to the next rank and a receive from the previous one on the group's
/// communication threads, and returns at once. [`PendingShift::finish`] gives the tensor
/// received. Backward is overlapped the same way: the finish's backward starts sending the
/// gradient back to the rank it came from, and the start's backward — after the gradients of
/// whatever was computed in between — adds the gradient that arrived.
pub fn ring_shift_start<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    tag: u64,
) -> PendingShift<D> {
    let kind = CollectiveKind::ShiftStart {
        offset: 1,
        tag,
        keep: true,
    };
    PendingShift {
        posted: run(tensor, group, kind),
        group: group.clone(),
        tag,
    }
}

/// A [`ring_shift_start`] in flight. Finish it on the thread that started it, before another
/// shift with the same tag starts on this rank.
#[must_use = "a started ring shift must be finished"]
#[derive(Debug)]
pub struct PendingShift<const D: usize> {
    posted: Tensor<D>,
    group: ProcessGroup,
    tag: u64,
}

impl<const D: usize> PendingShift<D> {
    /// Waits for the transfer and returns the previous rank's tensor.
    pub fn finish(self) -> Tensor<D> {
        let kind = CollectiveKind::ShiftFinish {
            offset: 1,
            tag: self.tag,
            add: false,
        };
        run(self.posted, &self.group, kind)
    }
}

/// Megatron's `f` ("copy to tensor-parallel region"): identity forward, all-reduce (sum)
/// backward.
pub fn copy_to_group<const D: usize>(tensor: Tensor<D>, group: &ProcessGroup) -> Tensor<D> {
    run(tensor, group, CollectiveKind::CopyToGroup)
}

/// Megatron's `g` ("reduce from tensor-parallel region"): all-reduce (sum) forward,
/// identity backward.
pub fn reduce_from_group<const D: usize>(tensor: Tensor<D>, group: &ProcessGroup) -> Tensor<D> {
    run(
        tensor,
        group,
        CollectiveKind::ReduceFromGroup { op: ReduceOp::Sum },
    )
}

/// Keeps this rank's torch.chunk piece along `dim` (no communication); backward all-gathers
/// the gradient (Megatron's "scatter to region").
pub fn split<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(dim)?;
    let sizes = chunk_sizes(tensor.dims()[dim], group.size());
    Ok(run(tensor, group, CollectiveKind::Split { dim, sizes }))
}

/// All-gathers along `dim` (rank `r` contributing `sizes[r]`, or all equal when `None`);
/// backward keeps this rank's piece of the gradient (Megatron's "gather from region").
pub fn gather<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    sizes: Option<&[usize]>,
) -> Result<Tensor<D>> {
    check_dim::<D>(dim)?;
    let sizes = match sizes {
        Some(s) => s.to_vec(),
        None => vec![tensor.dims()[dim]; group.size()],
    };
    check_sizes(group, &sizes)?;
    check_local(tensor.dims()[dim], &sizes, group.rank(), dim)?;
    Ok(run(tensor, group, CollectiveKind::Gather { dim, sizes }))
}

/// [`all_gather_uneven`] marked recomputable: under the Balanced checkpointing strategy the
/// gathered tensor is re-gathered in backward where it is needed instead of being kept
/// (ZeRO-3 / FSDP parameters).
pub fn all_gather_recomputable<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    sizes: &[usize],
) -> Result<Tensor<D>> {
    all_gather_recomputable_as(tensor, group, dim, sizes, None)
}

/// [`all_gather_recomputable`] whose output is cast to `dtype` inside the collective (the
/// gradient cast back before the reduce-scatter), so that the recompute re-runs the cast too
/// and no half-precision copy is kept from forward to backward (mixed-precision ZeRO-3).
pub fn all_gather_recomputable_as<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    sizes: &[usize],
    dtype: Option<burn::tensor::DType>,
) -> Result<Tensor<D>> {
    let kind = all_gather_kind(&tensor, group, dim, sizes)?;
    let mut spec = CollectiveSpec::new(group, kind).recomputable();
    spec.output_dtype = dtype;
    Ok(collective(tensor, spec))
}
