//! The context-parallel scope of the current thread: while a [`ContextScope`] is entered,
//! attention ([`attention`]) runs as ring attention over its cp group and token positions
//! ([`positions`]) are those of the rank's chunks — the models call these two and stay plain
//! Burn models (with no scope they are ordinary attention and `0..T`).

use super::{ContextSplit, ring_attention};
use bonfire_comm::ProcessGroup;
use burn::tensor::Tensor;
use std::cell::RefCell;

/// A cp group and how sequences are split over it.
#[derive(Debug, Clone)]
pub struct ContextScope {
    /// The ranks that share each sequence.
    pub group: ProcessGroup,
    /// How the sequence is split over them.
    pub split: ContextSplit,
}

thread_local! {
    static CURRENT: RefCell<Vec<ContextScope>> = const { RefCell::new(Vec::new()) };
}

/// Leaves the scope when dropped.
#[derive(Debug)]
pub struct ScopeGuard(());

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        CURRENT.with(|c| c.borrow_mut().pop());
    }
}

impl ContextScope {
    /// Enters the scope on this thread until the guard drops (scopes nest).
    pub fn enter(self) -> ScopeGuard {
        assert_eq!(
            self.group.size(),
            self.split.cp(),
            "a split for {} ranks on a group of {}",
            self.split.cp(),
            self.group.size()
        );
        CURRENT.with(|c| c.borrow_mut().push(self));
        ScopeGuard(())
    }

    /// The innermost scope entered on this thread, if any.
    pub fn current() -> Option<ContextScope> {
        CURRENT.with(|c| c.borrow().last().cloned())
    }
}

/// The positions in the whole sequence of a rank's `t` tokens: its chunks' under a scope
/// (where `t` must be the split's local length), `0..t` otherwise.
pub fn positions(t: usize) -> Vec<usize> {
    match ContextScope::current() {
        Some(s) => {
            assert_eq!(
                t,
                s.split.local_len(),
                "{t} tokens under a context split of {}",
                s.split.local_len()
            );
            s.split.positions(s.group.rank())
        }
        None => (0..t).collect(),
    }
}

/// Causal attention of `q` `[B, H, T, hd]` over `k`, `v` `[B, H_kv, T, hd]`, limited to a
/// sliding `window` of positions if one is given: ring attention over the whole sequence under
/// a scope, `local(q, k, v)` (the model's own, which applies the same window) otherwise.
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    window: Option<usize>,
    local: impl FnOnce(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
) -> Tensor<4> {
    match ContextScope::current() {
        Some(s) => {
            let mask = bonfire_kernels::Mask::CAUSAL.with_window(window);
            ring_attention(q, k, v, &s.group, &s.split, mask)
        }
        None => local(q, k, v),
    }
}
