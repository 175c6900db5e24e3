//! Stage 2's gradient reduction: gradient buckets reduce-scattered while backward runs.
//!
//! The flat gradient vector is cut into buckets of `bucket_bytes`, from its end (the order in
//! which backward produces gradients). Each parameter's gradient, a tensor on the device, is
//! cut into its buckets' slices as it arrives; a bucket is packed (its slices concatenated,
//! on the device) and its reduce-scatter (average) — each rank receiving its own range's part —
//! starts on the group's communication thread as soon as every parameter in it has its
//! gradient, while backward goes on (as DDP's all-reduces do); its slices are dropped: a rank
//! keeps only its own range, plus the buckets still filling or in flight — at most
//! [`MAX_IN_FLIGHT`] of them: launching one more first waits for the oldest (as FSDP limits
//! its collectives in flight), so a communication thread that falls behind backward slows it
//! instead of letting full-gradient buckets pile up. [`GradBuckets::finish`] waits for every
//! bucket at the end of backward.
//!
//! Gradients arrive two ways:
//! - during backward, for the layers a model runs through [`bonfire_module::layer`]: each
//!   parameter of the layer's copy carries a gradient hook anchored at the layer's input
//!   ([`bonfire_module::graph::SinkHook`]), which fires right after the layer's backward
//!   and deposits it here ([`GradBuckets`] is its [`GradSink`]);
//! - after backward, from Burn's `Gradients`, for everything else ([`GradBuckets::finish`]).
//!
//! Buckets are launched strictly in order on every rank, so the reduce-scatters line up
//! whichever way their gradients came.

use crate::error::{Result, ZeroError};
use crate::partition::Partition;
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::plane::{self, PendingPiece};
use bonfire_dtensor::timing::{self, Span};
use bonfire_module::graph::GradSink;
use bonfire_module::params::ParamInfo;
use burn::tensor::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

/// The most bucket reduce-scatters a rank keeps in flight during backward: one, running
/// while the next layer's backward computes (the stage-2 memory test's bound of a couple of
/// layers in flight held with a 2 MiB margin in 5 of 5 runs with one; with two it came within
/// 0.06 MiB of it in 1 run of 3, and with no limit failed, 4 layers in flight).
pub(crate) const MAX_IN_FLIGHT: usize = 1;

pub(crate) struct GradBuckets {
    pg: ProcessGroup,
    part: Arc<Partition>,
    infos: Arc<Vec<ParamInfo>>,
    /// Bucket `b`'s range of the flat vector; bucket 0 holds its end.
    bounds: Vec<Range<usize>>,
    /// The buckets each parameter overlaps.
    buckets_of: Vec<Vec<usize>>,
    /// The slices of each bucket filled so far, by parameter (summed over its uses).
    slices: Vec<BTreeMap<usize, Tensor<1>>>,
    launched: Vec<bool>,
    /// Hooks attached to each parameter, and how many have fired.
    expected: Vec<u32>,
    arrived: Vec<u32>,
    /// Parameters of each bucket whose gradient is not complete yet.
    incomplete: Vec<usize>,
    next: usize,
    /// The reduce-scatters in flight, in launch order, with where their part goes in this
    /// rank's own range.
    in_flight: std::collections::VecDeque<(usize, PendingPiece)>,
    /// The buckets already waited for (to keep [`MAX_IN_FLIGHT`]): where their part goes, the
    /// part, and when the communication thread ran them.
    done: Vec<(usize, Option<Tensor<1>>, Span)>,
    /// When each bucket was handed to the communication thread (µs since the timing epoch).
    launches: Vec<f64>,
    device: Option<Device>,
    /// What gradients are reduce-scattered in (the mixed-precision reduce dtype).
    dtype: DType,
    error: Option<ZeroError>,
}

impl GradBuckets {
    pub(crate) fn new(
        pg: ProcessGroup,
        part: Arc<Partition>,
        infos: Arc<Vec<ParamInfo>>,
        bucket_bytes: usize,
        dtype: DType,
    ) -> Self {
        let cap = (bucket_bytes / 4).max(1);
        let mut bounds = Vec::new();
        let mut end = part.total();
        while end > 0 {
            let start = end.saturating_sub(cap);
            bounds.push(start..end);
            end = start;
        }
        let buckets_of: Vec<Vec<usize>> = (0..part.num_params())
            .map(|p| {
                let (a, b) = (part.offsets[p], part.offsets[p + 1]);
                (0..bounds.len())
                    .filter(|&k| bounds[k].start < b && a < bounds[k].end)
                    .collect()
            })
            .collect();
        let mut incomplete = vec![0; bounds.len()];
        buckets_of
            .iter()
            .flatten()
            .for_each(|&k| incomplete[k] += 1);
        Self {
            slices: vec![BTreeMap::new(); bounds.len()],
            launched: vec![false; bounds.len()],
            expected: vec![0; infos.len()],
            arrived: vec![0; infos.len()],
            incomplete,
            next: 0,
            in_flight: std::collections::VecDeque::new(),
            done: Vec::new(),
            launches: Vec::new(),
            device: None,
            dtype,
            error: None,
            pg,
            part,
            infos,
            bounds,
            buckets_of,
        }
    }

