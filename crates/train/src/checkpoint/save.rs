//! Saving: [`Checkpointer`], the training loop's checkpoint hook. At a checkpoint every rank
//! copies what it owns to the host (a short pause), then a thread of its own writes that to
//! `step-N.partial/rank-R.safetensors` and syncs it while training goes on. At the next step
//! boundary where every rank's thread is done (checked with one tiny all-reduce per step),
//! rank 0 writes the index, syncs it, renames the directory to `step-N` — the moment the
//! checkpoint becomes visible — and drops all but the last K.

use super::files::{self, Fault};
use super::index::{self, ChunkRecord, FileRecord, Index, ParamRecord, TensorRecord};
use super::state::{RankState, Stateful};
use super::{CheckpointError, agree, gather_strings};
use crate::error::TrainError;
use bonfire_comm::{ProcessGroup, ReduceOp};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// Where and how checkpoints are saved (when: [`crate::FitConfig::checkpoint_every`] and the
/// end of the run).
#[derive(Debug, Clone)]
pub struct CheckpointConfig {
    /// The root directory: checkpoints are its `step-NNNNNNNN` subdirectories.
    pub dir: PathBuf,
    /// Keep only the last `keep` checkpoints (`None`: all).
    pub keep: Option<usize>,
    /// Write in a background thread while training goes on (the default), or before the
    /// loop continues.
    pub background: bool,
    /// Bytes per checksummed block of a data file (the unit a resharding load reads).
    pub block_bytes: u64,
    /// Recorded in the index: the optimizer (name, hyper-parameters, e.g.
    /// [`crate::OptimizerKind::describe`]).
    pub optimizer: serde_json::Value,
    /// Recorded in the index: the run's randomness (seeds).
    pub rng: serde_json::Value,
    /// Recorded in the index: anything else the run wants back when it resumes (its
    /// configuration).
    pub extra: serde_json::Value,
    /// A failure injected at a save's step (tests of atomicity).
    #[doc(hidden)]
    pub fault: Option<(usize, Fault)>,
}

impl CheckpointConfig {
    /// Checkpoints under `dir`: all kept, written in the background, in 1 MiB blocks, with
    /// nothing recorded of the run (nulls).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            keep: None,
            background: true,
            block_bytes: index::BLOCK_BYTES,
            optimizer: serde_json::Value::Null,
            rng: serde_json::Value::Null,
            extra: serde_json::Value::Null,
            fault: None,
        }
    }
    /// Keeps only the last `keep` checkpoints (`None`: all).
    pub fn with_keep(mut self, keep: Option<usize>) -> Self {
        self.keep = keep;
        self
    }
    /// Writes in a background thread (`true`) or before the loop continues (`false`).
    pub fn with_background(mut self, background: bool) -> Self {
        self.background = background;
        self
    }
    /// Bytes per checksummed block of a data file (at least 8).
    pub fn with_block_bytes(mut self, bytes: u64) -> Self {
        self.block_bytes = bytes.max(8);
        self
    }
    /// The optimizer's description the index records.
    pub fn with_optimizer(mut self, optimizer: serde_json::Value) -> Self {
        self.optimizer = optimizer;
        self
    }
    /// The run's randomness (seeds) the index records.
    pub fn with_rng(mut self, rng: serde_json::Value) -> Self {
        self.rng = rng;
        self
    }
    /// The run's own record (its configuration) the index keeps for it.
    pub fn with_extra(mut self, extra: serde_json::Value) -> Self {
        self.extra = extra;
        self
    }
}

/// One rank's slices as rank 0 needs them for the index (no values).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SliceDesc {
    param: usize,
    region: bonfire_parallel::Region,
    state: Option<StateDesc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StateDesc {
    leaves: Vec<String>,
    scalars: std::collections::BTreeMap<String, index::ScalarValue>,
}

/// A save whose files are being written.
struct Pending {
    step: usize,
    /// Rank 0: every rank's slices and the model.
    descs: Vec<Vec<SliceDesc>>,
    params: Vec<(String, Vec<usize>)>,
    dims: String,
    writer: Option<JoinHandle<Result<FileRecord, CheckpointError>>>,
}

/// The training loop's checkpoint hook (it implements [`crate::Hooks`]; see the module docs). One per rank; every call is
/// a collective.
pub struct Checkpointer {
    config: CheckpointConfig,
    pending: Option<Pending>,
    /// The last checkpoint made visible.
    last: Option<PathBuf>,
}

impl Checkpointer {
    /// This rank's hook, saving as `config` says; no save pending, none committed yet.
    pub fn new(config: CheckpointConfig) -> Self {
        Self {
            config,
            pending: None,
            last: None,
        }
    }

    /// The last checkpoint this rank saw committed.
    pub fn last(&self) -> Option<&Path> {
        self.last.as_deref()
    }

