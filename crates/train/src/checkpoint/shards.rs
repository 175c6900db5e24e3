//! What one rank holds of the training state, as the checkpoint sees it: every slice of a
//! parameter (and the optimizer state of the same elements) it owns, placed in the whole
//! tensor as a [`Region`] — its tensor-parallel shard's box, narrowed to its ZeRO piece — and
//! the slices it must be given to resume. The engines call these on their dp wrapper.
//!
//! Ownership (each element written once): DDP replicas are written by dp coordinate 0 (an
//! expert parameter under ep by each of the first ep ranks, its slice of the experts), ZeRO
//! pieces by the rank that owns them, parameters replicated over tp by tp coordinate 0,
//! pipeline stages by the pp coordinate that runs them.

use super::region::Region;
use crate::engine::export::ModelLayout;
use crate::error::TrainError;
use crate::wrapper::DpWrapper;
use bonfire_dtensor::DataParallel;
use bonfire_zero::optim::{record_states, with_states};
use bonfire_zero::{FlatState, ZeroStage};
use burn::module::Module;
use burn_pack::Scalar;

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

/// Where a rank's dp wrapper sits: the model's layout, which model parameter each of the
/// wrapper's parameters is, and the rank's tp and dp coordinates.
pub(crate) struct Holding<'a> {
    pub layout: &'a ModelLayout,
    /// Wrapper parameter `k` is model parameter `indices[k]`.
    pub indices: &'a [usize],
    pub tp_rank: usize,
    pub tp_size: usize,
    pub dp_rank: usize,
    /// The ep degree: expert parameters hold the experts of ep rank `dp_rank % ep`.
    pub ep: usize,
    /// HSDP: which replica of the ZeRO shards this rank is (its dp_replicate coordinate; 0
    /// without HSDP). Only replica 0 writes its shards.
    pub replica: usize,
}

impl Holding<'_> {
    /// The box of the whole tensor that wrapper parameter `k` is on this rank.
    fn shard_box(&self, k: usize) -> Region {
        let i = self.indices[k];
        let shape = self.layout.infos[i].shape.clone();
        let mut offsets = vec![0; shape.len()];
        if let Some(d) = self.layout.shard_dim(i).filter(|_| self.tp_size > 1) {
            offsets[d] = self.tp_rank * shape[d];
        }
        if self.layout.is_expert(i) {
            offsets[0] = self.dp_rank % self.ep * shape[0];
        }
        Region::of_box(offsets, shape)
    }

    /// Whether this DDP replica writes wrapper parameter `k`: dp rank 0 a shared one, the
    /// first ep ranks (each its own experts) an expert one.
    fn writes_replica(&self, k: usize) -> bool {
        match self.layout.is_expert(self.indices[k]) {
            true => self.dp_rank < self.ep,
            false => self.dp_rank == 0,
        }
    }

    /// Whether this rank writes wrapper parameter `k` (one tp rank writes a replicated one).
    fn writes_on_tp(&self, k: usize) -> bool {
        self.tp_rank == 0 || (self.tp_size > 1 && self.layout.shard_dim(self.indices[k]).is_some())
    }

    fn params(&self) -> Vec<(String, Vec<usize>)> {
        self.layout.whole_params(self.tp_size)
    }
}

/// Drops Burn's `__rank` scalar (the holder's own business: 1 for a ZeRO range, the
/// parameter's rank under DDP).
fn without_rank(mut s: FlatState) -> FlatState {
    s.scalars.retain(|(k, _)| k != "__rank");
    s
}

/// `s` shaped for a holder: every tensor `shape`, Burn's `__rank` of it.
fn for_holder(mut s: FlatState, shape: &[usize]) -> FlatState {
    for t in &mut s.tensors {
        t.1 = shape.to_vec();
    }
    s.scalars.retain(|(k, _)| k != "__rank");
    s.scalars
        .push(("__rank".into(), Scalar::UInt(shape.len().max(1) as u64)));
    s
}

/// Checkpoints of ZeRO with expert parallelism's shards are not written yet: refused before
/// anything is written or changed.
fn refuse_experts<M: Module>(z: &bonfire_zero::Zero<M>) -> Result<(), TrainError> {
    match z.has_experts() {
        true => Err(TrainError::Io(
            "checkpoints of ZeRO with expert parallelism are not supported yet: save under \
             DDP (zero=0) with ep, or without ep"
                .into(),
        )),
        false => Ok(()),
    }
}

