//! Agreement across ranks on what each did: every rank's string ([`gather_strings`]) and
//! every rank's outcome ([`agree`]), so that an error on one rank is an error on all before
//! any state changes.

use crate::error::{CheckpointError, TrainError};
use bonfire_comm::ProcessGroup;

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
