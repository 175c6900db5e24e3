//! PyTorch beside `cargo xtask bench train`: after Bonfire's rows, the same model, optimizer,
//! batch and step counts through `examples/benches/pytorch/train.py` (one rank with one
//! thread, then gloo DDP over `--ranks` processes of one thread each), in the same run, and a
//! `bench compare` line per layout both sides measured:
//! `bench compare model=… layout=single|ddp bonfire_tokens_per_s=… pytorch_tokens_per_s=…
//! ratio=… ratio_min=… ratio_max=… rounds=N` (ratio = Bonfire's tokens/s over PyTorch's).
//! `--rounds N` runs the two sides alternately N times: the figures are the medians over the
//! rounds, `ratio_min`/`ratio_max` the range of the rounds' own ratios. Where both sides print
//! their fastest step (`best_tokens_per_s=`), the line adds `best_bonfire_tokens_per_s=…
//! best_pytorch_tokens_per_s=… best_ratio=…`: each side's fastest over every round.
//!
//! The Python is [`crate::python`]'s; where it cannot import `torch` (and
//! `transformers` for the Llama) the bench says so in one `bench pytorch … skipped=…` line and
//! Bonfire's rows stand alone. `--no-pytorch` skips it. The Mixtral has no PyTorch row.

use crate::process::{Failure, Result};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// The script, relative to the workspace root.
const SCRIPT: &str = "examples/benches/pytorch/train.py";

/// The values of `--flag v` / `--flag=v` in `args`, or `default`.
fn flag(args: &[String], name: &str, default: &str) -> String {
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        if arg == name {
            return it.next().cloned().unwrap_or_default();
        }
        if let Some(v) = arg.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            return v.to_string();
        }
    }
    default.to_string()
}

/// `key=value`'s value in a bench line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// Runs `command`, echoing its standard output line by line, and returns those lines.
pub fn run_echoed(mut command: Command) -> std::result::Result<Vec<String>, Failure> {
    println!("$ {command:?}");
    let mut child = command
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| Failure::usage(format!("could not start {command:?}: {e}")))?;
    let mut lines = Vec::new();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line.map_err(|e| Failure::usage(e.to_string()))?;
        println!("{line}");
        lines.push(line);
    }
    let status = child.wait().map_err(|e| Failure::usage(e.to_string()))?;
    match status.success() {
        true => Ok(lines),
        false => Err(Failure {
            message: format!("{command:?} failed ({status})"),
            exit_code: status
                .code()
                .and_then(|c| u8::try_from(c).ok())
                .unwrap_or(1),
        }),
    }
}

/// The Python that can run the script for `model`, or why there is none.
fn python(model: &str) -> std::result::Result<String, String> {
    crate::python::with(match model {
        "llama" => "import torch, transformers",
        _ => "import torch",
    })
}

/// PyTorch's rows for the run `bench_args` describes (one rank, then `--ranks`), echoed; none
/// (with one `bench pytorch … skipped=…` line) where PyTorch is not installed, for the
/// Mixtral, or with `--no-pytorch`.
pub fn rows(bench_args: &[String]) -> Result<Vec<String>> {
    if bench_args.iter().any(|a| a == "--no-pytorch") {
        return Ok(Vec::new());
    }
    let model = flag(bench_args, "--model", "gpt");
    if model == "mixtral" {
        println!("bench pytorch model=mixtral skipped=no PyTorch counterpart");
        return Ok(Vec::new());
    }
    let default_opt = if model == "llama" { "adamw" } else { "sgd" };
    let python = match python(&model) {
        Ok(p) => p,
        Err(why) => {
            println!("bench pytorch model={model} skipped={why}");
            return Ok(Vec::new());
        }
    };
    let root = crate::process::root();
    let mut rows = Vec::new();
    for ranks in ["1".to_string(), flag(bench_args, "--ranks", "2")] {
        let mut command = Command::new(&python);
        command.arg(root.join(SCRIPT)).args([
            "--model".into(),
            model.clone(),
            "--optimizer".into(),
            flag(bench_args, "--optimizer", default_opt),
            "--ranks".into(),
            ranks,
            "--batch".into(),
            flag(bench_args, "--batch", "8"),
            "--steps".into(),
            flag(bench_args, "--steps", "5"),
            "--warmup".into(),
            flag(bench_args, "--warmup", "2"),
        ]);
        rows.extend(run_echoed(command)?);
    }
    Ok(rows)
}

