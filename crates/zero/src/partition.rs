//! The flat-buffer partitioner: every parameter, in module order, is laid end to end in one
//! logical vector of `Ψ` elements, which is cut into `N` contiguous ranges of (almost) equal
//! byte size — torch.chunk style: `ceil(Ψ/N)` elements each, the last range taking the
//! remainder (possibly empty). A parameter may straddle ranks; a rank owns the *slices* of the
//! parameters that intersect its range.

use bonfire_module::params::ParamInfo;
use std::ops::Range;

/// One rank's part of one parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSlice {
    /// Index of the parameter in the inventory.
    pub param: usize,
    /// Element range inside the parameter (row-major flattening).
    pub within: Range<usize>,
    /// The same elements in the flat vector.
    pub flat: Range<usize>,
}

impl ParamSlice {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.within.len()
    }
    /// Whether the slice holds no element.
    pub fn is_empty(&self) -> bool {
        self.within.is_empty()
    }
}

/// How the flat parameter vector is split over `n` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// Start offset of each parameter in the flat vector, plus the total at the end.
    pub offsets: Vec<usize>,
    /// The flat range owned by each rank.
    pub ranges: Vec<Range<usize>>,
}

impl Partition {
    /// Balanced by bytes (all parameters are f32, so by elements): `ceil(Ψ/n)` per rank.
    pub fn balanced(infos: &[ParamInfo], n: usize) -> Self {
        Self::from_numels(&infos.iter().map(ParamInfo::numel).collect::<Vec<_>>(), n)
    }

    /// The same from parameter sizes alone.
    pub fn from_numels(numels: &[usize], n: usize) -> Self {
        assert!(n > 0, "a partition needs at least one rank");
        let mut offsets = Vec::with_capacity(numels.len() + 1);
        let mut at = 0;
        offsets.push(0);
        for &k in numels {
            at += k;
            offsets.push(at);
        }
        let total = at;
        let chunk = total.div_ceil(n);
        let ranges = (0..n)
            .map(|r| (r * chunk).min(total)..((r + 1) * chunk).min(total))
            .collect();
        Self { offsets, ranges }
    }

    /// Ψ, the number of elements.
    pub fn total(&self) -> usize {
        *self.offsets.last().unwrap_or(&0)
    }
    /// Number of ranks the vector is split over.
    pub fn num_ranks(&self) -> usize {
        self.ranges.len()
    }
    /// Number of parameters in the vector.
    pub fn num_params(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Elements owned by each rank.
    pub fn counts(&self) -> Vec<usize> {
        self.ranges.iter().map(|r| r.len()).collect()
    }

    /// The non-empty slices of rank `rank`, in flat order (they tile its range).
    pub fn slices(&self, rank: usize) -> Vec<ParamSlice> {
        let own = &self.ranges[rank];
        (0..self.num_params())
            .filter_map(|p| self.slice(p, own.clone()))
            .collect()
    }

    fn slice(&self, p: usize, range: Range<usize>) -> Option<ParamSlice> {
        let (a, b) = (self.offsets[p], self.offsets[p + 1]);
        let s = a.max(range.start);
        let e = b.min(range.end);
        (s < e).then(|| ParamSlice {
            param: p,
            within: s - a..e - a,
            flat: s..e,
        })
    }

    /// How many elements of parameter `p` each rank owns (zeros included).
    pub fn param_counts(&self, p: usize) -> Vec<usize> {
        (0..self.num_ranks())
            .map(|r| {
                self.slice(p, self.ranges[r].clone())
                    .map_or(0, |pc| pc.len())
            })
            .collect()
    }

    /// How many elements of the flat sub-range `sub` each rank owns.
    pub fn sub_counts(&self, sub: &Range<usize>) -> Vec<usize> {
        self.ranges
            .iter()
            .map(|r| r.end.min(sub.end).saturating_sub(r.start.max(sub.start)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skewed_sizes_straddle_ranks() {
        // One huge parameter and three tiny ones: balanced by bytes, not one parameter each.
        let p = Partition::from_numels(&[100, 1, 2, 3], 4);
        assert_eq!(p.total(), 106);
        assert_eq!(p.counts(), vec![27, 27, 27, 25]);
        assert_eq!(p.param_counts(0), vec![27, 27, 27, 19]);
        let last = p.slices(3);
        assert_eq!(last.len(), 4);
        assert_eq!(last[0].within, 81..100);
        assert_eq!(p.sub_counts(&(20..30)), vec![7, 3, 0, 0]);
    }

    #[test]
    fn uneven_tail_and_empty_rank() {
        let p = Partition::from_numels(&[2, 3], 4);
        assert_eq!(p.counts(), vec![2, 2, 1, 0]);
        assert!(p.slices(3).is_empty());
        for r in 0..4 {
            let n: usize = p.slices(r).iter().map(ParamSlice::len).sum();
            assert_eq!(n, p.counts()[r]);
        }
    }
}
