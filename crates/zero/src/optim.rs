//! The optimizer on a rank's own range: Burn's own [`ModuleOptimizer`] (SGD, Adam, AdamW,
//! whatever the user built) stepping one 1-d parameter that holds the rank's whole range of the
//! flat parameter vector, as a tensor. Its state is therefore exactly this rank's shard of the
//! optimizer state, kept by Burn on the device the step runs on: the model's device, or, with
//! offload (ZeRO-Offload), a separate CPU device — the gradient goes down, the step runs
//! there, the updated range comes back up (counted in the transfer ledger where a device
//! boundary is crossed).
//!
//! Burn's optimizers are element-wise, so stepping a slice of the flat vector with the same
//! slice of the gradient gives exactly the values the whole-tensor step gives for those
//! elements. What is not element-wise is refused at construction: gradient clipping inside the
//! optimizer would clip each rank's shard by its own norm.
//!
//! The state of a slice (a rank's slice of one parameter) is read and written through Burn's
//! own record format ([`ModuleOptimizer::into_bytes`], burnpack): [`ShardOptimizer::export`]
//! slices the shard's state, [`ShardOptimizer::import`] assembles it, for resharding
//! checkpoints.

use crate::error::{Result, ZeroError};
use crate::partition::ParamSlice;
use bonfire_dtensor::plane::{self, ledger::Reason};
use burn::module::{Module, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_pack::Scalar;
use std::collections::BTreeMap;

/// One slice's (or one range's) optimizer state on the host: named element vectors (all of
/// the range's length for element-wise optimizers) and scalars (step counters).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FlatState {
    /// Each state tensor as (name, shape, values in f32), e.g. `momentum.moment_1`.
    pub tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    /// Each state scalar as (name, value), e.g. `momentum.time`.
    pub scalars: Vec<(String, Scalar)>,
}

impl FlatState {
    /// Bytes of tensor data (f32).
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|(_, _, v)| v.len() * 4).sum()
    }

    fn is_empty(&self) -> bool {
        self.tensors.is_empty() && self.scalars.is_empty()
    }

    /// Elements `r` of every tensor (the state of a sub-range).
    fn slice(&self, r: std::ops::Range<usize>) -> FlatState {
        FlatState {
            tensors: self
                .tensors
                .iter()
                .map(|(n, _, v)| (n.clone(), vec![r.len()], v[r.clone()].to_vec()))
                .collect(),
            scalars: self.scalars.clone(),
        }
    }
}

/// The one parameter the optimizer steps: a rank's range of the flat vector.
#[derive(Module, Debug)]
struct Range1d {
    values: Param<Tensor<1>>,
}

/// Burn's optimizer over one rank's range.
pub struct ShardOptimizer {
    optim: ModuleOptimizer,
    /// A stateless copy, to start from when state is loaded from bytes.
    blank: ModuleOptimizer,
    id: ParamId,
    pub(crate) slices: Vec<ParamSlice>,
    /// Start of the rank's range in the flat vector.
    pub(crate) own_start: usize,
    own_len: usize,
    /// Where the step runs and the state lives: the model's device, or the offload device.
    step_device: Device,
    /// Whether `step_device` is the offload device.
    offloaded: bool,
    /// The range's fp32 values as of the last step, on the step device: with offload (the
    /// master of ZeRO-Offload, so that a step sends only the gradient down and the update
    /// up; taken at the first step) and under mixed precision (the master the half-precision
    /// model is cast from; given by [`set_master`](Self::set_master)). Dropped when the
    /// values are replaced from outside without a master (a checkpoint load through
    /// [`import`](Self::import) under offload alone).
    master: Option<Tensor<1>>,
    /// Whether the values the model holds are a half type (so the master is kept).
    mixed: bool,
    /// Weight decay kept off 1-d parameters: the split and the range's elements it decays.
    decay: Option<(bonfire_module::DecaySplit, Vec<std::ops::Range<usize>>)>,
}

impl ShardOptimizer {
    /// `optim` over the range made of `slices` (starting at `own_start` in the flat vector),
    /// stepped on `device`, or on `offload` when given. Fails for an optimizer that clips
    /// gradients (not element-wise).
    pub fn new(
        optim: ModuleOptimizer,
        slices: Vec<ParamSlice>,
        own_start: usize,
        device: Device,
        offload: Option<Device>,
    ) -> Result<Self> {
        if optim.has_gradient_clipping() {
            return Err(ZeroError::Usage(
                "the optimizer clips gradients, which ZeRO cannot do per shard (each rank would \
                 clip its own slice by its own norm); clip before the step instead"
                    .into(),
            ));
        }
        let own_len = slices.iter().map(ParamSlice::len).sum();
        Ok(Self {
            blank: optim.clone(),
            optim,
            id: ParamId::new(),
            slices,
            own_start,
            own_len,
            offloaded: offload.is_some(),
            step_device: offload.unwrap_or(device),
            master: None,
            mixed: false,
            decay: None,
        })
    }

