//! Nothing above the collective layer — DDP, ZeRO, the pipeline, tensor, context and expert
//! parallelism, recompute, what the engines share of a model, the trainer — reads a training tensor to the host or writes one from it behind the data
//! plane's back: every such crossing goes through `bonfire_dtensor::plane` (counted by reason
//! in the transfer ledger). This scans their sources (tests excluded) for Burn's host
//! accessors, allowing them only as the named data-plane functions of [`PLANE_CALLS`]; every
//! other call into the plane must be one of those functions too, and the plane's functions
//! are called by path (not imported by name), so a host read through a new plane function
//! fails until it is reviewed and listed.

use std::path::{Path, PathBuf};

/// Burn's calls that move a tensor's data between the device and the host, by name: found as
/// a call (`name(` or `name::<`) whatever its receiver or path (`.into_data(`,
/// `Tensor::from_data(`, …).
const FORBIDDEN: &[&str] = &[
    "into_data",
    "to_data",
    "from_data",
    "read_sync",
    "into_scalar",
    "float_into_data",
    "float_from_data",
];

/// The data-plane functions the sources above the collective layer may call, by path: the
/// host crossings that record their bytes in the ledger by reason (`to_data`, `from_data`,
/// `to_device`, `to_host`, `from_host`), the collectives (staged and counted as `Collective`),
/// point-to-point sends and receives
/// and the ledger's own. A host accessor of [`FORBIDDEN`] is allowed only as one of these.
const PLANE_CALLS: &[&str] = &[
    "plane::to_data",
    "plane::from_data",
    "plane::to_device",
    "plane::to_host",
    "plane::from_host",
    "plane::all_reduce",
    "plane::all_reduce_async",
    "plane::reduce_scatter",
    "plane::reduce_scatter_async",
    "plane::all_gather",
    "plane::broadcast",
    // Point-to-point (a tied head's table between pipeline stages), counted as `Send`/`Recv`.
    "plane::send",
    "plane::recv",
    "plane::counts_to_host",
    "plane::indices_from_host",
    "plane::ledger::current",
    "plane::ledger::record_payload",
];

