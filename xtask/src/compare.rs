//! `cargo xtask bench compare --rev A --rev B [--target train] [--rounds N] [--metric K] --
//! <bench args>`: a before/after measurement anyone can re-run.
//!
//! Each revision is checked out in a worktree of its own (`target/compare/<sha>/src`) and its
//! bench built there into its own target folder (`target/compare/<sha>/target`), so the two
//! builds share nothing. Then `--rounds` rounds run A's bench, PyTorch's side of it (where it
//! is installed, for `bench train`), and B's, interleaved, so that both revisions meet the
//! same machine: load and thermal drift fall on both. Every bench line the two revisions
//! print with the metric (default `tokens_per_s`) is matched by its other `key=value` fields,
//! and one line a row says the medians and their ratio:
//!
//! `bench compare a=<sha> b=<sha> <the row's fields> a_<metric>=… b_<metric>=… ratio=… rounds=N`
//!
//! (ratio = B over A), with `pytorch_<metric>=…` and B's ratio to it where PyTorch ran the row.

use crate::process::{self, Failure, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The options of `bench compare` (before the `--`).
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// The two revisions, A then B.
    pub revs: [String; 2],
    /// The bench target (`cargo xtask bench <target>`'s name).
    pub target: String,
    /// Rounds, A then PyTorch then B each.
    pub rounds: usize,
    /// The field compared.
    pub metric: String,
}

/// `compare`'s own options out of `args` (up to `--`), and the bench's arguments after it.
pub fn parse(args: &[String]) -> std::result::Result<(Options, Vec<String>), String> {
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let (own, bench) = (&args[..split], args.get(split + 1..).unwrap_or_default());
    let mut revs = Vec::new();
    let (mut target, mut rounds, mut metric) = ("train".to_string(), 3, "tokens_per_s".into());
    let mut it = own.iter();
    while let Some(arg) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("`{arg}` needs a value"))
        };
        match arg.as_str() {
            "--rev" => revs.push(value()?),
            "--target" => target = value()?,
            "--metric" => metric = value()?,
            "--rounds" => rounds = value()?.parse().map_err(|e| format!("--rounds: {e}"))?,
            other => return Err(format!("unknown option `{other}` of bench compare")),
        }
    }
    let revs: [String; 2] = revs
        .try_into()
        .map_err(|_| "bench compare needs two revisions: --rev A --rev B".to_string())?;
    if rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    let options = Options {
        revs,
        target,
        rounds,
        metric,
    };
    Ok((options, bench.to_vec()))
}

/// Runs `bench compare` (see the module docs).
pub fn run(args: &[String]) -> Result {
    let (options, bench_args) = parse(args).map_err(Failure::usage)?;
    let (package, bench) = crate::bench::target(&options.target)?;
    let root = process::root();
    let mut binaries = Vec::new();
    for rev in &options.revs {
        let sha = resolve(&root, rev)?;
        binaries.push((sha.clone(), build(&root, &sha, package, bench)?));
    }
    let mut lines: [Vec<String>; 2] = [Vec::new(), Vec::new()];
    let mut pytorch = Vec::new();
    for round in 0..options.rounds {
        println!(
            "==> bench compare: round {} of {}",
            round + 1,
            options.rounds
        );
        lines[0].extend(measure(&binaries[0].1, &bench_args)?);
        if options.target == "train" {
            pytorch.extend(crate::pytorch::rows(&bench_args)?);
        }
        lines[1].extend(measure(&binaries[1].1, &bench_args)?);
    }
    let shas = [binaries[0].0.as_str(), binaries[1].0.as_str()];
    for line in report(shas, &options, &lines, &pytorch) {
        println!("{line}");
    }
    Ok(())
}

