//! Where a pipeline's pieces are cut into stages: [`even_split_points`] (runs of nearly equal
//! length) and [`balanced_split_points`] (runs whose ranks carry nearly equal costs).

use crate::ScheduleKind;

/// The `parts − 1` indices where `n` items are cut into `parts` consecutive runs whose
/// lengths differ by at most one, the first runs the longer: the trainer's default pipeline
/// stages and the planner's model of them.
///
/// ```
/// assert_eq!(bonfire_layout::even_split_points(10, 4), vec![3, 6, 8]);
/// assert_eq!(bonfire_layout::even_split_points(4, 1), Vec::<usize>::new());
/// ```
pub fn even_split_points(n: usize, parts: usize) -> Vec<usize> {
    let mut at = 0;
    (0..parts.saturating_sub(1))
        .map(|i| {
            at += n / parts + usize::from(i < n % parts);
            at
        })
        .collect()
}

/// The most placements [`balanced_split_points`] tries; past it, the best found so far.
const SEARCH_BUDGET: usize = 1 << 20;

/// The piece indices where pieces of `costs` (one per piece, finite and non-negative; a
/// model's forward FLOPs per token of each) are cut into the `pp × kind.chunks()` consecutive
/// stages of `kind` on `pp` ranks so that the busiest rank's summed cost (its stages placed by
/// [`ScheduleKind::stage`]) is least; ties go to the smaller largest stage (a V, or
/// interleaving, also waits on its stages one by one), then to [`even_split_points`], then to
/// the first found. The trainer's default split of a pipeline whose pieces carry costs, and
/// the planner's model of it. A depth-first search over every placement, pruned once a
/// rank's load reaches the best found; it stops after 2²⁰ placements with the best so far
/// (deterministic: the same cut on every rank and in every run). With fewer pieces than
/// stages, or costs that are not finite and non-negative, [`even_split_points`].
///
/// ```
/// use bonfire_layout::{ScheduleKind, balanced_split_points};
/// // An embedding, four blocks and a head worth 1.25 blocks on two ranks: three blocks and
/// // the embedding on the first stage.
/// let costs = [0.0, 1.0, 1.0, 1.0, 1.0, 1.25];
/// assert_eq!(balanced_split_points(&costs, ScheduleKind::OneFOneB, 2), vec![4]);
/// ```
pub fn balanced_split_points(costs: &[f64], kind: ScheduleKind, pp: usize) -> Vec<usize> {
    let stages = pp * kind.chunks();
    let even = even_split_points(costs.len(), stages);
    if stages <= 1 || costs.len() < stages || costs.iter().any(|c| !c.is_finite() || *c < 0.0) {
        return even;
    }
    let rank_of = rank_of_stages(kind, pp);
    let mut search = Search {
        costs,
        rank_of: &rank_of,
        load: vec![0.0; pp],
        points: Vec::with_capacity(stages - 1),
        best: (score(costs, &even, &rank_of, pp), even),
        budget: SEARCH_BUDGET,
    };
    search.place(0, 0, 0.0);
    search.best.1
}

/// The rank each of `kind`'s `pp × kind.chunks()` stages runs on ([`ScheduleKind::stage`]
/// inverted).
fn rank_of_stages(kind: ScheduleKind, pp: usize) -> Vec<usize> {
    let mut rank_of = vec![0; pp * kind.chunks()];
    for rank in 0..pp {
        for chunk in 0..kind.chunks() {
            rank_of[kind.stage(pp, rank, chunk)] = rank;
        }
    }
    rank_of
}

/// `(busiest rank's load, largest stage)` of `costs` cut at `points`.
fn score(costs: &[f64], points: &[usize], rank_of: &[usize], pp: usize) -> (f64, f64) {
    let mut load = vec![0.0; pp];
    let mut largest = 0f64;
    let bounds = std::iter::once(0).chain(points.iter().copied());
    let ends = points.iter().copied().chain(std::iter::once(costs.len()));
    for (s, (a, b)) in bounds.zip(ends).enumerate() {
        let stage: f64 = costs[a..b].iter().sum();
        load[rank_of[s]] += stage;
        largest = largest.max(stage);
    }
    (load.iter().copied().fold(0.0, f64::max), largest)
}

/// [`balanced_split_points`]'s depth-first search.
struct Search<'a> {
    costs: &'a [f64],
    rank_of: &'a [usize],
    load: Vec<f64>,
    points: Vec<usize>,
    best: ((f64, f64), Vec<usize>),
    budget: usize,
}

