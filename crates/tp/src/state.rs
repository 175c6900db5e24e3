//! The parallel state of the layers on this thread: each parallel-aware layer's identity
//! ([`ParallelKey`]), what `parallelize_module` applied to it ([`ParallelState`]: the style and
//! the group), recorded per thread (per rank) and read by the layer's `forward`. See
//! [`crate::layers`] for why the state lives here and not in the module.

use crate::style::{
    ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, ReplicateParallel, RowwiseParallel,
    SequenceParallel,
};
use bonfire_comm::ProcessGroup;
use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
};
use burn::tensor::Device;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// The container type a [`ParallelKey`] reports to visitors and mappers.
pub(crate) const KEY_CONTAINER: &str = "Bonfire:ParallelKey";

static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// The identity of one parallel-aware layer (see the module docs). Holds no tensor and
/// nothing persistent; a fresh one per constructed layer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ParallelKey(u64);

impl Default for ParallelKey {
    fn default() -> Self {
        Self(NEXT_KEY.fetch_add(1, Ordering::Relaxed))
    }
}

impl ParallelKey {
    /// The state recorded for this layer on this thread, if any.
    pub(crate) fn state(&self) -> Option<ParallelState> {
        STATES.with(|s| s.borrow().get(&self.0).cloned())
    }
}

impl Module for ParallelKey {
    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        let name = self.0.to_string();
        visitor.enter_module(&name, KEY_CONTAINER);
        visitor.exit_module(&name, KEY_CONTAINER);
    }
    fn map<M: ModuleMapper>(self, mapper: &mut M) -> Self {
        // While `parallelize_module` maps, every layer gets a fresh key, so that the model
        // it started from (and its other forks) keep their own state.
        let key = REKEY.with(|r| {
            r.borrow_mut().as_mut().map(|m| {
                let fresh = ParallelKey::default();
                m.insert(self.0, fresh.0);
                fresh
            })
        });
        let key = key.unwrap_or(self);
        let name = key.0.to_string();
        mapper.enter_module(&name, KEY_CONTAINER);
        mapper.exit_module(&name, KEY_CONTAINER);
        key
    }
    fn to_device(self, _: &Device) -> Self {
        self
    }
    fn fork(self, _: &Device) -> Self {
        self
    }
    fn collect_devices(&self, devices: Devices) -> Devices {
        devices
    }
    fn materialize(self) -> Self {
        self
    }
    fn valid(&self) -> Self {
        self.clone()
    }
    fn train(self) -> Self {
        self
    }
}

impl ModuleDisplayDefault for ParallelKey {
    fn content(&self, content: Content) -> Option<Content> {
        content
            .add_formatted(&format!("ParallelKey({})", self.0))
            .optional()
    }
}
impl ModuleDisplay for ParallelKey {}

/// What `parallelize_module` applied to one layer on this rank.
#[derive(Debug, Clone)]
pub(crate) struct ParallelState {
    pub group: ProcessGroup,
    pub applied: Applied,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Applied {
    Colwise(ColwiseParallel),
    /// `offset`: the first global row (embedding) this rank holds.
    Rowwise {
        style: RowwiseParallel,
        offset: usize,
    },
    Sequence(#[allow(dead_code)] SequenceParallel),
    Replicate(ReplicateParallel),
    Io {
        input: Option<PrepareModuleInput>,
        output: Option<PrepareModuleOutput>,
    },
}

thread_local! {
    static REKEY: RefCell<Option<HashMap<u64, u64>>> = const { RefCell::new(None) };
    static STATES: RefCell<HashMap<u64, ParallelState>> = RefCell::new(HashMap::new());
}

/// Runs `f` (a module map) giving every [`ParallelKey`] it maps a fresh key; returns the
/// old → new keys.
pub(crate) fn with_fresh_keys<R>(f: impl FnOnce() -> R) -> (R, HashMap<u64, u64>) {
    REKEY.with(|r| *r.borrow_mut() = Some(HashMap::new()));
    let out = f();
    let keys = REKEY.with(|r| r.borrow_mut().take()).unwrap_or_default();
    (out, keys)
}

pub(crate) fn set_state(key: u64, state: ParallelState) {
    STATES.with(|s| s.borrow_mut().insert(key, state));
}

/// Forgets every parallel state recorded on this thread: every layer built or parallelized
/// here behaves unsharded again (its parameters stay the shards they are).
pub fn clear_parallel_states() {
    STATES.with(|s| s.borrow_mut().clear());
}

/// The kinds of parallel-aware layers, as seen by plan validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayerKind {
    Linear,
    Embedding,
    Norm,
    Io,
}

impl LayerKind {
    pub(crate) fn from_container(container: &str) -> Option<Self> {
        match container.strip_prefix("Struct:")? {
            "ParallelLinear" => Some(Self::Linear),
            "ParallelEmbedding" => Some(Self::Embedding),
            "ParallelLayerNorm" | "ParallelRmsNorm" => Some(Self::Norm),
            "ParallelIo" => Some(Self::Io),
            _ => None,
        }
    }
}

/// `key`'s state, for the plan's bookkeeping.
pub(crate) fn state_of(key: u64) -> Option<ParallelState> {
    STATES.with(|s| s.borrow().get(&key).cloned())
}