/// What this rank writes (see the module docs).
pub(crate) fn rank_state<M: Module>(
    w: &DpWrapper<M>,
    h: &Holding,
) -> Result<RankState, TrainError> {
    let mut slices = Vec::new();
    match w {
        DpWrapper::Ddp(d) => {
            if h.dp_rank < h.ep {
                let values = d.parameters()?;
                let mut states = record_states(d.optimizer());
                for (k, (p, info)) in values.into_iter().zip(d.params()).enumerate() {
                    let state = states.remove(&info.id.val()).map(without_rank);
                    if h.writes_on_tp(k) && h.writes_replica(k) {
                        slices.push(Slice {
                            param: h.indices[k],
                            region: h.shard_box(k),
                            values: p.values,
                            state,
                        });
                    }
                }
            }
        }
        DpWrapper::Zero(z) => {
            refuse_experts(z)?;
            let replicated = z.config().stage == ZeroStage::Zero0;
            if h.replica == 0 && (!replicated || h.dp_rank == 0) {
                let own = z.own_values();
                let start = z.own_range().start;
                let states = z.optimizer().export_all();
                for (piece, state) in z.optimizer().pieces().iter().zip(states) {
                    let k = piece.param;
                    if h.writes_on_tp(k) {
                        let at = piece.flat.start - start..piece.flat.end - start;
                        slices.push(Slice {
                            param: h.indices[k],
                            region: h.shard_box(k).narrow(piece.within.clone()),
                            values: own[at].to_vec(),
                            state: state.map(without_rank),
                        });
                    }
                }
            }
        }
    }
    Ok(RankState {
        params: h.params(),
        slices,
    })
}

/// What this rank must be given: every parameter of its shard whole where it holds the
/// replica (DDP, ZeRO 1–2), its pieces where it holds only those (ZeRO-3); the optimizer
/// state of what its optimizer steps.
pub(crate) fn wants<M: Module>(w: &DpWrapper<M>, h: &Holding) -> Wants {
    let all: Vec<(usize, Region)> = (0..h.indices.len())
        .map(|k| (h.indices[k], h.shard_box(k)))
        .collect();
    let (values, state) = match w {
        DpWrapper::Ddp(_) => (all.clone(), all),
        DpWrapper::Zero(z) => {
            let pieces: Vec<(usize, Region)> = z
                .optimizer()
                .pieces()
                .iter()
                .map(|p| {
                    let region = h.shard_box(p.param).narrow(p.within.clone());
                    (h.indices[p.param], region)
                })
                .collect();
            match z.config().stage {
                ZeroStage::Zero3 => (pieces.clone(), pieces),
                _ => (all, pieces),
            }
        }
    };
    Wants {
        params: h.params(),
        values,
        state,
    }
}

/// Installs `loaded` (the answer to [`wants`]) into the wrapper. No communication.
pub(crate) fn load<M: Module>(w: &mut DpWrapper<M>, loaded: Loaded) -> Result<(), TrainError> {
    let flat: Vec<f32> = loaded.values.into_iter().flatten().collect();
    match w {
        DpWrapper::Ddp(d) => {
            let states = d
                .params()
                .iter()
                .zip(loaded.state)
                .filter_map(|(info, s)| Some((info.id, for_holder(s?, &info.shape))))
                .collect();
            let optim = with_states(d.optimizer().clone(), states);
            d.load_state(&flat, optim);
        }
        DpWrapper::Zero(z) => {
            refuse_experts(z)?;
            let pieces = z.optimizer().pieces().to_vec();
            let scalars = loaded.state.iter().flatten().map(|s| &s.scalars);
            if let Some(first) = scalars.clone().next()
                && let Some(other) = scalars.clone().find(|s| *s != first)
            {
                return Err(TrainError::Io(format!(
                    "the checkpoint's optimizer scalars differ between the parameters one ZeRO \
                     rank steps together ({first:?} and {other:?}): they cannot share one range"
                )));
            }
            let states = loaded
                .state
                .into_iter()
                .zip(&pieces)
                .map(|(s, p)| s.map(|s| for_holder(s, &[p.len()])))
                .collect();
            z.load_state(flat, states)?;
        }
    }
    Ok(())
}
