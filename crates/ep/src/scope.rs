//! The expert-parallel scope of the current thread: while an [`ExpertScope`] is entered, a
//! mixture-of-experts layer's [`run_experts`] sends its grouped rows to the ranks of the
//! scope's ep group that hold their experts and back ([`super::dispatch`], [`super::combine`]);
//! with no scope every expert runs here. The models call [`run_experts`] and stay plain Burn
//! models: the trainer enters the scope around their forward and backward, as it does
//! `bonfire_cp::ContextScope`.

use super::{combine, dispatch};
use bonfire_comm::ProcessGroup;
use bonfire_dtensor::Result;
use burn::tensor::Tensor;
use std::cell::RefCell;

/// The ep group a layer's experts are split over (rank `r` holds experts
/// `r·E/ep .. (r+1)·E/ep`).
#[derive(Debug, Clone)]
pub struct ExpertScope {
    /// The ranks that split each layer's experts and exchange tokens.
    pub group: ProcessGroup,
}

thread_local! {
    static CURRENT: RefCell<Vec<ExpertScope>> = const { RefCell::new(Vec::new()) };
}

/// Leaves the scope when dropped.
#[derive(Debug)]
pub struct ExpertGuard(());

impl Drop for ExpertGuard {
    fn drop(&mut self) {
        CURRENT.with(|c| c.borrow_mut().pop());
    }
}

impl ExpertScope {
    /// Enters the scope on this thread until the guard drops (scopes nest).
    pub fn enter(self) -> ExpertGuard {
        CURRENT.with(|c| c.borrow_mut().push(self));
        ExpertGuard(())
    }

    /// The innermost scope entered on this thread, if any.
    pub fn current() -> Option<ExpertScope> {
        CURRENT.with(|c| c.borrow().last().cloned())
    }
}

/// A mixture-of-experts layer's experts on its grouped rows: `grouped` `[M, d]` holds
/// `counts[e]` rows for each of the E experts in order (as [`super::permute`] gives them);
/// `expert(i, rows)` runs this rank's `i`-th expert on its rows and keeps their shape. With
/// no [`ExpertScope`] this rank holds every expert; in one, it holds `E/ep` of them and the
/// rows travel there and back (dispatch, combine), so every rank of the group must call this
/// the same number of times. Returns the outputs in `grouped`'s order. An expert with no row
/// does not run; a rank with no row at all still takes part in both exchanges and in their
/// backward (its experts must keep the rows' width: `[M, d]` → `[M, d]`).
///
/// Backward runs the exchanges' duals in the reverse of their forward order on every rank,
/// whatever the loads: each exchange hangs off the residual stream after the one before (and
/// after the layer's ring-attention shifts under cp), and Burn's backward, deepest node
/// first, keeps that order. The depths themselves depend on the loads — a rank none of whose
/// experts gets a row skips their operations, and its combine is shallower — so a collective
/// in backward on a branch off that stream (into the loss) would fall among the exchanges at
/// a different place on different ranks and deadlock them: keep such branches free of
/// backward collectives (the Mixtral's balance term sums over cp in forward only).
pub fn run_experts(
    grouped: Tensor<2>,
    counts: &[usize],
    expert: impl Fn(usize, Tensor<2>) -> Tensor<2>,
) -> Result<Tensor<2>> {
    let Some(scope) = ExpertScope::current() else {
        return Ok(each_expert(grouped, counts, expert));
    };
    let (rows, plan) = dispatch(grouped, counts, &scope.group)?;
    let out = each_expert(rows, plan.counts(), expert);
    combine(out, &plan)
}

/// `expert(i, ·)` on each group of `counts[i]` consecutive rows of `rows`, concatenated; an
/// expert with no row does not run.
fn each_expert(
    rows: Tensor<2>,
    counts: &[usize],
    expert: impl Fn(usize, Tensor<2>) -> Tensor<2>,
) -> Tensor<2> {
    let mut start = 0;
    let mut outputs = Vec::with_capacity(counts.len());
    for (i, &len) in counts.iter().enumerate() {
        if len > 0 {
            outputs.push(expert(i, rows.clone().narrow(0, start, len)));
            start += len;
        }
    }
    if outputs.is_empty() {
        // No row here (`rows` is `[0, d]`): an empty output that still hangs off the graph, so
        // that backward runs the exchanges' duals on this rank too, and that touches the
        // first expert (on a zero row, times 0), so that a wrapper's collectives on the
        // experts' parameters in backward run here too: ZeRO-3's reduce-scatter of their
        // gather, and its re-gather under recompute — the row is a leaf that wants its
        // gradient, so backward needs the parameters as it does where rows arrived.
        let [_, d] = rows.dims();
        let zero_row = Tensor::<2>::zeros([1, d], &rows.device())
            .cast(rows.dtype())
            .require_grad();
        let touch = expert(0, zero_row).sum().mul_scalar(0.0).reshape([1, 1]);
        return rows * 0.0 + touch;
    }
    Tensor::cat(outputs, 0)
}
