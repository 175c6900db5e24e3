//! Gradients on their way to a reduction, for both of a wrapper's flat vectors (the
//! parameters' and, under expert parallelism, the experts'): per-parameter gradients summed
//! over micro-batches ([`sum_into`]) and packed into one flat vector ([`pack`]); at stage 3
//! the gathers' slices' gradients summed by their place ([`accumulate_slices`]) and laid out
//! as the own range ([`own_range`]).

use crate::partition::ParamSlice;
use bonfire_module::params::ParamInfo;
use burn::tensor::{DType, Device, Gradients, Tensor};
use std::collections::BTreeMap;
use std::ops::Range;

/// Adds per-parameter flat gradients (`None`: none this time) to the running sums.
pub(crate) fn sum_into(sums: &mut [Option<Tensor<1>>], per_param: Vec<Option<Tensor<1>>>) {
    for (acc, g) in sums.iter_mut().zip(per_param) {
        if let Some(g) = g {
            *acc = Some(match acc.take() {
                Some(sum) => sum + g,
                None => g,
            });
        }
    }
}

/// Per-parameter flat gradients of `infos` (zeros for a parameter without one) in `dtype`,
/// packed in order into one flat vector and multiplied by `scale` — what is reduced.
pub(crate) fn pack(
    per_param: Vec<Option<Tensor<1>>>,
    infos: &[ParamInfo],
    device: &Device,
    dtype: DType,
    scale: f32,
) -> Tensor<1> {
    let parts: Vec<Tensor<1>> = per_param
        .into_iter()
        .zip(infos)
        .map(|(g, p)| match g {
            Some(g) => g.cast(dtype),
            None => Tensor::zeros([p.numel()], (device, dtype)),
        })
        .collect();
    let flat = bonfire_kernels::pack_scaled(&parts, scale);
    bonfire_module::precision::observe::observer().reduced(flat.dtype());
    flat
}

/// Adds each of a stage-3 wrapper's recorded `slices` (their place in the own range, the
/// autodiff leaf) that `grads` has a gradient for to `sums` (by offset) and forgets it; each
/// forward's slices get gradients from that forward's backward only.
pub(crate) fn accumulate_slices(
    slices: &mut Vec<(Range<usize>, Tensor<1>)>,
    sums: &mut BTreeMap<usize, Tensor<1>>,
    grads: &mut Gradients,
) {
    slices.retain(|(slot, slice)| match slice.grad_remove(grads) {
        Some(g) => {
            let sum = sums.remove(&slot.start);
            sums.insert(slot.start, sum.map_or(g.clone(), |s| s + g));
            false
        }
        None => true,
    });
}

/// The own range's gradient (stage 3) from the slices' sums by offset (`sums`, emptied; zeros
/// for a slice without one), in the order of the optimizer's `slices` starting at
/// `own_start`, multiplied by `scale`; `None` when the rank owns nothing.
pub(crate) fn own_range(
    slices: &[ParamSlice],
    own_start: usize,
    sums: &mut BTreeMap<usize, Tensor<1>>,
    device: &Device,
    scale: f32,
) -> Option<Tensor<1>> {
    let parts: Vec<Tensor<1>> = slices
        .iter()
        .map(|slice| {
            let slot = slice.flat.start - own_start;
            sums.remove(&slot)
                .unwrap_or_else(|| Tensor::zeros([slice.len()], device))
        })
        .collect();
    (!parts.is_empty()).then(|| bonfire_kernels::pack_scaled(&parts, scale))
}

/// Σ `weights[p]`·|g_p|² over a held gradient `g` of the vector `part` lays out: the whole
/// vector (`own`: `None`) or rank `own`'s range of it (each parameter's slice there). On the
/// device ([`bonfire_module::weighted_square_sum`]).
pub(crate) fn held_square_sum(
    g: &Tensor<1>,
    part: &crate::Partition,
    own: Option<usize>,
    weights: &[f32],
) -> Option<Tensor<1>> {
    match own {
        None => bonfire_module::weighted_square_sum(
            g,
            (0..part.num_params()).map(|p| (part.offsets[p]..part.offsets[p + 1], weights[p])),
        ),
        Some(rank) => {
            let start = part.ranges[rank].start;
            bonfire_module::weighted_square_sum(
                g,
                part.slices(rank)
                    .into_iter()
                    .map(|s| (s.flat.start - start..s.flat.end - start, weights[s.param])),
            )
        }
    }
}
