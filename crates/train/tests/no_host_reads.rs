//! Nothing above the collective layer — DDP, ZeRO, the pipeline, tensor parallelism, the
//! trainer — reads a training tensor to the host or writes one from it behind the data
//! plane's back: every such crossing goes through `bonfire_dtensor::plane` (counted by reason
//! in the transfer ledger). This scans their sources (tests excluded) for Burn's host
//! accessors.

use std::path::{Path, PathBuf};

/// Burn's calls that move a tensor's data between the device and the host.
const FORBIDDEN: &[&str] = &[
    ".into_data(",
    ".to_data(",
    "::from_data(",
    "read_sync(",
    ".into_scalar(",
    "float_into_data(",
    "float_from_data(",
];

/// The sources above the collective layer.
fn sources() -> Vec<PathBuf> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let roots = [
        "ddp/src",
        "zero/src",
        "pipeline/src",
        "train/src",
        "dtensor/src/parallel",
    ];
    let mut files = Vec::new();
    for root in roots {
        collect(&crates.join(root), &mut files);
    }
    files
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_tensor_crosses_to_the_host_outside_the_data_plane() {
    let files = sources();
    assert!(
        files.len() > 30,
        "found the sources ({} files)",
        files.len()
    );
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        // Unit tests may read tensors to check them.
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for (n, line) in code.lines().enumerate() {
            let line = line.trim_start();
            if line.starts_with("//") || line.contains("plane::") {
                continue;
            }
            for call in FORBIDDEN.iter().filter(|c| line.contains(*c)) {
                found.push(format!(
                    "{}:{}: `{call}` in `{line}`",
                    file.display(),
                    n + 1
                ));
            }
        }
    }
    assert!(
        found.is_empty(),
        "host reads outside the data plane:\n{}",
        found.join("\n")
    );
}
