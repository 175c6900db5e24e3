//! Fixed-size encoding of a [`Fingerprint`] (and of control notices) as eight `u64` words
//! (shared by the MPI and NCCL backends),
//! the unit ranks exchange before every collective and in front of every message.

#![cfg_attr(not(feature = "mpi"), allow(dead_code))]

use crate::{DType, Fingerprint, OpKind, ReduceOp};

/// Words in one encoded notice.
pub(crate) const WORDS: usize = 8;
/// Bytes in one encoded notice.
pub(crate) const BYTES: usize = WORDS * 8;

/// What an encoded notice is.
const KIND_CALL: u64 = 0xB0F1_0001;
const KIND_EXIT: u64 = 0xB0F1_0002;

pub(crate) type Words = [u64; WORDS];

fn op_code(op: OpKind) -> u64 {
    match op {
        OpKind::AllReduce => 0,
        OpKind::Broadcast => 1,
        OpKind::Reduce => 2,
        OpKind::AllGather => 3,
        OpKind::ReduceScatter => 4,
        OpKind::AllToAll => 5,
        OpKind::Barrier => 6,
        OpKind::Send => 7,
        OpKind::Recv => 8,
    }
}

const OPS: [OpKind; 9] = [
    OpKind::AllReduce,
    OpKind::Broadcast,
    OpKind::Reduce,
    OpKind::AllGather,
    OpKind::ReduceScatter,
    OpKind::AllToAll,
    OpKind::Barrier,
    OpKind::Send,
    OpKind::Recv,
];

fn dtype_code(d: DType) -> u64 {
    DType::ALL.iter().position(|&x| x == d).unwrap_or(0) as u64
}

fn reduce_code(op: Option<ReduceOp>) -> u64 {
    op.map_or(0, |op| {
        ReduceOp::ALL.iter().position(|&x| x == op).unwrap_or(0) as u64 + 1
    })
}

/// Encodes a call's fingerprint.
pub(crate) fn encode(fp: &Fingerprint) -> Words {
    let flags = op_code(fp.op)
        | dtype_code(fp.dtype) << 8
        | reduce_code(fp.reduce_op) << 16
        | (fp.root.is_some() as u64) << 24
        | (fp.tag.is_some() as u64) << 25;
    [
        KIND_CALL,
        fp.seq,
        flags,
        fp.count,
        fp.layout,
        fp.root.unwrap_or(0) as u64,
        fp.tag.unwrap_or(0),
        0,
    ]
}

/// The notice a rank sends to every peer when it shuts down normally.
pub(crate) fn exit_notice(world_rank: usize) -> Words {
    [KIND_EXIT, world_rank as u64, 0, 0, 0, 0, 0, 0]
}

/// Decodes a call's fingerprint; `None` if the words are not one.
pub(crate) fn decode(w: &Words) -> Option<Fingerprint> {
    if w[0] != KIND_CALL {
        return None;
    }
    let flags = w[2];
    let op = *OPS.get((flags & 0xff) as usize)?;
    let dtype = *DType::ALL.get(((flags >> 8) & 0xff) as usize)?;
    let reduce = (flags >> 16) & 0xff;
    let reduce_op = match reduce {
        0 => None,
        r => Some(*ReduceOp::ALL.get(r as usize - 1)?),
    };
    Some(Fingerprint {
        seq: w[1],
        op,
        dtype,
        count: w[3],
        layout: w[4],
        root: ((flags >> 24) & 1 == 1).then_some(w[5] as u32),
        reduce_op,
        tag: ((flags >> 25) & 1 == 1).then_some(w[6]),
    })
}

/// Writes `w` as little-endian bytes into `out[..BYTES]`.
pub(crate) fn to_bytes(w: &Words, out: &mut [u8]) {
    for (chunk, word) in out[..BYTES].chunks_exact_mut(8).zip(w) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
}

/// Reads words from `bytes[..BYTES]`.
pub(crate) fn from_bytes(bytes: &[u8]) -> Option<Words> {
    if bytes.len() < BYTES {
        return None;
    }
    let mut w = [0u64; WORDS];
    for (word, chunk) in w.iter_mut().zip(bytes[..BYTES].chunks_exact(8)) {
        *word = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
    }
    Some(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_round_trip() {
        for (i, op) in OPS.iter().enumerate() {
            for dtype in DType::ALL {
                let fp = Fingerprint {
                    seq: 41 + i as u64,
                    op: *op,
                    dtype,
                    count: 1 << 33,
                    layout: 0xdead_beef_0123_4567,
                    root: (i % 2 == 0).then_some(3),
                    reduce_op: ReduceOp::ALL.get(i).copied(),
                    tag: (i % 3 == 0).then_some(u64::MAX - 1),
                };
                let mut bytes = [0u8; BYTES];
                to_bytes(&encode(&fp), &mut bytes);
                assert_eq!(decode(&from_bytes(&bytes).unwrap()), Some(fp));
            }
        }
        assert_eq!(decode(&exit_notice(3)), None);
    }
}
