//! [`ZeroStage`]: what ZeRO shards over the data-parallel group.

/// What is sharded over the data-parallel group (stage 0 is plain data parallelism).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ZeroStage {
    /// Nothing (plain data parallelism, DDP).
    Zero0,
    /// Optimizer state.
    Zero1,
    /// Optimizer state and gradients.
    Zero2,
    /// Optimizer state, gradients and parameters.
    Zero3,
}

impl ZeroStage {
    /// Every stage, in order.
    pub const ALL: [ZeroStage; 4] = [Self::Zero0, Self::Zero1, Self::Zero2, Self::Zero3];

    /// The stage numbered `i` (0–3).
    pub fn from_index(i: usize) -> Option<Self> {
        Self::ALL.get(i).copied()
    }

    /// The stage's number (0–3).
    pub fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_are_numbered_in_order() {
        for (i, s) in ZeroStage::ALL.into_iter().enumerate() {
            assert_eq!((s.index(), ZeroStage::from_index(i)), (i, Some(s)));
        }
        assert_eq!(ZeroStage::from_index(4), None);
        assert!(ZeroStage::Zero1 < ZeroStage::Zero3);
    }
}
