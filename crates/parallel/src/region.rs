//! [`Region`]: which elements of a whole tensor a slice holds — a box of the tensor (a
//! tensor-parallel shard, or the whole tensor) and a range of that box's row-major flattening
//! (a ZeRO slice, or the whole box) — and how two regions of the same tensor overlap, as runs
//! of contiguous elements (what resharding copies).

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Elements `start..end` of the row-major flattening of the box `offsets .. offsets + shape`
/// of a whole tensor: a tensor-parallel shard is a box (the whole of it), a ZeRO slice of a
/// shard a range of the box, a replicated parameter the whole tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// Where the box starts in the whole tensor, per dimension.
    pub offsets: Vec<usize>,
    /// The box's size per dimension.
    pub shape: Vec<usize>,
    /// First element held, in the box's row-major order.
    pub start: usize,
    /// One past the last element held.
    pub end: usize,
}

/// A run of contiguous elements two regions share: `len` elements starting at `src` in one
/// region's data and at `dst` in the other's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Where it starts in the source region's data (counted from its `start`).
    pub src: usize,
    /// Where it starts in the destination region's data (counted from its `start`).
    pub dst: usize,
    /// Elements in the run.
    pub len: usize,
}

impl Region {
    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &[usize]) -> Self {
        Self::of_box(vec![0; shape.len()], shape.to_vec())
    }

    /// The whole box `offsets .. offsets + shape`.
    pub fn of_box(offsets: Vec<usize>, shape: Vec<usize>) -> Self {
        let end = shape.iter().product();
        Self {
            offsets,
            shape,
            start: 0,
            end,
        }
    }

    /// Elements `flat` of this region's box (a range of the box, not of this region).
    pub fn narrow(mut self, flat: Range<usize>) -> Self {
        self.start = flat.start;
        self.end = flat.end;
        self
    }

    /// Number of elements held.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }

    /// Whether the region lies inside a tensor of shape `whole` (same rank, box inside,
    /// range inside the box).
    pub fn fits(&self, whole: &[usize]) -> bool {
        let n: usize = self.shape.iter().product();
        self.offsets.len() == whole.len()
            && self.shape.len() == whole.len()
            && self
                .offsets
                .iter()
                .zip(&self.shape)
                .zip(whole)
                .all(|((o, s), w)| o.checked_add(*s).is_some_and(|e| e <= *w))
            && self.start <= self.end
            && self.end <= n
    }

    /// The runs of `self`'s elements that `have` holds: `src` counts in `have`'s data, `dst`
    /// in `self`'s (both from their `start`). Adjacent runs are merged. Both regions must be
    /// of the same tensor ([`fits`](Self::fits) it).
    pub fn runs_from(&self, have: &Region) -> Vec<Run> {
        let mut out: Vec<Run> = Vec::new();
        if self.is_empty() || have.is_empty() {
            return out;
        }
        // A 0-d tensor is one element: treat it as [1].
        let (wo, ws) = padded(self);
        let (ho, hs) = padded(have);
        let last = ws.len() - 1;
        let width = ws[last];
        let mut index = vec![0usize; last];
        for row in self.start / width..self.end.div_ceil(width) {
            // This row's columns within the range, then its place in the whole tensor.
            let c0 = self.start.max(row * width) - row * width;
            let c1 = self.end.min((row + 1) * width) - row * width;
            unravel(row, &ws[..last], &mut index);
            let inside = (0..last).all(|d| {
                let g = wo[d] + index[d];
                g >= ho[d] && g < ho[d] + hs[d]
            });
            let (g0, g1) = (wo[last] + c0, wo[last] + c1);
            let (h0, h1) = (g0.max(ho[last]), g1.min(ho[last] + hs[last]));
            if !inside || h0 >= h1 {
                continue;
            }
            let hrow = (0..last).fold(0, |acc, d| acc * hs[d] + (wo[d] + index[d] - ho[d]));
            let hpos = hrow * hs[last] + (h0 - ho[last]);
            let (a, b) = (hpos.max(have.start), (hpos + h1 - h0).min(have.end));
            if a >= b {
                continue;
            }
            let dst = row * width + (h0 - wo[last]) + (a - hpos) - self.start;
            let run = Run {
                src: a - have.start,
                dst,
                len: b - a,
            };
            match out.last_mut() {
                Some(p) if p.src + p.len == run.src && p.dst + p.len == run.dst => p.len += run.len,
                _ => out.push(run),
            }
        }
        out
    }
}

