//! The forward of every collective, on host memory.
//!
//! A tensor's data is moved out of the backend ([`TensorData`] takes the allocation when no
//! other handle shares it), reduced in place when the call allows it (all-reduce,
//! broadcast, reduce, recv: no copy at all on Flex) or written into one fresh buffer
//! otherwise, and moved back in. Collectives along a dimension other than the outermost
//! (non-trivial leading dims) reorder the pieces in rank order: in place where every rank's
//! piece has the same size ([`transpose_blocks`]: each block moved once, no second buffer —
//! the sequence-parallel gathers of `[B, T, d]` along T; reduce-scatter's and all-to-all's
//! input in the buffer the tensor gave up), else with one extra copy.

use super::buffers::{check, slice, slice_mut};
use super::{CollectiveKind, CollectiveSpec};
use crate::debug::record;
use bonfire_comm::OpKind;
use bonfire_comm::{Element as CommElement, ProcessGroup, ReduceOp, bf16, f16};
use burn::tensor::{DType, Element as BurnElement, TensorData};
use std::borrow::Cow;

/// Runs the communicating part of `spec` on `data` and returns the output data.
pub(crate) fn execute(data: TensorData, spec: &CollectiveSpec) -> TensorData {
    match data.dtype() {
        DType::F32 => typed::<f32>(data, spec),
        DType::F64 => typed::<f64>(data, spec),
        DType::F16 => typed::<f16>(data, spec),
        DType::BF16 => typed::<bf16>(data, spec),
        other => {
            panic!("bonfire-dtensor: collectives support f32, f64, f16 and bf16, not {other:?}")
        }
    }
}

/// `(pre, post)`: the products of the dims before and after `dim`.
fn outer_inner(shape: &[usize], dim: usize) -> (usize, usize) {
    (
        shape[..dim].iter().product(),
        shape[dim + 1..].iter().product(),
    )
}

/// Reorders `[pre, sum(sizes), post]` into consecutive pieces `[pre, sizes[r], post]`.
fn pack<'a, T: Copy>(src: &'a [T], pre: usize, sizes: &[usize], post: usize) -> Cow<'a, [T]> {
    if pre == 1 {
        return Cow::Borrowed(src);
    }
    let total: usize = sizes.iter().sum();
    let mut out = Vec::with_capacity(src.len());
    let mut offset = 0;
    for &s in sizes {
        for p in 0..pre {
            let start = (p * total + offset) * post;
            out.extend_from_slice(&src[start..start + s * post]);
        }
        offset += s;
    }
    Cow::Owned(out)
}

/// `data`'s `[pre, sum(sizes), post]` elements as [`pack`] lays them out, rank-major: reordered
/// in the buffer the tensor gave up where the pieces are equal ([`transpose_blocks`]), else
/// copied.
fn rank_major<'a, T: BurnElement + Copy>(
    data: &'a mut TensorData,
    pre: usize,
    sizes: &[usize],
    post: usize,
) -> Cow<'a, [T]> {
    if pre > 1 && all_equal(sizes) {
        let blocks = slice_mut::<T>(data);
        transpose_blocks(blocks, pre, sizes.len(), sizes[0] * post);
        return Cow::Borrowed(&*blocks);
    }
    pack(slice::<T>(data), pre, sizes, post)
}

/// The inverse of [`pack`]: consecutive pieces `[pre, sizes[r], post]` into
/// `[pre, sum(sizes), post]` (in `src`'s own buffer where the pieces are equal).
fn unpack<T: Copy>(mut src: Vec<T>, pre: usize, sizes: &[usize], post: usize, zero: T) -> Vec<T> {
    if pre == 1 {
        return src;
    }
    if all_equal(sizes) {
        // Rank-major blocks `[r][p]` of `sizes[0]·post` elements, wanted `[p][r]`.
        transpose_blocks(&mut src, sizes.len(), pre, sizes[0] * post);
        return src;
    }
    let total: usize = sizes.iter().sum();
    let mut out = vec![zero; src.len()];
    let mut read = 0;
    let mut offset = 0;
    for &s in sizes {
        for p in 0..pre {
            let start = (p * total + offset) * post;
            out[start..start + s * post].copy_from_slice(&src[read..read + s * post]);
            read += s * post;
        }
        offset += s;
    }
    out
}