/// The comparison of Bonfire's bench lines (`ours[i]`, round `i`) with PyTorch's rows of the
/// same rounds (`theirs[i]`): one `bench compare` line a layout both sides measured in every
/// round (medians, and the rounds' own ratio range: [`crate::compare::paired`]).
pub fn compare(bench_args: &[String], ours: &[Vec<String>], theirs: &[Vec<String>]) -> Vec<String> {
    let model = flag(bench_args, "--model", "gpt");
    let metric = |lines: &[String], layout: &str, prefix: &str, key: &str| {
        lines
            .iter()
            .filter(|l| l.starts_with(prefix) && field(l, "layout") == Some(layout))
            .find_map(|l| field(l, key)?.parse::<f64>().ok())
    };
    let tokens = |lines: &[String], layout: &str, prefix: &str| {
        metric(lines, layout, prefix, "tokens_per_s")
    };
    // A side's fastest step's tokens/s over every round, where every round has one.
    let best = |rounds: &[Vec<String>], layout: &str, prefix: &str| {
        crate::compare::best_of_rounds(rounds, |r| metric(r, layout, prefix, "best_tokens_per_s"))
    };
    let Some(first) = ours.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for line in first.iter().filter(|l| l.starts_with("bench train ")) {
        let layout = field(line, "layout").unwrap_or_default();
        let rounds: Option<Vec<(f64, f64)>> = ours
            .iter()
            .zip(theirs)
            .map(|(o, t)| Some((tokens(o, layout, "bench train ")?, tokens(t, layout, "")?)))
            .collect();
        let Some(p) = rounds.as_deref().and_then(crate::compare::paired) else {
            continue;
        };
        let mut row = format!(
            "bench compare model={model} layout={layout} bonfire_tokens_per_s={:.0} \
             pytorch_tokens_per_s={:.0} {}",
            p.ours,
            p.theirs,
            p.ratios()
        );
        if let (Some(o), Some(t)) = (best(ours, layout, "bench train "), best(theirs, layout, "")) {
            row.push_str(&format!(
                " best_bonfire_tokens_per_s={o:.0} best_pytorch_tokens_per_s={t:.0} \
                 best_ratio={:.2}",
                o / t
            ));
        }
        out.push(row);
    }
    out
}

/// `cargo bench` of the train bench with `extra_args`, PyTorch's rows after it, `--rounds`
/// times alternately (default 1), then [`compare`].
pub fn bench_train(extra_args: &[String]) -> Result {
    let (rounds, args) = crate::compare::take_rounds(extra_args).map_err(Failure::usage)?;
    let bench_args: Vec<String> = args
        .iter()
        .filter(|a| *a != "--no-pytorch")
        .cloned()
        .collect();
    let precision = flag(&args, "--precision", "f32");
    let binary = crate::compare::built("bonfire-examples", "train")?;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if rounds > 1 {
            println!("==> bench train: round {} of {rounds}", round + 1);
        }
        ours.push(crate::compare::measure(&binary, &bench_args)?);
        if precision == "f32" {
            theirs.push(rows(&args)?);
        }
    }
    if precision != "f32" {
        // PyTorch's side trains in f32: a ratio against it would not be like for like.
        println!("bench train side=pytorch skipped=bonfire ran --precision {precision}");
        return Ok(());
    }
    for line in compare(&args, &ours, &theirs) {
        println!("{line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_flags_and_fields() {
        let args: Vec<String> = ["--model", "llama", "--ranks=4"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(flag(&args, "--model", "gpt"), "llama");
        assert_eq!(flag(&args, "--ranks", "2"), "4");
        assert_eq!(flag(&args, "--steps", "5"), "5");
        let line = "bench train model=gpt layout=ddp ranks=2 tokens_per_s=2554 x=1";
        assert_eq!(field(line, "layout"), Some("ddp"));
        assert_eq!(field(line, "tokens_per_s"), Some("2554"));
        assert_eq!(field(line, "missing"), None);
    }

    #[test]
    fn layouts_compare_by_rounds_and_only_where_both_sides_ran() {
        let args: Vec<String> = vec!["--model".into(), "gpt".into()];
        let ours = |single: u32, ddp: u32| {
            vec![
                format!("bench train model=gpt layout=single ranks=1 tokens_per_s={single}"),
                format!("bench train model=gpt layout=ddp ranks=2 tokens_per_s={ddp}"),
                format!("bench train model=gpt layout=zero3 ranks=2 tokens_per_s={ddp}"),
            ]
        };
        let theirs = |single: u32| {
            vec![format!(
                "bench pytorch model=gpt layout=single ranks=1 tokens_per_s={single}"
            )]
        };
        // Round ratios 1.1 and 0.9 (single); medians 2,000 and 2,000.
        let out = compare(
            &args,
            &[ours(2200, 4000), ours(1800, 4000)],
            &[theirs(2000), theirs(2000)],
        );
        assert_eq!(
            out,
            vec![
                "bench compare model=gpt layout=single bonfire_tokens_per_s=2000 \
                 pytorch_tokens_per_s=2000 ratio=1.00 ratio_min=0.90 ratio_max=1.10 rounds=2"
                    .to_string()
            ]
        );
        // PyTorch skipped (no rows): no comparison at all.
        assert!(compare(&args, &[ours(1, 1)], &[]).is_empty());
        // The fastest steps: each side's best over every round (ours 2,600, PyTorch's 2,500).
        let with_best = |line: String, best: u32| format!("{line} best_tokens_per_s={best}");
        let ours_best = |single, ddp, best| {
            let mut rows = ours(single, ddp);
            rows[0] = with_best(rows[0].clone(), best);
            rows
        };
        let theirs_best = |single, best| vec![with_best(theirs(single)[0].clone(), best)];
        let out = compare(
            &args,
            &[ours_best(2200, 4000, 2600), ours_best(1800, 4000, 2400)],
            &[theirs_best(2000, 2100), theirs_best(2000, 2500)],
        );
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(
            out[0].ends_with(
                "rounds=2 best_bonfire_tokens_per_s=2600 best_pytorch_tokens_per_s=2500 \
                 best_ratio=1.04"
            ),
            "{}",
            out[0]
        );
    }
}
