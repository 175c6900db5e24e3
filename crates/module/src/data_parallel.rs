//! [`DataParallel`]: the one interface of Bonfire's data-parallel wrappers. DDP
//! (`bonfire-ddp`) and ZeRO stages 0–3 (`bonfire-zero`) implement it, so that one training
//! loop — the trainer's, a pipeline stage's, yours — runs with any of them, chosen at run time.
//!
//! A step is either one forward and its backward:
//!
//! ```ignore
//! let loss = dp.forward(|m| m.loss(batch));   // hooks attached: reduction overlaps backward
//! dp.backward(loss)?;                          // gradients averaged over the group
//! dp.step(lr)?;                                // Burn's optimizer on what this rank owns
//! ```
//!
//! or several micro-batches whose backward the caller runs (a pipeline stage, gradient
//! accumulation), reduced once:
//!
//! ```ignore
//! for mb in micro_batches {
//!     let out = dp.forward_micro(|m| m.forward(mb.input));
//!     let mut grads = root(out).backward();
//!     dp.accumulate(&mut grads)?;              // summed, not reduced
//! }
//! dp.reduce()?;                                // averaged over the group, once
//! dp.step(lr)?;
//! ```
//!
//! Every call is a collective on [`DataParallel::process_group`] where the wrapper needs one:
//! make the same calls in the same order on every rank.
//!
//! A [`Subgroup`] is what an engine needs to know of parameters that only part of its group
//! holds (expert parallelism's experts): it keeps them apart, on their own replicas.

use crate::params::ParamValues;
use bonfire_comm::ProcessGroup;
use bonfire_dtensor::plane::{self, ledger::Reason};
use burn::module::{Module, ParamId};
use burn::tensor::{Gradients, Tensor};
use std::collections::HashSet;
use std::ops::Range;

/// Parameters that only part of a data-parallel group holds — expert parallelism's experts
/// (`bonfire-ep` builds this): each rank holds its own slice of them, and the ranks that hold
/// the same slice are their `replicas`. A data-parallel engine keeps them apart from the
/// other parameters: synchronized from rank 0 of `replicas`, their gradients averaged over
/// `replicas` and multiplied by `grad_scale` to be the mean over the whole group, their
/// optimizer state (ZeRO) partitioned over `replicas`.
#[derive(Debug, Clone)]
pub struct Subgroup {
    /// The parameters (this rank's slices).
    pub ids: HashSet<ParamId>,
    /// The ranks holding the same values.
    pub replicas: ProcessGroup,
    /// What their average over `replicas` is multiplied by to be the mean over the whole
    /// data-parallel group.
    pub grad_scale: f32,
}

impl Subgroup {
    /// Whether parameter `id` is one of them.
    pub fn contains(&self, id: &ParamId) -> bool {
        self.ids.contains(id)
    }
}

/// One rank's data-parallel wrapper of a module `M` (see the module docs).
pub trait DataParallel<M: Module> {
    /// The wrapper's error; every variant is raised on every rank alike.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The group over which gradients are averaged.
    fn process_group(&self) -> &ProcessGroup;

    /// Runs the forward pass `f` on the module as this rank computes with it (a replica, or
    /// parameters gathered from their shards), attaching what makes [`backward`](Self::backward)
    /// reduce gradients while it runs (for layers entered through [`crate::layer`]).
    fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R;

    /// Backpropagates `loss` (built in [`forward`](Self::forward)) and leaves the gradients
    /// averaged over the group, ready for [`step`](Self::step).
    fn backward(&mut self, loss: Tensor<1>) -> Result<(), Self::Error>;

    /// Runs the forward pass of a micro-batch whose backward the caller runs: nothing is
    /// reduced during that backward; hand its gradients to [`accumulate`](Self::accumulate).
    fn forward_micro<R>(&mut self, f: impl FnOnce(&M) -> R) -> R;