    /// Starts the checkpoint of `step`: waits for the previous one, copies this rank's slices
    /// to the host and hands them to the writer thread (or writes them now). A collective.
    pub fn save(
        &mut self,
        step: usize,
        engine: &mut (impl Stateful + ?Sized),
    ) -> Result<(), TrainError> {
        self.wait(engine.world())?;
        let pg = engine.world().clone();
        let root = self.config.dir.clone();
        let partial = index::partial_dir(&root, step);
        let prepared = match pg.rank() {
            0 => prepare(&root, &partial),
            _ => Ok(()),
        };
        agree(&pg, prepared)?;
        let state = engine.save_state()?;
        let mine: Vec<SliceDesc> = describe(&state);
        let all = gather_strings(&pg, &serde_json::to_string(&mine).expect("serializes"))?;
        let descs = match pg.rank() {
            0 => all
                .iter()
                .map(|s| serde_json::from_str(s).expect("a rank's description"))
                .collect(),
            _ => Vec::new(),
        };
        let writer = (!state.slices.is_empty()).then(|| {
            let file = partial.join(index::rank_file(pg.rank()));
            let name = index::rank_file(pg.rank());
            let block = self.config.block_bytes;
            let abort = self.config.fault == Some((step, Fault::MidFile { rank: pg.rank() }));
            let (slices, params) = (state.slices, state.params.clone());
            std::thread::spawn(move || {
                let tensors = tensors_of(&slices, &params);
                files::write_tensors(&file, &name, &tensors, block, abort)
            })
        });
        self.pending = Some(Pending {
            step,
            descs,
            params: state.params,
            dims: engine.dims().to_string(),
            writer,
        });
        if !self.config.background {
            self.wait(&pg)?;
        }
        Ok(())
    }

    /// Commits the pending checkpoint if every rank's writer is done (a collective).
    pub fn poll(&mut self, pg: &ProcessGroup) -> Result<(), TrainError> {
        let Some(p) = &self.pending else {
            return Ok(());
        };
        let mut done = [u8::from(p.writer.as_ref().is_none_or(|w| w.is_finished()))];
        pg.all_reduce(&mut done, ReduceOp::Min)?;
        if done[0] == 1 {
            self.commit(pg)?;
        }
        Ok(())
    }

    /// Waits for the pending checkpoint and commits it (a collective).
    pub fn wait(&mut self, pg: &ProcessGroup) -> Result<(), TrainError> {
        if self.pending.is_some() {
            self.commit(pg)?;
        }
        Ok(())
    }

    fn commit(&mut self, pg: &ProcessGroup) -> Result<(), TrainError> {
        let mut p = self.pending.take().expect("a pending save");
        let written = match p.writer.take() {
            None => Ok(None),
            Some(w) => w
                .join()
                .unwrap_or_else(|_| Err(CheckpointError::Failed("the writer panicked".into())))
                .map(Some),
        };
        let files = agree(pg, written)?;
        let records = gather_strings(pg, &serde_json::to_string(&files).expect("serializes"))?;
        let committed = match pg.rank() {
            0 => {
                let records: Vec<Option<FileRecord>> = records
                    .iter()
                    .map(|s| serde_json::from_str(s).expect("a file record"))
                    .collect();
                let partial = index::partial_dir(&self.config.dir, p.step);
                let result = build_index(&self.config, &p, records)
                    .and_then(|index| publish(&self.config, &partial, p.step, &index));
                if result.is_err() {
                    let _ = std::fs::remove_dir_all(&partial);
                }
                result
            }
            _ => Ok(()),
        };
        agree(pg, committed)?;
        self.last = Some(index::step_dir(&self.config.dir, p.step));
        Ok(())
    }
}

/// Rank 0's preparation: the root, no stale partial directories, a fresh partial one.
fn prepare(root: &Path, partial: &Path) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(root).map_err(|e| CheckpointError::io(root, e))?;
    let entries = std::fs::read_dir(root).map_err(|e| CheckpointError::io(root, e))?;
    for e in entries.filter_map(|e| e.ok()) {
        let stale = e
            .file_name()
            .to_str()
            .is_some_and(|n| n.ends_with(".partial"));
        if stale {
            let path = e.path();
            std::fs::remove_dir_all(&path).map_err(|e| CheckpointError::io(&path, e))?;
        }
    }
    std::fs::create_dir_all(partial).map_err(|e| CheckpointError::io(partial, e))
}

fn describe(state: &RankState) -> Vec<SliceDesc> {
    state
        .slices
        .iter()
        .map(|s| SliceDesc {
            param: s.param,
            region: s.region.clone(),
            state: s.state.as_ref().map(|st| StateDesc {
                leaves: st.tensors.iter().map(|t| t.0.clone()).collect(),
                scalars: st
                    .scalars
                    .iter()
                    .map(|(k, v)| (k.clone(), (*v).into()))
                    .collect(),
            }),
        })
        .collect()
}

/// The (key, shape, values) of every tensor a rank's file holds: each slice's values and
/// its optimizer-state tensors, 1-d.
fn tensors_of<'a>(
    slices: &'a [super::state::Slice],
    params: &[(String, Vec<usize>)],
) -> Vec<(String, Vec<usize>, &'a [f32])> {
    let mut out = Vec::new();
    for s in slices {
        let path = &params[s.param].0;
        out.push((
            index::key(path, None),
            vec![s.values.len()],
            s.values.as_slice(),
        ));
        for (leaf, _, v) in s.state.iter().flat_map(|st| &st.tensors) {
            out.push((index::key(path, Some(leaf)), vec![v.len()], v.as_slice()));
        }
    }
    out
}

