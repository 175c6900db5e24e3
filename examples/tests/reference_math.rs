//! The Burn model computes exactly the contract's math: a naive f64 implementation written
//! from the contract (embeddings, pre-norm blocks, LayerNorm with biased variance and eps
//! 1e-5, causal attention with heads on contiguous feature ranges, exact erf GELU, untied
//! head, mean cross-entropy) gives the same logits and loss on random, large-scale weights.

mod common;

use bonfire_examples::default_device;
use bonfire_models::{Gpt, GptConfig};
use bonfire_module::params;
use std::collections::HashMap;

struct Ref<'a> {
    p: &'a HashMap<String, Vec<f64>>,
    cfg: GptConfig,
}

fn erf(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 3.0 {
        // Maclaurin series: fine in f64 for |x| < 3.
        let (mut term, mut sum, mut n) = (a, a, 0.0);
        while term.abs() > 1e-17 {
            n += 1.0;
            term *= -a * a / n;
            sum += term / (2.0 * n + 1.0);
        }
        2.0 / std::f64::consts::PI.sqrt() * sum
    } else {
        let x2 = a * a;
        let series = 1.0 - 1.0 / (2.0 * x2) + 3.0 / (4.0 * x2 * x2) - 15.0 / (8.0 * x2 * x2 * x2);
        1.0 - (-x2).exp() / (a * std::f64::consts::PI.sqrt()) * series
    };
    r.copysign(x)
}

impl Ref<'_> {
    fn linear(&self, name: &str, x: &[f64], d_in: usize, d_out: usize, bias: bool) -> Vec<f64> {
        let w = &self.p[&format!("{name}.weight")];
        (0..d_out)
            .map(|o| {
                let mut acc: f64 = (0..d_in).map(|i| w[o * d_in + i] * x[i]).sum();
                if bias {
                    acc += self.p[&format!("{name}.bias")][o];
                }
                acc
            })
            .collect()
    }

    fn layer_norm(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let (w, b) = (
            &self.p[&format!("{name}.weight")],
            &self.p[&format!("{name}.bias")],
        );
        x.iter()
            .enumerate()
            .map(|(i, v)| (v - mean) / (var + 1e-5).sqrt() * w[i] + b[i])
            .collect()
    }

    /// Logits `[T][V]` of one sequence.
    fn forward(&self, ids: &[i64]) -> Vec<Vec<f64>> {
        let c = self.cfg;
        let (d, t_len) = (c.d_model, ids.len());
        let dh = d / c.n_heads;
        let mut x: Vec<Vec<f64>> = ids
            .iter()
            .enumerate()
            .map(|(t, &id)| {
                (0..d)
                    .map(|k| {
                        self.p["tok_emb.weight"][id as usize * d + k]
                            + self.p["pos_emb.weight"][t * d + k]
                    })
                    .collect()
            })
            .collect();
        for l in 0..c.n_layers {
            let pre = |s: &str| format!("blocks.{l}.{s}");
            let h: Vec<Vec<f64>> = x.iter().map(|r| self.layer_norm(&pre("ln1"), r)).collect();
            let proj = |n: &str| -> Vec<Vec<f64>> {
                h.iter()
                    .map(|r| self.linear(&pre(n), r, d, d, true))
                    .collect()
            };
            let (q, k, v) = (proj("attn.q"), proj("attn.k"), proj("attn.v"));
            let mut cat = vec![vec![0.0; d]; t_len];
            for j in 0..c.n_heads {
                let f = j * dh..(j + 1) * dh;
                for tq in 0..t_len {
                    let scores: Vec<f64> = (0..=tq)
                        .map(|tk| {
                            f.clone().map(|i| q[tq][i] * k[tk][i]).sum::<f64>() / (dh as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for i in f.clone() {
                        cat[tq][i] = (0..=tq).map(|tk| e[tk] / z * v[tk][i]).sum();
                    }
                }
            }
            for t in 0..t_len {
                let o = self.linear(&pre("attn.o"), &cat[t], d, d, true);
                x[t].iter_mut().zip(o).for_each(|(a, b)| *a += b);
                let h2 = self.layer_norm(&pre("ln2"), &x[t]);
                let f1 = self.linear(&pre("mlp.fc1"), &h2, d, c.d_ff, true);
                let g: Vec<f64> = f1
                    .iter()
                    .map(|&u| u * 0.5 * (1.0 + erf(u / std::f64::consts::SQRT_2)))
                    .collect();
                let f2 = self.linear(&pre("mlp.fc2"), &g, c.d_ff, d, true);
                x[t].iter_mut().zip(f2).for_each(|(a, b)| *a += b);
            }
        }
        x.iter()
            .map(|r| {
                let h = self.layer_norm("ln_f", r);
                self.linear("head", &h, d, c.vocab_size, false)
            })
            .collect()
    }
}

#[test]
fn erf_is_accurate() {
    // Reference values of erf.
    for (x, e) in [
        (0.5, 0.5204998778130465),
        (1.0, 0.8427007929497149),
        (2.5, 0.999_593_047_982_555),
        (3.5, 0.9999992569016276),
    ] {
        assert!((erf(x) - e).abs() < 1e-9, "erf({x}) = {}", erf(x));
        assert!((erf(-x) + e).abs() < 1e-9);
    }
}

#[test]
fn logits_and_loss_match_the_contract() {
    let cfg = GptConfig::tiny();
    let device = default_device();
    let model = params::seeded(23, &device, |d| Gpt::new(&cfg, d));
    let infos = params::inventory(&model);
    // Large random weights (not the N(0, 0.02) init) so every part of the math matters.
    let mut state = 12345u64;
    let n = params::flatten_values(&model, &infos).len();
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1.2
        })
        .collect();
    let model = params::assign_values(model, &infos, &values);
    let mut by_path = HashMap::new();
    let mut at = 0;
    for p in &infos {
        by_path.insert(
            p.path.clone(),
            values[at..at + p.numel()]
                .iter()
                .map(|&v| v as f64)
                .collect(),
        );
        at += p.numel();
    }
    let reference = Ref { p: &by_path, cfg };

    let batches = common::random_batches(&cfg, 1, 2, 3);
    let (ids, targets) = batches.rows(0, 0, 2, &device);
    let logits = params::to_host(model.forward(ids.clone()));
    let loss = params::to_host(model.loss(ids, targets))[0] as f64;

    let t = cfg.max_seq_len;
    let mut ref_loss = 0.0;
    let mut ref_logits = Vec::new();
    for b in 0..2 {
        let seq = &batches.input_ids[b * t..(b + 1) * t];
        for (pos, row) in reference.forward(seq).into_iter().enumerate() {
            let m = row.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            ref_loss += lse - row[batches.targets[b * t + pos] as usize];
            ref_logits.extend(row.iter().map(|&v| v as f32));
        }
    }
    ref_loss /= (2 * t) as f64;
    assert!(
        (ref_loss - 32f64.ln()).abs() > 0.1,
        "weights too small to test anything"
    );
    let tol = bonfire_comm::testing::Tolerance::new(1e-4, 1e-5);
    bonfire_comm::testing::assert_close("logits", &logits, &ref_logits, tol);
    assert!(
        ((loss - ref_loss) / ref_loss).abs() < 1e-5,
        "loss {loss} vs reference {ref_loss}"
    );
}
