//! PyTorch beside `cargo xtask bench train`: after Bonfire's rows, the same model, optimizer,
//! batch and step counts through `examples/benches/pytorch/train.py` (one rank with one
//! thread, then gloo DDP over `--ranks` processes of one thread each), in the same run, and a
//! `bench compare` line per layout both sides measured:
//! `bench compare model=… layout=single|ddp bonfire_tokens_per_s=… pytorch_tokens_per_s=… ratio=…`
//! (ratio = Bonfire's tokens/s over PyTorch's).
//!
//! The Python is [`crate::python`]'s; where it cannot import `torch` (and
//! `transformers` for the Llama) the bench says so in one `bench pytorch … skipped=…` line and
//! Bonfire's rows stand alone. `--no-pytorch` skips it. The Mixtral has no PyTorch row.

use crate::process::{self, Failure, Result};
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

/// PyTorch's rows for the run `bench_args` described, and the comparison with `bonfire`'s
/// lines of the same run.
pub fn compare(bench_args: &[String], bonfire: &[String]) -> Result {
    let rows = rows(bench_args)?;
    let model = flag(bench_args, "--model", "gpt");
    for line in bonfire.iter().filter(|l| l.starts_with("bench train ")) {
        let layout = field(line, "layout").unwrap_or_default();
        let theirs = rows
            .iter()
            .find(|r| field(r, "layout") == Some(layout))
            .and_then(|r| field(r, "tokens_per_s")?.parse::<f64>().ok());
        let ours = field(line, "tokens_per_s").and_then(|v| v.parse::<f64>().ok());
        if let (Some(theirs), Some(ours)) = (theirs, ours) {
            println!(
                "bench compare model={model} layout={layout} bonfire_tokens_per_s={ours:.0} \
                 pytorch_tokens_per_s={theirs:.0} ratio={:.2}",
                ours / theirs
            );
        }
    }
    Ok(())
}

/// `cargo bench` of the train bench with `extra_args`, then [`compare`].
pub fn bench_train(extra_args: &[String]) -> Result {
    let bench_args: Vec<String> = extra_args
        .iter()
        .filter(|a| *a != "--no-pytorch")
        .cloned()
        .collect();
    let mut command = process::cargo();
    command.args(["bench", "-p", "bonfire-examples", "--bench", "train", "--"]);
    command.args(&bench_args);
    let lines = run_echoed(command)?;
    let precision = flag(extra_args, "--precision", "f32");
    if precision != "f32" {
        // PyTorch's side trains in f32: a ratio against it would not be like for like.
        println!("bench train side=pytorch skipped=bonfire ran --precision {precision}");
        return Ok(());
    }
    compare(extra_args, &lines)
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
}
