//! Collectives and point-to-point on *device* memory: raw buffers that a backend whose
//! transport reads device memory (NCCL) moves without staging through the host.
//!
//! A [`DeviceBuf`] is an address in the memory of the device the group's backend runs on
//! (for NCCL, a CUDA device pointer on the communicator's device), a length and an element
//! type. A [`DeviceCollective`] describes one call on such buffers; [`ProcessGroup`]
//! validates it and fingerprints it exactly like a host [`Collective`](crate::Collective)
//! (the same [`Shape`]), so mismatches and timeouts are reported the same way. Backends that
//! cannot read device memory say so with [`Backend::takes_device_buffers`] and return
//! [`CommError::Unsupported`](crate::CommError::Unsupported); callers (the dtensor data
//! plane) then stage through the host and count it.
//!
//! Synchronisation: the caller makes sure the device work that writes the input buffers has
//! finished (for a CubeCL tensor, `client.sync()`) before the call; the call returns once the
//! outputs are written (the backend waits on its own stream, against the group's timeout).
//!
//! [`ProcessGroup`]: crate::ProcessGroup
//! [`Backend::takes_device_buffers`]: crate::Backend::takes_device_buffers

use crate::collective::{Counts, Shape};
use crate::{DType, OpKind, ReduceOp};

/// `len` elements of `dtype` at address `ptr` of the backend's device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuf {
    /// Device address of the first element.
    pub ptr: u64,
    /// Number of elements (not bytes).
    pub len: usize,
    /// Element type.
    pub dtype: DType,
}

impl DeviceBuf {
    /// `len` elements of `dtype` starting at device address `ptr`.
    pub fn new(ptr: u64, len: usize, dtype: DType) -> Self {
        Self { ptr, len, dtype }
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
}

/// One collective on device buffers. Outputs are distinct from inputs (out of place), so a
/// caller never has to prove that it owns a tensor's buffer exclusively.
#[derive(Debug, Clone, Copy)]
pub enum DeviceCollective<'a> {
    /// `recv` becomes the reduction of every rank's `send`.
    AllReduce {
        /// This rank's input.
        send: DeviceBuf,
        /// Receives the reduction; same type and length as `send`.
        recv: DeviceBuf,
        /// How the ranks' values combine.
        op: ReduceOp,
    },
    /// Every rank's `recv` becomes `root`'s `send`.
    Broadcast {
        /// The data to send (read on `root` only).
        send: DeviceBuf,
        /// Receives `root`'s data; same type and length as `send`.
        recv: DeviceBuf,
        /// The rank whose `send` is broadcast.
        root: usize,
    },
    /// `recv` becomes every rank's `send` in rank order (`counts[r]` elements from rank `r`).
    AllGather {
        /// This rank's contribution.
        send: DeviceBuf,
        /// Receives every rank's contribution, in rank order.
        recv: DeviceBuf,
        /// Elements contributed by each rank, or `None` when every rank sends `send.len`.
        counts: Counts<'a>,
    },
    /// `send` split in rank order (by `counts`); `recv` becomes the reduction of every
    /// rank's piece `rank`.
    ReduceScatter {
        /// This rank's full input, every rank's piece in rank order.
        send: DeviceBuf,
        /// Receives the reduction of this rank's piece.
        recv: DeviceBuf,
        /// How the ranks' pieces combine.
        op: ReduceOp,
        /// Length of each rank's piece, or `None` when every piece is `recv.len` long.
        counts: Counts<'a>,
    },
}

impl<'a> DeviceCollective<'a> {
    /// What checks and fingerprints read of the call (the host calls' [`Shape`]).
    pub fn shape(&self) -> Shape<'a> {
        let shape = |kind, send: &DeviceBuf, recv: &DeviceBuf| {
            Shape::of(kind, (send.dtype, send.len), (recv.dtype, recv.len))
        };
        match self {
            Self::AllReduce { send, recv, op } => Shape {
                op: Some(*op),
                ..shape(OpKind::AllReduce, send, recv)
            },
            Self::Broadcast { send, recv, root } => Shape {
                root: Some(*root),
                ..shape(OpKind::Broadcast, send, recv)
            },
            Self::AllGather { send, recv, counts } => Shape {
                counts: *counts,
                ..shape(OpKind::AllGather, send, recv)
            },
            Self::ReduceScatter {
                send,
                recv,
                op,
                counts,
            } => Shape {
                counts: *counts,
                op: Some(*op),
                ..shape(OpKind::ReduceScatter, send, recv)
            },
        }
    }

    /// Checks the arguments for a group of `size` ranks in which this rank is `rank`: the
    /// host calls' checks, plus equal input and output for an all-reduce and a broadcast.
    pub fn validate(&self, rank: usize, size: usize) -> Result<(), String> {
        if let Self::AllReduce { send, recv, .. } | Self::Broadcast { send, recv, .. } = self
            && (send.dtype, send.len) != (recv.dtype, recv.len)
        {
            return Err(format!(
                "send ({} × {}) and recv ({} × {}) differ",
                send.len, send.dtype, recv.len, recv.dtype
            ));
        }
        self.shape().validate(rank, size)
    }
}
