//! Dynamic loss scaling for f16 training (PyTorch's `GradScaler`, DeepSpeed's fp16
//! optimizer): the loss is multiplied by a scale before backward so that small gradients
//! survive f16's narrow range; after the reduction the gradients are divided by it and
//! checked on every rank. A step with an infinite or NaN gradient anywhere is skipped (no
//! update, on every rank alike) and the scale is lowered; after `growth_interval` clean steps
//! in a row it is raised again.

/// The scaler's settings (PyTorch's defaults but for a shorter growth interval).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaling {
    /// The scale of the first step.
    pub init_scale: f32,
    /// What the scale is multiplied by after `growth_interval` clean steps.
    pub growth_factor: f32,
    /// What the scale is multiplied by after a step with an overflow.
    pub backoff_factor: f32,
    /// Clean steps in a row before the scale grows.
    pub growth_interval: usize,
    /// The scale never goes below this (a run whose gradients overflow even here is broken).
    pub min_scale: f32,
}

impl Default for LossScaling {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 1000,
            min_scale: 1.0 / 65536.0,
        }
    }
}

impl LossScaling {
    /// The scale of the first step.
    pub fn with_init_scale(mut self, scale: f32) -> Self {
        self.init_scale = scale;
        self
    }
    /// Clean steps in a row before the scale grows.
    pub fn with_growth_interval(mut self, steps: usize) -> Self {
        self.growth_interval = steps;
        self
    }
}

/// The scaler's state over a run.
#[derive(Debug, Clone)]
pub struct LossScaler {
    settings: LossScaling,
    scale: f32,
    clean: usize,
}

impl LossScaler {
    /// A scaler at `settings.init_scale`, with no clean step counted yet.
    pub fn new(settings: LossScaling) -> Self {
        Self {
            scale: settings.init_scale,
            settings,
            clean: 0,
        }
    }

    /// The scale of the next step.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// After a step: `finite` says whether its gradients were finite on every rank (the
    /// step was taken) or not (it was skipped).
    pub fn update(&mut self, finite: bool) {
        let s = &self.settings;
        if finite {
            self.clean += 1;
            if self.clean >= s.growth_interval {
                self.scale *= s.growth_factor;
                self.clean = 0;
            }
        } else {
            self.scale = (self.scale * s.backoff_factor).max(s.min_scale);
            self.clean = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_on_overflow_and_grows_after_clean_steps() {
        let mut s = LossScaler::new(LossScaling::default().with_growth_interval(3));
        assert_eq!(s.scale(), 65536.0);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 16384.0);
        s.update(true);
        s.update(true);
        assert_eq!(s.scale(), 16384.0);
        s.update(true);
        assert_eq!(s.scale(), 32768.0);
        s.update(true);
        s.update(false);
        s.update(true);
        s.update(true);
        assert_eq!(s.scale(), 16384.0, "an overflow restarts the count");
    }
}
