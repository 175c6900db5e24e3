//! The executed schedule as a timeline: when each action started and ended on each rank, the
//! bubble fraction, and an SVG picture like the figures of the GPipe and PTD-P papers.

use crate::schedule::{Action, Costs, Schedule};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// One executed action, in seconds since the rank's step began.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    /// What ran.
    pub action: Action,
    /// Start, seconds.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
}

/// One rank's record of a step.
#[derive(Clone, Debug)]
pub struct RankTimeline {
    /// The rank (in the pipeline group).
    pub rank: usize,
    /// When the rank started the step (aligns ranks that share a clock: threads).
    pub origin: Instant,
    /// Every action, in execution order.
    pub spans: Vec<Span>,
}

impl RankTimeline {
    /// An empty record starting now.
    pub fn start(rank: usize) -> Self {
        Self {
            rank,
            origin: Instant::now(),
            spans: Vec::new(),
        }
    }

    /// Records `action` running from `start` to `end`.
    pub fn record(&mut self, action: Action, start: Instant, end: Instant) {
        let secs = |t: Instant| t.saturating_duration_since(self.origin).as_secs_f64();
        self.spans.push(Span {
            action,
            start: secs(start),
            end: secs(end),
        });
    }

    /// Time spent computing (forward and backward actions), seconds.
    pub fn busy(&self) -> f64 {
        self.spans
            .iter()
            .filter(|s| s.action.is_compute())
            .map(|s| s.end - s.start)
            .sum()
    }
}

/// Every rank's record of one step, on one clock.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// `ranks[r]`: rank `r`'s spans, in seconds since the earliest rank began.
    pub ranks: Vec<Vec<Span>>,
}

impl Timeline {
    /// Aligns the ranks' records on their shared clock (the ranks are threads of one process)
    /// and orders them by rank.
    pub fn merge(mut records: Vec<RankTimeline>) -> Self {
        records.sort_by_key(|r| r.rank);
        let Some(origin) = records.iter().map(|r| r.origin).min() else {
            return Self::default();
        };
        let ranks = records
            .into_iter()
            .map(|r| {
                let shift = r.origin.duration_since(origin).as_secs_f64();
                r.spans
                    .into_iter()
                    .map(|s| Span {
                        start: s.start + shift,
                        end: s.end + shift,
                        ..s
                    })
                    .collect()
            })
            .collect();
        Self { ranks }
    }

    /// The timeline `schedule` would have if every action took its cost in `costs` (seconds
    /// = cost units) and messages were instant; `None` if the schedule deadlocks. A full
    /// backward costs `backward_input + backward_weight`.
    pub fn simulate(schedule: &Schedule, costs: Costs) -> Option<Self> {
        Self::simulate_with(schedule, |_, action| match action {
            Action::Forward { .. } => costs.forward as f64,
            Action::Backward { .. } => (costs.backward_input + costs.backward_weight) as f64,
            Action::BackwardInput { .. } => costs.backward_input as f64,
            Action::BackwardWeight { .. } => costs.backward_weight as f64,
            _ => 0.0,
        })
    }

    /// [`Timeline::simulate`] with each compute action costing `cost(rank, action)` seconds
    /// (e.g. what it measured on that rank: unequal stages included).
    pub fn simulate_with(
        schedule: &Schedule,
        cost: impl Fn(usize, &Action) -> f64,
    ) -> Option<Self> {
        let p = schedule.ranks();
        let mut pc = vec![0usize; p];
        let mut clock = vec![0.0f64; p];
        let mut spans: Vec<Vec<Span>> = vec![Vec::new(); p];
        // Message arrival times keyed by (is gradient, mb, destination stage).
        let mut posted: HashMap<(bool, usize, usize), f64> = HashMap::new();
        let pl = schedule.stage_map;
        loop {
            let mut progress = false;
            for r in 0..p {
                while let Some(&action) = schedule.actions[r].get(pc[r]) {
                    let s = pl.stage(r, action.chunk());
                    let mb = action.mb();
                    let cost = match action {
                        Action::SendActivation { .. } => {
                            posted.insert((false, mb, s + 1), clock[r]);
                            0.0
                        }
                        Action::SendGrad { .. } => {
                            posted.insert((true, mb, s.wrapping_sub(1)), clock[r]);
                            0.0
                        }
                        Action::RecvActivation { .. } | Action::RecvGrad { .. } => {
                            let key = (matches!(action, Action::RecvGrad { .. }), mb, s);
                            let Some(&at) = posted.get(&key) else { break };
                            clock[r] = clock[r].max(at);
                            0.0
                        }
                        _ => cost(r, &action),
                    };
                    spans[r].push(Span {
                        action,
                        start: clock[r],
                        end: clock[r] + cost,
                    });
                    clock[r] += cost;
                    pc[r] += 1;
                    progress = true;
                }
            }
            if !progress {
                break;
            }
        }
        (0..p)
            .all(|r| pc[r] == schedule.actions[r].len())
            .then_some(Self { ranks: spans })
    }

