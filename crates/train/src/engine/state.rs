//! An engine's training state as the checkpoint sees it, from its dp wrapper: every slice of a
//! parameter (and the optimizer state of the same elements) this rank owns, placed in the
//! whole tensor as a [`Region`] — its tensor-parallel shard's box, narrowed to its ZeRO slice
//! — and the slices it must be given to resume.
//!
//! Ownership (each element written once): DDP replicas are written by dp coordinate 0 (an
//! expert parameter under ep by each of the first ep ranks, its slice of the experts), ZeRO
//! slices by the rank that owns them, parameters replicated over tp by tp coordinate 0,
//! pipeline stages by the pp coordinate that runs them.

use super::export::ModelLayout;
use crate::checkpoint::{Loaded, RankState, Slice, Wants};
use crate::error::TrainError;
use crate::mesh::RankMesh;
use crate::wrapper::DpWrapper;
use bonfire_layout::ZeroStage;
use bonfire_module::DataParallel;
use bonfire_parallel::Region;
use bonfire_zero::FlatState;
use bonfire_zero::optim::{record_states, with_states};
use burn::module::Module;
use burn_pack::Scalar;

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

impl<'a> Holding<'a> {
    /// Where a dp wrapper holding model parameters `indices` sits on `at`, for checkpoints.
    pub(crate) fn at(at: &RankMesh, layout: &'a ModelLayout, indices: &'a [usize]) -> Self {
        Holding {
            layout,
            indices,
            tp_rank: at.coord(bonfire_layout::Axis::Tp),
            tp_size: at.dims.tp(),
            // The rank in the dp wrapper's group (dp × cp, row-major; dp_replicate outside
            // them under DDP).
            dp_rank: at.wrapper_rank(),
            ep: at.dims.ep(),
            replica: match at.dims.is_hsdp() {
                true => at.coord(bonfire_layout::Axis::DpReplicate),
                false => 0,
            },
        }
    }

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

/// A ZeRO partition's slices on this rank (the parameters' or the experts'), with their
/// values and optimizer state, and each partition parameter's place among the wrapper's.
struct Owned<'a> {
    slices: &'a [bonfire_zero::ParamSlice],
    values: Vec<f32>,
    states: Vec<Option<FlatState>>,
    at: Vec<usize>,
}

impl Owned<'_> {
    /// Adds a slice per slice this rank writes.
    fn write(self, h: &Holding, slices: &mut Vec<Slice>) {
        let start = self.slices.first().map_or(0, |p| p.flat.start);
        for (slice, state) in self.slices.iter().zip(self.states) {
            let k = self.at[slice.param];
            if h.writes_on_tp(k) {
                let at = slice.flat.start - start..slice.flat.end - start;
                slices.push(Slice {
                    param: h.indices[k],
                    region: h.shard_box(k).narrow(slice.within.clone()),
                    values: self.values[at].to_vec(),
                    state: state.map(without_rank),
                });
            }
        }
    }
}

