//! Stage 2's gradient reduction: gradient buckets reduce-scattered while backward runs.
//!
//! The flat gradient vector is cut into buckets of `bucket_bytes`, from its end (the order in
//! which backward produces gradients). A bucket is reduce-scattered (average) — each rank
//! receiving its own range's part — as soon as every parameter in it has its gradient, and
//! its buffer is dropped: a rank keeps only its own range, plus the buckets still filling.
//!
//! Gradients arrive two ways:
//! - during backward, for the layers a model runs through [`bonfire_dtensor::layer`]: each
//!   parameter of the layer's copy carries a gradient hook anchored at the layer's input
//!   ([`bonfire_dtensor::graph::SinkHook`]), which fires right after the layer's backward
//!   and deposits it here ([`GradBuckets`] is its [`GradSink`]);
//! - after backward, from Burn's `Gradients`, for everything else ([`GradBuckets::finish`]).
//!
//! Buckets are launched strictly in order on every rank, so the reduce-scatters line up
//! whichever way their gradients came.

use crate::error::{Result, ZeroError};
use crate::params::ParamInfo;
use crate::partition::Partition;
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::graph::GradSink;
use std::ops::Range;
use std::sync::Arc;

pub(crate) struct GradBuckets {
    pg: ProcessGroup,
    part: Arc<Partition>,
    infos: Arc<Vec<ParamInfo>>,
    /// Bucket `b`'s range of the flat vector; bucket 0 holds its end.
    bounds: Vec<Range<usize>>,
    /// The buckets each parameter overlaps.
    buckets_of: Vec<Vec<usize>>,
    /// Buffers of the buckets being filled (allocated by their first gradient).
    bufs: Vec<Option<Vec<f32>>>,
    launched: Vec<bool>,
    /// Hooks attached to each parameter, and how many have fired.
    expected: Vec<u32>,
    arrived: Vec<u32>,
    /// Parameters of each bucket whose gradient is not complete yet.
    incomplete: Vec<usize>,
    next: usize,
    /// This rank's range of the averaged gradient.
    own: Vec<f32>,
    error: Option<ZeroError>,
}

impl GradBuckets {
    pub(crate) fn new(
        pg: ProcessGroup,
        part: Arc<Partition>,
        infos: Arc<Vec<ParamInfo>>,
        bucket_bytes: usize,
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
        let own = vec![0.0; part.ranges[pg.rank()].len()];
        Self {
            bufs: vec![None; bounds.len()],
            launched: vec![false; bounds.len()],
            expected: vec![0; infos.len()],
            arrived: vec![0; infos.len()],
            incomplete,
            next: 0,
            own,
            error: None,
            pg,
            part,
            infos,
            bounds,
            buckets_of,
        }
    }

    /// Adds parameter `p`'s gradient (or a part of it, from one use) into its buckets.
    fn add(&mut self, p: usize, grad: &[f32]) -> Result<()> {
        let a = self.part.offsets[p];
        for &k in &self.buckets_of[p] {
            if self.launched[k] {
                return Err(ZeroError::Usage(format!(
                    "parameter `{}` got gradient from outside the layer it was entered with \
                     (`bonfire_dtensor::layer`) after its bucket was reduced; run every module \
                     that uses it through `layer`",
                    self.infos[p].path
                )));
            }
            let range = self.bounds[k].clone();
            let buf = self.bufs[k].get_or_insert_with(|| vec![0.0; range.len()]);
            let (s, e) = (range.start.max(a), range.end.min(a + grad.len()));
            buf[s - range.start..e - range.start]
                .iter_mut()
                .zip(&grad[s - a..e - a])
                .for_each(|(acc, g)| *acc += g);
        }
        Ok(())
    }

    fn complete(&mut self, p: usize) {
        for &k in &self.buckets_of[p] {
            self.incomplete[k] -= 1;
        }
    }

    /// Reduce-scatters, in bucket order, every bucket whose parameters are all complete.
    fn launch_ready(&mut self) -> Result<()> {
        while self.next < self.bounds.len() && self.incomplete[self.next] == 0 {
            let k = self.next;
            self.next += 1;
            self.launched[k] = true;
            let range = self.bounds[k].clone();
            let send = self.bufs[k]
                .take()
                .unwrap_or_else(|| vec![0.0; range.len()]);
            let counts = self.part.sub_counts(&range);
            let mine = counts[self.pg.rank()];
            let mut recv = vec![0.0f32; mine];
            self.pg
                .reduce_scatter_uneven(&send, &mut recv, &counts, ReduceOp::Avg)?;
            if mine > 0 {
                let own_start = self.part.ranges[self.pg.rank()].start;
                let at = own_start.max(range.start) - own_start;
                self.own[at..at + mine].copy_from_slice(&recv);
            }
        }
        Ok(())
    }

    /// After backward: adds the gradients that did not come through hooks (`leftover[p]`,
    /// `None` for none), reduces the remaining buckets and returns this rank's range of the
    /// averaged gradient.
    pub(crate) fn finish(mut self, leftover: Vec<Option<Vec<f32>>>) -> Result<Vec<f32>> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        for (p, grad) in leftover.into_iter().enumerate() {
            if let Some(g) = grad {
                self.add(p, &g)?;
            }
            if self.expected[p] == 0 || self.arrived[p] < self.expected[p] {
                self.complete(p);
            }
        }
        self.launch_ready()?;
        Ok(self.own)
    }
}

impl GradSink for GradBuckets {
    fn expect(&mut self, p: usize) {
        self.expected[p] += 1;
    }

    fn deposit(&mut self, p: usize, grad: &[f32]) {
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