    /// Builds a timeline from spans already on one clock.
    pub fn from_spans(ranks: Vec<Vec<Span>>) -> Self {
        Self { ranks }
    }

    /// First start and last end over all ranks (seconds).
    pub fn extent(&self) -> (f64, f64) {
        let all = self.ranks.iter().flatten();
        let start = all.clone().map(|s| s.start).fold(f64::INFINITY, f64::min);
        let end = all.map(|s| s.end).fold(f64::NEG_INFINITY, f64::max);
        if start.is_finite() {
            (start, end)
        } else {
            (0.0, 0.0)
        }
    }

    /// Wall time of the step: first start to last end.
    pub fn makespan(&self) -> Duration {
        let (a, b) = self.extent();
        Duration::from_secs_f64((b - a).max(0.0))
    }

    /// The bubble fraction: idle time over total time, where total is `ranks × makespan` and
    /// idle is whatever a rank spent not computing (waiting on receives, or done early).
    pub fn bubble(&self) -> f64 {
        let (a, b) = self.extent();
        let total = (b - a) * self.ranks.len() as f64;
        if total <= 0.0 {
            return 0.0;
        }
        let busy: f64 = self
            .ranks
            .iter()
            .flatten()
            .filter(|s| s.action.is_compute())
            .map(|s| s.end - s.start)
            .sum();
        (1.0 - busy / total).max(0.0)
    }

    /// Each rank's compute time over the step (forward and backward actions), seconds.
    pub fn busy(&self) -> Vec<f64> {
        self.ranks
            .iter()
            .map(|spans| {
                let compute = spans.iter().filter(|s| s.action.is_compute());
                compute.map(|s| s.end - s.start).sum()
            })
            .collect()
    }

    /// The stage imbalance: the busiest rank's compute time over the mean rank's, minus one
    /// (0 on equal stages), from the executed compute ([`Timeline::busy`]).
    pub fn imbalance(&self) -> f64 {
        imbalance(&self.busy())
    }

    /// The bubble net of the stage imbalance: the measured bubble minus the idle that unequal
    /// stages force, `Σ_r (busy_max − busy_r) / (p × makespan)` (a rank with less compute than
    /// the busiest must idle that difference whatever the schedule). What is left equals the
    /// busiest rank's idle fraction, `1 − busy_max / makespan`: the bubble the schedule (and
    /// the runtime) add on top of the stages' imbalance, which is what the schedule would
    /// show on equal stages.
    pub fn bubble_net_of_imbalance(&self) -> f64 {
        let (a, b) = self.extent();
        let span = b - a;
        if span <= 0.0 {
            return 0.0;
        }
        let max = self.busy().into_iter().fold(0.0, f64::max);
        (1.0 - max / span).max(0.0)
    }

