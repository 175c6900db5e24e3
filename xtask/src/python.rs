//! The Python of the checks and benches that use PyTorch and transformers: one place that
//! picks it, and `cargo xtask python`, which installs it from `examples/python/requirements.txt`
//! into a virtual environment under `target/python` (PyPI only; on Linux PyPI's torch brings
//! its CUDA libraries, about 5.6 GB).
//!
//! The Python is `$BONFIRE_PYTHON` where set, else `target/python/bin/python` where
//! `cargo xtask python` made it, else `python3`.

use crate::process::{self, Failure, Result};
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The folder of the environment `cargo xtask python` makes.
fn venv() -> PathBuf {
    process::root().join("target/python")
}

/// The Python to run (see the module docs).
pub fn interpreter() -> String {
    if let Ok(python) = std::env::var("BONFIRE_PYTHON") {
        return python;
    }
    let ours = venv().join("bin/python");
    match ours.exists() {
        true => ours.display().to_string(),
        false => "python3".into(),
    }
}

/// The Python of [`interpreter`] when it can run `imports` (a Python statement), or why not.
pub fn with(imports: &str) -> std::result::Result<String, String> {
    let python = interpreter();
    let ok = Command::new(&python)
        .args(["-c", imports])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    match ok {
        true => Ok(python),
        false => Err(format!(
            "`{python} -c '{imports}'` failed (`cargo xtask python` installs what it needs, or \
             set BONFIRE_PYTHON to a Python that has it)"
        )),
    }
}

/// `cargo xtask python`: makes `target/python` (with `python3 -m venv`) and installs the
/// requirements into it.
pub fn install() -> Result {
    let dir = venv();
    if !dir.join("bin/python").exists() {
        let mut make = Command::new("python3");
        make.args(["-m", "venv"]).arg(&dir);
        process::run(make).map_err(|e| {
            Failure::usage(format!(
                "{} (on Debian: apt install python3-venv)",
                e.message
            ))
        })?;
    }
    let mut pip = Command::new(dir.join("bin/pip"));
    pip.args(["install", "--disable-pip-version-check", "-r"])
        .arg(process::root().join("examples/python/requirements.txt"));
    process::run(pip)?;
    println!(
        "python: {} has torch and transformers",
        dir.join("bin/python").display()
    );
    Ok(())
}
