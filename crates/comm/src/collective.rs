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
    AllReduce { buf: BufMut<'a>, op: ReduceOp },
    /// Every rank ends with `root`'s `buf`.
    Broadcast { buf: BufMut<'a>, root: usize },
    /// `root`'s `buf` ends with the reduction; other ranks' buffers are left unchanged.
    Reduce {
        buf: BufMut<'a>,
        op: ReduceOp,
        root: usize,
    },
    /// `recv` is the concatenation of every rank's `send`, in rank order. With `counts`,
    /// rank r contributes `counts[r]` elements.
    AllGather {
        send: BufRef<'a>,
        recv: BufMut<'a>,
        counts: Counts<'a>,
    },
    /// `send` is split in rank order (by `counts` when given); rank r receives the reduction
    /// of every rank's r-th piece.
    ReduceScatter {
        send: BufRef<'a>,
        recv: BufMut<'a>,
        op: ReduceOp,
        counts: Counts<'a>,
    },
    /// Rank r sends piece j of `send` to rank j and stores the piece from rank j at position
    /// j of `recv`. Uneven: `send_counts[j]` elements go to j, `recv_counts[j]` come from j.
    AllToAll {
        send: BufRef<'a>,
        recv: BufMut<'a>,
        counts: Option<AllToAllCounts<'a>>,
    },
    /// Returns once every rank has entered.
    Barrier,
}

/// Per-peer counts of an uneven all-to-all.
#[derive(Debug, Clone, Copy)]
pub struct AllToAllCounts<'a> {
    pub send: &'a [usize],
    pub recv: &'a [usize],
}

impl Collective<'_> {
    /// The kind of this call.
    pub fn kind(&self) -> OpKind {
        match self {
            Collective::AllReduce { .. } => OpKind::AllReduce,
            Collective::Broadcast { .. } => OpKind::Broadcast,
            Collective::Reduce { .. } => OpKind::Reduce,
            Collective::AllGather { .. } => OpKind::AllGather,
            Collective::ReduceScatter { .. } => OpKind::ReduceScatter,
            Collective::AllToAll { .. } => OpKind::AllToAll,
            Collective::Barrier => OpKind::Barrier,
        }
    }

    /// The element type moved (f32 for a barrier, which moves nothing).
    pub fn dtype(&self) -> DType {
        match self {
            Collective::AllReduce { buf, .. }
            | Collective::Broadcast { buf, .. }
            | Collective::Reduce { buf, .. } => buf.dtype(),
            Collective::AllGather { send, .. }
            | Collective::ReduceScatter { send, .. }
            | Collective::AllToAll { send, .. } => send.dtype(),
            Collective::Barrier => DType::U8,
        }
    }

    /// Checks this rank's arguments for a group of `size` ranks in which it is `rank`.
    /// Returns a message describing the first problem found.
    pub fn validate(&self, rank: usize, size: usize) -> Result<(), String> {
        let check_root = |root: usize| {
            if root >= size {
                Err(format!(
                    "root {root} is out of range for a group of {size} ranks"
                ))
            } else {
                Ok(())
            }
        };
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
        match self {
            Collective::AllReduce { .. } | Collective::Barrier => Ok(()),
            Collective::Broadcast { root, .. } | Collective::Reduce { root, .. } => {
                check_root(*root)
            }
            Collective::AllGather { send, recv, counts } => {
                same_dtype(send.dtype(), recv.dtype())?;
                match counts {
                    None => expect_len("recv", recv.len(), send.len() * size, "send.len() × ranks"),
                    Some(counts) => {
                        check_counts(counts, "counts")?;
                        expect_len("send", send.len(), counts[rank], "counts[rank]")?;
                        expect_len("recv", recv.len(), counts.iter().sum(), "sum(counts)")
                    }
                }
            }
            Collective::ReduceScatter {
                send, recv, counts, ..
            } => {
                same_dtype(send.dtype(), recv.dtype())?;
                match counts {
                    None => expect_len("send", send.len(), recv.len() * size, "recv.len() × ranks"),
                    Some(counts) => {
                        check_counts(counts, "counts")?;
                        expect_len("recv", recv.len(), counts[rank], "counts[rank]")?;
                        expect_len("send", send.len(), counts.iter().sum(), "sum(counts)")
                    }
                }
            }
            Collective::AllToAll { send, recv, counts } => {
                same_dtype(send.dtype(), recv.dtype())?;
                match counts {
                    None => {
                        expect_len("recv", recv.len(), send.len(), "send.len()")?;
                        if send.len() % size != 0 {
                            return Err(format!(
                                "send length {} is not divisible by the {size} ranks \
                                 (use the uneven form with explicit counts)",
                                send.len()
                            ));
                        }
                        Ok(())
                    }
                    Some(c) => {
                        check_counts(c.send, "send_counts")?;
                        check_counts(c.recv, "recv_counts")?;
                        expect_len("send", send.len(), c.send.iter().sum(), "sum(send_counts)")?;
                        expect_len("recv", recv.len(), c.recv.iter().sum(), "sum(recv_counts)")
                    }
                }
            }
        }
    }

    /// The fingerprint of this call at position `seq` (after [`Collective::validate`]).
    pub fn fingerprint(&self, seq: u64, size: usize) -> Fingerprint {
        let (count, layout, root, reduce_op) = match self {
            Collective::AllReduce { buf, op } => (buf.len(), 0, None, Some(*op)),
            Collective::Broadcast { buf, root } => (buf.len(), 0, Some(*root), None),
            Collective::Reduce { buf, op, root } => (buf.len(), 0, Some(*root), Some(*op)),
            Collective::AllGather { recv, counts, .. } => {
                (recv.len(), counts.map_or(0, digest_counts), None, None)
            }
            Collective::ReduceScatter {
                send, op, counts, ..
            } => (send.len(), counts.map_or(0, digest_counts), None, Some(*op)),
            // Per-rank totals legitimately differ in an uneven all-to-all; backends check that
            // every (sender, receiver) pair agrees instead. The layout marks the form, so an
            // even call can never be paired with an uneven one (even with empty buffers).
            Collective::AllToAll { send, counts, .. } => match counts {
                None => (send.len() * size, 0, None, None),
                Some(_) => (0, UNEVEN_ALL_TO_ALL, None, None),
            },
            Collective::Barrier => (0, 0, None, None),
        };
        Fingerprint {
            seq,
            op: self.kind(),
            dtype: self.dtype(),
            count: count as u64,
            layout,
            root: root.map(|r| r as u32),
            reduce_op,
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
