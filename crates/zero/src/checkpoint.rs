//! Checkpoints.
//!
//! - **Consolidated** ([`Zero::save_consolidated`]): every parameter in full under its module
//!   path, one safetensors file — the layout a plain single-device model loads (e.g. with
//!   burn-store's `SafetensorsStore`).
//! - **Sharded** ([`Zero::save_sharded`]): one safetensors file per rank holding that rank's
//!   pieces — parameter values and optimizer state — each named by parameter path and element
//!   offset, plus JSON metadata (world size, stage, steps, the optimizer's scalars per piece).
//!   [`Zero::load_sharded`] reassembles whatever pieces its own partition needs from all files,
//!   so N ranks' checkpoint loads on M ranks, at any stage, or on one.

use crate::config::ZeroStage;
use crate::error::{Result, ZeroError};
use crate::optim::FlatState;
use crate::zero::Zero;
use bonfire_dtensor::plane::{self, ledger::Reason};
use burn::module::Module;
use burn_pack::Scalar;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

fn err(e: impl std::fmt::Display) -> ZeroError {
    ZeroError::Checkpoint(e.to_string())
}

#[derive(Serialize, Deserialize, Debug, Clone)]
struct PieceMeta {
    path: String,
    start: usize,
    end: usize,
    /// Whether the optimizer has state for the piece.
    state: bool,
    state_leaves: Vec<String>,
    scalars: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
struct ShardMeta {
    world: usize,
    rank: usize,
    stage: usize,
    steps: u64,
    pieces: Vec<PieceMeta>,
}

fn scalar_to_string(s: &Scalar) -> String {
    match s {
        Scalar::Int(v) => format!("i:{v}"),
        Scalar::UInt(v) => format!("u:{v}"),
        Scalar::Float(v) => format!("f:{v:e}"),
        Scalar::Bool(v) => format!("b:{v}"),
    }
}

fn scalar_from_string(s: &str) -> Result<Scalar> {
    let (kind, v) = s
        .split_once(':')
        .ok_or_else(|| err(format!("bad scalar `{s}`")))?;
    let bad = |_| err(format!("bad scalar `{s}`"));
    Ok(match kind {
        "i" => Scalar::Int(
            v.parse()
                .map_err(|e: std::num::ParseIntError| bad(e.to_string()))?,
        ),
        "u" => Scalar::UInt(
            v.parse()
                .map_err(|e: std::num::ParseIntError| bad(e.to_string()))?,
        ),
        "f" => Scalar::Float(
            v.parse()
                .map_err(|e: std::num::ParseFloatError| bad(e.to_string()))?,
        ),
        "b" => Scalar::Bool(v == "true"),
        _ => return Err(err(format!("bad scalar `{s}`"))),
    })
}

fn shard_file(dir: &Path, rank: usize, world: usize) -> PathBuf {
    dir.join(format!("rank-{rank:05}-of-{world:05}.safetensors"))
}

fn write(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    meta: Option<HashMap<String, String>>,
) -> Result<()> {
    let raw: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, d)| d.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&raw)
        .map(|((name, shape, _), r)| {
            TensorView::new(Dtype::F32, shape.clone(), r)
                .map(|v| (name.clone(), v))
                .map_err(err)
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, meta, path).map_err(err)
}

type Metadata = Option<HashMap<String, String>>;

fn read(path: &Path) -> Result<(HashMap<String, Vec<f32>>, Metadata)> {
    let bytes = std::fs::read(path).map_err(|e| err(format!("{}: {e}", path.display())))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(err)?;
    let meta = header.metadata().clone();
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(err)?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(err(format!("{}: `{name}` is not f32", path.display())));
        }
        let data = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        out.insert(name, data);
    }
    Ok((out, meta))
}

/// Every piece of a sharded checkpoint, by parameter path.
struct Pieces {
    by_path: HashMap<String, Vec<OldPiece>>,
}

/// State leaves (name, values) and scalars of one stored piece.
type OldState = (Vec<(String, Vec<f32>)>, Vec<(String, Scalar)>);

struct OldPiece {
    range: Range<usize>,
    values: Vec<f32>,
    state: Option<OldState>,
}