/// Reorders `v`, `rows × cols` blocks of `block` elements in row-major order, into column-major
/// order (the block at row `r`, column `c` to index `c · rows + r`), in place: the blocks move
/// along the permutation's cycles, each once, through one block of scratch.
fn transpose_blocks<T: Copy>(v: &mut [T], rows: usize, cols: usize, block: usize) {
    let n = rows * cols;
    assert_eq!(
        v.len(),
        n * block,
        "bonfire-dtensor: blocks do not tile the buffer"
    );
    if rows <= 1 || cols <= 1 || block == 0 {
        return;
    }
    // The block landing at index j is the one at row j % rows, column j / rows.
    let from = |j: usize| (j % rows) * cols + j / rows;
    let mut done = vec![false; n];
    let mut held: Vec<T> = Vec::with_capacity(block);
    for start in 0..n {
        if done[start] {
            continue;
        }
        held.clear();
        held.extend_from_slice(&v[start * block..(start + 1) * block]);
        let mut at = start;
        loop {
            done[at] = true;
            let src = from(at);
            if src == start {
                v[at * block..(at + 1) * block].copy_from_slice(&held);
                break;
            }
            v.copy_within(src * block..(src + 1) * block, at * block);
            at = src;
        }
    }
}

fn all_equal(v: &[usize]) -> bool {
    v.windows(2).all(|w| w[0] == w[1])
}

/// Runs the communicating part of `spec` on `data`, whose elements are `T`.
fn typed<T>(mut data: TensorData, spec: &CollectiveSpec) -> TensorData
where
    T: CommElement + BurnElement + Copy,
{
    let pg: &ProcessGroup = &spec.group;
    let out_shape = spec.output_shape(&shape_of(&data));
    let zero = T::from_f64(0.0);
    match &spec.kind {
        CollectiveKind::AllReduce { op } | CollectiveKind::ReduceFromGroup { op } => {
            record(OpKind::AllReduce);
            check(pg.all_reduce(slice_mut::<T>(&mut data), *op), "all_reduce");
            data
        }
        CollectiveKind::Broadcast { root } => {
            record(OpKind::Broadcast);
            check(pg.broadcast(slice_mut::<T>(&mut data), *root), "broadcast");
            data
        }
        CollectiveKind::Reduce { op, root } => {
            record(OpKind::Reduce);
            let buf = slice_mut::<T>(&mut data);
            check(pg.reduce(buf, *op, *root), "reduce");
            if pg.rank() != *root {
                buf.fill(zero);
            }
            data
        }
        CollectiveKind::AllGather { dim, sizes } | CollectiveKind::Gather { dim, sizes } => {
            all_gather::<T>(pg, &data, out_shape, Along::new(*dim, sizes))
        }
        CollectiveKind::ReduceScatter { dim, sizes, op } => {
            reduce_scatter::<T>(pg, data, out_shape, Along::new(*dim, sizes), *op)
        }
        CollectiveKind::AllToAll {
            split_dim,
            split_sizes,
            cat_dim,
            cat_sizes,
        } => {
            let split = Along::new(*split_dim, split_sizes);
            all_to_all::<T>(pg, data, out_shape, split, Along::new(*cat_dim, cat_sizes))
        }
        CollectiveKind::Send { dst, tag } => {
            record(OpKind::Send);
            check(pg.send(slice::<T>(&data), *dst, *tag), "send");
            TensorData::new(vec![zero], out_shape)
        }
        CollectiveKind::Recv { src, tag } => {
            record(OpKind::Recv);
            check(pg.recv(slice_mut::<T>(&mut data), *src, *tag), "recv");
            data
        }
        CollectiveKind::Shift { offset, tag } => {
            let (me, n) = (pg.rank(), pg.size());
            let (dst, src) = ((me + offset) % n, (me + n - offset % n) % n);
            if dst == me {
                return data;
            }
            record(OpKind::Send);
            record(OpKind::Recv);
            let mut received = data.clone();
            // Even ranks send first, odd ranks receive first: no cycle of ranks all waiting
            // in a send that only completes when its receiver posts its receive.
            let send = |d: &TensorData| check(pg.send(slice::<T>(d), dst, *tag), "ring send");
            if me % 2 == 0 {
                send(&data);
                check(
                    pg.recv(slice_mut::<T>(&mut received), src, *tag),
                    "ring recv",
                );
            } else {
                check(
                    pg.recv(slice_mut::<T>(&mut received), src, *tag),
                    "ring recv",
                );
                send(&data);
            }
            received
        }
        CollectiveKind::ShiftStart { offset, tag, keep } => {
            super::shift::start::<T>(pg, data, (*offset, *tag), *keep)
        }
        CollectiveKind::ShiftFinish { tag, add, .. } => {
            super::shift::finish::<T>(pg, data, *tag, *add)
        }
        CollectiveKind::CopyToGroup
        | CollectiveKind::Pad { .. }
        | CollectiveKind::Split { .. }
        | CollectiveKind::Partition { .. } => {
            unreachable!("{:?} does not communicate in forward", spec.kind)
        }
    }
}

