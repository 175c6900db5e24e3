//! Bucket layout: parameters grouped, in reverse order, into buffers of bounded size.
//!
//! Reverse order because backward produces the last layers' gradients first: the first bucket
//! fills first and its all-reduce starts while the earlier layers still compute.
//!
//! The other end matters too: the buckets of the first parameters (embeddings, first layer)
//! complete only as backward ends, and a bucket waits for its last gradient. So the
//! parameters within the first `TAIL_CAPS` caps (in module order) are bucketed at a
//! `TAIL_SPLIT`-th of the cap: the first layer's gradients then leave in pieces while the
//! embeddings' are still computed, instead of waiting for them in one bucket. (PyTorch makes
//! its *first* bucket small, for the same reason at the start of backward.) On the bench GPT
//! (4 MiB buckets, 2 rank threads) this took the hidden share of communication from
//! 0.71–0.77 to 0.81–0.85; see docs/ddp.md.

use bonfire_module::params::ParamInfo;

/// How many caps' worth of the first parameters (the last gradients of backward) are bucketed
/// at the smaller cap.
const TAIL_CAPS: usize = 2;

/// By how much the cap shrinks for those parameters.
const TAIL_SPLIT: usize = 4;

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
    /// Groups `infos` from last to first into buckets of at most `cap_bytes` (f32) each, a
    /// quarter of that for the parameters within the first two caps (module order); a
    /// parameter larger than its cap gets a bucket of its own.
    pub fn new(infos: &[ParamInfo], cap_bytes: usize) -> Self {
        Self::grouped(infos, cap_bytes, &vec![false; infos.len()])
    }

    /// [`new`](Self::new) with the parameters where `expert` is true never sharing a bucket
    /// with the others (expert parallelism reduces them over another group).
    pub fn grouped(infos: &[ParamInfo], cap_bytes: usize, expert: &[bool]) -> Self {
        let cap = (cap_bytes / 4).max(1);
        let tail_cap = (cap / TAIL_SPLIT).max(1);
        // Elements of the parameters before each one, in module order.
        let mut before = Vec::with_capacity(infos.len());
        let mut total = 0usize;
        for info in infos {
            before.push(total);
            total += info.numel();
        }
        let mut kinds: Vec<bool> = Vec::new();
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut lens = Vec::new();
        let mut loc = vec![(0, 0); infos.len()];
        for i in (0..infos.len()).rev() {
            let n = infos[i].numel();
            let cap = if before[i] < TAIL_CAPS * cap {
                tail_cap
            } else {
                cap
            };
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
        // Cap 8: the tail (parameters starting within the first 16 elements) is bucketed
        // at 2; that covers none of these but the first, which is alone anyway.
        let infos = vec![info(20), info(3), info(5), info(2), info(10)];
        let plan = BucketPlan::new(&infos, 8 * 4);
        // 10 alone (over the cap), then 2 + 5, then 3, then 20.
        assert_eq!(plan.buckets, vec![vec![4], vec![3, 2], vec![1], vec![0]]);
        assert_eq!(plan.lens, vec![10, 7, 3, 20]);
        assert_eq!(plan.loc[2], (1, 2));
    }

    #[test]
    fn the_first_parameters_get_smaller_buckets() {
        // Cap 8, tail cap 2, tail = parameters starting before element 16.
        let infos: Vec<ParamInfo> = [4, 1, 1, 1, 1, 1, 1, 4, 4, 4, 4]
            .into_iter()
            .map(info)
            .collect();
        let plan = BucketPlan::new(&infos, 8 * 4);
        // Past the tail (the last two start at 18 and 22): 4 + 4 at cap 8; in the tail
        // (the others start before 16): 4 alone twice, 1 + 1 three times, then 4 alone.
        assert_eq!(
            plan.buckets,
            vec![
                vec![10, 9],
                vec![8],
                vec![7],
                vec![6, 5],
                vec![4, 3],
                vec![2, 1],
                vec![0]
            ]
        );
    }
}
