//! What a rank believes a collective call is, so that ranks can compare notes.
//!
//! Every collective carries a [`Fingerprint`]. Backends exchange fingerprints when ranks meet;
//! if any field differs the call fails on every rank with both views in the error, instead of
//! silently combining unrelated buffers (or hanging when sizes differ).

use crate::{DType, ReduceOp};
use std::fmt;

/// The kind of a communication call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpKind {
    /// Every rank gets the reduction of every rank's buffer.
    AllReduce,
    /// Every rank gets the root's buffer.
    Broadcast,
    /// The root gets the reduction of every rank's buffer.
    Reduce,
    /// Every rank gets every rank's buffer, concatenated in rank order.
    AllGather,
    /// Each rank gets the reduction of its piece of every rank's buffer.
    ReduceScatter,
    /// Each rank sends a piece to every rank and receives one from every rank.
    AllToAll,
    /// Waits until every rank has entered; moves no data.
    Barrier,
    /// Point-to-point: sends a message to one rank.
    Send,
    /// Point-to-point: receives a message from one rank.
    Recv,
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::Barrier => "barrier",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
        };
        f.write_str(s)
    }
}

/// One rank's description of a call. Two ranks taking part in the same call must produce equal
/// fingerprints (for send/recv: equal except `op`, which is `Send` on one side and `Recv` on
/// the other).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    /// Position of the call in this group's sequence of collectives (0-based); for send/recv,
    /// the position in the (source, destination, tag) channel.
    pub seq: u64,
    /// The kind of call (`Send` or `Recv` for point-to-point).
    pub op: OpKind,
    /// Element type of the data moved (u8 for a barrier).
    pub dtype: DType,
    /// The element count every rank must agree on: the buffer length for all_reduce /
    /// broadcast / reduce, the total (gathered / scattered) length for all_gather /
    /// reduce_scatter, the message length for send/recv, 0 for a barrier.
    pub count: u64,
    /// A digest of per-rank counts for the uneven forms (0 for the even forms). For
    /// all_to_all it digests this rank's row of the exchange; backends check pairs instead.
    pub layout: u64,
    /// Root rank of a broadcast or reduce (`None` for the other calls).
    pub root: Option<u32>,
    /// Reduce op of an all_reduce, reduce or reduce_scatter (`None` for the other calls).
    pub reduce_op: Option<ReduceOp>,
    /// The message tag (send/recv only).
    pub tag: Option<u64>,
}

impl Fingerprint {
    /// Compares two fingerprints of what should be the same call; send/recv pairs match
    /// when everything but the direction agrees.
    pub fn matches(&self, other: &Fingerprint) -> bool {
        let same_except_op = Fingerprint {
            op: self.op,
            ..*other
        } == *self;
        let p2p_pair = matches!(
            (self.op, other.op),
            (OpKind::Send, OpKind::Recv) | (OpKind::Recv, OpKind::Send)
        );
        same_except_op && (self.op == other.op || p2p_pair)
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} {}", self.seq, self.op)?;
        if self.op != OpKind::Barrier {
            write!(f, " {}x{}", self.count, self.dtype)?;
        }
        if self.layout != 0 {
            write!(f, " layout={:016x}", self.layout)?;
        }
        if let Some(root) = self.root {
            write!(f, " root={root}")?;
        }
        if let Some(op) = self.reduce_op {
            write!(f, " op={op}")?;
        }
        if let Some(tag) = self.tag {
            write!(f, " tag={tag}")?;
        }
        Ok(())
    }
}

/// A stable 64-bit digest of a list of counts (FNV-1a), used in [`Fingerprint::layout`].
pub fn digest_counts(counts: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &c in counts {
        for b in (c as u64).to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
