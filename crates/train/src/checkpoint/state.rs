//! What one rank holds of the training state as the checkpoint sees it ([`RankState`]: every
//! slice of a parameter, and of its optimizer state, that it owns, placed in the whole tensor
//! as a [`Region`]), what it must be given to resume ([`Wants`], answered by [`Loaded`]), and
//! [`Stateful`]: what the checkpoint asks of an engine (the trainer's engines implement it).

use crate::error::TrainError;
use bonfire_comm::ProcessGroup;
use bonfire_layout::ParallelDims;
use bonfire_module::params::ParamValues;
use bonfire_parallel::Region;
use bonfire_zero::FlatState;

/// One slice a rank writes: elements `region` of model parameter `param`, their values, and
/// the optimizer's state of the same elements (`None`: no state yet).
#[derive(Debug, Clone)]
pub struct Slice {
    /// The model parameter: an index into [`RankState::params`].
    pub param: usize,
    /// The elements of the whole parameter it holds.
    pub region: Region,
    /// Their values, in the region's order.
    pub values: Vec<f32>,
    /// The optimizer's state of the same elements (`None`: no state yet).
    pub state: Option<FlatState>,
}

/// What a rank writes to a checkpoint (host copies), with the model it is of.
#[derive(Debug, Clone, Default)]
pub struct RankState {
    /// Every parameter's path and whole shape, in model order.
    pub params: Vec<(String, Vec<usize>)>,
    /// Every slice this rank owns, and so writes.
    pub slices: Vec<Slice>,
}

/// What a rank must be given to resume: parameter values and optimizer state, by model
/// parameter and region.
#[derive(Debug, Clone, Default)]
pub struct Wants {
    /// Every parameter's path and whole shape, in model order.
    pub params: Vec<(String, Vec<usize>)>,
    /// The parameter values it needs: (model parameter index, region) each.
    pub values: Vec<(usize, Region)>,
    /// The optimizer state it needs: (model parameter index, region) each.
    pub state: Vec<(usize, Region)>,
}

/// The answer to [`Wants`], in its order: values, and optimizer state (`None`: none saved).
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    /// The values of each of [`Wants::values`], in its order.
    pub values: Vec<Vec<f32>>,
    /// The optimizer state of each of [`Wants::state`], in its order (`None`: the checkpoint
    /// has none for that parameter).
    pub state: Vec<Option<FlatState>>,
}

/// What saving, resuming and loading weights ask of one rank's training state (an engine).
/// Every method that says "collective" must be called on every rank, in the same order.
pub trait Stateful {
    /// All the ranks of the layout.
    fn world(&self) -> &ProcessGroup;
    /// The layout.
    fn dims(&self) -> &ParallelDims;
    /// Every parameter's values, whole, in the model's order. A collective.
    fn parameters(&mut self) -> Result<Vec<ParamValues>, TrainError>;
    /// The model's state tensors (parameters without gradient: DeepSeek-V3's balancing
    /// biases), whole, in the model's order (none for most models). A collective under a
    /// pipeline (each stage holds its own). A checkpoint holds them after the parameters,
    /// whole, without optimizer state.
    fn buffers(&mut self) -> Result<Vec<ParamValues>, TrainError>;
    /// What this rank writes to a checkpoint: its own slices of every parameter and of their
    /// optimizer state, copied to the host (replicas and tp-replicated parameters: one rank
    /// writes). No communication.
    fn save_state(&mut self) -> Result<RankState, TrainError>;
    /// The model as a checkpoint names it and the slices this rank must be given to resume.
    fn state_wants(&self) -> Wants;
    /// Installs the answer to [`state_wants`](Self::state_wants): parameter values and
    /// optimizer state. No communication; call it between steps.
    fn load_state(&mut self, loaded: Loaded) -> Result<(), TrainError>;
}
