//! The optimizer on a rank's own range: one Burn per-tensor [`Optimizer`] step per *piece*
//! (a rank's slice of a parameter), its state kept per piece — on the device, or, with offload,
//! flattened into a separate host store between steps.
//!
//! Burn's optimizers (SGD, Adam, AdamW, ...) are element-wise, so stepping a slice of a
//! parameter with the same slice of its gradient and of its state gives exactly the values the
//! whole-tensor step gives for those elements.

use crate::partition::Piece;
use burn::optim::{Optimizer, RecordState, StateSink, StateSource};
use burn::tensor::{Device, Tensor, TensorData};
use burn_pack::Scalar;
use std::collections::BTreeMap;

/// One piece's optimizer state, flattened to host memory: named element vectors (all of the
/// piece's length for element-wise optimizers) and scalars (step counters).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FlatState {
    pub tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    pub scalars: Vec<(String, Scalar)>,
}

impl FlatState {
    /// Bytes of tensor data (f32).
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|(_, _, v)| v.len() * 4).sum()
    }
}

const PREFIX: &str = "s";

fn flatten<S: RecordState>(state: &S) -> FlatState {
    let mut sink = StateSink::default();
    state.state_flatten(PREFIX, &mut sink);
    FlatState {
        tensors: sink
            .tensors
            .into_iter()
            .map(|(name, data)| {
                let shape = data.shape().to_vec();
                let v = data
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .expect("f32 optimizer state");
                (leaf(&name), shape, v)
            })
            .collect(),
        scalars: sink
            .scalars
            .into_iter()
            .map(|(name, s)| (leaf(&name), s))
            .collect(),
    }
}

fn leaf(name: &str) -> String {
    name.strip_prefix("s.").unwrap_or(name).to_string()
}

fn unflatten<S: RecordState>(flat: FlatState, device: &Device) -> Option<S> {
    let scalars: BTreeMap<String, Scalar> = flat
        .scalars
        .into_iter()
        .map(|(n, s)| (format!("{PREFIX}.{n}"), s))
        .collect();
    let mut src = StateSource::new(scalars);
    for (n, shape, v) in flat.tensors {
        src.insert_tensor(format!("{PREFIX}.{n}"), TensorData::new(v, shape));
    }
    S::state_unflatten(PREFIX, &mut src, device)
}

/// The host store of offloaded optimizer state (ZeRO-Offload): state lives here between steps
/// and is moved to the device for the step only.
#[derive(Debug, Default)]
pub struct HostStore {
    states: Vec<Option<FlatState>>,
    /// Bytes moved host → device and device → host so far.
    pub bytes_in: u64,
    pub bytes_out: u64,
}

impl HostStore {
    pub fn bytes(&self) -> usize {
        self.states.iter().flatten().map(FlatState::bytes).sum()
    }
}

/// A Burn optimizer over the pieces of one rank.
pub struct ShardOptimizer<O: Optimizer> {
    optim: O,
    pub(crate) pieces: Vec<Piece>,
    /// Start of the rank's range in the flat vector.
    pub(crate) own_start: usize,
    device: Device,
    states: Vec<Option<O::State<1>>>,
    host: Option<HostStore>,
}

impl<O: Optimizer> ShardOptimizer<O> {
    pub fn new(
        optim: O,
        pieces: Vec<Piece>,
        own_start: usize,
        device: Device,
        offload: bool,
    ) -> Self {
        let n = pieces.len();
        Self {
            optim,
            pieces,
            own_start,
            device,
            states: (0..n).map(|_| None).collect(),
            host: offload.then(|| HostStore {
                states: vec![None; n],
                ..HostStore::default()
            }),
        }
    }

    /// Steps every piece: `values` and `grads` are the rank's own range of the flat vector.
    pub fn step(&mut self, lr: f64, values: &mut [f32], grads: &[f32]) {
        for k in 0..self.pieces.len() {
            let r = self.pieces[k].flat.start - self.own_start
                ..self.pieces[k].flat.end - self.own_start;
            let n = r.len();
            let t = Tensor::<1>::from_data(
                TensorData::new(values[r.clone()].to_vec(), [n]),
                &self.device,
            );
            let g = Tensor::<1>::from_data(
                TensorData::new(grads[r.clone()].to_vec(), [n]),
                &self.device,
            );
            let state = self.take_state(k);
            let (t, state) = self.optim.step(lr, t, g, state);
            let v = t
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("f32 parameter");
            values[r].copy_from_slice(&v);
            self.put_state(k, state);
        }
    }

    fn take_state(&mut self, k: usize) -> Option<O::State<1>> {
        match &mut self.host {
            None => self.states[k].take(),
            Some(host) => {
                let flat = host.states[k].take()?;
                host.bytes_in += flat.bytes() as u64;
                unflatten(flat, &self.device)
            }
        }
    }

    fn put_state(&mut self, k: usize, state: Option<O::State<1>>) {
        match &mut self.host {
            None => self.states[k] = state,
            Some(host) => {
                let flat = state.as_ref().map(flatten);
                host.bytes_out += flat.as_ref().map_or(0, FlatState::bytes) as u64;
                host.states[k] = flat;
            }
        }
    }

    /// Piece `k`'s state, flattened (a copy; for checkpoints and accounting).
    pub fn export(&self, k: usize) -> Option<FlatState> {
        match &self.host {
            None => self.states[k].as_ref().map(flatten),
            Some(host) => host.states[k].clone(),
        }
    }

    /// Replaces piece `k`'s state.
    pub fn import(&mut self, k: usize, flat: Option<FlatState>) {
        match &mut self.host {
            None => self.states[k] = flat.and_then(|f| unflatten(f, &self.device)),
            Some(host) => host.states[k] = flat,
        }
    }

    /// Bytes of optimizer state resident on the device (zero at rest with offload).
    pub fn device_bytes(&self) -> usize {
        self.states
            .iter()
            .flatten()
            .map(|s| flatten(s).bytes())
            .sum()
    }
    /// Bytes of optimizer state in the host store.
    pub fn host_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, HostStore::bytes)
    }
    /// The host store, when offloading.
    pub fn host_store(&self) -> Option<&HostStore> {
        self.host.as_ref()
    }
}
