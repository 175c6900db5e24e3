//! Loading with resharding: every rank reads the index, checks the checkpoint is of its model,
//! works out which runs of which stored slices make up each region it holds in its own layout
//! and reads only those bytes (checked blocks); the ranks agree that all of them succeeded,
//! and only then does any engine change. Also the consolidated export: every parameter whole
//! in one safetensors file.

use super::agree::agree;
use super::files::{self, DataFile};
use super::index::{self, Index};
use super::state::{Loaded, Stateful, Wants};
use crate::error::CheckpointError;
use crate::error::TrainError;
use bonfire_module::params::ParamValues;
use bonfire_parallel::Region;
use bonfire_zero::FlatState;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A checkpoint on disk: its directory and index (no data read yet).
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Its directory (the one holding `index.json`).
    pub dir: PathBuf,
    /// Its index, read and checked.
    pub index: Index,
}

/// What [`resume`] did.
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The step the run resumes at (the checkpoint's).
    pub step: usize,
    /// The checkpoint loaded.
    pub checkpoint: Checkpoint,
    /// Bytes this rank read from data files (whole checksummed blocks).
    pub bytes_read: u64,
}

impl Checkpoint {
    /// The checkpoint at `path`: a checkpoint directory, or a root holding checkpoints (its
    /// latest complete one). Reads and checks the index only.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let dir = index::resolve(path.as_ref())?;
        let index = Index::read(&dir)?;
        Ok(Self { dir, index })
    }

    /// The step it was written at.
    pub fn step(&self) -> usize {
        self.index.step
    }

    /// Reads what `wants` asks for, resharding from the stored slices (only the blocks that
    /// hold them). No state anywhere changes.
    pub fn read(&self, wants: &Wants) -> Result<(Loaded, u64), CheckpointError> {
        self.index.check_model(&wants.params)?;
        let mut reader = Reader {
            dir: &self.dir,
            index: &self.index,
            files: HashMap::new(),
        };
        let mut loaded = Loaded::default();
        for (i, region) in &wants.values {
            let path = &wants.params[*i].0;
            loaded.values.push(reader.region(path, None, region)?);
        }
        for (i, region) in &wants.state {
            let record = &self.index.model.params[*i];
            if !record.has_state {
                loaded.state.push(None);
                continue;
            }
            let mut state = FlatState::default();
            for leaf in &record.state_leaves {
                let values = reader.region(&record.path, Some(leaf), region)?;
                state
                    .tensors
                    .push((leaf.clone(), vec![values.len()], values));
            }
            state.scalars = record
                .scalars
                .iter()
                .map(|(k, v)| (k.clone(), (*v).into()))
                .collect();
            loaded.state.push(Some(state));
        }
        let bytes = reader.files.values().map(|f| f.bytes_read).sum();
        Ok((loaded, bytes))
    }

    /// Every parameter whole, in model order.
    pub fn parameters(&self) -> Result<Vec<ParamValues>, CheckpointError> {
        let params: Vec<(String, Vec<usize>)> = self
            .index
            .model
            .params
            .iter()
            .map(|p| (p.path.clone(), p.shape.clone()))
            .collect();
        let wants = Wants {
            values: (0..params.len())
                .map(|i| (i, Region::whole(&params[i].1)))
                .collect(),
            params,
            state: Vec::new(),
        };
        let (loaded, _) = self.read(&wants)?;
        Ok(wants
            .params
            .into_iter()
            .zip(loaded.values)
            .map(|((path, shape), values)| ParamValues {
                path,
                shape,
                values,
            })
            .collect())
    }

    /// Writes every parameter whole to one safetensors file at `out` (names: the model's
    /// parameter paths — PyTorch's layout for a model that keeps it), atomically.
    pub fn export_consolidated(&self, out: impl AsRef<Path>) -> Result<(), CheckpointError> {
        write_consolidated(out.as_ref(), &self.parameters()?)
    }
}

