//! The collective calls, described as data.
//!
//! A [`Collective`] bundles a call's buffers and arguments. The generic layer
//! ([`ProcessGroup`](crate::ProcessGroup)) validates it and derives its
//! [`Fingerprint`] once, so every backend gets the same argument checks and the same
//! mismatch detection for free; backends only move the bytes.

use crate::fingerprint::digest_counts;
use crate::{BufMut, BufRef, DType, Fingerprint, OpKind, ReduceOp};

/// [`Fingerprint::layout`] of every uneven all-to-all.
pub const UNEVEN_ALL_TO_ALL: u64 = 0x0a11_2a11_0e0e_0001;

/// Per-rank element counts of an uneven call, or `None` when every rank has the same count.
pub type Counts<'a> = Option<&'a [usize]>;

/// One collective call with its buffers.
///
/// Uneven forms pass per-rank counts; the even forms pass `None` and split buffers equally.
#[derive(Debug)]
pub enum Collective<'a> {
    /// Every rank ends with the reduction of all ranks' `buf`.
    AllReduce {
        /// Each rank's input, overwritten with the result.
        buf: BufMut<'a>,
        /// How the ranks' values combine.
        op: ReduceOp,
    },
    /// Every rank ends with `root`'s `buf`.
    Broadcast {
        /// The root's data to send; every other rank's buffer, overwritten with it.
        buf: BufMut<'a>,
        /// The rank whose buffer is sent.
        root: usize,
    },
    /// `root`'s `buf` ends with the reduction; other ranks' buffers are left unchanged.
    Reduce {
        /// Each rank's input; on `root`, overwritten with the result.
        buf: BufMut<'a>,
        /// How the ranks' values combine.
        op: ReduceOp,
        /// The rank that receives the reduction.
        root: usize,
    },
    /// `recv` is the concatenation of every rank's `send`, in rank order. With `counts`,
    /// rank r contributes `counts[r]` elements.
    AllGather {
        /// This rank's contribution.
        send: BufRef<'a>,
        /// Receives every rank's contribution: `send.len()` × ranks elements, or the sum of
        /// `counts`.
        recv: BufMut<'a>,
        /// Elements contributed by each rank, or `None` when every rank sends `send.len()`.
        counts: Counts<'a>,
    },
    /// `send` is split in rank order (by `counts` when given); rank r receives the reduction
    /// of every rank's r-th piece.
    ReduceScatter {
        /// This rank's full input, every rank's piece in rank order.
        send: BufRef<'a>,
        /// Receives the reduction of this rank's piece.
        recv: BufMut<'a>,
        /// How the ranks' pieces combine.
        op: ReduceOp,
        /// Length of each rank's piece, or `None` when every piece is `recv.len()` long.
        counts: Counts<'a>,
    },
    /// Rank r sends piece j of `send` to rank j and stores the piece from rank j at position
    /// j of `recv`. Uneven: `send_counts[j]` elements go to j, `recv_counts[j]` come from j.
    AllToAll {
        /// The pieces for every rank, in rank order.
        send: BufRef<'a>,
        /// Receives the pieces from every rank, in rank order.
        recv: BufMut<'a>,
        /// Per-peer counts of the uneven form, or `None` to split both buffers evenly.
        counts: Option<AllToAllCounts<'a>>,
    },
    /// Returns once every rank has entered.
    Barrier,
}

/// Per-peer counts of an uneven all-to-all.
#[derive(Debug, Clone, Copy)]
pub struct AllToAllCounts<'a> {
    /// `send[j]`: elements this rank sends to rank `j`.
    pub send: &'a [usize],
    /// `recv[j]`: elements this rank receives from rank `j`.
    pub recv: &'a [usize],
}

impl Collective<'_> {
    /// The kind of this call.
    pub fn kind(&self) -> OpKind {
        self.shape().kind
    }

    /// The element type moved (u8 for a barrier, which moves nothing).
    pub fn dtype(&self) -> DType {
        self.shape().send.0
    }

    /// What checks and fingerprints read of this call.
    pub fn shape(&self) -> Shape<'_> {
        let one = |kind, buf: &BufMut<'_>, root: Option<usize>, op| Shape {
            root,
            op,
            ..Shape::of(kind, (buf.dtype(), buf.len()), (buf.dtype(), buf.len()))
        };
        let two = |kind, send: &BufRef<'_>, recv: &BufMut<'_>| {
            Shape::of(kind, (send.dtype(), send.len()), (recv.dtype(), recv.len()))
        };
        match self {
            Collective::AllReduce { buf, op } => one(OpKind::AllReduce, buf, None, Some(*op)),
            Collective::Broadcast { buf, root } => one(OpKind::Broadcast, buf, Some(*root), None),
            Collective::Reduce { buf, op, root } => {
                one(OpKind::Reduce, buf, Some(*root), Some(*op))
            }
            Collective::AllGather { send, recv, counts } => Shape {
                counts: *counts,
                ..two(OpKind::AllGather, send, recv)
            },
            Collective::ReduceScatter {
                send,
                recv,
                op,
                counts,
            } => Shape {
                counts: *counts,
                op: Some(*op),
                ..two(OpKind::ReduceScatter, send, recv)
            },
            Collective::AllToAll { send, recv, counts } => Shape {
                all_to_all: *counts,
                ..two(OpKind::AllToAll, send, recv)
            },
            Collective::Barrier => Shape::of(OpKind::Barrier, (DType::U8, 0), (DType::U8, 0)),
        }
    }

    /// Checks this rank's arguments for a group of `size` ranks in which it is `rank`.
    /// Returns a message describing the first problem found.
    pub fn validate(&self, rank: usize, size: usize) -> Result<(), String> {
        self.shape().validate(rank, size)
    }

    /// The fingerprint of this call at position `seq` (after [`Collective::validate`]).
    pub fn fingerprint(&self, seq: u64, size: usize) -> Fingerprint {
        self.shape().fingerprint(seq, size)
    }
}