/// The index from every rank's slices and files, checking that the slices tile every
/// parameter and agree on its optimizer state.
fn build_index(
    config: &CheckpointConfig,
    p: &Pending,
    records: Vec<Option<FileRecord>>,
) -> Result<Index, CheckpointError> {
    let mut files = Vec::new();
    let mut file_of = vec![usize::MAX; records.len()];
    for (rank, r) in records.into_iter().enumerate() {
        if let Some(r) = r {
            file_of[rank] = files.len();
            files.push(r);
        }
    }
    let n = p.params.len();
    let mut states: Vec<Option<Option<StateDesc>>> = vec![None; n];
    let mut covered = vec![0usize; n];
    let mut tensors: Vec<TensorRecord> = Vec::new();
    let mut chunks = vec![Vec::new(); n];
    let mut state_chunks: Vec<Vec<(String, ChunkRecord)>> = vec![Vec::new(); n];
    for (rank, descs) in p.descs.iter().enumerate() {
        for d in descs {
            let path = &p.params[d.param].0;
            let seen = states[d.param].get_or_insert_with(|| d.state.clone());
            if *seen != d.state {
                return Err(CheckpointError::Failed(format!(
                    "`{path}`: the ranks' optimizer states differ ({seen:?} and {:?})",
                    d.state
                )));
            }
            covered[d.param] += d.region.len();
            let chunk = |key| ChunkRecord {
                file: file_of[rank],
                key,
                region: d.region.clone(),
            };
            chunks[d.param].push(chunk(index::key(path, None)));
            for leaf in d.state.iter().flat_map(|s| &s.leaves) {
                state_chunks[d.param].push((leaf.clone(), chunk(index::key(path, Some(leaf)))));
            }
        }
    }
    let mut params = Vec::with_capacity(n);
    for (i, (path, shape)) in p.params.iter().enumerate() {
        let numel: usize = shape.iter().product();
        if covered[i] != numel {
            return Err(CheckpointError::Failed(format!(
                "the ranks' slices of `{path}` hold {} of its {numel} elements",
                covered[i]
            )));
        }
        let state = states[i].clone().flatten();
        tensors.push(TensorRecord {
            param: path.clone(),
            state: None,
            chunks: std::mem::take(&mut chunks[i]),
        });
        for leaf in state.iter().flat_map(|s| &s.leaves) {
            tensors.push(TensorRecord {
                param: path.clone(),
                state: Some(leaf.clone()),
                chunks: state_chunks[i]
                    .iter()
                    .filter(|(l, _)| l == leaf)
                    .map(|(_, c)| c.clone())
                    .collect(),
            });
        }
        params.push(ParamRecord {
            path: path.clone(),
            shape: shape.clone(),
            has_state: state.is_some(),
            state_leaves: state.as_ref().map_or(Vec::new(), |s| s.leaves.clone()),
            scalars: state.map_or(Default::default(), |s| s.scalars),
        });
    }
    Ok(Index {
        format: index::FORMAT.into(),
        step: p.step,
        data_position: p.step,
        rng: config.rng.clone(),
        layout: index::LayoutRecord {
            dims: p.dims.clone(),
            world: p.descs.len(),
        },
        optimizer: config.optimizer.clone(),
        model: index::ModelRecord {
            fingerprint: index::fingerprint(&p.params),
            params,
        },
        files,
        tensors,
        extra: config.extra.clone(),
    })
}

/// Writes the index into the partial directory, syncs it, renames the directory into place
/// (moving an older checkpoint of the same step aside first) and keeps the last K.
fn publish(
    config: &CheckpointConfig,
    partial: &Path,
    step: usize,
    index: &Index,
) -> Result<(), CheckpointError> {
    if config.fault == Some((step, Fault::BeforeIndex)) {
        files::abort("before writing the index");
    }
    let json = serde_json::to_vec_pretty(index).expect("an index serializes");
    files::write_atomic(&partial.join(index::INDEX), &json)?;
    if config.fault == Some((step, Fault::BeforeRename)) {
        files::abort("before the rename");
    }
    let root = &config.dir;
    let dir = index::step_dir(root, step);
    if dir.exists() {
        let old = root.join(format!("step-{step:08}.replaced.partial"));
        std::fs::rename(&dir, &old).map_err(|e| CheckpointError::io(&dir, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| CheckpointError::io(&old, e))?;
    }
    std::fs::rename(partial, &dir).map_err(|e| CheckpointError::io(&dir, e))?;
    files::sync_dir(root)?;
    if let Some(keep) = config.keep {
        let all = index::complete(root)?;
        for (_, old) in all.iter().take(all.len().saturating_sub(keep.max(1))) {
            // The index first: the checkpoint is invisible before its files go.
            let _ = std::fs::remove_file(old.join(index::INDEX));
            std::fs::remove_dir_all(old).map_err(|e| CheckpointError::io(old, e))?;
        }
    }
    Ok(())
}