impl Search<'_> {
    /// Places stage `stage`, which begins at piece `start`, with the largest stage so far
    /// `largest`, and every stage after it.
    fn place(&mut self, stage: usize, start: usize, largest: f64) {
        let stages = self.rank_of.len();
        let rank = self.rank_of[stage];
        // The last stage takes the rest; every other leaves a piece for each stage after it.
        let ends = match stage + 1 == stages {
            true => self.costs.len()..=self.costs.len(),
            false => start + 1..=self.costs.len() - (stages - stage - 1),
        };
        for end in ends {
            if self.budget == 0 {
                return;
            }
            self.budget -= 1;
            let cost: f64 = self.costs[start..end].iter().sum();
            let (load, largest) = (self.load[rank] + cost, largest.max(cost));
            let (best_load, best_largest) = self.best.0;
            if load > best_load || (load == best_load && largest >= best_largest) {
                // A longer stage only adds to this rank's load; a shorter one may not.
                match load > best_load {
                    true => break,
                    false => continue,
                }
            }
            if stage + 1 == stages {
                let busiest = self.load.iter().copied().fold(load, f64::max);
                if (busiest, largest) < self.best.0 {
                    self.best = ((busiest, largest), self.points.clone());
                }
                continue;
            }
            let before = std::mem::replace(&mut self.load[rank], load);
            self.points.push(end);
            self.place(stage + 1, end, largest);
            self.points.pop();
            self.load[rank] = before;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_differ_by_at_most_one_and_cover_everything() {
        for n in 1..20 {
            for parts in 1..=n {
                let mut cuts = vec![0];
                cuts.extend(even_split_points(n, parts));
                cuts.push(n);
                let lens: Vec<usize> = cuts.windows(2).map(|w| w[1] - w[0]).collect();
                assert_eq!(lens.len(), parts);
                assert_eq!(lens.iter().sum::<usize>(), n);
                assert!(
                    lens.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 1),
                    "{lens:?}"
                );
            }
        }
    }

    /// Every cut of `n` pieces into `stages` non-empty runs, in ascending order.
    fn every_cut(n: usize, stages: usize) -> Vec<Vec<usize>> {
        fn go(from: usize, n: usize, left: usize, at: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
            if left == 0 {
                out.push(at.clone());
                return;
            }
            for p in from..=n - left {
                at.push(p);
                go(p + 1, n, left - 1, at, out);
                at.pop();
            }
        }
        let mut out = Vec::new();
        go(1, n, stages - 1, &mut Vec::new(), &mut out);
        out
    }

    /// The search finds what trying every cut finds — the least busiest rank, then the least
    /// largest stage, the even split on a tie, then the first — for one stage a rank,
    /// interleaving and a V, on pseudo-random costs with ties (whole numbers) and without.
    #[test]
    fn the_search_finds_the_best_cut() {
        let kinds = [
            (ScheduleKind::OneFOneB, 2),
            (ScheduleKind::OneFOneB, 3),
            (ScheduleKind::ZbV, 2),
            (ScheduleKind::Interleaved { chunks: 2 }, 2),
        ];
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as f64 / (1u64 << 31) as f64
        };
        let mut cases = 0;
        for (kind, pp) in kinds {
            let stages = pp * kind.chunks();
            for n in stages..stages + 5 {
                for whole in [false, true] {
                    let costs: Vec<f64> = (0..n)
                        .map(|_| match whole {
                            true => (next() * 3.0).floor(),
                            false => next(),
                        })
                        .collect();
                    let rank_of = rank_of_stages(kind, pp);
                    let even = even_split_points(n, stages);
                    let mut want = (score(&costs, &even, &rank_of, pp), even);
                    for cut in every_cut(n, stages) {
                        let s = score(&costs, &cut, &rank_of, pp);
                        if s < want.0 {
                            want = (s, cut);
                        }
                    }
                    let got = balanced_split_points(&costs, kind, pp);
                    assert_eq!(got, want.1, "{kind:?} pp={pp} costs={costs:?}");
                    cases += 1;
                }
            }
        }
        assert_eq!(cases, 40);
    }

    /// Equal costs keep the even split; fewer pieces than stages or a cost that is not finite
    /// and non-negative fall back to it; a heavy last piece moves the cut.
    #[test]
    fn ties_and_bad_costs_keep_the_even_split() {
        let kind = ScheduleKind::OneFOneB;
        assert_eq!(
            balanced_split_points(&[1.0; 7], kind, 3),
            even_split_points(7, 3)
        );
        assert_eq!(
            balanced_split_points(&[1.0, f64::NAN, 1.0], kind, 2),
            vec![2]
        );
        assert_eq!(balanced_split_points(&[1.0, -1.0, 1.0], kind, 2), vec![2]);
        assert_eq!(
            balanced_split_points(&[1.0], kind, 2),
            even_split_points(1, 2)
        );
        assert_eq!(
            balanced_split_points(&[1.0, 1.0, 1.0, 3.0], kind, 2),
            vec![3]
        );
    }
}
