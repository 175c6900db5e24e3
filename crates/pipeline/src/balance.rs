//! Split points from measured piece times: [`balance_measured`] cuts a model's pieces into a
//! schedule's stages so that the schedule, replayed with those stages' costs, takes the least
//! time ([`simulated_step`]); [`rank_loads`] gives each rank's total under given split points
//! (summing every stage its stage map puts there: a V puts the first and last stage
//! together) and [`imbalance`] their spread. The trainer takes the
//! result by name (`ParallelDims::with_split_points`, the pieces' names at these indices).

use crate::error::PipelineError;
use crate::schedule::{Action, Schedule};
use crate::timeline::Timeline;
pub use crate::timeline::imbalance;

/// Each rank's summed cost when `costs` (one per piece) are cut at `points` into
/// `schedule`'s stages (placed by its stage map).
pub fn rank_loads(costs: &[f64], points: &[usize], schedule: &Schedule) -> Vec<f64> {
    let mut load = vec![0.0; schedule.ranks()];
    let bounds: Vec<usize> = std::iter::once(0)
        .chain(points.iter().copied())
        .chain(std::iter::once(costs.len()))
        .collect();
    for (s, w) in bounds.windows(2).enumerate() {
        load[schedule.stage_map.locate(s).0] += costs[w[0]..w[1]].iter().sum::<f64>();
    }
    load
}

/// The split points (piece indices where stages 1.. begin) of `costs` (a measured time per
/// piece: its forward + backward, the last one's with the loss) into `schedule`'s stages
/// whose step is shortest when `schedule` is replayed ([`Timeline::simulate_with`], instant
/// messages) with each stage's actions costing thirds of its pieces' total: F = B = W = ⅓
/// (a full backward ⅔). Ties go to the smaller busiest-rank load, then to the first found.
///
/// Replaying matters beyond the ranks' totals: a schedule's dependencies run through every
/// stage, so under ZB-V (rank 0 holds the first and the last stage) two stages of one rank
/// that sum to the other rank's pair but differ from each other still stall the V. Every
/// placement is searched depth-first, pruned once the ranks' loads so far reach the best
/// step found (no step is shorter than its busiest rank's load).
pub fn balance_measured(costs: &[f64], schedule: &Schedule) -> Result<Vec<usize>, PipelineError> {
    let stages = schedule.stages();
    if stages == 0 || stages > costs.len() {
        return Err(PipelineError::Invalid(format!(
            "cannot split {} pieces into {stages} non-empty stages",
            costs.len()
        )));
    }
    if costs.iter().any(|c| !c.is_finite() || *c < 0.0) {
        return Err(PipelineError::Invalid(
            "piece costs must be finite and non-negative".into(),
        ));
    }
    let mut search = Search {
        costs,
        schedule,
        load: vec![0.0; schedule.ranks()],
        points: Vec::with_capacity(stages - 1),
        best: ((f64::INFINITY, f64::INFINITY), Vec::new()),
    };
    search.place(0, 0);
    Ok(search.best.1)
}

/// The step time of `schedule` replayed with stage costs cut from `costs` at `points` (see
/// [`balance_measured`]); infinite if the schedule cannot be replayed.
pub fn simulated_step(costs: &[f64], points: &[usize], schedule: &Schedule) -> f64 {
    let bounds: Vec<usize> = std::iter::once(0)
        .chain(points.iter().copied())
        .chain(std::iter::once(costs.len()))
        .collect();
    let stage_cost: Vec<f64> = bounds
        .windows(2)
        .map(|w| costs[w[0]..w[1]].iter().sum())
        .collect();
    let map = schedule.stage_map;
    let cost = |rank: usize, action: &Action| {
        let third = stage_cost[map.stage(rank, action.chunk())] / 3.0;
        match action {
            Action::Backward { .. } => 2.0 * third,
            a if a.is_compute() => third,
            _ => 0.0,
        }
    };
    Timeline::simulate_with(schedule, cost).map_or(f64::INFINITY, |t| t.makespan().as_secs_f64())
}