/// Writes whole parameters to one safetensors file, through a temporary name.
pub(crate) fn write_consolidated(
    out: &Path,
    params: &[ParamValues],
) -> Result<(), CheckpointError> {
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
    }
    let tmp = out.with_extension("partial");
    let tensors: Vec<(String, Vec<usize>, &[f32])> = params
        .iter()
        .map(|p| (p.path.clone(), p.shape.clone(), p.values.as_slice()))
        .collect();
    files::write_tensors(&tmp, "", &tensors, index::BLOCK_BYTES, false)?;
    std::fs::rename(&tmp, out).map_err(|e| CheckpointError::io(out, e))
}

/// Reads regions of stored tensors, opening data files as needed.
struct Reader<'a> {
    dir: &'a Path,
    index: &'a Index,
    files: HashMap<usize, DataFile>,
}

impl Reader<'_> {
    /// `region` of tensor (`param`, `state`), from every stored slice that overlaps it.
    fn region(
        &mut self,
        param: &str,
        state: Option<&str>,
        region: &Region,
    ) -> Result<Vec<f32>, CheckpointError> {
        let what = match state {
            None => format!("`{param}`"),
            Some(leaf) => format!("optimizer state `{leaf}` of `{param}`"),
        };
        let chunks = self.index.chunks(param, state).ok_or_else(|| {
            CheckpointError::Corrupt(format!("the index lists no slice of {what}"))
        })?;
        let mut out = vec![0f32; region.len()];
        let mut covered = 0;
        for chunk in chunks {
            let runs = region.runs_from(&chunk.region);
            if runs.is_empty() {
                continue;
            }
            let file = match self.files.entry(chunk.file) {
                std::collections::hash_map::Entry::Occupied(f) => f.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(DataFile::open(self.dir, &self.index.files[chunk.file])?)
                }
            };
            for run in runs {
                let dst = &mut out[run.dst..run.dst + run.len];
                file.read_f32(&chunk.key, chunk.region.len(), run.src, dst)?;
                covered += run.len;
            }
        }
        if covered != region.len() {
            return Err(CheckpointError::Corrupt(format!(
                "the checkpoint's slices of {what} hold {covered} of the {} elements wanted",
                region.len()
            )));
        }
        Ok(out)
    }
}

/// Resumes `engine` from the checkpoint at `path` (a checkpoint, or a root: its latest):
/// every rank reads what its layout holds, resharding as it reads; all ranks agree that every
/// read succeeded before any engine changes, so a bad checkpoint is an error with the engine
/// untouched. A collective on the world.
pub fn resume(
    engine: &mut (impl Stateful + ?Sized),
    path: impl AsRef<Path>,
) -> Result<Resumed, TrainError> {
    let read = Checkpoint::open(path.as_ref()).and_then(|c| {
        let (loaded, bytes) = c.read(&engine.state_wants())?;
        Ok((c, loaded, bytes))
    });
    let world = engine.world().clone();
    // The step of what each rank read, compared before anything changes (a rank that failed
    // says i64::MAX; its error is what the ranks agree on below).
    let step = read.as_ref().map_or(i64::MAX, |(c, _, _)| c.step() as i64);
    let mut steps = vec![0i64; world.size()];
    world.all_gather(&[step], &mut steps)?;
    let read = read.and_then(
        |r| match steps.iter().all(|&s| s == step || s == i64::MAX) {
            true => Ok(r),
            false => Err(CheckpointError::Failed(format!(
                "the ranks found checkpoints of different steps {steps:?}"
            ))),
        },
    );
    let (checkpoint, loaded, bytes_read) = agree(&world, read)?;
    engine.load_state(loaded)?;
    Ok(Resumed {
        step: checkpoint.step(),
        checkpoint,
        bytes_read,
    })
}

/// Writes every parameter of `engine` whole to one safetensors file at `path` (names: the
/// model's parameter paths), from rank 0, atomically. A collective (parameters are gathered).
pub fn save_consolidated(
    engine: &mut (impl Stateful + ?Sized),
    path: impl AsRef<Path>,
) -> Result<(), TrainError> {
    let params = engine.parameters()?;
    let written = match engine.world().rank() {
        0 => write_consolidated(path.as_ref(), &params),
        _ => Ok(()),
    };
    agree(engine.world(), written)
}
