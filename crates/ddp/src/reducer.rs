//! One synchronized step's gradient reduction, on the device: hooks
//! ([`bonfire_module::graph::SinkHook`]) hand each parameter's gradient as a tensor; when
//! all the parameters of a bucket are in, the bucket is packed into one flat tensor (Burn ops,
//! on the device) and its all-reduce starts on the group's communication thread, in bucket
//! order; `finish` adds whatever backward did not deliver through hooks, waits for every
//! bucket, and returns the averaged buckets.

use crate::bucket::BucketPlan;
use crate::compress::{Compression, InFlight};
use crate::config::{DdpConfig, UnusedParams};
use crate::error::DdpError;
use bonfire_comm::{ProcessGroup, ReduceOp};
use bonfire_dtensor::timing::Span;
use bonfire_module::PrecisionDTypes;
use bonfire_module::graph::GradSink;
use bonfire_module::params::ParamInfo;
use burn::tensor::{DType, Device, Tensor};
use std::sync::Arc;

pub(crate) struct Reducer {
    pg: ProcessGroup,
    /// Expert parallelism's parameters' group and gradient scale (their buckets' reduction).
    experts: Option<(ProcessGroup, f32)>,
    plan: Arc<BucketPlan>,
    infos: Arc<Vec<ParamInfo>>,
    compression: Compression,
    /// Error-feedback residual of each bucket (lent by the DDP wrapper for the step).
    residuals: Vec<Option<Tensor<1>>>,
    /// Each parameter's gradient so far (summed over its uses and accumulated micro-batches).
    parts: Vec<Option<Tensor<1>>>,
    /// Hooks attached to each parameter this step, and how many have fired.
    expected: Vec<u32>,
    arrived: Vec<u32>,
    /// Parameters of each bucket not yet complete through hooks.
    incomplete: Vec<usize>,
    next_launch: usize,
    in_flight: Vec<Option<InFlight>>,
    /// When each bucket was handed to the communication thread (µs since the epoch).
    launches: Vec<f64>,
    record: bool,
    /// What gradients are all-reduced in (the mixed-precision reduce dtype).
    dtype: DType,
}

impl Reducer {
    /// A reducer starting from `accumulated` gradients (per parameter, from `no_sync`
    /// backwards or micro-batches).
    /// The compression, timing record and reduce dtype come from `config`.
    pub(crate) fn new(
        pg: ProcessGroup,
        plan: Arc<BucketPlan>,
        infos: Arc<Vec<ParamInfo>>,
        config: &DdpConfig,
        residuals: Vec<Option<Tensor<1>>>,
        accumulated: Vec<Option<Tensor<1>>>,
        experts: Option<(ProcessGroup, f32)>,
    ) -> Self {
        let (compression, record) = (config.compression, config.record_timings);
        let dtype = config.precision.reduce_dtype();
        let nb = plan.num_buckets();
        let incomplete = plan.buckets.iter().map(Vec::len).collect();
        Self {
            expected: vec![0; infos.len()],
            arrived: vec![0; infos.len()],
            pg,
            experts,
            plan,
            infos,
            compression,
            residuals,
            parts: accumulated,
            incomplete,
            next_launch: 0,
            in_flight: (0..nb).map(|_| None).collect(),
            launches: vec![0.0; nb],
            record,
            dtype,
        }
    }

    fn add(&mut self, i: usize, grad: Tensor<1>) {
        let grad = grad.cast(self.dtype);
        self.parts[i] = Some(match self.parts[i].take() {
            Some(sum) => sum + grad,
            None => grad,
        });
    }

    /// Starts, in bucket order, every bucket whose parameters are all complete.
    fn launch_ready(&mut self) {
        while self.next_launch < self.plan.num_buckets() && self.incomplete[self.next_launch] == 0 {
            self.launch(self.next_launch);
            self.next_launch += 1;
        }
    }

    /// The device of the gradients (any parameter's).
    fn device(&self) -> Option<Device> {
        self.parts.iter().flatten().next().map(Tensor::device)
    }

