//! [`DistributedDataParallel`]: a Burn module and optimizer trained data-parallel.

use crate::anchor::activate;
use crate::bucket::BucketPlan;
use crate::check::check_same_params;
use crate::config::{DdpConfig, SyncMode};
use crate::error::DdpError;
use crate::params::{self, ParamInfo};
use crate::reducer::{Reducer, SharedReducer, add_into};
use crate::timing::{self, StepTiming};
use bonfire_comm::{ProcessGroup, ReduceOp};
use burn::module::{Module, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One rank's replica of a data-parallel model: the module, its optimizer, and the gradient
/// machinery that keeps all replicas identical.
///
/// A step is [`forward`](Self::forward) → [`backward`](Self::backward) →
/// [`step`](Self::step) (or [`train_step`](Self::train_step) for all three). Backward
/// averages the gradients over the group: buckets of gradients are all-reduced in the
/// background as soon as backward has produced them (for models that call
/// [`bonfire_dtensor::layer`]), and `backward` returns once all have arrived.
pub struct DistributedDataParallel<M: Module> {
    model: Option<M>,
    optim: ModuleOptimizer,
    pg: ProcessGroup,
    config: DdpConfig,
    infos: Arc<Vec<ParamInfo>>,
    index: Arc<HashMap<ParamId, usize>>,
    plan: Arc<BucketPlan>,
    residuals: Vec<Vec<f32>>,
    /// Gradients summed over `no_sync` backwards, per bucket.
    accumulated: Option<Vec<Vec<f32>>>,
    pending: Option<SharedReducer>,
    syncing: bool,
    grads: Option<GradientsParams>,
    /// The gradients of the last backward, per bucket (averaged when synchronized).
    last_buckets: Option<Vec<Vec<f32>>>,
    steps: u64,
    timing: StepTiming,
    timings: Vec<StepTiming>,
}

impl<M: Module> DistributedDataParallel<M> {
    /// Wraps `model` and `optim` for rank `pg.rank()` of `pg`. Checks that every rank has the
    /// same parameters (paths and shapes) and copies rank 0's values to every rank. A
    /// collective: call it on every rank. With ranks as threads, give each rank its own
    /// parameters (`model.fork(&device)`), never clones sharing autodiff leaves.
    pub fn new(
        model: M,
        optim: ModuleOptimizer,
        pg: ProcessGroup,
        config: DdpConfig,
    ) -> Result<Self, DdpError> {
        let infos = params::inventory(&model);
        check_same_params(&pg, &infos)?;
        let mut flat = params::flatten_values(&model, &infos);
        pg.broadcast(&mut flat, 0)?;
        let model = params::assign_values(model, &infos, &flat);
        let plan = BucketPlan::new(&infos, config.bucket_bytes);
        Ok(Self {
            model: Some(model),
            optim,
            index: Arc::new(params::index_of(&infos)),
            infos: Arc::new(infos),
            residuals: vec![Vec::new(); plan.num_buckets()],
            plan: Arc::new(plan),
            pg,
            config,
            accumulated: None,
            pending: None,
            syncing: true,
            grads: None,
            last_buckets: None,
            steps: 0,
            timing: StepTiming::default(),
            timings: Vec::new(),
        })
    }

    /// The local replica.
    pub fn model(&self) -> &M {
        self.model
            .as_ref()
            .expect("the model is present between calls")
    }
    /// Unwraps the replica and its optimizer.
    pub fn into_parts(mut self) -> (M, ModuleOptimizer) {
        (self.model.take().expect("model"), self.optim)
    }
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }
    pub fn config(&self) -> &DdpConfig {
        &self.config
    }
    /// The parameters DDP synchronizes, in module order.
    pub fn params(&self) -> &[ParamInfo] {
        &self.infos
    }
    /// Number of gradient buckets.
    pub fn num_buckets(&self) -> usize {
        self.plan.num_buckets()
    }
    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    fn reduces_this_step(&self) -> bool {
        self.syncing && self.config.sync == SyncMode::EveryStep
    }

    /// Runs the forward pass `f` on the replica (typically returning the loss). In a
    /// synchronized step with overlap, the [`bonfire_dtensor::layer`] calls inside `f` attach the
    /// gradient hooks that start bucket all-reduces during backward.
    pub fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        let start = timing::now();
        self.pending = None;
        let out = if self.reduces_this_step() {
            let reducer = Reducer::new(
                self.pg.clone(),
                self.plan.clone(),
                self.infos.clone(),
                self.index.clone(),
                self.config.compression,
                std::mem::take(&mut self.residuals),
                self.accumulated.take(),
                self.config.record_timings,
            );
            let shared: SharedReducer = Arc::new(Mutex::new(Some(reducer)));
            self.pending = Some(shared.clone());
            if self.config.overlap {
                let _guard = activate(shared);
                f(self.model())
            } else {
                f(self.model())
            }
        } else {
            f(self.model())
        };
        self.timing.forward = timing::span_since(start);
        out
    }

    /// Backpropagates `loss` (built in [`forward`](Self::forward)) and makes the gradients
    /// ready for [`step`](Self::step): averaged over the group in a synchronized step, kept
    /// and summed locally inside [`no_sync`](Self::no_sync).
    pub fn backward<const D: usize>(&mut self, loss: Tensor<D>) -> Result<(), DdpError> {
        let start = timing::now();
        let grads = loss.backward();
        drop(loss);
        self.timing.backward = timing::span_since(start);
        let wait_start = timing::now();
        let mut gp = GradientsParams::from_grads(grads, self.model());
        let leftover = params::take_grads(self.model(), &self.infos, &mut gp);
        let reducer = self
            .pending
            .take()
            .and_then(|shared| shared.lock().unwrap().take());
        let buckets = match reducer {
            Some(reducer) => {
                let finished = reducer.finish(leftover, self.config.unused);
                // Residuals come back only on success; start fresh otherwise.
                let finished = match finished {
                    Ok(f) => f,
                    Err(e) => {
                        self.residuals = vec![Vec::new(); self.plan.num_buckets()];
                        return Err(e);
                    }
                };
                self.residuals = finished.residuals;
                self.timing.buckets = finished.spans;
                self.timing.launches = finished.launches;
                Some(finished.buckets)
            }
            None if self.reduces_this_step() => {
                return Err(DdpError::Usage(
                    "backward must follow a forward run through DistributedDataParallel::forward"
                        .into(),
                ));
            }
            None => {
                let mut local = self
                    .accumulated
                    .take()
                    .unwrap_or_else(|| self.zero_buckets());
                for (i, g) in leftover.iter().enumerate() {
                    if let Some(g) = g {
                        let (b, off) = self.plan.loc[i];
                        add_into(&mut local[b][off..off + g.len()], g);
                    }
                }
                if self.syncing {
                    Some(local) // local SGD: step on the local gradient
                } else {
                    self.accumulated = Some(local);
                    None
                }
            }
        };
        self.timing.wait = timing::span_since(wait_start);
        if let Some(buckets) = buckets {
            let plan = &self.plan;
            let infos = &self.infos;
            self.grads = Some(params::grads_from_host(self.model(), infos, |i| {
                let (b, off) = plan.loc[i];
                &buckets[b][off..off + infos[i].numel()]
            }));
            self.last_buckets = Some(buckets);
        }
        Ok(())
    }

    fn zero_buckets(&self) -> Vec<Vec<f32>> {
        self.plan.lens.iter().map(|&n| vec![0.0; n]).collect()
    }

    /// Runs `f` with gradient synchronization off: backwards inside accumulate locally and
    /// the next synchronized backward reduces the sum (gradient accumulation). Scale each
    /// micro-batch's loss by 1/k yourself, as with PyTorch.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let was = std::mem::replace(&mut self.syncing, false);
        let out = f(self);
        self.syncing = was;
        out
    }

    /// Applies the optimizer with the gradients of the last synchronized backward; under
    /// [`SyncMode::Periodic`], averages the parameters over the group every `every` steps.
    pub fn step(&mut self, lr: f64) -> Result<(), DdpError> {
        let grads = self.grads.take().ok_or_else(|| {
            DdpError::Usage(
                "step needs gradients: call backward first (outside no_sync)".to_string(),
            )
        })?;
        let model = self.model.take().expect("model");
        let model = self.optim.step(lr, model, grads);
        self.steps += 1;
        let model = match self.config.sync {
            SyncMode::Periodic { every } if every > 0 && self.steps % every == 0 => {
                let mut flat = params::flatten_values(&model, &self.infos);
                self.pg.all_reduce(&mut flat, ReduceOp::Avg)?;
                params::assign_values(model, &self.infos, &flat)
            }
            _ => model,
        };
        self.model = Some(model);
        if self.config.record_timings {
            let mut t = std::mem::take(&mut self.timing);
            t.rank = self.pg.rank();
            t.step = self.steps - 1;
            self.timings.push(t);
        }
        Ok(())
    }

    /// One training step: forward `loss_fn`, backward, optimizer step. Returns this rank's
    /// loss (the mean over its own batch).
    pub fn train_step(
        &mut self,
        lr: f64,
        loss_fn: impl FnOnce(&M) -> Tensor<1>,
    ) -> Result<f32, DdpError> {
        let loss = self.forward(loss_fn);
        let value = params::to_host(loss.clone().detach())[0];
        self.backward(loss)?;
        self.step(lr)?;
        Ok(value)
    }

    /// The gradient of each parameter from the last backward (averaged over the group when
    /// synchronized), by path; empty before the first backward.
    pub fn gradients(&self) -> Vec<(String, Vec<f32>)> {
        let Some(buckets) = &self.last_buckets else {
            return Vec::new();
        };
        self.infos
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (b, off) = self.plan.loc[i];
                (p.path.clone(), buckets[b][off..off + p.numel()].to_vec())
            })
            .collect()
    }

    /// The recorded step timings (with [`DdpConfig::record_timings`]).
    pub fn timings(&self) -> &[StepTiming] {
        &self.timings
    }
}