/// The commit `rev` names.
fn resolve(root: &Path, rev: &str) -> Result<String> {
    let out = Command::new("git")
        .args(["rev-parse", "--short=12", &format!("{rev}^{{commit}}")])
        .current_dir(root)
        .output()
        .map_err(|e| Failure::usage(format!("git rev-parse: {e}")))?;
    if !out.status.success() {
        return Err(Failure::usage(format!("`{rev}` names no commit")));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `sha`'s bench `bench` of `package`, built in its own worktree and target folder; its path.
fn build(root: &Path, sha: &str, package: &str, bench: &str) -> Result<PathBuf> {
    let base = root.join("target/compare").join(sha);
    let src = base.join("src");
    if !src.join("Cargo.toml").is_file() {
        let mut add = Command::new("git");
        add.args(["worktree", "add", "--force", "--detach"])
            .arg(&src)
            .arg(sha)
            .current_dir(root);
        process::run(add)?;
    }
    let mut cargo = process::cargo();
    cargo
        .args([
            "bench",
            "--no-run",
            "--message-format",
            "json-render-diagnostics",
        ])
        .args(["-p", package, "--bench", bench])
        .env("CARGO_TARGET_DIR", base.join("target"))
        .current_dir(&src);
    println!(
        "$ (in {}) cargo bench --no-run -p {package} --bench {bench}",
        src.display()
    );
    let out = cargo
        .output()
        .map_err(|e| Failure::usage(format!("cargo bench --no-run: {e}")))?;
    if !out.status.success() {
        return Err(Failure::usage(format!(
            "building {sha}'s bench `{bench}` failed"
        )));
    }
    executable(&String::from_utf8_lossy(&out.stdout), bench).ok_or_else(|| {
        Failure::usage(format!(
            "cargo named no executable of {sha}'s bench `{bench}`"
        ))
    })
}

/// The executable of bench target `bench` among cargo's JSON messages `json`.
pub fn executable(json: &str, bench: &str) -> Option<PathBuf> {
    json.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == bench)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
}

/// One run of a built bench (as `cargo bench` runs it: `--bench` first), its lines.
pub fn measure(binary: &Path, args: &[String]) -> Result<Vec<String>> {
    let mut command = Command::new(binary);
    command
        .arg("--bench")
        .args(args)
        .current_dir(process::root());
    crate::pytorch::run_echoed(command)
}

/// A bench line's identity: its non-numeric fields but `metric`'s and the timings', sorted
/// (`bench train model=gpt layout=ddp`).
pub fn identity(line: &str, metric: &str) -> Option<String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    if words.first() != Some(&"bench") || !line.contains(&format!(" {metric}=")) {
        return None;
    }
    let mut keys: Vec<&str> = words[1..]
        .iter()
        .copied()
        .filter(|w| match w.split_once('=') {
            None => true,
            Some((k, v)) => k != metric && v.parse::<f64>().is_err(),
        })
        .collect();
    keys.sort();
    Some(keys.join(" "))
}

/// The largest of a figure over every round, or none where a round lacks it or there is no
/// round: a side's fastest over the rounds (`best_gflops`, `peak_best_gflops`,
/// `best_tokens_per_s`).
pub fn best_of_rounds<R>(rounds: &[R], figure: impl Fn(&R) -> Option<f64>) -> Option<f64> {
    let all: Option<Vec<f64>> = rounds.iter().map(figure).collect();
    all.filter(|v| !v.is_empty())
        .map(|v| v.into_iter().fold(f64::NEG_INFINITY, f64::max))
}

/// The median of `v` (`v` not empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n % 2 {
        1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The executable of `package`'s bench `bench`, built (release) in this checkout: rounds run
/// it, not `cargo bench`, so a source edited while they run changes nothing measured.
pub fn built(package: &str, bench: &str) -> Result<PathBuf> {
    let args = ["bench", "-p", package, "--bench", bench, "--no-run"];
    println!("$ cargo {}", args.join(" "));
    crate::mpi::built_executable(&args, bench).map(PathBuf::from)
}

/// `--rounds N` taken out of `args` (default 1), and the rest (a bench's own arguments).
pub fn take_rounds(args: &[String]) -> std::result::Result<(usize, Vec<String>), String> {
    let (mut rounds, mut rest, mut it) = (1, Vec::new(), args.iter());
    while let Some(arg) = it.next() {
        let value = match arg.strip_prefix("--rounds") {
            Some("") => it.next().cloned().unwrap_or_default(),
            Some(v) if v.starts_with('=') => v[1..].to_string(),
            _ => {
                rest.push(arg.clone());
                continue;
            }
        };
        rounds = value
            .parse()
            .map_err(|e| format!("--rounds {value:?}: {e}"))?;
    }
    match rounds {
        0 => Err("--rounds must be at least 1".into()),
        n => Ok((n, rest)),
    }
}

