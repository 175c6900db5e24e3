//! Distributed checkpoints of the whole training state, in any layout, resumable on any other
//! (PyTorch Distributed Checkpoint's shape: every rank writes what it owns, rank 0 an index).
//!
//! - Save: [`Checkpointer`] is the training loop's checkpoint hook ([`crate::Hooks`]): each
//!   rank writes only its own slices of every parameter and of the optimizer state (a
//!   safetensors file, in a background thread after a host copy); rank 0 writes the index
//!   ([`Index`]: model fingerprint and global shapes, where each slice of each tensor lies,
//!   checksums, step, layout, optimizer) last, and a rename makes the checkpoint visible. The
//!   last K are kept.
//! - Load: [`resume`] reads into an engine of any layout and world size, each rank reading
//!   only the byte ranges its own slices need ([`Region`]s intersected), every block checked;
//!   every error is found, and agreed on by all ranks, before any state changes.
//! - Export: [`Checkpoint::export_consolidated`] (from a checkpoint on disk) and
//!   [`save_consolidated`] (from a live engine) write every parameter whole to one
//!   safetensors file.
//!
//! What the checkpoint asks of an engine is [`Stateful`] (the trainer's engines implement
//! it), so that this module stands below them. See `docs/checkpoint.md`.

mod files;
mod index;
mod load;
mod save;
mod source;
mod state;

pub use files::Fault;
pub use index::{
    ChunkRecord, FileRecord, Index, LayoutRecord, ModelRecord, ParamRecord, ScalarValue,
    TensorRecord,
};
pub use load::{Checkpoint, Resumed, resume};
pub use save::{CheckpointConfig, Checkpointer};
pub use source::{LoadedParameters, load_parameters};
pub use state::{Loaded, RankState, Slice, Stateful, Wants};

pub use crate::error::CheckpointError;
use crate::error::TrainError;
use bonfire_comm::ProcessGroup;
use std::path::Path;

/// Every rank's `s`, in rank order (a collective).
pub(crate) fn gather_strings(pg: &ProcessGroup, s: &str) -> Result<Vec<String>, TrainError> {
    let mut lens = vec![0i64; pg.size()];
    pg.all_gather(&[s.len() as i64], &mut lens)?;
    let counts: Vec<usize> = lens.iter().map(|&n| n as usize).collect();
    let mut all = vec![0u8; counts.iter().sum()];
    pg.all_gather_uneven(s.as_bytes(), &mut all, &counts)?;
    let mut at = 0;
    Ok(counts
        .iter()
        .map(|&n| {
            let s = String::from_utf8_lossy(&all[at..at + n]).into_owned();
            at += n;
            s
        })
        .collect())
}

/// Every rank's outcome, agreed on (a collective): `Ok` on every rank when every rank
/// succeeded; otherwise an error on every rank — a failed rank's own, the others' quoting
/// every failure.
pub(crate) fn agree<T>(
    pg: &ProcessGroup,
    outcome: Result<T, CheckpointError>,
) -> Result<T, TrainError> {
    let mine = outcome
        .as_ref()
        .err()
        .map(ToString::to_string)
        .unwrap_or_default();
    let all = gather_strings(pg, &mine)?;
    let failed: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, e)| !e.is_empty())
        .map(|(r, e)| format!("rank {r}: {e}"))
        .collect();
    match outcome {
        Err(e) => Err(e.into()),
        Ok(_) if !failed.is_empty() => Err(CheckpointError::Failed(failed.join("; ")).into()),
        Ok(v) => Ok(v),
    }
}

/// Writes every parameter of `engine` whole to one safetensors file at `path` (names: the
/// model's parameter paths), from rank 0, atomically. A collective (parameters are gathered).
pub fn save_consolidated(
    engine: &mut (impl Stateful + ?Sized),
    path: impl AsRef<Path>,
) -> Result<(), TrainError> {
    let params = engine.parameters()?;
    let written = match engine.world().rank() {
        0 => load::write_consolidated(path.as_ref(), &params),
        _ => Ok(()),
    };
    agree(engine.world(), written)
}
