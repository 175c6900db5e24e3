//! Bucket layout: parameters grouped, in reverse order, into buffers of bounded size.
//!
//! Reverse order because backward produces the last layers' gradients first: the first bucket
//! fills first and its all-reduce starts while the earlier layers still compute.

use crate::params::ParamInfo;

/// Where each parameter's gradient lives.
#[derive(Debug, Clone)]
pub struct BucketPlan {
    /// Parameter indices (into the inventory) of each bucket, in fill order.
    pub buckets: Vec<Vec<usize>>,
    /// Element count of each bucket.
    pub lens: Vec<usize>,
    /// (bucket, offset within it) of each parameter.
    pub loc: Vec<(usize, usize)>,
    /// Whether each bucket holds expert parameters (reduced over their own group).
    pub expert: Vec<bool>,
}

impl BucketPlan {
    /// Groups `infos` from last to first into buckets of at most `cap_bytes` (f32) each; a
    /// parameter larger than the cap gets a bucket of its own.
    pub fn new(infos: &[ParamInfo], cap_bytes: usize) -> Self {
        Self::grouped(infos, cap_bytes, &vec![false; infos.len()])
    }

    /// [`new`](Self::new) with the parameters where `expert` is true never sharing a bucket
    /// with the others (expert parallelism reduces them over another group).
    pub fn grouped(infos: &[ParamInfo], cap_bytes: usize, expert: &[bool]) -> Self {
        let cap = (cap_bytes / 4).max(1);
        let mut kinds: Vec<bool> = Vec::new();
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut lens = Vec::new();
        let mut loc = vec![(0, 0); infos.len()];
        for i in (0..infos.len()).rev() {
            let n = infos[i].numel();
            let start_new = match lens.last() {
                None => true,
                Some(&len) => (len > 0 && len + n > cap) || kinds.last() != Some(&expert[i]),
            };
            if start_new {
                buckets.push(Vec::new());
                lens.push(0);
                kinds.push(expert[i]);
            }
            let b = buckets.len() - 1;
            loc[i] = (b, lens[b]);
            buckets[b].push(i);
            lens[b] += n;
        }
        Self {
            buckets,
            lens,
            loc,
            expert: kinds,
        }
    }

    /// Number of buckets.
    pub fn num_buckets(&self) -> usize {
        self.buckets.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::ParamId;

    fn info(n: usize) -> ParamInfo {
        ParamInfo {
            id: ParamId::new(),
            path: format!("p{n}"),
            shape: vec![n],
        }
    }

    #[test]
    fn reverse_order_and_cap() {
        let infos = vec![info(3), info(5), info(2), info(10)];
        let plan = BucketPlan::new(&infos, 8 * 4);
        // 10 alone (over the cap), then 2 + 5, then 3.
        assert_eq!(plan.buckets, vec![vec![3], vec![2, 1], vec![0]]);
        assert_eq!(plan.lens, vec![10, 7, 3]);
        assert_eq!(plan.loc[1], (1, 2));
    }
}
