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

mod agree;
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
pub(crate) use agree::{agree, gather_strings};
pub use load::save_consolidated;
