//! The learning rate of each optimizer step: a linear warmup, then constant, linear or cosine
//! decay to a minimum — the formulas of the parity contract (`notes/parity-harness.md`, "The
//! training recipe"). The position in the schedule is the step number itself, so a run resumed
//! at step s (in any layout) continues the schedule exactly where the saved run was.

use std::f64::consts::PI;

/// How the learning rate falls after the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    /// The peak rate to the end.
    #[default]
    Constant,
    /// A straight line from the peak to the minimum at the last step.
    Linear,
    /// Half a cosine from the peak to the minimum at the last step.
    Cosine,
}

impl Decay {
    /// The names [`parse`](Self::parse) takes.
    pub const NAMES: &'static str = "constant, linear, cosine";

    /// The decay named `name`; `Err` names the known ones.
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "constant" => Ok(Self::Constant),
            "linear" => Ok(Self::Linear),
            "cosine" => Ok(Self::Cosine),
            other => Err(format!(
                "--lr-decay {other}: unknown (known: {})",
                Self::NAMES
            )),
        }
    }
}

/// A schedule's shape around the run's peak learning rate and length (which
/// [`FitConfig`](crate::FitConfig) owns): `lr_at(s, lr, steps)` for step s = 0..steps−1 is
/// `lr·(s+1)/warmup` while `s < warmup`, then by [`Decay`]: `lr`; `lr − (lr − min)·f`; or
/// `min + (lr − min)·(1 + cos(π·f))/2`, with `f = (s − warmup)/(steps − warmup)`.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    /// Steps of linear warmup (0: none).
    pub warmup: usize,
    /// The decay after the warmup.
    pub decay: Decay,
    /// The rate the decay ends at (the contract's `lr_min`; default 0).
    pub min_lr: f64,
}

impl LrSchedule {
    /// The learning rate of optimizer step `step` of a run of `steps` steps peaking at `lr`.
    pub fn lr_at(&self, step: usize, lr: f64, steps: usize) -> f64 {
        if step < self.warmup {
            return lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = steps.saturating_sub(self.warmup).max(1) as f64;
        let f = ((step - self.warmup) as f64 / span).min(1.0);
        match self.decay {
            Decay::Constant => lr,
            Decay::Linear => lr - (lr - self.min_lr) * f,
            Decay::Cosine => self.min_lr + (lr - self.min_lr) * (1.0 + (PI * f).cos()) / 2.0,
        }
    }

    /// Refuses a schedule that cannot be run: a warmup longer than the run, or a minimum that
    /// is negative or above the peak `lr` under a decay.
    pub fn check(&self, lr: f64, steps: usize) -> Result<(), String> {
        if self.warmup > steps {
            return Err(format!(
                "--lr-warmup {}: longer than the run's {steps} steps",
                self.warmup
            ));
        }
        let decays = self.decay != Decay::Constant;
        if decays && !(0.0..=lr).contains(&self.min_lr) {
            return Err(format!(
                "--lr-min {}: must lie in [0, lr = {lr}] for a decay",
                self.min_lr
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-15 * b.abs().max(1.0), "{a} != {b}");
    }

    #[test]
    fn warmup_rises_linearly_to_the_peak() {
        let s = LrSchedule {
            warmup: 4,
            ..LrSchedule::default()
        };
        let lrs: Vec<f64> = (0..6).map(|i| s.lr_at(i, 1e-3, 10)).collect();
        for (got, want) in lrs.iter().zip([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]) {
            close(*got, want);
        }
    }

    #[test]
    fn decays_end_their_span_at_the_minimum() {
        let (lr, min, steps, w) = (1e-3, 1e-4, 12, 2);
        for decay in [Decay::Linear, Decay::Cosine] {
            let s = LrSchedule {
                warmup: w,
                decay,
                min_lr: min,
            };
            close(s.lr_at(w, lr, steps), lr);
            // Halfway (f = 1/2): the mean of peak and minimum for both.
            close(s.lr_at(w + (steps - w) / 2, lr, steps), (lr + min) / 2.0);
            // The last step is one step short of the end: f = 9/10.
            let f: f64 = 0.9;
            let last = match decay {
                Decay::Linear => lr - (lr - min) * f,
                _ => min + (lr - min) * (1.0 + (PI * f).cos()) / 2.0,
            };
            close(s.lr_at(steps - 1, lr, steps), last);
        }
    }

    #[test]
    fn cosine_values_are_the_contract_formula() {
        // Computed by hand from the contract: lr 0.01, min 0.001, S 8, W 3, s = 5 → f = 2/5.
        let s = LrSchedule {
            warmup: 3,
            decay: Decay::Cosine,
            min_lr: 1e-3,
        };
        let want = 1e-3 + (1e-2 - 1e-3) * (1.0 + (PI * 0.4).cos()) / 2.0;
        close(s.lr_at(5, 1e-2, 8), want);
        close(s.lr_at(0, 1e-2, 8), 1e-2 / 3.0);
    }

    #[test]
    fn impossible_schedules_are_refused() {
        let s = LrSchedule {
            warmup: 11,
            ..LrSchedule::default()
        };
        assert!(s.check(1e-3, 10).unwrap_err().contains("--lr-warmup 11"));
        let s = LrSchedule {
            decay: Decay::Cosine,
            min_lr: 2e-3,
            ..LrSchedule::default()
        };
        assert!(s.check(1e-3, 10).unwrap_err().contains("--lr-min"));
        assert!(
            Decay::parse("step")
                .unwrap_err()
                .contains("known: constant")
        );
    }
}