/// One row measured by two sides in the same rounds: each side's median, the ratio of the
/// medians, and the lowest and highest of the rounds' own ratios (ours over theirs of one
/// round) — the spread a drifting machine leaves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Paired {
    pub ours: f64,
    pub theirs: f64,
    pub min: f64,
    pub max: f64,
    pub rounds: usize,
}

impl Paired {
    /// `ratio=… ratio_min=… ratio_max=… rounds=N`.
    pub fn ratios(&self) -> String {
        format!(
            "ratio={:.2} ratio_min={:.2} ratio_max={:.2} rounds={}",
            self.ours / self.theirs,
            self.min,
            self.max,
            self.rounds
        )
    }
}

/// [`Paired`] of the rounds' `(ours, theirs)`; `None` when there are none.
pub fn paired(rounds: &[(f64, f64)]) -> Option<Paired> {
    if rounds.is_empty() {
        return None;
    }
    let ratios = rounds.iter().map(|(a, b)| a / b);
    Some(Paired {
        ours: median(rounds.iter().map(|p| p.0).collect()),
        theirs: median(rounds.iter().map(|p| p.1).collect()),
        min: ratios.clone().fold(f64::INFINITY, f64::min),
        max: ratios.fold(f64::NEG_INFINITY, f64::max),
        rounds: rounds.len(),
    })
}

/// The `bench compare` lines of the two revisions' `lines` (and PyTorch's rows).
pub fn report(
    shas: [&str; 2],
    options: &Options,
    lines: &[Vec<String>; 2],
    pytorch: &[String],
) -> Vec<String> {
    let metric = options.metric.as_str();
    let values = |lines: &[String]| {
        let mut by: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for line in lines {
            let value = crate::pytorch::field(line, metric).and_then(|v| v.parse::<f64>().ok());
            if let (Some(id), Some(v)) = (identity(line, metric), value) {
                by.entry(id).or_default().push(v);
            }
        }
        by
    };
    let (a, b) = (values(&lines[0]), values(&lines[1]));
    let mut out = Vec::new();
    for (id, va) in &a {
        let Some(vb) = b.get(id) else {
            out.push(format!("bench compare missing={id:?} in={}", shas[1]));
            continue;
        };
        let (ma, mb) = (median(va.clone()), median(vb.clone()));
        let row = id.trim_start_matches("bench ").to_string();
        let mut line = format!(
            "bench compare a={} b={} {row} a_{metric}={ma:.1} b_{metric}={mb:.1} ratio={:.3} rounds={}",
            shas[0],
            shas[1],
            mb / ma,
            va.len().min(vb.len())
        );
        if let Some(theirs) = pytorch_value(pytorch, &row, metric) {
            line.push_str(&format!(
                " pytorch_{metric}={theirs:.1} a_vs_pytorch={:.3} b_vs_pytorch={:.3}",
                ma / theirs,
                mb / theirs
            ));
        }
        out.push(line);
    }
    out
}