impl Pieces {
    fn load(dir: &Path) -> Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| err(format!("{}: {e}", dir.display())))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("rank-") && n.ends_with(".safetensors"))
            })
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(err(format!("{}: no shard files", dir.display())));
        }
        let mut by_path: HashMap<String, Vec<OldPiece>> = HashMap::new();
        let mut world = None;
        for f in &files {
            let (mut tensors, meta) = read(f)?;
            let meta: ShardMeta = serde_json::from_str(
                meta.as_ref()
                    .and_then(|m| m.get("zero"))
                    .ok_or_else(|| err(format!("{}: no metadata", f.display())))?,
            )
            .map_err(err)?;
            if *world.get_or_insert(meta.world) != meta.world || files.len() != meta.world {
                return Err(err(format!(
                    "{}: {} files for a world of {}",
                    dir.display(),
                    files.len(),
                    meta.world
                )));
            }
            for p in meta.pieces {
                let key = |prefix: &str| format!("{prefix}/{}/{}", p.path, p.start);
                let values = tensors
                    .remove(&key("param"))
                    .ok_or_else(|| err(format!("missing {}", key("param"))))?;
                let state = if p.state {
                    let leaves = p
                        .state_leaves
                        .iter()
                        .map(|l| {
                            let k = key(&format!("state/{l}"));
                            tensors
                                .remove(&k)
                                .map(|v| (l.clone(), v))
                                .ok_or_else(|| err(format!("missing {k}")))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let scalars = p
                        .scalars
                        .iter()
                        .map(|(k, v)| Ok((k.clone(), scalar_from_string(v)?)))
                        .collect::<Result<Vec<_>>>()?;
                    Some((leaves, scalars))
                } else {
                    None
                };
                by_path.entry(p.path.clone()).or_default().push(OldPiece {
                    range: p.start..p.end,
                    values,
                    state,
                });
            }
        }
        Ok(Self { by_path })
    }

    fn overlapping(&self, path: &str, r: &Range<usize>) -> Result<Vec<&OldPiece>> {
        let list = self
            .by_path
            .get(path)
            .ok_or_else(|| err(format!("the checkpoint has no parameter `{path}`")))?;
        let found: Vec<&OldPiece> = list
            .iter()
            .filter(|p| p.range.start < r.end && r.start < p.range.end)
            .collect();
        let covered: usize = found
            .iter()
            .map(|p| p.range.end.min(r.end) - p.range.start.max(r.start))
            .sum();
        if covered != r.len() {
            return Err(err(format!(
                "`{path}` elements {r:?} are not covered by the checkpoint"
            )));
        }
        Ok(found)
    }

    /// Elements `r` of parameter `path`.
    fn values(&self, path: &str, r: Range<usize>) -> Result<Vec<f32>> {
        let mut out = vec![0.0; r.len()];
        for p in self.overlapping(path, &r)? {
            let (s, e) = (p.range.start.max(r.start), p.range.end.min(r.end));
            out[s - r.start..e - r.start]
                .copy_from_slice(&p.values[s - p.range.start..e - p.range.start]);
        }
        Ok(out)
    }

    /// The optimizer state of elements `r` of `path` (None when any old piece had none).
    fn state(&self, path: &str, r: Range<usize>) -> Result<Option<FlatState>> {
        let found = self.overlapping(path, &r)?;
        let Some(first) = found.first().and_then(|p| p.state.as_ref()) else {
            return Ok(None);
        };
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = first
            .0
            .iter()
            .map(|(l, _)| (l.clone(), vec![r.len()], vec![0.0; r.len()]))
            .collect();
        for p in &found {
            let Some((leaves, _)) = &p.state else {
                return Ok(None);
            };
            let (s, e) = (p.range.start.max(r.start), p.range.end.min(r.end));
            for (t, (l, v)) in tensors.iter_mut().zip(leaves) {
                if &t.0 != l {
                    return Err(err(format!("`{path}`: state leaves differ between pieces")));
                }
                t.2[s - r.start..e - r.start]
                    .copy_from_slice(&v[s - p.range.start..e - p.range.start]);
            }
        }
        Ok(Some(FlatState {
            tensors,
            scalars: first.1.clone(),
        }))
    }
}

impl<M: Module> Zero<M> {
    /// This file format knows one partition: a wrapper with expert shards checkpoints through
    /// `bonfire-train`'s checkpoints (which place every slice in the whole tensors).
    fn refuse_experts(&self, what: &str) -> Result<()> {
        match self.experts.is_some() {
            true => Err(ZeroError::Usage(format!(
                "{what}: this format has no place for expert parallelism's shards; use \
                 bonfire_train::checkpoint"
            ))),
            false => Ok(()),
        }
    }

