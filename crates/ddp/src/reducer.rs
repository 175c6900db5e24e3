//! One synchronized step's gradient reduction: hooks ([`bonfire_dtensor::graph::SinkHook`])
//! deposit gradients into bucket buffers;
//! each bucket's all-reduce starts, in bucket order, as soon as it is complete; `finish`
//! fills in whatever backward did not deliver through hooks and waits for everything.

use crate::bucket::BucketPlan;
use crate::compress::Compression;
use crate::config::UnusedParams;
use crate::error::DdpError;
use crate::params::ParamInfo;
use crate::timing::{Span, Stamp};
use bonfire_comm::{ProcessGroup, ReduceOp, Work};
use bonfire_dtensor::graph::GradSink;
use std::sync::{Arc, Mutex};

pub(crate) struct Reducer {
    pg: ProcessGroup,
    plan: Arc<BucketPlan>,
    infos: Arc<Vec<ParamInfo>>,
    compression: Compression,
    /// Error-feedback residual of each bucket (lent by the DDP wrapper for the step).
    residuals: Vec<Vec<f32>>,
    bufs: Vec<Option<Vec<f32>>>,
    /// Hooks attached to each parameter this step, and how many have fired.
    expected: Vec<u32>,
    arrived: Vec<u32>,
    /// Parameters of each bucket not yet complete through hooks.
    incomplete: Vec<usize>,
    next_launch: usize,
    works: Vec<Option<Work<Vec<f32>>>>,
    spans: Option<Arc<Mutex<Vec<Span>>>>,
    /// When each bucket was handed to the communication thread (µs since the epoch).
    launches: Vec<f64>,
}

impl Reducer {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        pg: ProcessGroup,
        plan: Arc<BucketPlan>,
        infos: Arc<Vec<ParamInfo>>,
        compression: Compression,
        residuals: Vec<Vec<f32>>,
        accumulated: Option<Vec<Vec<f32>>>,
        record: bool,
    ) -> Self {
        let nb = plan.num_buckets();
        let bufs = match accumulated {
            Some(acc) => acc.into_iter().map(Some).collect(),
            None => plan.lens.iter().map(|&n| Some(vec![0.0; n])).collect(),
        };
        let incomplete = plan.buckets.iter().map(Vec::len).collect();
        Self {
            expected: vec![0; infos.len()],
            arrived: vec![0; infos.len()],
            pg,
            plan,
            infos,
            compression,
            residuals,
            bufs,
            incomplete,
            next_launch: 0,
            works: (0..nb).map(|_| None).collect(),
            spans: record.then(|| Arc::new(Mutex::new(vec![Span::default(); nb]))),
            launches: vec![0.0; nb],
        }
    }

    /// Starts, in bucket order, every bucket whose parameters are all complete.
    fn launch_ready(&mut self) {
        while self.next_launch < self.plan.num_buckets() && self.incomplete[self.next_launch] == 0 {
            self.launch(self.next_launch);
            self.next_launch += 1;
        }
    }

    fn launch(&mut self, b: usize) {
        let buf = self.bufs[b].take().expect("a bucket is launched once");
        let stamp = Stamp::new(self.spans.as_ref().map(|s| (s.clone(), b)));
        if self.spans.is_some() {
            self.launches[b] = crate::timing::now();
        }
        self.works[b] = Some(
            self.compression
                .launch(&self.pg, buf, &mut self.residuals[b], stamp),
        );
    }

    /// Completes the step: `leftover[i]` is parameter i's gradient that did not come
    /// through a hook (or `None`). Returns the averaged bucket buffers, the residuals and the
    /// bucket timings.
    pub(crate) fn finish(
        mut self,
        leftover: Vec<Option<Vec<f32>>>,
        unused: UnusedParams,
    ) -> Result<Finished, DdpError> {
        let mut first_error = None;
        let mut unused_flags = vec![0u8; self.infos.len()];
        for (i, grad) in leftover.into_iter().enumerate() {
            let (b, off) = self.plan.loc[i];
            let complete = self.expected[i] > 0 && self.arrived[i] == self.expected[i];
            match (grad, self.bufs[b].as_mut()) {
                (Some(g), Some(buf)) => {
                    add_into(&mut buf[off..off + g.len()], &g);
                }
                (Some(_), None) => {
                    first_error.get_or_insert(DdpError::LateGradient(self.infos[i].path.clone()));
                }
                (None, _) if self.arrived[i] == 0 => unused_flags[i] = 1,
                (None, _) => {}
            }
            if !complete {
                self.incomplete[b] -= 1;
            }
        }
        // Every bucket is complete now; start the rest in order so every rank issues the
        // same sequence of collectives whatever happened locally.
        self.launch_ready();
        debug_assert_eq!(self.next_launch, self.plan.num_buckets());
        let mut outs = Vec::with_capacity(self.works.len());
        let mut comm_error = None;
        for w in self.works.iter_mut() {
            match w.take().expect("every bucket was launched").wait() {
                Ok(v) => outs.push(v),
                Err(e) => {
                    comm_error.get_or_insert(e);
                    outs.push(Vec::new());
                }
            }
        }
        if let Some(e) = comm_error {
            return Err(e.into());
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
        let spans = self
            .spans
            .map(|s| s.lock().unwrap().clone())
            .unwrap_or_default();
        Ok(Finished {
            buckets: outs,
            residuals: self.residuals,
            spans,
            launches: self.launches,
        })
    }
}

impl GradSink for Reducer {
    fn expect(&mut self, i: usize) {
        self.expected[i] += 1;
    }

    fn deposit(&mut self, i: usize, grad: &[f32]) {
        let (b, off) = self.plan.loc[i];
        if let Some(buf) = self.bufs[b].as_mut() {
            add_into(&mut buf[off..off + grad.len()], grad);
        }
        self.arrived[i] += 1;
        if self.arrived[i] == self.expected[i] {
            self.incomplete[b] -= 1;
            self.launch_ready();
        }
    }
}

pub(crate) struct Finished {
    pub buckets: Vec<Vec<f32>>,
    pub residuals: Vec<Vec<f32>>,
    pub spans: Vec<Span>,
    pub launches: Vec<f64>,
}

pub(crate) fn add_into(dst: &mut [f32], src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
}
