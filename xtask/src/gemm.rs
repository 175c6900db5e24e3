//! `cargo xtask bench gemm [--rounds N]` (issue 49, point 1): the bench models' matrix products
//! on one thread — Bonfire's (`examples/benches/gemm.rs`: Burn's matmul on Flex, with the
//! machine's FMA peak measured by a micro-kernel) and PyTorch's
//! (`examples/benches/pytorch/gemm.py`: MKL / oneDNN) in the same run — then one comparison
//! line per product:
//! `bench gemm compare shape=… dtype=… bonfire_gflops=… pytorch_gflops=… ratio=… of_peak=…`
//! (`ratio`: Bonfire's over PyTorch's; `of_peak`: Bonfire's over the measured f32 peak), and
//! where the bench timed Burn's own product too (bf16: Bonfire's is AMX's where the CPU has it)
//! `burn_gflops=… over_burn=…`.
//!
//! `--rounds N` (default 1) runs the two sides alternately N times, Bonfire's first in each
//! round, so that a machine whose speed drifts (a shared VM) weighs on both: every figure is
//! then the median over the rounds, and `ratio_min=… ratio_max=…` are the lowest and highest
//! of the rounds' own ratios (Bonfire's over PyTorch's of the same round) — a goal is met only
//! where `ratio_min` meets it. Each side also prints its fastest repetition (`best_gflops=`, and
//! the peak's `peak_best_gflops=`): the row adds `best_bonfire_gflops=… best_pytorch_gflops=…
//! best_ratio=… best_of_peak=…`, each side's fastest over every round — what each side's
//! product does when a shared VM's neighbours slow it least, the same estimate on both sides
//! (`docs/performance.md` says which goals each figure meets). Where the Python cannot import torch, one `… skipped=…` line
//! says so and Bonfire's rows stand alone. Bonfire's side builds in the bench profile
//! (release): the dev profile's debug assertions and overflow checks, which apply to the
//! dependencies too, slow `gemm`'s kernels 2.6× (measured: 107–113 → 41–43 GFLOP/s on the
//! same shapes).

use crate::compare::{best_of_rounds, built, measure, median, paired, take_rounds};
use crate::process::{self, Failure, Result};
use crate::pytorch::{field, run_echoed};
use std::process::Command;

/// A product line's `(shape, dtype)`.
fn key(line: &str) -> (Option<&str>, Option<&str>) {
    (field(line, "shape"), field(line, "dtype"))
}

/// Runs both sides `--rounds` times and prints the comparison.
pub fn bench(extra_args: &[String]) -> Result {
    let (rounds, bench_args) = take_rounds(extra_args).map_err(Failure::usage)?;
    let python = crate::python::with("import torch");
    let binary = built("bonfire-examples", "gemm")?;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        println!("==> bench gemm: round {} of {rounds}", round + 1);
        ours.push(measure(&binary, &bench_args)?);
        match &python {
            Ok(python) => {
                let mut command = Command::new(python);
                command.arg(process::root().join("examples/benches/pytorch/gemm.py"));
                theirs.push(run_echoed(command)?);
            }
            Err(why) => {
                println!("bench gemm side=pytorch skipped={why}");
                return Ok(());
            }
        }
    }
    for line in report(&ours, &theirs) {
        println!("{line}");
    }
    Ok(())
}