/// The state of [`balance_measured`]'s depth-first search.
struct Search<'a> {
    costs: &'a [f64],
    schedule: &'a Schedule,
    /// Each rank's load from the stages placed so far.
    load: Vec<f64>,
    points: Vec<usize>,
    /// (simulated step, busiest rank's load) of the best points so far, and the points.
    best: ((f64, f64), Vec<usize>),
}

impl Search<'_> {
    /// Places stage `stage`, which begins at piece `from`.
    fn place(&mut self, stage: usize, from: usize) {
        let (n, stages) = (self.costs.len(), self.schedule.stages());
        let rank = self.schedule.stage_map.locate(stage).0;
        // The last stage takes the rest; the others end where enough pieces remain.
        let ends: Vec<usize> = match stage + 1 == stages {
            true => vec![n],
            false => (from + 1..=n - (stages - 1 - stage)).collect(),
        };
        for end in ends {
            let cost: f64 = self.costs[from..end].iter().sum();
            self.load[rank] += cost;
            let max = self.load.iter().copied().fold(0.0, f64::max);
            if max <= self.best.0.0 {
                if stage + 1 == stages {
                    let step = simulated_step(self.costs, &self.points, self.schedule);
                    if (step, max) < self.best.0 {
                        self.best = ((step, max), self.points.clone());
                    }
                } else {
                    self.points.push(end);
                    self.place(stage + 1, end);
                    self.points.pop();
                }
            }
            self.load[rank] -= cost;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{Generate, ScheduleKind};

    #[test]
    fn one_stage_per_rank_cuts_where_the_halves_meet() {
        let s = ScheduleKind::OneFOneB.generate(2, 4);
        let costs = [1.0, 5.0, 5.0, 5.0, 5.0, 11.0];
        let points = balance_measured(&costs, &s).unwrap();
        assert_eq!(points, vec![4]);
        assert_eq!(rank_loads(&costs, &points, &s), vec![16.0, 16.0]);
        assert_eq!(imbalance(&rank_loads(&costs, &points, &s)), 0.0);
    }

    #[test]
    fn a_v_wants_equal_stages_not_only_equal_ranks() {
        // ZB-V: stages 0 and 3 on rank 0, 1 and 2 on rank 1. Eight equal pieces: [1, 2, 5]
        // (stages 1, 1, 3, 3 pieces) loads both ranks with 4 as [2, 4, 6] does, but its
        // unequal stages stall the V.
        let s = ScheduleKind::ZbV.generate(2, 4);
        assert_eq!(s.stages(), 4);
        let costs = [1.0; 8];
        let points = balance_measured(&costs, &s).unwrap();
        assert_eq!(points, vec![2, 4, 6]);
        assert_eq!(rank_loads(&costs, &[1, 2, 5], &s), vec![4.0, 4.0]);
        let (even, uneven) = (
            simulated_step(&costs, &[2, 4, 6], &s),
            simulated_step(&costs, &[1, 2, 5], &s),
        );
        assert!(even < uneven, "{even} vs {uneven}");
    }

    #[test]
    fn the_best_of_unequal_pieces_and_its_imbalance() {
        let s = ScheduleKind::OneFOneB.generate(2, 4);
        let costs = [0.5, 23.0, 23.0, 23.0, 23.0, 30.0];
        let points = balance_measured(&costs, &s).unwrap();
        assert_eq!(points, vec![4]);
        let loads = rank_loads(&costs, &points, &s);
        assert_eq!(loads, vec![69.5, 53.0]);
        assert!((imbalance(&loads) - (69.5 / 61.25 - 1.0)).abs() < 1e-12);
    }

    #[test]
    fn too_few_pieces_or_bad_costs_are_refused() {
        let s = ScheduleKind::ZbV.generate(2, 4);
        assert!(balance_measured(&[1.0, 1.0, 1.0], &s).is_err());
        let s = ScheduleKind::OneFOneB.generate(2, 4);
        assert!(balance_measured(&[1.0, f64::NAN], &s).is_err());
        assert!(balance_measured(&[1.0, -1.0], &s).is_err());
    }
}
