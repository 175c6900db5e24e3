//! The checkpoint's index (`index.json`, written last by rank 0): what the checkpoint holds —
//! the model's fingerprint and global shapes, where every slice of every parameter and
//! optimizer-state tensor lies (file, key, [`Region`]), each data file's size and block
//! checksums, the step, the layout and the optimizer — and the directory naming that makes a
//! checkpoint visible only once it is complete.

use super::CheckpointError;
use bonfire_parallel::Region;
use burn_pack::Scalar;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The format's name and version, the index's first field.
pub const FORMAT: &str = "bonfire-checkpoint/1";
/// The index's file name inside a checkpoint directory.
pub const INDEX: &str = "index.json";
/// Bytes per checksummed block of a data file.
pub const BLOCK_BYTES: u64 = 1 << 20;

/// A checkpoint's index (see docs/checkpoint.md for every field).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Index {
    /// The format's name and version (`bonfire-checkpoint/1`); a reader refuses any other.
    pub format: String,
    /// Optimizer steps taken: the run resumes at this step.
    pub step: usize,
    /// Where the data resumes: the data source is indexed by step, so this is `step`.
    pub data_position: usize,
    /// What the run says about its randomness (seeds; the trainer itself draws none).
    pub rng: serde_json::Value,
    /// The layout that wrote it.
    pub layout: LayoutRecord,
    /// The optimizer (its name and hyper-parameters, as the run described it).
    pub optimizer: serde_json::Value,
    /// The model it is of: every parameter's path, shape and optimizer state, and their
    /// fingerprint.
    pub model: ModelRecord,
    /// The data files, one per rank that wrote slices; [`ChunkRecord::file`] indexes it.
    pub files: Vec<FileRecord>,
    /// One entry per parameter (values) and per optimizer-state tensor of a parameter.
    pub tensors: Vec<TensorRecord>,
    /// The run's own record (its configuration), untouched by the trainer.
    pub extra: serde_json::Value,
}

/// The layout a checkpoint was written under.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayoutRecord {
    /// `ParallelDims`'s display, e.g. `pp=1,dp=2,tp=2 zero=3`.
    pub dims: String,
    /// The world size it was written by.
    pub world: usize,
}

/// The model the checkpoint is of: every parameter's path and whole shape, in model order,
/// and a checksum of that list.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelRecord {
    /// A CRC-32 of the parameters' paths and shapes, in order, as 8 hex digits: what a load
    /// names when the model differs.
    pub fingerprint: String,
    /// Every parameter, in model order.
    pub params: Vec<ParamRecord>,
}

/// One parameter of the model: its path, whole shape and what the optimizer holds for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamRecord {
    /// Its path in the model.
    pub path: String,
    /// Its whole (unsharded) shape.
    pub shape: Vec<usize>,
    /// Whether the optimizer holds state for it (none before its first step).
    pub has_state: bool,
    /// The optimizer's state tensors of it, by leaf name (`momentum.moment_1`, …), each
    /// shaped like the parameter.
    pub state_leaves: Vec<String>,
    /// The optimizer's scalars of it (`momentum.time`, …).
    pub scalars: BTreeMap<String, ScalarValue>,
}

/// A data file: its name in the checkpoint directory, size and a CRC-32 per block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Its name in the checkpoint directory (`rank-RRRRR.safetensors`).
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Bytes per checksummed block (the last block may be shorter).
    pub block_bytes: u64,
    /// The CRC-32 of each block, in order.
    pub block_crc32: Vec<u32>,
}

/// Where the slices of one tensor lie.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TensorRecord {
    /// The parameter's path.
    pub param: String,
    /// `None`: the parameter's values; `Some(leaf)`: that optimizer-state tensor of it.
    pub state: Option<String>,
    /// Its slices, across the data files (together they hold every element once).
    pub chunks: Vec<ChunkRecord>,
}

/// One slice: `key` in file `file` (an index into [`Index::files`]) holds `region`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRecord {
    /// The data file holding it: an index into [`Index::files`].
    pub file: usize,
    /// Its safetensors key in that file (`param/<path>` or `optim/<leaf>/<path>`).
    pub key: String,
    /// The elements of the whole tensor it holds.
    pub region: Region,
}

/// An optimizer scalar, typed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum ScalarValue {
    /// A signed integer (Burn's `Scalar::Int`).
    Int(i64),
    /// An unsigned integer (`Scalar::UInt`).
    UInt(u64),
    /// A floating-point number (`Scalar::Float`).
    Float(f64),
    /// A flag (`Scalar::Bool`).
    Bool(bool),
}

impl Eq for ScalarValue {}

impl From<Scalar> for ScalarValue {
    fn from(s: Scalar) -> Self {
        match s {
            Scalar::Int(v) => Self::Int(v),
            Scalar::UInt(v) => Self::UInt(v),
            Scalar::Float(v) => Self::Float(v),
            Scalar::Bool(v) => Self::Bool(v),
        }
    }
}

impl From<ScalarValue> for Scalar {
    fn from(s: ScalarValue) -> Self {
        match s {
            ScalarValue::Int(v) => Self::Int(v),
            ScalarValue::UInt(v) => Self::UInt(v),
            ScalarValue::Float(v) => Self::Float(v),
            ScalarValue::Bool(v) => Self::Bool(v),
        }
    }
}