    /// Writes every parameter in full to `path` (safetensors, module paths), from rank 0.
    /// A collective (parameters are gathered at stage 3).
    pub fn save_consolidated(&self, path: impl AsRef<Path>) -> Result<()> {
        self.refuse_experts("save_consolidated")?;
        let flat = plane::to_host(self.full_tensor()?, Reason::Checkpoint);
        if self.pg.rank() == 0 {
            let tensors: Vec<_> = self
                .infos
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let r = self.part.offsets[i]..self.part.offsets[i + 1];
                    (p.path.clone(), p.shape.clone(), flat[r].to_vec())
                })
                .collect();
            let path = path.as_ref();
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(err)?;
            }
            write(path, &tensors, None)?;
        }
        self.pg.barrier()?;
        Ok(())
    }

    /// Writes this rank's pieces (values and optimizer state) to `dir`; every rank writes its
    /// own file. A collective (a barrier at the end).
    pub fn save_sharded(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.refuse_experts("save_sharded")?;
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(err)?;
        let own = self.own_range();
        let values = self
            .own_master()
            .map_or_else(Vec::new, |t| plane::to_host(t, Reason::Checkpoint));
        let mut tensors = Vec::new();
        let mut pieces = Vec::new();
        let write_rank = self.config.stage != ZeroStage::Zero0 || self.pg.rank() == 0;
        for (k, piece) in self.optim.pieces.iter().enumerate() {
            let path = &self.infos[piece.param].path;
            let name = |prefix: &str| format!("{prefix}/{path}/{}", piece.within.start);
            let r = piece.flat.start - own.start..piece.flat.end - own.start;
            tensors.push((name("param"), vec![r.len()], values[r.clone()].to_vec()));
            let state = self.optim.export(k);
            let mut meta = PieceMeta {
                path: path.clone(),
                start: piece.within.start,
                end: piece.within.end,
                state: state.is_some(),
                state_leaves: Vec::new(),
                scalars: BTreeMap::new(),
            };
            if let Some(st) = state {
                for (leaf, _, v) in st.tensors {
                    if v.len() != r.len() {
                        return Err(err(format!(
                            "optimizer state `{leaf}` of `{path}` is not element-wise ({} values for {} elements): sharded checkpoints need an element-wise optimizer",
                            v.len(),
                            r.len()
                        )));
                    }
                    tensors.push((name(&format!("state/{leaf}")), vec![v.len()], v));
                    meta.state_leaves.push(leaf);
                }
                for (leaf, s) in st.scalars {
                    meta.scalars.insert(leaf, scalar_to_string(&s));
                }
            }
            pieces.push(meta);
        }
        // Stage 0 replicates everything: rank 0 writes the one file.
        let world = if self.config.stage == ZeroStage::Zero0 {
            1
        } else {
            self.pg.size()
        };
        if write_rank {
            let meta = ShardMeta {
                world,
                rank: if world == 1 { 0 } else { self.pg.rank() },
                stage: self.config.stage.index(),
                steps: self.steps,
                pieces,
            };
            let mut m = HashMap::new();
            m.insert(
                "zero".to_string(),
                serde_json::to_string(&meta).map_err(err)?,
            );
            write(&shard_file(dir, meta.rank, world), &tensors, Some(m))?;
        }
        self.pg.barrier()?;
        Ok(())
    }

    /// Loads a sharded checkpoint written by any number of ranks at any stage: this rank's
    /// parameters (all of them at stages 0–2, its range at 3) and the optimizer state of its
    /// pieces. Every rank reads the files it needs; a collective (barrier).
    pub fn load_sharded(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        self.refuse_experts("load_sharded")?;
        let store = Pieces::load(dir.as_ref())?;
        let infos = self.infos.clone();
        let values = if self.config.stage == ZeroStage::Zero3 {
            let mut values = Vec::with_capacity(self.own_range().len());
            for piece in &self.optim.pieces {
                values.extend(store.values(&infos[piece.param].path, piece.within.clone())?);
            }
            values
        } else {
            let mut flat = Vec::with_capacity(self.part.total());
            for p in infos.iter() {
                flat.extend(store.values(&p.path, 0..p.numel())?);
            }
            flat
        };
        let states = self
            .optim
            .pieces
            .iter()
            .map(|piece| store.state(&infos[piece.param].path, piece.within.clone()))
            .collect::<Result<Vec<_>>>()?;
        self.load_state(values, states)?;
        self.pg.barrier()?;
        Ok(())
    }

    /// Installs parameter values and optimizer state from outside (a checkpoint): `values`
    /// are fp32, this rank's range of the flat vector at stage 3 and the whole flat vector at
    /// stages 0–2 (every rank of the group passing the same); `states` are the state of each
    /// of the optimizer's pieces ([`ShardOptimizer::pieces`](crate::ShardOptimizer::pieces)),
    /// all `None` for a fresh optimizer. No communication; call it between steps.
    pub fn load_state(&mut self, values: Vec<f32>, states: Vec<Option<FlatState>>) -> Result<()> {
        let want = if self.config.stage == ZeroStage::Zero3 {
            self.own_range().len()
        } else {
            self.part.total()
        };
        if values.len() != want || states.len() != self.optim.pieces.len() {
            return Err(err(format!(
                "load_state: {} values and {} piece states for {want} values and {} pieces",
                values.len(),
                states.len(),
                self.optim.pieces.len()
            )));
        }
        let n = values.len();
        let t = plane::from_host(values, [n], &self.device, Reason::Checkpoint);
        if self.config.stage == ZeroStage::Zero3 {
            self.set_shard(Some(t));
        } else {
            self.set_full_values(t);
        }
        self.optim.import(states)?;
        self.grads = None;
        Ok(())
    }
}