/// The shape of `data`.
fn shape_of(data: &TensorData) -> Vec<usize> {
    data.shape().iter().copied().collect()
}

/// A dim of a tensor and the size of each rank's piece along it.
#[derive(Clone, Copy)]
struct Along<'a> {
    dim: usize,
    sizes: &'a [usize],
}

impl<'a> Along<'a> {
    /// The pieces of `sizes` along `dim`.
    fn new(dim: usize, sizes: &'a [usize]) -> Self {
        Self { dim, sizes }
    }
}

/// All-gather (or gather) of every rank's piece of `data` along `along`, in rank order.
fn all_gather<T>(
    pg: &ProcessGroup,
    data: &TensorData,
    out_shape: Vec<usize>,
    along: Along,
) -> TensorData
where
    T: CommElement + BurnElement + Copy,
{
    record(OpKind::AllGather);
    let zero = T::from_f64(0.0);
    let (pre, post) = outer_inner(&shape_of(data), along.dim);
    let sizes = along.sizes;
    // A rank of size 0 holds a placeholder, which it does not send.
    let send = &slice::<T>(data)[..pre * sizes[pg.rank()] * post];
    let mut recv = vec![zero; pre * post * sizes.iter().sum::<usize>()];
    if all_equal(sizes) {
        check(pg.all_gather(send, &mut recv), "all_gather");
    } else {
        let counts: Vec<usize> = sizes.iter().map(|s| pre * s * post).collect();
        check(pg.all_gather_uneven(send, &mut recv, &counts), "all_gather");
    }
    TensorData::new(unpack(recv, pre, sizes, post, zero), out_shape)
}

/// Reduce-scatter of `data` with `op`: this rank gets its piece along `along`, reduced.
fn reduce_scatter<T>(
    pg: &ProcessGroup,
    mut data: TensorData,
    out_shape: Vec<usize>,
    along: Along,
    op: ReduceOp,
) -> TensorData
where
    T: CommElement + BurnElement + Copy,
{
    record(OpKind::ReduceScatter);
    let zero = T::from_f64(0.0);
    let (pre, post) = outer_inner(&shape_of(&data), along.dim);
    let sizes = along.sizes;
    let send = rank_major::<T>(&mut data, pre, sizes, post);
    let mut recv = vec![zero; pre * sizes[pg.rank()] * post];
    if all_equal(sizes) {
        check(pg.reduce_scatter(&send, &mut recv, op), "reduce_scatter");
    } else {
        let counts: Vec<usize> = sizes.iter().map(|s| pre * s * post).collect();
        check(
            pg.reduce_scatter_uneven(&send, &mut recv, &counts, op),
            "reduce_scatter",
        );
    }
    TensorData::new(recv, out_shape)
}

/// All-to-all: `data` split into one piece per rank along `split`, the pieces received
/// concatenated in rank order along `cat`.
fn all_to_all<T>(
    pg: &ProcessGroup,
    mut data: TensorData,
    out_shape: Vec<usize>,
    split: Along,
    cat: Along,
) -> TensorData
where
    T: CommElement + BurnElement + Copy,
{
    record(OpKind::AllToAll);
    let zero = T::from_f64(0.0);
    let (pre_s, post_s) = outer_inner(&shape_of(&data), split.dim);
    let send = rank_major::<T>(&mut data, pre_s, split.sizes, post_s);
    let send_counts: Vec<usize> = split.sizes.iter().map(|s| pre_s * s * post_s).collect();
    // The piece from rank r: the output shape with `cat.sizes[r]` along `cat.dim`.
    let (pre_c, post_c) = outer_inner(&out_shape, cat.dim);
    let recv_counts: Vec<usize> = cat.sizes.iter().map(|s| pre_c * s * post_c).collect();
    let mut recv = vec![zero; recv_counts.iter().sum()];
    // Decide from the sizes, which every rank of the group shares, so that all ranks
    // make the same (even or uneven) call.
    if all_equal(split.sizes) && all_equal(cat.sizes) {
        check(pg.all_to_all(&send, &mut recv), "all_to_all");
    } else {
        check(
            pg.all_to_all_uneven(&send, &send_counts, &mut recv, &recv_counts),
            "all_to_all",
        );
    }
    TensorData::new(unpack(recv, pre_c, cat.sizes, post_c, zero), out_shape)
}
