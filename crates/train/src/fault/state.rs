//! The training state in memory, as the checkpoint sees it ([`RankState`]: every slice a rank
//! owns, placed in the whole tensor by a [`Region`]) — encoded to bytes so that ranks can
//! hand it to each other (the buddy copy, the survivors' gather), and answered from memory
//! into the slices a rank of another layout [`Wants`]: the checkpoint's "load into another
//! layout", minus the disk.
//!
//! An encoded state is `[u64 header length][JSON header][f32 data, little-endian]`: the header
//! lists the model's parameters and every slice (parameter, region, optimizer leaves and
//! scalars, element counts); the data is every slice's values then its state tensors, in
//! header order.

use crate::checkpoint::{Loaded, RankState, ScalarValue, Slice, Wants};
use crate::error::TrainError;
use bonfire_parallel::Region;
use bonfire_zero::FlatState;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Header {
    params: Vec<(String, Vec<usize>)>,
    slices: Vec<SliceHeader>,
}

#[derive(Serialize, Deserialize)]
struct SliceHeader {
    param: usize,
    region: Region,
    values: usize,
    /// `None`: no optimizer state yet.
    state: Option<StateHeader>,
}

#[derive(Serialize, Deserialize)]
struct StateHeader {
    /// Each state tensor's leaf, shape and element count.
    tensors: Vec<(String, Vec<usize>, usize)>,
    scalars: Vec<(String, ScalarValue)>,
}

fn corrupt(what: &str) -> TrainError {
    TrainError::Io(format!(
        "fault tolerance: an in-memory state copy is damaged ({what})"
    ))
}

/// `state` as bytes.
pub(crate) fn encode(state: &RankState) -> Vec<u8> {
    let header = Header {
        params: state.params.clone(),
        slices: state
            .slices
            .iter()
            .map(|s| SliceHeader {
                param: s.param,
                region: s.region.clone(),
                values: s.values.len(),
                state: s.state.as_ref().map(|st| {
                    let tensors = st
                        .tensors
                        .iter()
                        .map(|(leaf, shape, v)| (leaf.clone(), shape.clone(), v.len()))
                        .collect();
                    let scalars = st
                        .scalars
                        .iter()
                        .map(|(k, v)| (k.clone(), ScalarValue::from(*v)))
                        .collect();
                    StateHeader { tensors, scalars }
                }),
            })
            .collect(),
    };
    let header = serde_json::to_vec(&header).expect("a header serializes");
    let floats: usize = state.slices.iter().map(slice_floats).sum();
    let mut out = Vec::with_capacity(8 + header.len() + 4 * floats);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    for s in &state.slices {
        put(&mut out, &s.values);
        for (_, _, v) in s.state.iter().flat_map(|st| &st.tensors) {
            put(&mut out, v);
        }
    }
    out
}

fn slice_floats(s: &Slice) -> usize {
    s.values.len() + s.state.as_ref().map_or(0, |st| st.bytes() / 4)
}

fn put(out: &mut Vec<u8>, values: &[f32]) {
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// The state encoded by [`encode`].
pub(crate) fn decode(bytes: &[u8]) -> Result<RankState, TrainError> {
    let len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .ok_or_else(|| corrupt("no header"))?;
    let header: Header = bytes
        .get(8..8 + len)
        .and_then(|h| serde_json::from_slice(h).ok())
        .ok_or_else(|| corrupt("unreadable header"))?;
    let mut data = bytes[8 + len..].chunks_exact(4);
    let mut take = |n: usize| -> Result<Vec<f32>, TrainError> {
        let v: Vec<f32> = data
            .by_ref()
            .take(n)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        (v.len() == n)
            .then_some(v)
            .ok_or_else(|| corrupt("short data"))
    };
    let mut slices = Vec::with_capacity(header.slices.len());
    for h in header.slices {
        let values = take(h.values)?;
        let state = match h.state {
            None => None,
            Some(StateHeader { tensors, scalars }) => Some(FlatState {
                tensors: tensors
                    .into_iter()
                    .map(|(leaf, shape, n)| Ok((leaf, shape, take(n)?)))
                    .collect::<Result<_, TrainError>>()?,
                scalars: scalars.into_iter().map(|(k, v)| (k, v.into())).collect(),
            }),
        };
        slices.push(Slice {
            param: h.param,
            region: h.region,
            values,
            state,
        });
    }
    Ok(RankState {
        params: header.params,
        slices,
    })
}

/// `buf` as length-prefixed frames (several encoded states in one buffer).
pub(crate) fn frames(buf: &[u8]) -> Result<Vec<&[u8]>, TrainError> {
    let mut out = Vec::new();
    let mut rest = buf;
    while !rest.is_empty() {
        let len = rest
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| corrupt("a frame without its length"))?;
        let frame = rest
            .get(8..8 + len)
            .ok_or_else(|| corrupt("a short frame"))?;
        out.push(frame);
        rest = &rest[8 + len..];
    }
    Ok(out)
}