    /// Packs bucket `b` (its parameters' gradients in bucket order, zeros for a parameter that
    /// got none) and starts its all-reduce: over the group, or for an expert bucket over the
    /// experts' replicas, scaled to the mean over the whole group.
    fn launch(&mut self, b: usize) {
        let device = self.device().unwrap_or_else(Device::flex);
        let parts: Vec<Tensor<1>> = self.plan.buckets[b]
            .iter()
            .map(|&i| {
                self.parts[i].take().unwrap_or_else(|| {
                    Tensor::zeros([self.infos[i].numel()], (&device, self.dtype))
                })
            })
            .collect();
        let (pg, scale) = match &self.experts {
            Some((group, scale)) if self.plan.expert[b] => (group, *scale),
            _ => (&self.pg, 1.0),
        };
        let bucket = bonfire_kernels::pack_scaled(&parts, scale);
        bonfire_module::precision::observe::observer().reduced(bucket.dtype());
        if self.record {
            self.launches[b] = bonfire_dtensor::timing::now();
        }
        let residual = &mut self.residuals[b];
        self.in_flight[b] = Some(self.compression.launch(pg, bucket, residual));
    }

    /// Completes the step: `leftover[i]` is parameter i's gradient that did not come through
    /// a hook (or `None`). Returns the averaged buckets, the residuals and the bucket timings.
    pub(crate) fn finish(
        mut self,
        leftover: Vec<Option<Tensor<1>>>,
        unused: UnusedParams,
    ) -> Result<Finished, DdpError> {
        let mut first_error = None;
        let mut unused_flags = vec![0u8; self.infos.len()];
        for (i, grad) in leftover.into_iter().enumerate() {
            let b = self.plan.loc[i].0;
            let complete = self.expected[i] > 0 && self.arrived[i] == self.expected[i];
            let launched = b < self.next_launch;
            match grad {
                Some(_) if launched => {
                    first_error.get_or_insert(DdpError::LateGradient(self.infos[i].path.clone()));
                }
                Some(g) => self.add(i, g),
                None if self.arrived[i] == 0 && self.parts[i].is_none() && !launched => {
                    unused_flags[i] = 1
                }
                None => {}
            }
            if !complete {
                self.incomplete[b] -= 1;
            }
        }
        // Every bucket is complete now; start the rest in order so every rank issues the
        // same sequence of collectives whatever happened locally.
        self.launch_ready();
        debug_assert_eq!(self.next_launch, self.plan.num_buckets());
        let mut buckets = Vec::with_capacity(self.in_flight.len());
        let mut spans = Vec::with_capacity(self.in_flight.len());
        let mut comm_error = None;
        for w in self.in_flight.iter_mut() {
            match w.take().expect("every bucket was launched").wait() {
                Ok((t, span)) => {
                    buckets.push(Some(t));
                    spans.push(span);
                }
                Err(e) => {
                    comm_error.get_or_insert(e);
                    buckets.push(None);
                    spans.push(Span::default());
                }
            }
        }
        if let Some(e) = comm_error {
            return Err(e);
        }
        if unused == UnusedParams::Error {
            // Agree across ranks before failing, so that every rank fails alike.
            self.pg.all_reduce(&mut unused_flags, ReduceOp::Max)?;
            let names: Vec<String> = unused_flags
                .iter()
                .zip(self.infos.iter())
                .filter(|(f, _)| **f != 0)
                .map(|(_, p)| p.path.clone())
                .collect();
            if !names.is_empty() {
                return Err(DdpError::UnusedParams(names));
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(Finished {
            buckets: buckets.into_iter().map(|b| b.expect("no error")).collect(),
            residuals: self.residuals,
            spans: if self.record { spans } else { Vec::new() },
            launches: self.launches,
        })
    }
}

impl GradSink for Reducer {
    fn expect(&mut self, i: usize) {
        self.expected[i] += 1;
    }

    fn deposit(&mut self, i: usize, grad: Tensor<1>) {
        let b = self.plan.loc[i].0;
        if b < self.next_launch {
            // Its bucket already left: `finish` reports it if the gradient is also seen there;
            // a hook firing after its step (a stale graph) has nowhere to go.
            return;
        }
        self.add(i, grad);
        self.arrived[i] += 1;
        if self.arrived[i] == self.expected[i] {
            self.incomplete[b] -= 1;
            self.launch_ready();
        }
    }
}

pub(crate) struct Finished {
    /// The averaged gradient of each bucket, flat, on the device.
    pub buckets: Vec<Tensor<1>>,
    pub residuals: Vec<Option<Tensor<1>>>,
    pub spans: Vec<Span>,
    pub launches: Vec<f64>,
}