    /// Mixed precision: the range's fp32 values (`None` when it is empty), kept on the step
    /// device as the master the optimizer steps; the model holds them in a half type.
    pub fn set_master(&mut self, values: Option<Tensor<1>>) {
        self.mixed = true;
        self.master = values.map(|v| {
            let v = v.inner().cast(DType::F32);
            if self.offloaded {
                plane::to_device(v, &self.step_device, Reason::Offload)
            } else {
                v
            }
        });
    }

    /// `optim` over rank `me`'s range of `part`, on `device` or, with `config`'s offload, on its
    /// offload device (the wrapper's partition, or expert parallelism's experts').
    /// With `config`'s [`decay`](crate::ZeroConfig::decay), the elements of parameters of
    /// `infos` (the partition's, in order) with two or more dimensions decay at each step.
    pub(crate) fn for_rank(
        optim: ModuleOptimizer,
        part: &crate::Partition,
        me: usize,
        device: &Device,
        config: &crate::ZeroConfig,
        infos: &[bonfire_module::params::ParamInfo],
    ) -> Result<Self> {
        let offload = config.offload.then(|| config.offload_device.clone());
        let mut shard = Self::new(
            optim,
            part.slices(me),
            part.ranges[me].start,
            device.clone(),
            offload,
        )?;
        shard.decay = config.decay.map(|split| {
            let ranges = bonfire_module::DecaySplit::flat_ranges(infos, part.ranges[me].clone());
            (split, ranges)
        });
        Ok(shard)
    }

    /// The range's fp32 master (mixed precision, or offload after its first step).
    pub fn master(&self) -> Option<&Tensor<1>> {
        self.master.as_ref()
    }

    /// Steps the range: `values` and `grads` are the rank's own range of the flat vector, on
    /// the model's device; returns the updated range there. With offload the step runs on the
    /// offload device against its master copy of the values (the gradient goes down, the
    /// update comes back up; the values go down once, at the first step).
    ///
    /// Under mixed precision `values` are in the model's half type: the step runs on the fp32
    /// master with the gradient cast to fp32, and the update comes back in `values`' dtype.
    pub fn step(&mut self, lr: f64, values: Tensor<1>, grads: Tensor<1>) -> Tensor<1> {
        let home = values.device();
        let dtype = values.dtype();
        let (values, grads) = (values.inner(), grads.inner().cast(DType::F32));
        let keep_master = self.offloaded || self.mixed;
        let (values, grads) = if keep_master {
            let to = &self.step_device;
            let v = match self.master.take() {
                Some(master) => master,
                None => plane::to_device(values.cast(DType::F32), to, Reason::Offload),
            };
            let g = if self.offloaded {
                plane::to_device(grads, to, Reason::Offload)
            } else {
                grads
            };
            (v, g)
        } else {
            (values, grads)
        };
        let values = match &self.decay {
            Some((split, ranges)) => split.apply_flat(lr, values, ranges),
            None => values,
        };
        let mut gp = GradientsParams::new();
        gp.register::<1>(self.id, grads);
        // Burn's optimizers step autodiff parameters (they ask whether one is distributed);
        // the state they keep is on the inner device.
        let module = Range1d {
            values: Param::initialized(self.id, values.autodiff()),
        };
        let updated = self.optim.step(lr, module, gp).values.val().inner();
        if keep_master {
            self.master = Some(updated.clone());
        }
        let updated = updated.cast(dtype);
        let updated = if self.offloaded {
            plane::to_device(updated, &home.clone().inner(), Reason::Offload)
        } else {
            updated
        };
        bonfire_dtensor::autodiff::with_context_of(updated, &home)
    }

    /// The device the optimizer steps on and keeps its state: the offload device with
    /// offload, else the model's.
    pub fn state_device(&self) -> &Device {
        &self.step_device
    }

    /// The range's state as Burn records it (`None` before the first step).
    fn read(&self) -> Option<FlatState> {
        record_states(&self.optim).remove(&self.id.val())
    }

    /// A stateless optimizer holding `state` for the range.
    fn load(&self, state: FlatState) -> ModuleOptimizer {
        with_states(self.blank.clone(), vec![(self.id, state)])
    }

    fn state(&self) -> Option<FlatState> {
        self.read()
    }

    /// The slices of the range (a rank's slices of parameters), in flat order.
    pub fn slices(&self) -> &[ParamSlice] {
        &self.slices
    }

    /// Every slice's state, in [`slices`](Self::slices) order (copies, read from Burn's record
    /// once; `None` before the first step) — for checkpoints.
    pub fn export_all(&self) -> Vec<Option<FlatState>> {
        let state = self.state();
        self.slices
            .iter()
            .map(|p| {
                let at = p.flat.start - self.own_start;
                state.as_ref().map(|s| s.slice(at..at + p.len()))
            })
            .collect()
    }

    /// ParamSlice `k`'s state (a copy; for checkpoints).
    pub fn export(&self, k: usize) -> Option<FlatState> {
        let p = &self.slices[k];
        let at = p.flat.start - self.own_start;
        Some(self.state()?.slice(at..at + p.len()))
    }