/// The key of a slice in its rank's file.
pub fn key(param: &str, state: Option<&str>) -> String {
    match state {
        None => format!("param/{param}"),
        Some(leaf) => format!("optim/{leaf}/{param}"),
    }
}

/// A rank's data file name.
pub fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// The directory of the checkpoint of `step` under `root`.
pub fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

/// Where the checkpoint of `step` is written before it is complete (invisible to loaders).
pub fn partial_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step:08}.partial"))
}

/// The step of a complete checkpoint directory's name (`step-00000010` → 10).
fn step_of(name: &str) -> Option<usize> {
    let digits = name.strip_prefix("step-")?;
    (digits.len() == 8 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The complete checkpoints under `root` (named `step-NNNNNNNN`, holding an index), oldest
/// first.
pub fn complete(root: &Path) -> Result<Vec<(usize, PathBuf)>, CheckpointError> {
    let entries = std::fs::read_dir(root).map_err(|e| CheckpointError::io(root, e))?;
    let mut out: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let step = step_of(e.file_name().to_str()?)?;
            let dir = e.path();
            dir.join(INDEX).is_file().then_some((step, dir))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// A checkpoint directory from what a user names: a checkpoint (a directory with an index)
/// or a root holding checkpoints (its latest complete one).
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.ends_with(".partial") {
        return Err(CheckpointError::NotFound(format!(
            "{}: an incomplete checkpoint (a save that did not finish)",
            path.display()
        )));
    }
    if path.join(INDEX).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(CheckpointError::NotFound(format!(
            "{}: no such checkpoint directory",
            path.display()
        )));
    }
    complete(path)?.pop().map(|(_, d)| d).ok_or_else(|| {
        CheckpointError::NotFound(format!(
            "{}: no complete checkpoint (a `step-NNNNNNNN` directory with an {INDEX})",
            path.display()
        ))
    })
}

/// A checksum of the model's parameter paths and shapes, in order.
pub fn fingerprint(params: &[(String, Vec<usize>)]) -> String {
    let mut h = crc32fast::Hasher::new();
    for (path, shape) in params {
        h.update(path.as_bytes());
        for d in shape {
            h.update(&(*d as u64).to_le_bytes());
        }
        h.update(b";");
    }
    format!("{:08x}", h.finalize())
}

impl Index {
    /// Reads and parses `dir`'s index, checking the format.
    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(INDEX);
        let text = std::fs::read_to_string(&path).map_err(|e| CheckpointError::io(&path, e))?;
        let index: Index = serde_json::from_str(&text)
            .map_err(|e| CheckpointError::Corrupt(format!("{}: {e}", path.display())))?;
        if index.format != FORMAT {
            return Err(CheckpointError::Corrupt(format!(
                "{}: format `{}`, this build reads `{FORMAT}`",
                path.display(),
                index.format
            )));
        }
        index.check()?;
        Ok(index)
    }

    /// The index's own consistency: known files and parameters, regions inside their tensor.
    fn check(&self) -> Result<(), CheckpointError> {
        let shapes: BTreeMap<&str, &ParamRecord> = self
            .model
            .params
            .iter()
            .map(|p| (p.path.as_str(), p))
            .collect();
        for t in &self.tensors {
            let bad =
                |why: String| CheckpointError::Corrupt(format!("index: `{}`: {why}", t.param));
            let p = shapes
                .get(t.param.as_str())
                .ok_or_else(|| bad("not a parameter of the model".into()))?;
            for c in &t.chunks {
                if c.file >= self.files.len() {
                    return Err(bad(format!("file #{} does not exist", c.file)));
                }
                if !c.region.fits(&p.shape) {
                    return Err(bad(format!("a slice outside its shape {:?}", p.shape)));
                }
            }
        }
        Ok(())
    }

    /// The chunks of a tensor (`None` when the checkpoint has no such tensor).
    pub fn chunks(&self, param: &str, state: Option<&str>) -> Option<&[ChunkRecord]> {
        self.tensors
            .iter()
            .find(|t| t.param == param && t.state.as_deref() == state)
            .map(|t| t.chunks.as_slice())
    }

    /// Checks that the checkpoint is of the model whose parameters are `params` (paths and
    /// whole shapes, in order), naming the first difference.
    pub fn check_model(&self, params: &[(String, Vec<usize>)]) -> Result<(), CheckpointError> {
        let mine = &self.model.params;
        let differ = |what: String| {
            Err(CheckpointError::OtherModel(format!(
                "the checkpoint (model {}) is of another model than this one ({}): {what}",
                self.model.fingerprint,
                fingerprint(params)
            )))
        };
        for (i, (path, shape)) in params.iter().enumerate() {
            match mine.get(i) {
                None => return differ(format!("it has no parameter #{i} `{path}`")),
                Some(p) if &p.path != path => {
                    return differ(format!(
                        "parameter #{i} is `{}` there, `{path}` here",
                        p.path
                    ));
                }
                Some(p) if &p.shape != shape => {
                    return differ(format!("`{path}` is {:?} there, {shape:?} here", p.shape));
                }
                Some(_) => {}
            }
        }
        if mine.len() != params.len() {
            return differ(format!(
                "it has {} parameters, this model {}",
                mine.len(),
                params.len()
            ));
        }
        Ok(())
    }
}
