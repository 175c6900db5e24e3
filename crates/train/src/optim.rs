//! Burn's optimizers by name and settings, for command lines: [`OptimizerKind`]
//! (`--optim sgd|adamw`) and [`OptimizerSpec`], the kind with AdamW's settings
//! (`--adamw-betas`, `--adamw-eps`, `--weight-decay`, `--no-decay-1d`). The trainer itself
//! takes any `Fn() -> ModuleOptimizer`; [`crate::Trainer::with_optimizer`] takes a spec.

use bonfire_module::DecaySplit;
use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};

/// An optimizer chosen at run time. The hyper-parameters are [`AdamWSettings`]' (by default
/// the parity contract's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    /// Plain SGD: p ← p − lr·g (no momentum, no weight decay).
    Sgd,
    /// Burn's AdamW (PyTorch's AdamW), by default with β1 = 0.9, β2 = 0.95, ε = 1e-6, weight
    /// decay 0.1 on every parameter.
    AdamW,
}

impl OptimizerKind {
    /// The optimizer named `name` (`sgd` or `adamw`, as `--optim` takes it); `Err` says what
    /// is expected.
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "sgd" => Ok(Self::Sgd),
            "adamw" => Ok(Self::AdamW),
            other => Err(format!("--optim {other}: expected `sgd` or `adamw`")),
        }
    }

    /// Its name, as [`parse`](Self::parse) takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sgd => "sgd",
            Self::AdamW => "adamw",
        }
    }

    /// Its name and hyper-parameters (the defaults), as a checkpoint's index records them.
    pub fn describe(self) -> serde_json::Value {
        OptimizerSpec::from(self).describe()
    }

    /// A fresh Burn optimizer of this kind, with the default settings.
    pub fn build(self) -> ModuleOptimizer {
        OptimizerSpec::from(self).build()
    }
}

/// AdamW's settings; the defaults are the parity contract's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWSettings {
    /// β1, β2 (`--adamw-betas B1,B2`).
    pub betas: (f32, f32),
    /// ε (`--adamw-eps`).
    pub epsilon: f32,
    /// The decoupled weight decay (`--weight-decay`).
    pub weight_decay: f32,
    /// Decay only parameters of two or more dimensions (`--no-decay-1d`): norm weights,
    /// biases and other 1-d tensors undecayed — PyTorch's two parameter groups.
    pub no_decay_1d: bool,
}

impl Default for AdamWSettings {
    fn default() -> Self {
        Self {
            betas: (0.9, 0.95),
            epsilon: 1e-6,
            weight_decay: 0.1,
            no_decay_1d: false,
        }
    }
}

impl AdamWSettings {
    /// Refuses settings PyTorch's AdamW refuses (β outside [0, 1), ε or the decay negative
    /// or not finite).
    pub fn check(&self) -> Result<(), String> {
        let (b1, b2) = self.betas;
        for (name, b) in [("β1", b1), ("β2", b2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(format!("--adamw-betas: {name} = {b} is outside [0, 1)"));
            }
        }
        if !(self.epsilon.is_finite() && self.epsilon >= 0.0) {
            return Err(format!("--adamw-eps {}: expected ≥ 0", self.epsilon));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(format!(
                "--weight-decay {}: expected ≥ 0",
                self.weight_decay
            ));
        }
        Ok(())
    }
}

/// An optimizer and its settings, chosen at run time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerSpec {
    /// SGD or AdamW.
    pub kind: OptimizerKind,
    /// AdamW's settings (unused by SGD).
    pub adamw: AdamWSettings,
}

impl From<OptimizerKind> for OptimizerSpec {
    fn from(kind: OptimizerKind) -> Self {
        Self {
            kind,
            adamw: AdamWSettings::default(),
        }
    }
}

impl OptimizerSpec {
    /// Its name and hyper-parameters, as a checkpoint's index records them.
    pub fn describe(&self) -> serde_json::Value {
        let a = &self.adamw;
        match self.kind {
            OptimizerKind::Sgd => {
                serde_json::json!({"name": "sgd", "momentum": null, "weight_decay": null})
            }
            OptimizerKind::AdamW => serde_json::json!({
                "name": "adamw", "beta_1": a.betas.0, "beta_2": a.betas.1,
                "epsilon": a.epsilon, "weight_decay": a.weight_decay,
                "no_decay_1d": a.no_decay_1d,
            }),
        }
    }

    /// The weight decay the data-parallel wrapper applies itself: AdamW's, kept off 1-d
    /// parameters, when asked (`None` otherwise: the optimizer decays every parameter).
    pub fn decay_split(&self) -> Option<DecaySplit> {
        let a = &self.adamw;
        (self.kind == OptimizerKind::AdamW && a.no_decay_1d && a.weight_decay != 0.0).then_some(
            DecaySplit {
                rate: a.weight_decay,
            },
        )
    }

    /// A fresh Burn optimizer: Burn's AdamW config carries β, ε and the decay — none when the
    /// wrapper applies it ([`decay_split`](Self::decay_split)).
    pub fn build(&self) -> ModuleOptimizer {
        let a = &self.adamw;
        match self.kind {
            OptimizerKind::Sgd => SgdConfig::new().init(),
            OptimizerKind::AdamW => AdamWConfig::new()
                .with_beta_1(a.betas.0)
                .with_beta_2(a.betas.1)
                .with_epsilon(a.epsilon)
                .with_weight_decay(match self.decay_split() {
                    Some(_) => 0.0,
                    None => a.weight_decay,
                })
                .init(),
        }
    }
}
