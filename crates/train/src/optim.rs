//! [`OptimizerKind`]: Burn's optimizers by name, for command lines (`--optim sgd|adamw`).
//! The trainer itself takes any `Fn() -> ModuleOptimizer`.

use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};

/// An optimizer chosen at run time. The hyper-parameters are the parity contract's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    /// Plain SGD: p ← p − lr·g (no momentum, no weight decay).
    Sgd,
    /// Burn's AdamW with β1 = 0.9, β2 = 0.95, ε = 1e-6, weight decay 0.1 (PyTorch's AdamW).
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

    /// Its name and hyper-parameters, as a checkpoint's index records them.
    pub fn describe(self) -> serde_json::Value {
        match self {
            Self::Sgd => serde_json::json!({"name": "sgd", "momentum": null, "weight_decay": null}),
            Self::AdamW => serde_json::json!({
                "name": "adamw", "beta_1": 0.9, "beta_2": 0.95, "epsilon": 1e-6, "weight_decay": 0.1
            }),
        }
    }

    /// A fresh Burn optimizer of this kind.
    pub fn build(self) -> ModuleOptimizer {
        match self {
            Self::Sgd => SgdConfig::new().init(),
            Self::AdamW => AdamWConfig::new()
                .with_beta_1(0.9)
                .with_beta_2(0.95)
                .with_epsilon(1e-6)
                .with_weight_decay(0.1)
                .init(),
        }
    }
}