/// The region's offsets and shape, a 0-d tensor as one element of a 1-d one.
fn padded(r: &Region) -> (Vec<usize>, Vec<usize>) {
    if r.shape.is_empty() {
        (vec![0], vec![1])
    } else {
        (r.offsets.clone(), r.shape.clone())
    }
}

/// The multi-index of row-major position `i` in a box of `shape`.
fn unravel(mut i: usize, shape: &[usize], out: &mut [usize]) {
    for d in (0..shape.len()).rev() {
        out[d] = i % shape[d];
        i /= shape[d];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values of `r` in a tensor of `shape` whose elements are their own flat indices.
    fn values(r: &Region, shape: &[usize]) -> Vec<usize> {
        let mut idx = vec![0; r.shape.len()];
        (r.start..r.end)
            .map(|i| {
                unravel(i, &r.shape, &mut idx);
                (0..shape.len()).fold(0, |acc, d| acc * shape[d] + r.offsets[d] + idx[d])
            })
            .collect()
    }

    /// Copies `want` from `haves` through `runs_from` and checks every element.
    fn check(shape: &[usize], want: &Region, haves: &[Region]) {
        let mut got = vec![usize::MAX; want.len()];
        let mut copied = 0;
        for h in haves {
            let data = values(h, shape);
            for run in want.runs_from(h) {
                got[run.dst..run.dst + run.len].copy_from_slice(&data[run.src..run.src + run.len]);
                copied += run.len;
            }
        }
        assert_eq!(copied, want.len(), "every element once");
        assert_eq!(got, values(want, shape));
    }

    #[test]
    fn tensor_parallel_shards_from_zero_pieces() {
        let shape = [6, 8];
        // Saved: tp=2 along dim 1, each shard cut in 3 ZeRO slices.
        let mut haves = Vec::new();
        for t in 0..2 {
            let b = Region::of_box(vec![0, 4 * t], vec![6, 4]);
            haves.extend([
                b.clone().narrow(0..5),
                b.clone().narrow(5..17),
                b.narrow(17..24),
            ]);
        }
        // Wanted: tp=2 along dim 0, pieces of it; the whole; a 1-d cut of the whole.
        for t in 0..2 {
            let b = Region::of_box(vec![3 * t, 0], vec![3, 8]);
            check(&shape, &b.clone().narrow(3..19), &haves);
            check(&shape, &b, &haves);
        }
        check(&shape, &Region::whole(&shape), &haves);
        check(&shape, &Region::whole(&shape).narrow(7..41), &haves);
    }

    #[test]
    fn three_dimensions_and_scalars() {
        let shape = [2, 3, 4];
        let haves: Vec<Region> = (0..2)
            .map(|t| Region::of_box(vec![0, 0, 2 * t], vec![2, 3, 2]))
            .collect();
        check(
            &shape,
            &Region::of_box(vec![1, 0, 0], vec![1, 3, 4]),
            &haves,
        );
        check(&shape, &Region::whole(&shape).narrow(5..23), &haves);
        let scalar = Region::whole(&[]);
        assert_eq!(
            scalar.runs_from(&scalar),
            vec![Run {
                src: 0,
                dst: 0,
                len: 1
            }]
        );
    }

    #[test]
    fn fits_rejects_regions_outside_the_tensor() {
        assert!(Region::of_box(vec![2, 0], vec![2, 4]).fits(&[4, 4]));
        assert!(!Region::of_box(vec![3, 0], vec![2, 4]).fits(&[4, 4]));
        assert!(!Region::whole(&[4]).fits(&[4, 4]));
        assert!(!Region::whole(&[4, 4]).narrow(0..17).fits(&[4, 4]));
    }
}