    /// The timeline as an SVG document: one row per rank, forward blue, backward green (input
    /// part light green, weight part purple), idle left blank, micro-batch numbers in the
    /// boxes (`3` or `3.1` for chunk 1).
    pub fn to_svg(&self, title: &str) -> String {
        let (t0, t1) = self.extent();
        let span = (t1 - t0).max(1e-12);
        let (left, top, row, gap, width) = (70.0, 40.0, 34.0, 6.0, 1000.0);
        let height = top + self.ranks.len() as f64 * (row + gap) + 50.0;
        let x = |t: f64| left + (t - t0) / span * width;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="monospace" font-size="11">"#,
            left + width + 20.0
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="20" font-size="14">{} — bubble {:.1}% — {:.2} ms</text>"#,
            escape(title),
            self.bubble() * 100.0,
            span * 1e3
        );
        for (r, spans) in self.ranks.iter().enumerate() {
            let y = top + r as f64 * (row + gap);
            let _ = writeln!(
                s,
                r##"<text x="8" y="{}">rank {r}</text><rect x="{left}" y="{y}" width="{width}" height="{row}" fill="#eeeeee"/>"##,
                y + row / 2.0 + 4.0
            );
            for sp in spans.iter().filter(|sp| sp.action.is_compute()) {
                let (color, tag) = match sp.action {
                    Action::Forward { .. } => ("#4c78a8", ""),
                    Action::Backward { .. } => ("#54a24b", ""),
                    Action::BackwardInput { .. } => ("#88d27a", ""),
                    _ => ("#b279a2", "w"),
                };
                let (x0, x1) = (x(sp.start), x(sp.end));
                let _ = writeln!(
                    s,
                    r#"<rect x="{x0:.2}" y="{y}" width="{:.2}" height="{row}" fill="{color}" stroke="white" stroke-width="0.5"><title>{}</title></rect>"#,
                    (x1 - x0).max(0.5),
                    sp.action
                );
                let label = if sp.action.chunk() == 0 {
                    format!("{tag}{}", sp.action.mb())
                } else {
                    format!("{tag}{}.{}", sp.action.mb(), sp.action.chunk())
                };
                if x1 - x0 > 7.0 * label.len() as f64 {
                    let _ = writeln!(
                        s,
                        r#"<text x="{:.2}" y="{}" fill="white" text-anchor="middle">{label}</text>"#,
                        (x0 + x1) / 2.0,
                        y + row / 2.0 + 4.0
                    );
                }
            }
        }
        let y = top + self.ranks.len() as f64 * (row + gap) + 20.0;
        let legend = [
            ("#4c78a8", "forward"),
            ("#54a24b", "backward"),
            ("#88d27a", "backward (input)"),
            ("#b279a2", "backward (weights)"),
            ("#eeeeee", "idle"),
        ];
        for (i, (color, name)) in legend.iter().enumerate() {
            let lx = left + i as f64 * 170.0;
            let _ = writeln!(
                s,
                r#"<rect x="{lx}" y="{}" width="14" height="14" fill="{color}"/><text x="{}" y="{}">{name}</text>"#,
                y - 11.0,
                lx + 20.0,
                y
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// `max / mean − 1` of `loads` (0 for equal loads): how much longer the busiest rank works
/// than the average one.
pub fn imbalance(loads: &[f64]) -> f64 {
    let mean = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    let max = loads.iter().copied().fold(0.0, f64::max);
    if mean > 0.0 { max / mean - 1.0 } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Generate;
    use crate::schedule::{Costs, ScheduleKind};
    use std::time::Duration;

    #[test]
    fn bubble_and_svg_of_a_simulated_1f1b() {
        let s = ScheduleKind::OneFOneB.generate(2, 4);
        let t = Timeline::simulate(&s, Costs::default()).unwrap();
        assert!((t.bubble() - 0.2).abs() < 1e-12);
        assert_eq!(t.makespan(), Duration::from_secs(15));
        let svg = t.to_svg("1f1b <p=2>");
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("1f1b &lt;p=2&gt; — bubble 20.0%"));
        assert_eq!(svg.matches("<title>Forward(").count(), 8);
        assert_eq!(svg.matches("<title>Backward(").count(), 8);
        assert!(svg.contains("rank 1"));
    }

    #[test]
    fn imbalance_and_the_bubble_net_of_it() {
        // 1F1B, p = 2, m = 4 with rank 1's actions twice rank 0's: rank 0 idles the
        // difference in compute whatever the schedule, plus the schedule's own bubble.
        let s = ScheduleKind::OneFOneB.generate(2, 4);
        let t = Timeline::simulate_with(&s, |r, a| {
            let unit = if r == 1 { 2.0 } else { 1.0 };
            match a {
                crate::Action::Forward { .. } => unit,
                _ => 2.0 * unit,
            }
        })
        .unwrap();
        assert_eq!(t.busy(), vec![12.0, 24.0]);
        assert!((t.imbalance() - (24.0 / 18.0 - 1.0)).abs() < 1e-12);
        let span = t.makespan().as_secs_f64();
        let forced = (24.0 - 12.0) / (2.0 * span);
        assert!((t.bubble_net_of_imbalance() - (t.bubble() - forced)).abs() < 1e-12);
        assert!((t.bubble_net_of_imbalance() - (1.0 - 24.0 / span)).abs() < 1e-12);
        // Equal stages: no imbalance, the whole bubble is the schedule's.
        let even = Timeline::simulate(&s, Costs::default()).unwrap();
        assert_eq!(even.imbalance(), 0.0);
        assert!((even.bubble_net_of_imbalance() - even.bubble()).abs() < 1e-12);
    }

    #[test]
    fn merge_aligns_ranks_on_their_clock() {
        let a = RankTimeline::start(1);
        std::thread::sleep(Duration::from_millis(5));
        let mut b = RankTimeline::start(0);
        let (s, e) = (b.origin, b.origin + Duration::from_millis(10));
        b.record(crate::Action::Forward { mb: 0, chunk: 0 }, s, e);
        let mut a = a;
        let o = a.origin;
        a.record(
            crate::Action::Forward { mb: 0, chunk: 0 },
            o,
            o + Duration::from_millis(15),
        );
        let t = Timeline::merge(vec![a, b]);
        // Rank 0 started ≥ 5 ms after rank 1, and comes first after the merge.
        assert!(t.ranks[0][0].start >= 0.005);
        assert_eq!(t.ranks[1][0].start, 0.0);
    }
}