    /// Runs a forward pass that no backward follows (evaluation): the module as
    /// [`forward_micro`](Self::forward_micro) sees it, with nothing kept for a backward and
    /// no gradient state touched.
    fn evaluate<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        self.forward_micro(f)
    }

    /// Takes the module's gradients out of `grads` (from a backward of
    /// [`forward_micro`](Self::forward_micro) outputs) and adds them to what earlier
    /// micro-batches left. Nothing is reduced; other tensors' gradients stay in `grads`.
    fn accumulate(&mut self, grads: &mut Gradients) -> Result<(), Self::Error>;

    /// Averages the accumulated gradients over the group, ready for [`step`](Self::step).
    fn reduce(&mut self) -> Result<(), Self::Error>;

    /// Applies Burn's optimizer to what this rank owns and brings the updated parameters to
    /// every rank that computes with them.
    fn step(&mut self, lr: f64) -> Result<(), Self::Error>;

    /// Replaces each flat gradient tensor this rank holds after the last reduction (a DDP
    /// bucket, a ZeRO vector or range, the experts') by `f` of it — what the optimizer then
    /// steps. No communication.
    fn map_gradients(
        &mut self,
        f: &mut dyn FnMut(Tensor<1>) -> Tensor<1>,
    ) -> Result<(), Self::Error>;

    /// Multiplies the gradients this rank holds after the last reduction by `factor` (the
    /// inverse loss scale of dynamic loss scaling) and says whether every one of them is
    /// finite — this rank's view only: the caller agrees across ranks before stepping or
    /// skipping. No communication; one scalar read per gradient tensor.
    fn unscale_gradients(&mut self, factor: f32) -> Result<bool, Self::Error> {
        let mut finite = true;
        self.map_gradients(&mut |g| {
            let (g, ok) = scale_and_check(g, factor);
            finite &= ok;
            g
        })?;
        Ok(finite)
    }

    /// Multiplies the gradients this rank holds after the last reduction by `factor`
    /// (clipping), on the device: no communication, nothing read back.
    fn scale_gradients(&mut self, factor: f32) -> Result<(), Self::Error> {
        self.map_gradients(&mut |g| g.mul_scalar(factor))
    }

    /// Σ `weights[k]`·|g_k|² over the gradient elements this rank holds after the last
    /// reduction (k: the wrapper's parameters, in module order), each element's term divided
    /// by how many ranks of the wrapper's groups (its group, an expert's replicas, HSDP's
    /// replicas) hold that same element — so that the sum of this over those ranks counts
    /// every element once: the square of the global gradient norm, for clipping. On the
    /// device, no communication; `None` where this rank holds no gradient.
    fn gradient_square_sum(&self, weights: &[f32]) -> Result<Option<Tensor<1>>, Self::Error>;

    /// [`forward`](Self::forward) with `loss_fn`, [`backward`](Self::backward),
    /// [`step`](Self::step); returns this rank's loss.
    fn train_step(
        &mut self,
        lr: f64,
        loss_fn: impl FnOnce(&M) -> Tensor<1>,
    ) -> Result<f32, Self::Error> {
        let loss = self.forward(loss_fn);
        let value = plane::to_host(loss.clone().detach(), Reason::Report)[0];
        self.backward(loss)?;
        self.step(lr)?;
        Ok(value)
    }

    /// The averaged gradient of every parameter from the last reduction, whole, in module
    /// order (gathered from the owners where sharded: a collective there). Empty when there
    /// is none (before the first backward, after a step).
    fn gradients(&self) -> Result<Vec<ParamValues>, Self::Error>;

    /// Every parameter's current values, whole, in module order (gathered from the owners
    /// where sharded: a collective there) — to compare, export or evaluate.
    fn parameters(&self) -> Result<Vec<ParamValues>, Self::Error>;

    /// The module's state tensors ([`crate::params::buffers`]: parameters without gradient,
    /// no part of the shards or the optimizer — every rank holds them whole) and their
    /// values, in module order.
    fn buffers(&self) -> Vec<(crate::params::ParamInfo, Vec<f32>)>;

    /// Sets the state tensors' values ([`buffers`](Self::buffers)' order), between steps.
    fn set_buffers(&mut self, values: &[Vec<f32>]);

    /// The module with every parameter whole, as a plain single-device model holds it
    /// (gathered where sharded: a collective there).
    fn into_model(self) -> Result<M, Self::Error>
    where
        Self: Sized;
}

/// `tensor × factor`, and whether every element is finite (one scalar read: `Σ x·0` is 0
/// for finite values and NaN as soon as one is infinite or NaN).
pub fn scale_and_check(tensor: Tensor<1>, factor: f32) -> (Tensor<1>, bool) {
    let tensor = if factor == 1.0 {
        tensor
    } else {
        tensor.mul_scalar(factor)
    };
    let probe = tensor
        .clone()
        .mul_scalar(0.0)
        .sum()
        .cast(burn::tensor::DType::F32);
    let probe = plane::to_host(probe, Reason::Report)[0];
    (tensor, probe == 0.0)
}

/// Σ weight·|g|² over `pieces` of the flat `grads` — (a range of it, its weight), in order and
/// disjoint — in f32 on the device: one slice per run of consecutive ranges of one weight.
/// `None` without a piece.
pub fn weighted_square_sum(
    grads: &Tensor<1>,
    pieces: impl IntoIterator<Item = (Range<usize>, f32)>,
) -> Option<Tensor<1>> {
    let mut runs: Vec<(Range<usize>, f32)> = Vec::new();
    for (r, w) in pieces {
        if r.is_empty() || w == 0.0 {
            continue;
        }
        match runs.last_mut() {
            Some((last, lw)) if last.end == r.start && *lw == w => last.end = r.end,
            _ => runs.push((r, w)),
        }
    }
    runs.into_iter()
        .map(|(r, w)| {
            let g = grads
                .clone()
                .narrow(0, r.start, r.len())
                .cast(burn::tensor::DType::F32);
            let s = g.clone().mul(g).sum();
            if w == 1.0 { s } else { s.mul_scalar(w) }
        })
        .reduce(|a, b| a + b)
}