    /// Replaces the state of the whole range with the slices' states (`None`: the optimizer
    /// starts fresh, as before its first step). Either every slice has a state or none. The
    /// offload master copy is dropped: the next step takes the values from the model's device.
    pub fn import(&mut self, slices: Vec<Option<FlatState>>) -> Result<()> {
        let state = match slices.iter().flatten().next() {
            None => None,
            Some(first) => {
                let mut whole = FlatState {
                    tensors: first
                        .tensors
                        .iter()
                        .map(|(n, _, _)| (n.clone(), vec![self.own_len], vec![0.0; self.own_len]))
                        .collect(),
                    scalars: first.scalars.clone(),
                };
                for (p, s) in self.slices.iter().zip(&slices) {
                    let s = s.as_ref().ok_or_else(|| {
                        ZeroError::Checkpoint(
                            "some slices of a range have optimizer state and some do not".into(),
                        )
                    })?;
                    let at = p.flat.start - self.own_start;
                    for ((name, _, dst), (leaf, _, src)) in whole.tensors.iter_mut().zip(&s.tensors)
                    {
                        if name != leaf || src.len() != p.len() {
                            return Err(ZeroError::Checkpoint(format!(
                                "optimizer state `{leaf}` does not fit its slice ({} values for {} elements)",
                                src.len(),
                                p.len()
                            )));
                        }
                        dst[at..at + p.len()].copy_from_slice(src);
                    }
                }
                Some(whole)
            }
        };
        self.optim = match state {
            Some(state) => self.load(state),
            None => self.blank.clone(),
        };
        if !self.mixed {
            self.master = None;
        }
        Ok(())
    }

    /// Bytes of optimizer state (and the fp32 master under mixed precision) on the model's
    /// device (zero with offload).
    pub fn device_bytes(&self) -> usize {
        if self.offloaded {
            0
        } else {
            self.state_bytes() + self.master_bytes()
        }
    }
    fn master_bytes(&self) -> usize {
        self.master
            .as_ref()
            .map_or(0, |m| m.dtype().size() * m.dims()[0])
    }
    /// Bytes on the offload device: the optimizer state and the master copy of the values.
    pub fn offload_bytes(&self) -> usize {
        if self.offloaded {
            self.state_bytes() + self.master_bytes()
        } else {
            0
        }
    }
    fn state_bytes(&self) -> usize {
        self.read().map_or(0, |s| s.bytes())
    }
}

/// Every parameter's state in Burn's record of `optim`, by parameter id: its tensors (named by
/// leaf, e.g. `momentum.moment_1`, as f32) and scalars (`momentum.time`, Burn's `__rank`).
/// The one reading of Burn's optimizer record (ZeRO's range state, the trainer's checkpoints).
pub fn record_states(optim: &ModuleOptimizer) -> BTreeMap<u64, FlatState> {
    let bytes = optim.into_bytes().expect("optimizer state to bytes");
    let reader = burn_pack::Reader::from_bytes(bytes).expect("Burn's own record");
    let split = |name: &str| -> Option<(u64, String)> {
        let (id, leaf) = name.split_once('.')?;
        Some((id.parse().ok()?, leaf.to_string()))
    };
    let mut out: BTreeMap<u64, FlatState> = BTreeMap::new();
    for (k, v) in reader.scalars() {
        if let Some((id, leaf)) = split(k) {
            out.entry(id).or_default().scalars.push((leaf, *v));
        }
    }
    for t in reader.into_tensors().expect("record tensors") {
        let (name, dtype, shape, _, bytes) = t.into_parts().expect("record tensor");
        let Some((id, leaf)) = split(&name) else {
            continue;
        };
        let data = TensorData::from_bytes(bytes, shape.clone(), dtype).convert::<f32>();
        let values = data.try_into_vec::<f32>().expect("f32 state");
        let entry = out.entry(id).or_default();
        entry.tensors.push((leaf, shape.to_vec(), values));
    }
    out.retain(|_, s| !s.is_empty());
    out
}

/// `optim` holding exactly `states` (every other parameter's state dropped): the inverse of
/// [`record_states`], through Burn's own record. A state's scalars must include Burn's
/// `__rank` (the parameter's number of dimensions).
pub fn with_states(optim: ModuleOptimizer, states: Vec<(ParamId, FlatState)>) -> ModuleOptimizer {
    let mut tensors = Vec::new();
    let mut scalars = Vec::new();
    for (id, state) in states {
        let id = id.val();
        for (leaf, shape, values) in state.tensors {
            let (bytes, shape, dtype) = TensorData::new(values, shape).into_parts();
            let name = format!("{id}.{leaf}");
            tensors.push(burn_pack::Tensor::new(name, dtype, shape, Some(id), bytes));
        }
        for (leaf, v) in state.scalars {
            scalars.push((format!("{id}.{leaf}"), v));
        }
    }
    let mut writer = burn_pack::Writer::new(tensors);
    for (k, v) in &scalars {
        writer = writer.with_scalar(k, *v);
    }
    let bytes = writer.into_bytes().expect("optimizer state record");
    optim.from_bytes(bytes).expect("Burn reads its own record")
}
