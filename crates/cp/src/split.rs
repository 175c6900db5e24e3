//! [`ContextSplit`]: which tokens of a sequence each rank of a cp group holds.

use burn::tensor::kind::Basic;
use burn::tensor::{Device, Int, Tensor};
use std::ops::Range;

/// How a sequence of `seq` tokens is split over `cp` ranks (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextSplit {
    seq: usize,
    cp: usize,
    balanced: bool,
}

impl ContextSplit {
    /// The split of `seq` tokens over `cp` ranks, load-balanced for causal attention when
    /// `balanced`. `Err` names the numbers when `seq` does not cut into `2·cp` (balanced) or
    /// `cp` (not) equal chunks.
    pub fn new(seq: usize, cp: usize, balanced: bool) -> Result<Self, String> {
        let chunks = if balanced { 2 * cp } else { cp };
        if cp == 0 || seq == 0 || !seq.is_multiple_of(chunks) {
            let how = if balanced { "2·cp" } else { "cp" };
            return Err(format!(
                "a sequence of {seq} tokens does not cut into {how} = {chunks} equal chunks \
                 (cp = {cp}): give a sequence length divisible by {chunks}"
            ));
        }
        Ok(Self { seq, cp, balanced })
    }

    /// The split the trainer trains with, its one owner: load-balanced (Megatron-Core's and
    /// torchtitan's default for causal models: every rank does the same attention work).
    pub fn for_training(seq: usize, cp: usize) -> Result<Self, String> {
        Self::new(seq, cp, true)
    }

    /// The ranks.
    pub fn cp(&self) -> usize {
        self.cp
    }

    /// Tokens of the whole sequence.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Tokens each rank holds.
    pub fn local_len(&self) -> usize {
        self.seq / self.cp
    }

    /// The token ranges of the whole sequence rank `rank` holds, in the order it holds them.
    pub fn chunks(&self, rank: usize) -> Vec<Range<usize>> {
        assert!(rank < self.cp, "rank {rank} of a cp group of {}", self.cp);
        if !self.balanced {
            let n = self.local_len();
            return std::iter::once(rank * n..(rank + 1) * n).collect();
        }
        let n = self.seq / (2 * self.cp);
        let other = 2 * self.cp - 1 - rank;
        vec![rank * n..(rank + 1) * n, other * n..(other + 1) * n]
    }

    /// The position in the whole sequence of each token rank `rank` holds.
    pub fn positions(&self, rank: usize) -> Vec<usize> {
        self.chunks(rank).into_iter().flatten().collect()
    }

    /// [`positions`](Self::positions) as an int tensor on `device`, built there (no host
    /// data).
    pub fn position_ids(&self, rank: usize, device: &Device) -> Tensor<1, Int> {
        let parts = self
            .chunks(rank)
            .into_iter()
            .map(|r| Tensor::<1, Int>::arange(r.start as i64..r.end as i64, device))
            .collect();
        Tensor::cat(parts, 0)
    }

    /// Rank `rank`'s tokens of `x`, whose dimension `dim` is the whole sequence.
    pub fn local<const D: usize, K: Basic + 'static>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
        rank: usize,
    ) -> Tensor<D, K> {
        assert_eq!(
            x.dims()[dim],
            self.seq,
            "dimension {dim} is not the whole sequence"
        );
        let parts: Vec<Tensor<D, K>> = self
            .chunks(rank)
            .into_iter()
            .map(|r| x.clone().narrow(dim, r.start, r.len()))
            .collect();
        Tensor::cat(parts, dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_chunks_pair_the_ends() {
        let s = ContextSplit::new(16, 4, true).unwrap();
        assert_eq!(s.positions(0), [0, 1, 14, 15]);
        assert_eq!(s.positions(3), [6, 7, 8, 9]);
        let mut all: Vec<usize> = (0..4).flat_map(|r| s.positions(r)).collect();
        all.sort();
        assert_eq!(all, (0..16).collect::<Vec<_>>());
        // Causal work (keys at or before each query) is the same on every rank.
        let work = |r| s.positions(r).iter().map(|p| p + 1).sum::<usize>();
        assert!((0..4).all(|r| work(r) == work(0)));
        assert_eq!(
            ContextSplit::new(16, 4, false).unwrap().positions(1),
            [4, 5, 6, 7]
        );
    }

    #[test]
    fn a_sequence_that_does_not_cut_is_refused_naming_the_numbers() {
        let err = ContextSplit::new(12, 4, true).unwrap_err();
        assert!(
            err.contains("12 tokens") && err.contains("2·cp = 8") && err.contains("cp = 4"),
            "{err}"
        );
        assert!(ContextSplit::new(12, 4, false).is_ok());
    }
}
