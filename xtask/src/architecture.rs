//! `docs/architecture.md`'s dependency table, checked against the manifests: every Bonfire
//! package's Bonfire dependencies, and those of its tests only, as `cargo metadata` reads them
//! from the `Cargo.toml` files, must be the table's row for it — no package missing, none
//! extra. The unit tests below run in the gate (`cargo test --workspace`).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// A package's Bonfire dependencies: (normal, dev-only), sorted names.
type Deps = (Vec<String>, Vec<String>);

/// The rows of the table that follows the `## Dependencies` heading of `markdown`:
/// `| `package` | normal deps | dev-only deps |`, names in backticks, each optionally followed
/// by `(optional …)`, `—` for none.
pub fn documented(markdown: &str) -> Result<BTreeMap<String, Deps>, String> {
    let section = markdown
        .split("\n## ")
        .find(|s| s.starts_with("Dependencies"))
        .ok_or("docs/architecture.md has no `## Dependencies` section")?;
    // `name`, or `name` (optional…): an optional dependency is `name?`.
    let names = |cell: &str| -> Vec<String> {
        let mut v: Vec<String> = cell
            .split(',')
            .filter(|item| item.trim_start().starts_with('`'))
            .filter_map(|item| {
                let name = item.split('`').nth(1)?;
                let optional = item.contains("(optional");
                Some(format!("{name}{}", if optional { "?" } else { "" }))
            })
            .collect();
        v.sort();
        v
    };
    let mut rows = BTreeMap::new();
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').collect();
        let [package, normal, dev] = cells[..] else {
            return Err(format!("a dependency row without three cells: {line}"));
        };
        let package = package.split('`').nth(1).unwrap_or_default().to_string();
        if rows
            .insert(package.clone(), (names(normal), names(dev)))
            .is_some()
        {
            return Err(format!("`{package}` has two rows"));
        }
    }
    if rows.is_empty() {
        return Err("the `## Dependencies` section has no rows".into());
    }
    Ok(rows)
}

/// Every workspace package named `bonfire*` and its Bonfire dependencies (an optional one
/// as `name?`), from the `cargo metadata` JSON `metadata`.
pub fn actual(metadata: &serde_json::Value) -> Result<BTreeMap<String, Deps>, String> {
    let packages = metadata["packages"]
        .as_array()
        .ok_or("cargo metadata: no packages")?;
    let mut rows = BTreeMap::new();
    for p in packages {
        let name = p["name"]
            .as_str()
            .ok_or("cargo metadata: a nameless package")?;
        if !name.starts_with("bonfire") {
            continue;
        }
        let deps = p["dependencies"].as_array().cloned().unwrap_or_default();
        let of_kind = |kind: Option<&str>| {
            let mut v: Vec<String> = deps
                .iter()
                .filter(|d| d["kind"].as_str() == kind)
                .filter(|d| d["name"].as_str().is_some_and(|n| n.starts_with("bonfire")))
                .map(|d| {
                    let optional = d["optional"].as_bool() == Some(true);
                    format!(
                        "{}{}",
                        d["name"].as_str().unwrap_or_default(),
                        if optional { "?" } else { "" }
                    )
                })
                .collect();
            v.sort();
            v.dedup();
            v
        };
        rows.insert(name.to_string(), (of_kind(None), of_kind(Some("dev"))));
    }
    Ok(rows)
}

/// Every difference between the table and the manifests, one line each.
pub fn differences(doc: &BTreeMap<String, Deps>, real: &BTreeMap<String, Deps>) -> Vec<String> {
    let mut out = Vec::new();
    for (name, deps) in real {
        match doc.get(name) {
            None => out.push(format!("`{name}` is not in the table")),
            Some(d) if d != deps => out.push(format!(
                "`{name}`: the table says {:?} (tests: {:?}), Cargo.toml says {:?} (tests: {:?})",
                d.0, d.1, deps.0, deps.1
            )),
            Some(_) => {}
        }
    }
    for name in doc.keys().filter(|n| !real.contains_key(*n)) {
        out.push(format!("`{name}` is in the table but not in the workspace"));
    }
    out
}

/// `cargo metadata` of the workspace at `root` (no registry access).
pub fn metadata(root: &Path) -> Result<serde_json::Value, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root)
        .output()
        .map_err(|e| format!("cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::process::root;

    #[test]
    fn architecture_md_names_every_crates_dependencies() {
        let md = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
        let doc = documented(&md).unwrap();
        let real = actual(&metadata(&root()).unwrap()).unwrap();
        assert!(
            real.len() >= 10,
            "only {} Bonfire packages found",
            real.len()
        );
        let diff = differences(&doc, &real);
        assert!(diff.is_empty(), "docs/architecture.md: {}", diff.join("; "));
    }

    #[test]
    fn a_wrong_row_a_missing_row_and_an_extra_row_are_each_named() {
        let md = "# A\n\n## Dependencies\n\n| crate | deps | tests |\n|---|---|---|\n\
                  | `bonfire-a` | `bonfire-b`, `bonfire-c` (optional, feature `f`) | — |\n\
                  | `bonfire-x` | — | — |\n";
        let doc = documented(md).unwrap();
        let row = |n: &[&str], d: &[&str]| {
            let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
            (s(n), s(d))
        };
        let real = BTreeMap::from([
            ("bonfire-a".to_string(), row(&["bonfire-b"], &[])),
            ("bonfire-b".to_string(), row(&[], &[])),
        ]);
        let diff = differences(&doc, &real);
        assert_eq!(diff.len(), 3, "{diff:?}");
        assert!(diff[0].starts_with("`bonfire-a`: the table says"));
        assert_eq!(diff[1], "`bonfire-b` is not in the table");
        assert_eq!(
            diff[2],
            "`bonfire-x` is in the table but not in the workspace"
        );
        assert_eq!(doc["bonfire-a"], row(&["bonfire-b", "bonfire-c?"], &[]));
        assert!(documented("# A\n\n## Other\n").is_err());
    }
}