/// What argument checks and fingerprints read of a call — kind, element types and lengths,
/// counts, root, reduce op — the same whether its buffers are host slices ([`Collective`])
/// or device memory ([`crate::DeviceCollective`]).
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    /// Which collective the call is.
    pub kind: OpKind,
    /// Element type and length of the input buffer (the one buffer of an in-place call).
    pub send: (DType, usize),
    /// Element type and length of the output buffer (the same as `send` in place).
    pub recv: (DType, usize),
    /// Per-rank counts of an uneven all-gather or reduce-scatter.
    pub counts: Counts<'a>,
    /// Per-peer counts of an uneven all-to-all.
    pub all_to_all: Option<AllToAllCounts<'a>>,
    /// Root rank of a broadcast or reduce.
    pub root: Option<usize>,
    /// Reduce op of an all-reduce, reduce or reduce-scatter.
    pub op: Option<ReduceOp>,
}

impl Shape<'_> {
    /// A call of `kind` from `send` to `recv` (element type, length), with no counts, root
    /// or reduce op.
    pub fn of(kind: OpKind, send: (DType, usize), recv: (DType, usize)) -> Self {
        Shape {
            kind,
            send,
            recv,
            counts: None,
            all_to_all: None,
            root: None,
            op: None,
        }
    }

    /// Checks the call's arguments for a group of `size` ranks in which it is `rank`.
    pub fn validate(&self, rank: usize, size: usize) -> Result<(), String> {
        let check_counts = |counts: &[usize], what: &str| {
            if counts.len() != size {
                Err(format!(
                    "{what} has {} entries but the group has {size} ranks",
                    counts.len()
                ))
            } else {
                Ok(())
            }
        };
        if let Some(root) = self.root.filter(|&r| r >= size) {
            return Err(format!(
                "root {root} is out of range for a group of {size} ranks"
            ));
        }
        let ((_, send), (_, recv)) = (self.send, self.recv);
        match self.kind {
            OpKind::AllGather => {
                same_dtype(self.send.0, self.recv.0)?;
                match self.counts {
                    None => expect_len("recv", recv, send * size, "send.len() × ranks"),
                    Some(counts) => {
                        check_counts(counts, "counts")?;
                        expect_len("send", send, counts[rank], "counts[rank]")?;
                        expect_len("recv", recv, counts.iter().sum(), "sum(counts)")
                    }
                }
            }
            OpKind::ReduceScatter => {
                same_dtype(self.send.0, self.recv.0)?;
                match self.counts {
                    None => expect_len("send", send, recv * size, "recv.len() × ranks"),
                    Some(counts) => {
                        check_counts(counts, "counts")?;
                        expect_len("recv", recv, counts[rank], "counts[rank]")?;
                        expect_len("send", send, counts.iter().sum(), "sum(counts)")
                    }
                }
            }
            OpKind::AllToAll => {
                same_dtype(self.send.0, self.recv.0)?;
                match self.all_to_all {
                    None => {
                        expect_len("recv", recv, send, "send.len()")?;
                        if send % size != 0 {
                            return Err(format!(
                                "send length {send} is not divisible by the {size} ranks \
                                 (use the uneven form with explicit counts)"
                            ));
                        }
                        Ok(())
                    }
                    Some(c) => {
                        check_counts(c.send, "send_counts")?;
                        check_counts(c.recv, "recv_counts")?;
                        expect_len("send", send, c.send.iter().sum(), "sum(send_counts)")?;
                        expect_len("recv", recv, c.recv.iter().sum(), "sum(recv_counts)")
                    }
                }
            }
            _ => Ok(()),
        }
    }

    /// The fingerprint of the call at position `seq` (after [`Shape::validate`]).
    pub fn fingerprint(&self, seq: u64, size: usize) -> Fingerprint {
        let ((_, send), (_, recv)) = (self.send, self.recv);
        let (count, layout) = match self.kind {
            OpKind::AllGather => (recv, self.counts.map_or(0, digest_counts)),
            OpKind::ReduceScatter => (send, self.counts.map_or(0, digest_counts)),
            // Per-rank totals legitimately differ in an uneven all-to-all; backends check that
            // every (sender, receiver) pair agrees instead. The layout marks the form, so an
            // even call can never be paired with an uneven one (even with empty buffers).
            OpKind::AllToAll => match self.all_to_all {
                None => (send * size, 0),
                Some(_) => (0, UNEVEN_ALL_TO_ALL),
            },
            _ => (send, 0),
        };
        Fingerprint {
            seq,
            op: self.kind,
            dtype: self.send.0,
            count: count as u64,
            layout,
            root: self.root.map(|r| r as u32),
            reduce_op: self.op,
            tag: None,
        }
    }
}

