//! YaRN's RoPE scaling (`rope_type: yarn`, arXiv:2309.00071) as DeepSeek-V3's config asks for
//! it (transformers' `_compute_yarn_parameters` and `yarn_apply_mscale`): the inverse
//! frequencies blended between θ^(−2j/r) (extrapolated) and the same ÷ `factor`
//! (interpolated) by a linear ramp over the pairs between the correction dimensions of
//! `beta_fast` and `beta_slow` rotations in `original_max_position_embeddings` positions;
//! cos and sin multiplied by the attention factor; and latent attention's softmax scale by
//! mscale(`factor`, `mscale_all_dim`)².

use serde_json::{Value, json};

/// YaRN's parameters (the `rope_parameters` fields of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// How much longer the context is than the one pre-trained on.
    pub factor: f64,
    /// The context length pre-trained on.
    pub original_max_position_embeddings: usize,
    /// Rotations bounding the extrapolated pairs (default 32).
    pub beta_fast: f64,
    /// Rotations bounding the interpolated pairs (default 1).
    pub beta_slow: f64,
    /// The attention factor's numerator mscale (with `mscale_all_dim`).
    pub mscale: Option<f64>,
    /// Its denominator's, and the softmax scale's.
    pub mscale_all_dim: Option<f64>,
    /// cos and sin's factor, when given (else from `factor` and the mscales).
    pub attention_factor: Option<f64>,
    /// Whether the correction range is rounded outwards to whole pairs (default true).
    pub truncate: bool,
}

/// YaRN's mscale: `0.1 · m · ln(scale) + 1` (1 when `scale ≤ 1`).
fn mscale(scale: f64, m: f64) -> f64 {
    match scale <= 1.0 {
        true => 1.0,
        false => 0.1 * m * scale.ln() + 1.0,
    }
}

impl Yarn {
    /// Reads a `rope_parameters` (or `rope_scaling`) object of type yarn.
    pub fn from_json(rope: &Value) -> Result<Self, String> {
        let number = |f: &str| rope.get(f).filter(|v| !v.is_null()).and_then(Value::as_f64);
        let positive = |f: &str| {
            number(f)
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| format!("rope_type yarn: `{f}` missing or not positive"))
        };
        Ok(Self {
            factor: positive("factor")?,
            original_max_position_embeddings: positive("original_max_position_embeddings")?
                as usize,
            beta_fast: number("beta_fast").unwrap_or(32.0),
            beta_slow: number("beta_slow").unwrap_or(1.0),
            mscale: number("mscale"),
            mscale_all_dim: number("mscale_all_dim"),
            attention_factor: number("attention_factor"),
            truncate: rope.get("truncate").and_then(Value::as_bool) != Some(false),
        })
    }

    /// The `rope_parameters` of an exported `config.json` (with `rope_theta` θ).
    pub fn json(&self, theta: f64) -> Value {
        json!({
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "mscale": self.mscale,
            "mscale_all_dim": self.mscale_all_dim,
            "attention_factor": self.attention_factor,
            "truncate": self.truncate,
        })
    }

    /// cos and sin's factor.
    pub fn attention_factor(&self) -> f64 {
        self.attention_factor
            .unwrap_or_else(|| match (self.mscale, self.mscale_all_dim) {
                (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    mscale(self.factor, m) / mscale(self.factor, all)
                }
                _ => mscale(self.factor, 1.0),
            })
    }

    /// The softmax scale's factor (`mscale(factor, mscale_all_dim)²`; 1 without one).
    pub fn softmax_factor(&self) -> f64 {
        match self.mscale_all_dim {
            Some(all) if all != 0.0 => mscale(self.factor, all).powi(2),
            _ => 1.0,
        }
    }

    /// The inverse frequencies of `dim` rotary features (dim/2 pairs) with base `theta`.
    pub fn inv_freqs(&self, theta: f64, dim: usize) -> Vec<f64> {
        let original = self.original_max_position_embeddings as f64;
        let correction = |rotations: f64| {
            dim as f64 * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (correction(self.beta_fast), correction(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..dim / 2)
            .map(|j| {
                let extrapolated = theta.powf(-((2 * j) as f64) / dim as f64);
                let interpolated = extrapolated / self.factor;
                let ramp = ((j as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                interpolated * (1.0 - keep) + extrapolated * keep
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSeek-V3's own parameters: equal mscales give an attention factor of 1, the
    /// softmax scale grows by (0.1·ln 40 + 1)²; the fastest pair is kept, the slowest divided
    /// by the factor.
    #[test]
    fn deepseek_v3s_yarn() {
        let y = Yarn::from_json(&json!({"type": "yarn", "factor": 40, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}))
        .unwrap();
        assert_eq!(y.attention_factor(), 1.0);
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((y.softmax_factor() - m * m).abs() < 1e-12);
        let f = y.inv_freqs(10_000.0, 64);
        assert_eq!(f[0], 1.0);
        let slowest = 10_000f64.powf(-62.0 / 64.0);
        assert!((f[31] - slowest / 40.0).abs() < 1e-18);
        assert_eq!(Yarn::from_json(&y.json(10_000.0)).unwrap(), y);
    }
}