/// The comparison lines of `ours[i]` against `theirs[i]`, round `i` of each side: one per
/// product both sides measured in every round.
pub fn report(ours: &[Vec<String>], theirs: &[Vec<String>]) -> Vec<String> {
    // A side's `metric` for `line`'s product in `round` (a `bonfire`, `burn` or PyTorch line).
    let figure_of = |metric: &str, round: &[String], side: Option<&str>, line: &str| {
        round
            .iter()
            .filter(|l| side.is_none_or(|s| field(l, "side") == Some(s)) && key(l) == key(line))
            .find_map(|l| field(l, metric)?.parse::<f64>().ok())
    };
    let figure = |round: &[String], side, line: &str| figure_of("gflops", round, side, line);
    // The peak's `metric` in `round`.
    let peak_in = |metric: &'static str| {
        move |round: &Vec<String>| round.iter().find_map(|l| field(l, metric)?.parse().ok())
    };
    // Every round's peak, or none.
    let peaks: Option<Vec<f64>> = ours.iter().map(peak_in("peak_gflops")).collect();
    let peak = peaks.filter(|p| !p.is_empty()).map(median);
    let peak_best = best_of_rounds(ours, peak_in("peak_best_gflops"));
    let Some(first) = ours.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for line in first.iter().filter(|l| field(l, "side") == Some("bonfire")) {
        // Every round of both sides, or no line: a product missing once is not compared.
        let per_round: Option<Vec<(f64, f64)>> = ours
            .iter()
            .zip(theirs)
            .map(|(o, t)| Some((figure(o, Some("bonfire"), line)?, figure(t, None, line)?)))
            .collect();
        let Some(per_round) = per_round else {
            continue;
        };
        let Some(p) = paired(&per_round) else {
            continue;
        };
        let (shape, dtype) = key(line);
        let mut row = format!(
            "bench gemm compare shape={} dtype={} bonfire_gflops={:.1} pytorch_gflops={:.1} {}",
            shape.unwrap_or_default(),
            dtype.unwrap_or_default(),
            p.ours,
            p.theirs,
            p.ratios(),
        );
        let bonfire = p.ours;
        if let Some(peak) = peak {
            row.push_str(&format!(" of_peak={:.2}", bonfire / peak));
        }
        // Each side's fastest repetition over every round, where every round has one.
        let best = |rounds: &[Vec<String>], side| {
            best_of_rounds(rounds, |r| figure_of("best_gflops", r, side, line))
        };
        if let (Some(o), Some(t)) = (best(ours, Some("bonfire")), best(theirs, None)) {
            row.push_str(&format!(
                " best_bonfire_gflops={o:.1} best_pytorch_gflops={t:.1} best_ratio={:.2}",
                o / t
            ));
            if let Some(peak) = peak_best {
                row.push_str(&format!(" best_of_peak={:.2}", o / peak));
            }
        }
        let burn: Option<Vec<f64>> = ours.iter().map(|o| figure(o, Some("burn"), line)).collect();
        if let Some(burn) = burn.filter(|b| !b.is_empty()) {
            let burn = median(burn);
            row.push_str(&format!(
                " burn_gflops={burn:.1} over_burn={:.2}",
                bonfire / burn
            ));
        }
        out.push(row);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(s: &[&str]) -> Vec<String> {
        s.iter().map(|l| l.to_string()).collect()
    }

    #[test]
    fn medians_over_rounds_and_the_rounds_own_ratios() {
        let ours = |g: f64, b: f64, peak: f64| {
            lines(&[
                &format!(
                    "bench gemm peak_gflops={peak} peak_best_gflops={} isa=avx2",
                    peak + 10.0
                ),
                &format!(
                    "bench gemm side=bonfire shape=head.dx m=1 n=2 k=3 dtype=f32 gflops={g} \
                     best_gflops={}",
                    g + 5.0
                ),
                &format!("bench gemm side=bonfire shape=fc1.fwd m=1 n=2 k=3 dtype=bf16 gflops={b}"),
                &format!(
                    "bench gemm side=burn shape=fc1.fwd m=1 n=2 k=3 dtype=bf16 gflops={}",
                    b / 2.0
                ),
            ])
        };
        let theirs = |g: f64| {
            lines(&[
                "bench gemm side=pytorch torch=2 threads=1",
                &format!(
                    "bench gemm side=pytorch shape=head.dx m=1 n=2 k=3 dtype=f32 gflops={g} \
                     best_gflops={}",
                    g * 1.5
                ),
            ])
        };
        // Rounds: ratios 90/100 = 0.9, 100/80 = 1.25, 80/80 = 1.0.
        let out = report(
            &[
                ours(90.0, 50.0, 100.0),
                ours(100.0, 60.0, 100.0),
                ours(80.0, 70.0, 100.0),
            ],
            &[theirs(100.0), theirs(80.0), theirs(80.0)],
        );
        assert_eq!(out.len(), 1, "only the product PyTorch measured: {out:?}");
        assert!(
            out[0].contains(
                "shape=head.dx dtype=f32 bonfire_gflops=90.0 pytorch_gflops=80.0 ratio=1.12 \
                 ratio_min=0.90 ratio_max=1.25 rounds=3 of_peak=0.90"
            ),
            "{}",
            out[0]
        );
        // The fastest over every round of each side: ours 105, PyTorch's 150, the peak's 110.
        assert!(
            out[0].contains(
                "best_bonfire_gflops=105.0 best_pytorch_gflops=150.0 best_ratio=0.70 \
                 best_of_peak=0.95"
            ),
            "{}",
            out[0]
        );
        // A product one round lacks is not compared; Burn's figure rides along where present.
        let mut short = theirs(80.0);
        short.pop();
        let out = report(
            &[ours(90.0, 50.0, 100.0), ours(90.0, 50.0, 100.0)],
            &[theirs(80.0), short],
        );
        assert!(out.is_empty(), "{out:?}");
        let both =
            lines(&["bench gemm side=pytorch shape=fc1.fwd m=1 n=2 k=3 dtype=bf16 gflops=25"]);
        let out = report(&[ours(90.0, 50.0, 100.0)], &[both]);
        assert_eq!(out.len(), 1, "{out:?}");
        // No best figure on PyTorch's side: no best comparison, the medians' stands.
        assert!(!out[0].contains("best_"), "{}", out[0]);
        assert!(
            out[0].contains("ratio=2.00") && out[0].contains("burn_gflops=25.0 over_burn=2.00"),
            "{}",
            out[0]
        );
    }
}
