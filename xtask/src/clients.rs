//! The gate's real clients: Hugging Face transformers, where the Python the gate finds has it
//! ([`crate::python`]: importing `torch`, `transformers` and `safetensors`).
//!
//! - `export`: Bonfire's Hugging Face export of the Llama fixture (written by the `llama`
//!   suite's round-trip test into a folder, `BONFIRE_KEEP_EXPORT`) loaded by transformers'
//!   own `from_pretrained` (`examples/fixtures/llama/check_export.py`): no missing or
//!   unexpected key, and transformers' logits of the fixture's batch within 1e-5 of Bonfire's.
//! - `regenerate-<family>`: each fixture's `generate.py`, run again in a fresh folder, writes
//!   the files committed beside it — the fixtures are what their script says: byte for byte,
//!   but for the `"transformers_version"` stamp in the JSON files (it names the version that
//!   wrote them: a newer transformers writes its own) and for safetensors files written on
//!   another CPU, whose float64 results differ in their last bits (AdamW turns that into part
//!   of a step): those hold the same tensors within `examples/fixtures/compare.py`'s bounds.
//!
//! Where the Python lacks them, each check is counted as skipped (the gate's total says so),
//! never as passed.

use crate::process::{self, Failure, Result};
use std::path::Path;
use std::process::Command;

/// The families with a fixture script, and the files it writes (`recipe` reads the Llama
/// fixture beside it: in the regeneration folder, the one just regenerated).
const FIXTURES: [(&str, &[&str]); 6] = [
    (
        "llama",
        &[
            "config.json",
            "model.safetensors",
            "batch.safetensors",
            "reference.safetensors",
        ],
    ),
    (
        "mixtral",
        &[
            "config.json",
            "model.safetensors",
            "batch.safetensors",
            "reference.safetensors",
            "state_dict.safetensors",
        ],
    ),
    // After the Mixtral's: its script calls `../mixtral/generate.py`.
    (
        "qwen3_moe",
        &[
            "config.json",
            "model.safetensors",
            "batch.safetensors",
            "reference.safetensors",
            "state_dict.safetensors",
            "dense_layers/config.json",
            "dense_layers/model.safetensors",
            "dense_layers/batch.safetensors",
            "dense_layers/reference.safetensors",
            "dense_layers/state_dict.safetensors",
        ],
    ),
    (
        "deepseek_v3",
        &[
            "config.json",
            "model.safetensors",
            "batch.safetensors",
            "reference.safetensors",
            "state_dict.safetensors",
            "q_proj/config.json",
            "q_proj/model.safetensors",
            "q_proj/batch.safetensors",
            "q_proj/reference.safetensors",
            "q_proj/state_dict.safetensors",
            "yarn/config.json",
            "yarn/model.safetensors",
            "yarn/batch.safetensors",
            "yarn/reference.safetensors",
            "yarn/state_dict.safetensors",
        ],
    ),
    ("recipe", &["batch.safetensors", "reference.safetensors"]),
    (
        "families",
        &[
            "llama3/config.json",
            "llama3/model.safetensors",
            "llama3/batch.safetensors",
            "llama3/reference.safetensors",
            "qwen2/config.json",
            "qwen2/model.safetensors",
            "qwen2/batch.safetensors",
            "qwen2/reference.safetensors",
            "qwen3/config.json",
            "qwen3/model.safetensors",
            "qwen3/batch.safetensors",
            "qwen3/reference.safetensors",
            "mistral/config.json",
            "mistral/model.safetensors",
            "mistral/batch.safetensors",
            "mistral/reference.safetensors",
            "llama32/config.json",
            "llama32/model.safetensors",
            "llama32/batch.safetensors",
            "llama32/reference.safetensors",
            "mistral_window/config.json",
            "mistral_window/model.safetensors",
            "mistral_window/batch.safetensors",
            "mistral_window/reference.safetensors",
        ],
    ),
];

/// The families' exports transformers loads besides the Llama's (`tests/families.rs`, the
/// DeepSeek ones `tests/deepseek.rs`).
const FAMILY_EXPORTS: [&str; 11] = [
    "llama3",
    "qwen2",
    "qwen3",
    "llama32",
    "mistral",
    "mistral_window",
    "qwen3_moe",
    "qwen3_moe_dense",
    "deepseek_v3",
    "deepseek_v3_q_proj",
    "deepseek_v3_yarn",
];

/// The checks of this step: the exports, one regeneration a family, TensorBoard's reader.
pub const CHECKS: usize = 2 + FAMILY_EXPORTS.len() + FIXTURES.len();

/// The Python with torch, transformers and safetensors, or why there is none.
pub fn python() -> std::result::Result<String, String> {
    crate::python::with("import torch, transformers, safetensors")
}

