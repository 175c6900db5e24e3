//! The per-group scratch memory of the MPI backend: handshake buffers, widened 16-bit floats,
//! ring receive space and count arrays, kept in one place and reused by every call so that
//! collectives allocate nothing in steady state.

use super::runtime::Request;
use crate::wire;
use std::os::raw::c_int;

/// Reused scratch memory of one group (no allocation in steady state).
#[derive(Default)]
pub(crate) struct Scratch {
    /// f32 scratch for widened 16-bit floats, and ring receive space (as u64 for alignment).
    pub(super) a: Vec<u64>,
    pub(super) b: Vec<u64>,
    pub(super) ints: Vec<c_int>,
    pub(super) offsets: Vec<usize>,
    pub(super) matrix: Vec<u64>,
    /// Handshake buffers: this rank's notice and one per peer.
    pub(super) mine: Box<wire::Words>,
    pub(super) theirs: Vec<wire::Words>,
    pub(super) reqs: Vec<Request>,
    pub(super) peers: Vec<usize>,
}

pub(super) fn words_for(bytes: usize) -> usize {
    bytes.div_ceil(8)
}

pub(super) fn grow(v: &mut Vec<u64>, bytes: usize) -> &mut [u8] {
    let words = words_for(bytes);
    if v.len() < words {
        v.resize(words, 0);
    }
    &mut bytemuck::cast_slice_mut::<u64, u8>(v)[..bytes]
}