/// The median of PyTorch's rows for the same model and layout as `row`.
fn pytorch_value(pytorch: &[String], row: &str, metric: &str) -> Option<f64> {
    let get = |k: &str| crate::pytorch::field(row, k);
    let vals: Vec<f64> = pytorch
        .iter()
        .filter(|r| {
            crate::pytorch::field(r, "model") == get("model")
                && crate::pytorch::field(r, "layout") == get("layout")
        })
        .filter_map(|r| crate::pytorch::field(r, metric)?.parse().ok())
        .collect();
    (!vals.is_empty()).then(|| median(vals))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn options_and_bench_arguments_split_at_the_double_dash() {
        let (o, bench) = parse(&args(
            "--rev HEAD~1 --rev HEAD --rounds 2 -- --model llama --steps 4",
        ))
        .unwrap();
        assert_eq!(o.revs, ["HEAD~1".to_string(), "HEAD".into()]);
        assert_eq!(
            (o.target.as_str(), o.rounds, o.metric.as_str()),
            ("train", 2, "tokens_per_s")
        );
        assert_eq!(bench, args("--model llama --steps 4"));
        assert!(parse(&args("--rev A")).is_err());
        assert!(parse(&args("--rev A --rev B --rounds 0")).is_err());
        assert!(parse(&args("--rev A --rev B --frob")).is_err());
    }

    #[test]
    fn rows_match_by_their_fields_and_report_medians_and_ratios() {
        let o = parse(&args("--rev a --rev b")).unwrap().0;
        let a = vec![
            "bench train model=gpt layout=ddp ranks=2 step_ms=10 tokens_per_s=100".to_string(),
            "bench train model=gpt layout=ddp ranks=2 step_ms=12 tokens_per_s=90".into(),
            "bench train model=gpt layout=ddp ranks=2 step_ms=11 tokens_per_s=120".into(),
            "noise".into(),
        ];
        let b = vec![
            "bench train model=gpt layout=ddp ranks=2 step_ms=8 tokens_per_s=150".to_string(),
            "bench train model=gpt layout=ddp ranks=2 step_ms=9 tokens_per_s=130".into(),
            "bench train model=gpt layout=ddp ranks=2 step_ms=8 tokens_per_s=160".into(),
        ];
        let torch = vec!["bench pytorch model=gpt layout=ddp ranks=2 tokens_per_s=200".to_string()];
        let out = report(["a1", "b1"], &o, &[a, b], &torch);
        assert_eq!(out.len(), 1, "{out:?}");
        let line = &out[0];
        assert!(
            line.contains("a_tokens_per_s=100.0 b_tokens_per_s=150.0 ratio=1.500"),
            "{line}"
        );
        assert!(
            line.contains("pytorch_tokens_per_s=200.0 a_vs_pytorch=0.500"),
            "{line}"
        );
        assert!(
            line.contains("layout=ddp") && line.contains("rounds=3"),
            "{line}"
        );
    }

    #[test]
    fn rounds_are_taken_out_of_a_benchs_arguments() {
        assert_eq!(
            take_rounds(&args("--rounds 3 --default-allocator")).unwrap(),
            (3, args("--default-allocator"))
        );
        assert_eq!(take_rounds(&args("--rounds=2")).unwrap(), (2, vec![]));
        assert_eq!(take_rounds(&[]).unwrap(), (1, vec![]));
        assert!(take_rounds(&args("--rounds 0")).is_err());
        assert!(take_rounds(&args("--rounds x")).is_err());
    }

    #[test]
    fn best_of_rounds_is_the_largest_where_every_round_has_one() {
        let figure = |r: &Option<f64>| *r;
        assert_eq!(
            best_of_rounds(&[Some(2.0), Some(5.0), Some(3.0)], figure),
            Some(5.0)
        );
        assert_eq!(best_of_rounds(&[Some(2.0), None], figure), None);
        assert_eq!(best_of_rounds(&[], figure), None);
    }

    #[test]
    fn paired_rounds_give_medians_and_the_rounds_own_ratio_range() {
        // Rounds' ratios 0.9, 1.25, 1.0; medians 90 and 80.
        let p = paired(&[(90.0, 100.0), (100.0, 80.0), (80.0, 80.0)]).unwrap();
        assert_eq!(
            (p.ours, p.theirs, p.min, p.max, p.rounds),
            (90.0, 80.0, 0.9, 1.25, 3)
        );
        assert_eq!(
            p.ratios(),
            "ratio=1.12 ratio_min=0.90 ratio_max=1.25 rounds=3"
        );
        assert_eq!(paired(&[]), None);
    }

    #[test]
    fn the_executable_is_read_from_cargos_messages() {
        let json = r#"{"reason":"compiler-artifact","target":{"name":"other"},"executable":"/x/other"}
{"reason":"compiler-artifact","target":{"name":"train"},"executable":"/t/train-abc"}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            executable(json, "train"),
            Some(PathBuf::from("/t/train-abc"))
        );
        assert_eq!(executable(json, "missing"), None);
    }
}