/// Where each of `part` (a partition's parameters) is among `all` (the wrapper's, in order).
fn positions(
    all: &[bonfire_module::params::ParamInfo],
    part: &[bonfire_module::params::ParamInfo],
) -> Vec<usize> {
    part.iter()
        .map(|p| {
            all.iter()
                .position(|a| a.id == p.id)
                .expect("a partition holds the wrapper's parameters")
        })
        .collect()
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
            let replicated = z.config().stage == ZeroStage::Zero0;
            if h.replica == 0 && (!replicated || h.dp_rank == 0) {
                let all = z.all_params();
                let dense = Owned {
                    slices: z.optimizer().slices(),
                    values: z.own_values(),
                    states: z.optimizer().export_all(),
                    at: positions(all, z.params()),
                };
                dense.write(h, &mut slices);
                if let Some(experts) = z.expert_params() {
                    let owned = Owned {
                        slices: z.expert_slices(),
                        values: z.expert_own_values(),
                        states: z.expert_states(),
                        at: positions(all, experts),
                    };
                    owned.write(h, &mut slices);
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
/// replica (DDP, ZeRO 1–2), its slices where it holds only those (ZeRO-3); the optimizer
/// state of what its optimizer steps.
pub(crate) fn wants<M: Module>(w: &DpWrapper<M>, h: &Holding) -> Wants {
    let all: Vec<(usize, Region)> = (0..h.indices.len())
        .map(|k| (h.indices[k], h.shard_box(k)))
        .collect();
    let (values, state) = match w {
        DpWrapper::Ddp(_) => (all.clone(), all),
        DpWrapper::Zero(z) => {
            let all_params = z.all_params();
            let region_of = |at: &[usize], p: &bonfire_zero::ParamSlice| {
                let k = at[p.param];
                (h.indices[k], h.shard_box(k).narrow(p.within.clone()))
            };
            let dense_at = positions(all_params, z.params());
            let mut slices: Vec<(usize, Region)> = z
                .optimizer()
                .slices()
                .iter()
                .map(|p| region_of(&dense_at, p))
                .collect();
            let experts_at = z.expert_params().map(|x| positions(all_params, x));
            if let Some(at) = &experts_at {
                slices.extend(z.expert_slices().iter().map(|p| region_of(at, p)));
            }
            match z.config().stage {
                // Its slices of every parameter, the experts' included.
                ZeroStage::Zero3 => (slices.clone(), slices),
                _ => (all, slices),
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
    match w {
        DpWrapper::Ddp(d) => {
            let flat: Vec<f32> = loaded.values.into_iter().flatten().collect();
            let states = d
                .params()
                .iter()
                .zip(loaded.state)
                .filter_map(|(info, s)| Some((info.id, for_holder(s?, &info.shape))))
                .collect();
            let optim = with_states(d.optimizer().clone(), states);
            d.load_state(&flat, optim);
        }
        DpWrapper::Zero(z) => load_zero(z, loaded)?,
    }
    Ok(())
}

/// Installs `loaded` into a ZeRO wrapper: its partition's values and slices' state, and under
/// expert parallelism the experts' (in [`wants`]' order: values — every parameter's in order
/// at stages 0–2, at stage 3 the partition's slices then the experts' — and the state of the
/// partition's slices, then of the experts').
fn load_zero<M: Module>(z: &mut bonfire_zero::Zero<M>, loaded: Loaded) -> Result<(), TrainError> {
    let scalars = loaded.state.iter().flatten().map(|s| &s.scalars);
    if let Some(first) = scalars.clone().next()
        && let Some(other) = scalars.clone().find(|s| *s != first)
    {
        return Err(TrainError::Io(format!(
            "the checkpoint's optimizer scalars differ between the parameters one ZeRO \
             rank steps together ({first:?} and {other:?}): they cannot share one range"
        )));
    }
    let holder = |slices: &[bonfire_zero::ParamSlice], states: Vec<Option<FlatState>>| {
        states
            .into_iter()
            .zip(slices)
            .map(|(s, p)| s.map(|s| for_holder(s, &[p.len()])))
            .collect::<Vec<_>>()
    };
    let dense_slices = z.optimizer().slices().to_vec();
    let expert_slices = z.expert_slices().to_vec();
    let mut states = loaded.state;
    let expert_states = states.split_off(dense_slices.len().min(states.len()));
    let (dense, experts) = split_values(z, loaded.values);
    z.load_state(dense, holder(&dense_slices, states))?;
    if z.expert_params().is_some() {
        z.load_expert_state(experts, holder(&expert_slices, expert_states))?;
    }
    Ok(())
}

/// The loaded values of a ZeRO wrapper split into its partition's and the experts' (both
/// flat, in order; see [`load_zero`]).
fn split_values<M: Module>(
    z: &bonfire_zero::Zero<M>,
    values: Vec<Vec<f32>>,
) -> (Vec<f32>, Vec<f32>) {
    let Some(experts) = z.expert_params() else {
        return (values.into_iter().flatten().collect(), Vec::new());
    };
    if z.config().stage == ZeroStage::Zero3 {
        let n = z.optimizer().slices().len();
        let mut values = values;
        let rest = values.split_off(n.min(values.len()));
        return (
            values.into_iter().flatten().collect(),
            rest.into_iter().flatten().collect(),
        );
    }
    let (mut dense, mut expert) = (Vec::new(), Vec::new());
    for (info, v) in z.all_params().iter().zip(values) {
        match experts.iter().any(|x| x.id == info.id) {
            true => expert.extend(v),
            false => dense.extend(v),
        }
    }
    (dense, expert)
}

/// `saved` with the state tensors this rank holds (`held[k]` is the model's state tensor
/// `indices[k]`, of `layout`'s list) after the parameters — named in `params` after them,
/// whole regions, no optimizer state — written when `writes` (one rank per pipeline stage).
pub(crate) fn with_buffers(
    mut saved: RankState,
    (layout, indices, held): (&ModelLayout, &[usize], Vec<Vec<f32>>),
    writes: bool,
) -> RankState {
    let base = saved.params.len();
    saved.params.extend(buffer_names(layout));
    if writes {
        for (values, &i) in held.into_iter().zip(indices) {
            saved.slices.push(Slice {
                param: base + i,
                region: Region::whole(&layout.buffers[i].shape),
                values,
                state: None,
            });
        }
    }
    saved
}

/// `wants` with the state tensors this rank holds (the model's `indices`), whole, after the
/// parameters (their values last, in `indices`' order: [`split_buffers`] takes them off).
pub(crate) fn wanting_buffers(mut wants: Wants, layout: &ModelLayout, indices: &[usize]) -> Wants {
    let base = wants.params.len();
    wants.params.extend(buffer_names(layout));
    for &i in indices {
        let whole = Region::whole(&layout.buffers[i].shape);
        wants.values.push((base + i, whole));
    }
    wants
}

/// The last `n` values of `loaded` (the state tensors [`wanting_buffers`] asked for) apart
/// from the rest.
pub(crate) fn split_buffers(mut loaded: Loaded, n: usize) -> (Loaded, Vec<Vec<f32>>) {
    let at = loaded.values.len() - n;
    let buffers = loaded.values.split_off(at);
    (loaded, buffers)
}

/// The model's state tensors as a checkpoint names them: path and whole shape.
fn buffer_names(layout: &ModelLayout) -> impl Iterator<Item = (String, Vec<usize>)> + '_ {
    layout
        .buffers
        .iter()
        .map(|b| (b.path.clone(), b.shape.clone()))
}