/// Runs every check (see the module docs); `Err` if one fails. Returns how many ran and how
/// many were skipped (TensorBoard's, where the Python has no TensorBoard).
pub fn run(python: &str) -> Result<(usize, usize)> {
    let root = process::root();
    let tmp = std::env::temp_dir().join(format!("bonfire-clients-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    export(&root, python, &tmp.join("export"))?;
    family_exports(&root, python, &tmp.join("families"))?;
    for (family, files) in FIXTURES {
        regenerate(&root, python, family, files, &tmp.join(family))?;
    }
    let board = tensorboard(&root, &tmp.join("tensorboard"))?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(match board {
        true => (CHECKS, 0),
        false => (CHECKS - 1, 1),
    })
}

/// The `tensorboard` check: TensorBoard's own reader reads the event files of a `train` run
/// as its metrics say (`examples/python/check_tensorboard.py`). `false`: skipped, the Python
/// has no TensorBoard.
fn tensorboard(root: &Path, dir: &Path) -> Result<bool> {
    let python = match crate::python::with("import tensorboard, numpy") {
        Ok(p) => p,
        Err(why) => {
            println!("    clients: tensorboard skipped: {why}");
            return Ok(false);
        }
    };
    println!("    clients: tensorboard — TensorBoard reads a run's event files");
    let mut test = crate::test::test_cargo();
    test.args(["-p", "bonfire-examples", "--test", "train_cli"])
        .args(["--", "--exact", "a_recipe_run_reports_to_tensorboard"])
        .env("BONFIRE_KEEP_TENSORBOARD", dir);
    process::run(test)?;
    let mut check = Command::new(python);
    check
        .arg(root.join("examples/python/check_tensorboard.py"))
        .arg(dir);
    process::run(check)?;
    Ok(true)
}

/// The `export-<family>` checks: transformers' `AutoModelForCausalLM` loads each family's
/// export with no missing or unexpected key, and its logits are Bonfire's.
fn family_exports(root: &Path, python: &str, dir: &Path) -> Result {
    println!(
        "    clients: export-{{{}}} — transformers loads the families' exports",
        FAMILY_EXPORTS.join(",")
    );
    let mut test = crate::test::test_cargo();
    test.args(["-p", "bonfire-examples", "--test", "families"])
        .env("BONFIRE_KEEP_EXPORT", dir);
    process::run(test)?;
    let mut test = crate::test::test_cargo();
    test.args(["-p", "bonfire-examples", "--test", "deepseek"])
        .args([
            "--",
            "--exact",
            "deepseek_v3_exports_what_transformers_loads",
        ])
        .env("BONFIRE_KEEP_EXPORT", dir);
    process::run(test)?;
    for family in FAMILY_EXPORTS {
        let mut check = Command::new(python);
        check
            .arg(root.join("examples/fixtures/llama/check_export.py"))
            .arg(dir.join(family));
        process::run(check)?;
    }
    Ok(())
}

/// The `export` check.
fn export(root: &Path, python: &str, dir: &Path) -> Result {
    println!("    clients: export — transformers loads Bonfire's Llama export");
    let mut test = crate::test::test_cargo();
    test.args(["-p", "bonfire-examples", "--test", "llama"])
        .args(["--", "--exact", "hugging_face_directories_round_trip"])
        .env("BONFIRE_KEEP_EXPORT", dir);
    process::run(test)?;
    let mut check = Command::new(python);
    check
        .arg(root.join("examples/fixtures/llama/check_export.py"))
        .arg(dir);
    process::run(check)
}

/// The `regenerate-<family>` check: `family`'s script run in `dir` writes `files` as
/// committed.
fn regenerate(root: &Path, python: &str, family: &str, files: &[&str], dir: &Path) -> Result {
    println!("    clients: regenerate-{family} — its generate.py writes the committed fixture");
    let fixture = root.join("examples/fixtures").join(family);
    std::fs::create_dir_all(dir).map_err(|e| Failure::usage(format!("{}: {e}", dir.display())))?;
    let script = dir.join("generate.py");
    std::fs::copy(fixture.join("generate.py"), &script)
        .map_err(|e| Failure::usage(format!("{}: {e}", script.display())))?;
    let mut generate = Command::new(python);
    generate.arg(&script).current_dir(dir);
    process::run(generate)?;
    let differ: Vec<String> = files
        .iter()
        .filter(|f| read(&fixture.join(f)) != read(&dir.join(f)))
        .filter(|f| !f.ends_with(".json") || unstamped(&fixture.join(f)) != unstamped(&dir.join(f)))
        .filter(|f| !f.ends_with(".safetensors") || !same_values(root, python, &fixture, dir, f))
        .map(|f| f.to_string())
        .collect();
    match differ.is_empty() {
        true => Ok(()),
        false => Err(Failure::usage(format!(
            "examples/fixtures/{family}: generate.py writes other bytes than committed for {} \
             (regenerated in {})",
            differ.join(", "),
            dir.display()
        ))),
    }
}

/// Whether the regenerated safetensors file `f` holds the committed one's values within
/// float64's difference between CPUs (`examples/fixtures/compare.py`, which prints how close).
fn same_values(root: &Path, python: &str, fixture: &Path, dir: &Path, f: &str) -> bool {
    let mut compare = Command::new(python);
    compare
        .arg(root.join("examples/fixtures/compare.py"))
        .arg(fixture.join(f))
        .arg(dir.join(f));
    process::run(compare).is_ok()
}

fn read(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok()
}

/// A JSON file's bytes without its `"transformers_version"` line.
fn unstamped(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(
        text.lines()
            .filter(|l| !l.trim_start().starts_with("\"transformers_version\""))
            .collect::<Vec<_>>()
            .join("\n"),
    )
}