/// The sources above the collective layer.
fn sources() -> Vec<PathBuf> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let roots = [
        "ddp/src",
        "zero/src",
        "pipeline/src",
        "train/src",
        "tp/src",
        "cp/src",
        "ep/src",
        "recompute/src",
        "parallel/src",
        "module/src",
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

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every call in `line`: `(path, name)` for each identifier followed by `(` or `::<`, with
/// `path` the identifier and the `a::b::` chain (or `.` receiver) written before it.
fn calls(line: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let chars: Vec<(usize, char)> = line.char_indices().collect();
    let mut i = 0;
    while i < chars.len() {
        let (start, c) = chars[i];
        if !is_ident(c) || (i > 0 && is_ident(chars[i - 1].1)) {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chars.len() && is_ident(chars[j].1) {
            j += 1;
        }
        let end = chars.get(j).map_or(line.len(), |&(at, _)| at);
        let rest = &line[end..];
        if rest.starts_with('(') || rest.starts_with("::<") {
            let before = &line[..start];
            let chain = before
                .trim_end_matches(|c: char| is_ident(c) || c == ':' || c == '.')
                .len();
            let path = format!("{}{}", &before[chain..], &line[start..end]);
            out.push((path, line[start..end].to_string()));
        }
        i = j;
    }
    out
}

/// What is wrong with one line of code: host accessors outside the listed plane functions,
/// plane functions not listed, plane functions imported by name.
fn line_problems(line: &str) -> Vec<String> {
    let mut found = Vec::new();
    let listed = |path: &str| {
        PLANE_CALLS
            .iter()
            .any(|p| path == *p || path.ends_with(&format!("::{p}")))
    };
    for (path, name) in calls(line) {
        let through_plane = path.contains("plane::");
        if through_plane && !listed(&path) {
            found.push(format!(
                "`{path}` is not a listed data-plane function (PLANE_CALLS)"
            ));
        } else if FORBIDDEN.contains(&name.as_str()) && !listed(&path) {
            found.push(format!("`{path}(` reads or writes host data"));
        }
    }
    found
}

/// Names a `use` statement imports from the plane that are not `self`, a module path to a type or
/// a type (capitalised): a function imported by name would be called without its path.
fn imported_functions(statement: &str) -> Vec<String> {
    let Some((_, items)) = statement.split_once("plane::") else {
        return Vec::new();
    };
    items
        .split([',', '{', '}', ';'])
        .filter_map(|item| item.split_whitespace().next())
        .filter_map(|item| item.rsplit("::").next())
        .filter(|last| *last != "self" && !last.starts_with(|c: char| c.is_ascii_uppercase()))
        .map(|last| format!("`{last}` imported from the plane by name: call it by its path"))
        .collect()
}

/// Every problem in a source file's text (its unit tests excluded), as `file:line: why`.
fn scan(file: &str, text: &str) -> Vec<String> {
    // Unit tests may read tensors to check them.
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    let mut found = Vec::new();
    // The `use` statement being read (it may span lines), from its first line.
    let mut statement: Option<(usize, String)> = None;
    for (n, line) in code.lines().enumerate() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        for why in line_problems(line) {
            found.push(format!("{file}:{}: {why} in `{line}`", n + 1));
        }
        if line.starts_with("use ") || line.starts_with("pub use ") {
            statement = Some((n, String::new()));
        }
        if let Some((first, mut text)) = statement.take() {
            text.push_str(line);
            if !line.contains(';') {
                statement = Some((first, text));
                continue;
            }
            for why in imported_functions(&text) {
                found.push(format!("{file}:{}: {why} in `{text}`", first + 1));
            }
        }
    }
    found
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
    let mut plane_calls = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        plane_calls += text.matches("plane::").count();
        found.extend(scan(&file.display().to_string(), &text));
    }
    assert!(
        plane_calls > 20,
        "the sources call the plane ({plane_calls})"
    );
    assert!(
        found.is_empty(),
        "host reads outside the data plane:\n{}",
        found.join("\n")
    );
}

/// The scan itself: what it must flag and what it must let through.
#[test]
fn the_scan_flags_reads_outside_the_listed_plane_functions() {
    let flagged = [
        "let d = t.into_data();",
        "let t = Tensor::<2>::from_data(data, &device);",
        "let v = burn::tensor::read_sync(B::float_into_data(t));",
        "let x = y.clone().into_scalar();",
        // A plane function on the same line no longer hides a raw read.
        "let v = plane::to_host(t.clone(), Reason::Report); let d = t.to_data();",
        // A plane function that is not listed.
        "let v = plane::peek_host(t);",
        "let v = bonfire_dtensor::plane::other::<2>(t);",
        "use bonfire_dtensor::plane::{self, to_host};",
        "use bonfire_dtensor::plane::peek_host as peek;",
    ];
    for line in flagged {
        assert!(!scan("snippet", line).is_empty(), "not flagged: `{line}`");
    }
    let split_import = "use bonfire_dtensor::plane::{\n    self,\n    to_host,\n};\n";
    assert_eq!(scan("snippet", split_import).len(), 1, "{split_import}");
    let allowed = [
        "let data = plane::to_data(t, Reason::Activation)",
        "plane::from_data::<D>(data, &self.device, Reason::Activation).cast(self.dtype)",
        ".map(|b| plane::to_host(b.clone(), Reason::Export))",
        "let ledger = bonfire_dtensor::plane::ledger::current();",
        "use bonfire_dtensor::plane::{self, ledger::Reason, PendingTensor};",
        "let y = x.to_device(&device).matmul(w);",
    ];
    for line in allowed {
        assert_eq!(scan("snippet", line), Vec::<String>::new(), "`{line}`");
    }
}
