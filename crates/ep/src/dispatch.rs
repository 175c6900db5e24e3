//! Expert parallelism's token exchange: each rank of an ep group holds `E/ep` consecutive
//! experts; [`dispatch`] sends every grouped row to the rank holding its expert
//! (`all_to_all_uneven`, sizes from the routed counts) and orders what arrives by local expert;
//! [`combine`] sends the experts' outputs back the same way. Both differentiable (the
//! all-to-all's backward is the inverse all-to-all). Dropless: any count, zero included.

use bonfire_comm::ProcessGroup;
use bonfire_dtensor::functional::all_to_all_uneven;
use bonfire_dtensor::plane::{self, ledger::Reason};
use bonfire_dtensor::{DTensorError, Result};
use burn::tensor::{Int, Tensor};

/// What [`dispatch`] sent and received, for [`combine`] to send the outputs back.
#[derive(Debug, Clone)]
pub struct ExpertDispatch {
    group: ProcessGroup,
    /// Rows sent to each rank of the group.
    sent: Vec<usize>,
    /// Rows received from each rank.
    received: Vec<usize>,
    /// For each received row (arrival order: by source rank, then expert), its position in
    /// local-expert order.
    by_source: Tensor<1, Int>,
    /// Rows per local expert, after the exchange.
    counts: Vec<usize>,
}

impl ExpertDispatch {
    /// Rows per expert this rank holds (its `E/ep` experts, in order).
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }
}

/// Sends `grouped` (`[M, d]`, rows grouped by global expert with `counts[e]` rows for expert
/// `e`, as [`super::permute`] gives them) to the ranks of `group` holding the experts (rank
/// `r` holds experts `r·E/ep .. (r+1)·E/ep`) and returns the rows this rank's experts must
/// process, grouped by local expert (within one, by source rank), with what [`combine`] needs.
pub fn dispatch(
    grouped: Tensor<2>,
    counts: &[usize],
    group: &ProcessGroup,
) -> Result<(Tensor<2>, ExpertDispatch)> {
    let (ep, e) = (group.size(), counts.len());
    if e % ep != 0 {
        return Err(DTensorError::InvalidArgument(format!(
            "{e} experts do not split over {ep} expert-parallel ranks: give a number of \
             experts divisible by ep"
        )));
    }
    let local = e / ep;
    let sent: Vec<usize> = counts.chunks(local).map(|c| c.iter().sum()).collect();
    // Each rank's counts for this rank's experts: `[ep, local]`, source-major.
    let mut theirs = vec![0i64; e];
    let mine: Vec<i64> = counts.iter().map(|&c| c as i64).collect();
    group.all_to_all(&mine, &mut theirs)?;
    let theirs: Vec<usize> = theirs.iter().map(|&c| c as usize).collect();
    let received: Vec<usize> = theirs.chunks(local).map(|c| c.iter().sum()).collect();
    let arrived = all_to_all_uneven(grouped, group, 0, &sent, 0, &received)?;
    // Offsets of (source, expert) blocks in the arrival order, then expert-major order.
    let mut starts = vec![0usize; e];
    let mut at = 0;
    for (i, c) in theirs.iter().enumerate() {
        starts[i] = at;
        at += c;
    }
    let mut by_expert = Vec::with_capacity(at);
    for x in 0..local {
        for s in 0..ep {
            let i = s * local + x;
            by_expert.extend((starts[i]..starts[i] + theirs[i]).map(|r| r as i64));
        }
    }
    let mut by_source = vec![0i64; at];
    for (pos, &r) in by_expert.iter().enumerate() {
        by_source[r as usize] = pos as i64;
    }
    let device = arrived.device();
    let index = |v| plane::indices_from_host(v, &device, Reason::Routing);
    let (by_expert, by_source) = (index(by_expert), index(by_source));
    let counts = (0..local)
        .map(|x| (0..ep).map(|s| theirs[s * local + x]).sum())
        .collect();
    let rows = arrived.select(0, by_expert);
    let plan = ExpertDispatch {
        group: group.clone(),
        sent,
        received,
        by_source,
        counts,
    };
    Ok((rows, plan))
}

/// Sends the experts' outputs `rows` (`[Σ counts, d]`, in [`dispatch`]'s order) back to the
/// ranks their tokens came from: `[M, d]` in the order `grouped` had.
pub fn combine(rows: Tensor<2>, plan: &ExpertDispatch) -> Result<Tensor<2>> {
    let by_source = rows.select(0, plan.by_source.clone());
    all_to_all_uneven(by_source, &plan.group, 0, &plan.received, 0, &plan.sent)
}