    /// Cuts parameter `p`'s flat gradient (or a part of it, from one use) into its buckets.
    fn add(&mut self, p: usize, grad: Tensor<1>) -> Result<()> {
        let a = self.part.offsets[p];
        self.device.get_or_insert_with(|| grad.device());
        let grad = grad.cast(self.dtype);
        for &k in &self.buckets_of[p] {
            if self.launched[k] {
                return Err(ZeroError::Usage(format!(
                    "parameter `{}` got gradient from outside the layer it was entered with \
                     (`bonfire_module::layer`) after its bucket was reduced; run every module \
                     that uses it through `layer`",
                    self.infos[p].path
                )));
            }
            let range = self.bounds[k].clone();
            let (s, e) = (range.start.max(a), range.end.min(self.part.offsets[p + 1]));
            let slice = grad.clone().narrow(0, s - a, e - s);
            let slot = self.slices[k].remove(&p);
            self.slices[k].insert(p, slot.map_or(slice.clone(), |sum| sum + slice));
        }
        Ok(())
    }

    fn complete(&mut self, p: usize) {
        for &k in &self.buckets_of[p] {
            self.incomplete[k] -= 1;
        }
    }

    /// Bucket `k` packed: its parameters' slices in flat order (zeros for a parameter that got
    /// no gradient).
    fn pack(&mut self, k: usize) -> Tensor<1> {
        let range = self.bounds[k].clone();
        let device = self.device.clone().unwrap_or_else(Device::flex);
        let mut filled = std::mem::take(&mut self.slices[k]);
        let members = (0..self.part.num_params()).filter(|&p| self.buckets_of[p].contains(&k));
        let parts: Vec<Tensor<1>> = members
            .map(|p| {
                filled.remove(&p).unwrap_or_else(|| {
                    let (a, b) = (self.part.offsets[p], self.part.offsets[p + 1]);
                    let n = range.end.min(b) - range.start.max(a);
                    Tensor::zeros([n], (&device, self.dtype))
                })
            })
            .collect();
        bonfire_kernels::pack_scaled(&parts, 1.0)
    }

    /// Starts, in bucket order, the reduce-scatter of every bucket whose parameters are all
    /// complete.
    fn launch_ready(&mut self) -> Result<()> {
        while self.next < self.bounds.len() && self.incomplete[self.next] == 0 {
            let k = self.next;
            self.next += 1;
            self.launched[k] = true;
            let range = self.bounds[k].clone();
            let bucket = self.pack(k);
            bonfire_module::precision::observe::observer().reduced(bucket.dtype());
            let counts = self.part.sub_counts(&range);
            let own_start = self.part.ranges[self.pg.rank()].start;
            let at = own_start.max(range.start).saturating_sub(own_start);
            self.launches.push(timing::now());
            let pending = plane::reduce_scatter_async(bucket, &counts, ReduceOp::Avg, &self.pg)?;
            self.in_flight.push_back((at, pending));
            while self.in_flight.len() > MAX_IN_FLIGHT {
                let (at, oldest) = self.in_flight.pop_front().expect("more than the limit");
                let (slice, ran) = oldest.wait_timed()?;
                self.done.push((at, slice, Span::from(ran)));
            }
        }
        Ok(())
    }

    /// After backward: adds the gradients that did not come through hooks (`leftover[p]`,
    /// `None` for none), reduces the remaining buckets, waits for every bucket and returns
    /// this rank's range of the averaged gradient (`None` when it owns nothing), with when
    /// each bucket was launched and ran.
    pub(crate) fn finish(mut self, leftover: Vec<Option<Tensor<1>>>) -> Result<Reduced> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        for (p, grad) in leftover.into_iter().enumerate() {
            if let Some(g) = grad {
                self.add(p, g)?;
            }
            if self.expected[p] == 0 || self.arrived[p] < self.expected[p] {
                self.complete(p);
            }
        }
        self.launch_ready()?;
        let mut own = BTreeMap::new();
        let mut spans = Vec::with_capacity(self.done.len() + self.in_flight.len());
        for (at, slice, span) in std::mem::take(&mut self.done) {
            spans.push(span);
            if let Some(slice) = slice {
                own.insert(at, slice);
            }
        }
        let mut first_error = None;
        for (at, pending) in std::mem::take(&mut self.in_flight) {
            // Every bucket is waited for, even after an error, so none is left running.
            match pending.wait_timed() {
                Ok((slice, ran)) => {
                    spans.push(Span::from(ran));
                    if let Some(slice) = slice {
                        own.insert(at, slice);
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e.into());
        }
        let parts: Vec<Tensor<1>> = own.into_values().collect();
        Ok(Reduced {
            own: (!parts.is_empty()).then(|| bonfire_kernels::pack_scaled(&parts, 1.0)),
            spans,
            launches: self.launches,
        })
    }
}

/// What [`GradBuckets::finish`] returns.
pub(crate) struct Reduced {
    /// This rank's range of the averaged gradient (`None` when it owns nothing).
    pub own: Option<Tensor<1>>,
    /// When the communication thread ran each bucket's reduce-scatter, in bucket order.
    pub spans: Vec<Span>,
    /// When each bucket was handed to it (µs since the timing epoch).
    pub launches: Vec<f64>,
}

impl GradSink for GradBuckets {
    fn expect(&mut self, p: usize) {
        self.expected[p] += 1;
    }

    fn deposit(&mut self, p: usize, grad: Tensor<1>) {
        if self.error.is_some() {
            return;
        }
        if let Err(e) = self.add(p, grad) {
            self.error = Some(e);
            return;
        }
        self.arrived[p] += 1;
        if self.arrived[p] == self.expected[p] {
            self.complete(p);
            if let Err(e) = self.launch_ready() {
                self.error = Some(e);
            }
        }
    }
}