fn same_dtype(a: DType, b: DType) -> Result<(), String> {
    if a != b {
        return Err(format!("send is {a} but recv is {b}"));
    }
    Ok(())
}

fn expect_len(name: &str, actual: usize, expected: usize, rule: &str) -> Result<(), String> {
    if actual != expected {
        return Err(format!(
            "{name} buffer has {actual} elements but must have {expected} ({rule})"
        ));
    }
    Ok(())
}

/// Start offsets of consecutive pieces with the given counts (`offsets[i] = sum(counts[..i])`),
/// written into `out` (cleared first) to avoid allocating in steady state.
pub fn offsets_into(counts: &[usize], out: &mut Vec<usize>) {
    out.clear();
    let mut acc = 0;
    for &c in counts {
        out.push(acc);
        acc += c;
    }
}

/// The piece of rank `r` when `len` elements are split evenly across `size` ranks.
pub fn even_piece(len: usize, size: usize, r: usize) -> std::ops::Range<usize> {
    let piece = len / size;
    r * piece..(r + 1) * piece
}

/// How a backend moves each kind of collective's data once every rank agreed on the call:
/// one method per kind, so that one match ([`Collective::move_with`]) dispatches every
/// backend's calls.
#[cfg(any(feature = "mpi", feature = "nccl"))]
pub(crate) trait MoveData {
    /// The backend's reusable buffers.
    type Scratch;
    /// What every call needs besides its buffers (its context, when it started).
    type Ctx<'c>: Copy;
    /// [`Collective::AllReduce`].
    fn all_reduce(
        &self,
        buf: BufMut<'_>,
        op: ReduceOp,
        s: &mut Self::Scratch,
        c: Self::Ctx<'_>,
    ) -> crate::Result<()>;
    /// [`Collective::Broadcast`].
    fn broadcast(
        &self,
        buf: BufMut<'_>,
        root: usize,
        s: &mut Self::Scratch,
        c: Self::Ctx<'_>,
    ) -> crate::Result<()>;
    /// [`Collective::Reduce`].
    fn reduce(
        &self,
        buf: BufMut<'_>,
        op: ReduceOp,
        root: usize,
        s: &mut Self::Scratch,
        c: Self::Ctx<'_>,
    ) -> crate::Result<()>;
    /// [`Collective::AllGather`].
    fn all_gather(
        &self,
        send: BufRef<'_>,
        recv: BufMut<'_>,
        counts: Counts<'_>,
        s: &mut Self::Scratch,
        c: Self::Ctx<'_>,
    ) -> crate::Result<()>;
    /// [`Collective::ReduceScatter`].
    fn reduce_scatter(
        &self,
        send: BufRef<'_>,
        recv: BufMut<'_>,
        op: ReduceOp,
        counts: Counts<'_>,
        s: &mut Self::Scratch,
        c: Self::Ctx<'_>,
    ) -> crate::Result<()>;
    /// [`Collective::AllToAll`].
    fn all_to_all(
        &self,
        send: BufRef<'_>,
        recv: BufMut<'_>,
        counts: Option<AllToAllCounts<'_>>,
        s: &mut Self::Scratch,
        c: Self::Ctx<'_>,
    ) -> crate::Result<()>;
}

#[cfg(any(feature = "mpi", feature = "nccl"))]
impl Collective<'_> {
    /// Moves this call's data with `backend` (a barrier moves none).
    pub(crate) fn move_with<M: MoveData>(
        self,
        backend: &M,
        s: &mut M::Scratch,
        c: M::Ctx<'_>,
    ) -> crate::Result<()> {
        match self {
            Collective::Barrier => Ok(()),
            Collective::AllReduce { buf, op } => backend.all_reduce(buf, op, s, c),
            Collective::Broadcast { buf, root } => backend.broadcast(buf, root, s, c),
            Collective::Reduce { buf, op, root } => backend.reduce(buf, op, root, s, c),
            Collective::AllGather { send, recv, counts } => {
                backend.all_gather(send, recv, counts, s, c)
            }
            Collective::ReduceScatter {
                send,
                recv,
                op,
                counts,
            } => backend.reduce_scatter(send, recv, op, counts, s, c),
            Collective::AllToAll { send, recv, counts } => {
                backend.all_to_all(send, recv, counts, s, c)
            }
        }
    }
}