/// Appends `bytes` to `buf` as one frame.
pub(crate) fn push_frame(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// The slices `wants` asks for, cut from `have` (the survivors' states together): each wanted
/// region assembled from every slice of the same parameter that overlaps it. Fails, naming
/// the tensor, when the slices do not cover a wanted region.
pub(crate) fn answer(have: &[RankState], wants: &Wants) -> Result<Loaded, TrainError> {
    let model = have
        .iter()
        .find(|s| !s.params.is_empty())
        .map(|s| &s.params);
    if let Some(params) = model.filter(|p| **p != wants.params) {
        return Err(TrainError::Model(format!(
            "the survivors' state is of another model ({} parameters, the engine has {})",
            params.len(),
            wants.params.len()
        )));
    }
    let of = |param: usize| {
        have.iter()
            .flat_map(|s| &s.slices)
            .filter(move |s| s.param == param)
    };
    let name = |param: usize| wants.params[param].0.clone();
    let mut loaded = Loaded::default();
    for (param, region) in &wants.values {
        let sources = of(*param).map(|s| (&s.region, s.values.as_slice()));
        loaded
            .values
            .push(assemble(region, sources, || format!("`{}`", name(*param)))?);
    }
    for (param, region) in &wants.state {
        let with_state: Vec<(&Region, &FlatState)> = of(*param)
            .filter_map(|s| Some((&s.region, s.state.as_ref()?)))
            .collect();
        let Some((_, first)) = with_state.first() else {
            loaded.state.push(None);
            continue;
        };
        let mut state = FlatState {
            tensors: Vec::new(),
            scalars: first.scalars.clone(),
        };
        for (k, (leaf, _, _)) in first.tensors.iter().enumerate() {
            let sources = with_state
                .iter()
                .filter_map(|(r, st)| Some((*r, st.tensors.get(k)?.2.as_slice())));
            let what = || format!("optimizer state `{leaf}` of `{}`", name(*param));
            let values = assemble(region, sources, what)?;
            state
                .tensors
                .push((leaf.clone(), vec![values.len()], values));
        }
        loaded.state.push(Some(state));
    }
    Ok(loaded)
}

/// `want`'s elements from `sources` (regions of the same tensor and their values).
fn assemble<'a>(
    want: &Region,
    sources: impl Iterator<Item = (&'a Region, &'a [f32])>,
    what: impl Fn() -> String,
) -> Result<Vec<f32>, TrainError> {
    let mut out = vec![0f32; want.len()];
    let mut covered = 0;
    for (region, values) in sources {
        for run in want.runs_from(region) {
            out[run.dst..run.dst + run.len].copy_from_slice(&values[run.src..run.src + run.len]);
            covered += run.len;
        }
    }
    if covered != want.len() {
        return Err(TrainError::Io(format!(
            "fault tolerance: the survivors hold {covered} of the {} elements of {} this rank \
             needs: that state was lost with the failed ranks (resume from a checkpoint)",
            want.len(),
            what()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_pack::Scalar;

    fn state() -> RankState {
        RankState {
            params: vec![("w".into(), vec![2, 3])],
            slices: vec![
                Slice {
                    param: 0,
                    region: Region::whole(&[2, 3]).narrow(0..4),
                    values: vec![1.0, 2.0, 3.0, 4.0],
                    state: Some(FlatState {
                        tensors: vec![("m".into(), vec![4], vec![0.1, 0.2, 0.3, 0.4])],
                        scalars: vec![("time".into(), Scalar::UInt(3))],
                    }),
                },
                Slice {
                    param: 0,
                    region: Region::whole(&[2, 3]).narrow(4..6),
                    values: vec![5.0, 6.0],
                    state: Some(FlatState {
                        tensors: vec![("m".into(), vec![2], vec![0.5, 0.6])],
                        scalars: vec![("time".into(), Scalar::UInt(3))],
                    }),
                },
            ],
        }
    }

    #[test]
    fn encode_decode_round_trip_and_reshard() {
        let s = state();
        let back = decode(&encode(&s)).unwrap();
        assert_eq!(back.slices.len(), 2);
        assert_eq!(back.slices[1].values, vec![5.0, 6.0]);
        let wants = Wants {
            params: s.params.clone(),
            values: vec![(0, Region::whole(&[2, 3]).narrow(3..6))],
            state: vec![(0, Region::whole(&[2, 3]).narrow(2..5))],
        };
        let loaded = answer(&[back], &wants).unwrap();
        assert_eq!(loaded.values, vec![vec![4.0, 5.0, 6.0]]);
        let st = loaded.state[0].as_ref().unwrap();
        assert_eq!(st.tensors[0].2, vec![0.3, 0.4, 0.5]);
        assert_eq!(st.scalars, vec![("time".into(), Scalar::UInt(3))]);
    }

    #[test]
    fn a_region_nobody_holds_is_an_error_naming_it() {
        let mut s = state();
        s.slices.pop();
        let wants = Wants {
            params: s.params.clone(),
            values: vec![(0, Region::whole(&[2, 3]))],
            state: vec![],
        };
        let err = answer(&[s], &wants).unwrap_err().to_string();
        assert!(err.contains("4 of the 6 elements of `w`"), "{err}");
    }

    #[test]
    fn frames_split_what_push_frame_joined() {
        let mut buf = Vec::new();
        push_frame(&mut buf, b"abc");
        push_frame(&mut buf, b"");
        push_frame(&mut buf, b"de");
        let f = frames(&buf).unwrap();
        assert_eq!(f, vec![&b"abc"[..], &b""[..], &b"de"[..]]);
        assert!(frames(&buf[..buf.len() - 1]).is_err());
    }
}
