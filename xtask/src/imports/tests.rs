//! The import checker's own tests: the stripper, the use-tree expansion, the module map and
//! the layering loops, on small crates written to a temporary directory.

use super::*;
use crate::process::root;

/// `crate_src` as a tempdir of files (path, text).
fn fake(files: &[(&str, &str)]) -> (tempdir::Dir, Crate) {
    let dir = tempdir::Dir::new();
    for (path, text) in files {
        let p = dir.0.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let c = Crate::read(&dir.0).unwrap();
    (dir, c)
}

mod tempdir {
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Self {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "xtask-imports-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::SeqCst)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn names(l: &[Vec<ModPath>]) -> Vec<Vec<String>> {
    l.iter()
        .map(|c| c.iter().map(|m| m.join("::")).collect())
        .collect()
}

#[test]
fn no_library_crate_imports_in_a_loop() {
    let root = root();
    let mut found = Vec::new();
    let mut files = 0;
    for src in library_sources(&root) {
        let c = Crate::read(&src).unwrap();
        files += c.files.len();
        let named = c.named_edges();
        for component in loops(&c.edges()) {
            let list: Vec<String> = component.iter().map(|m| c.file(m, &root)).collect();
            found.push(list.join(" <-> "));
            for m in &component {
                for (to, paths) in named[m].iter().filter(|(to, _)| component.contains(to)) {
                    let paths: Vec<&str> = paths.iter().map(String::as_str).collect();
                    let (from, to) = (c.file(m, &root), c.file(to, &root));
                    found.push(format!("    {from} -> {to}: {}", paths.join(", ")));
                }
            }
        }
    }
    // The walk saw the workspace (a wrong root would find nothing and pass).
    assert!(
        files > 150,
        "only {files} library files found under {}",
        root.display()
    );
    assert!(
        found.is_empty(),
        "files that import in a loop:\n{}",
        found.join("\n")
    );
}

#[test]
fn a_loop_through_a_use_a_path_a_super_or_a_macro_is_found() {
    let (_d, c) = fake(&[
        ("lib.rs", "mod a; mod b; pub use a::A;"),
        ("a.rs", "pub struct A; fn f() { crate::b::g(); }"),
        ("b.rs", "use crate::A; pub fn g() {}"),
    ]);
    assert_eq!(names(&loops(&c.edges())), [["a", "b"]]);
    let (_d, c) = fake(&[
        ("lib.rs", "mod e;"),
        (
            "e/mod.rs",
            "mod s; pub struct H; macro_rules! m { () => { $crate::e::s::f() } }",
        ),
        ("e/s.rs", "use super::H; pub fn f() {}"),
    ]);
    assert_eq!(names(&loops(&c.edges())), [["e", "e::s"]]);
}

#[test]
fn re_exports_comments_and_strings_make_no_loop() {
    let (_d, c) = fake(&[
        (
            "lib.rs",
            "mod a; mod b; pub use a::A; pub use b::g; // crate::b::g\n",
        ),
        (
            "a.rs",
            "pub struct A; fn f() { let _ = \"crate::b::g\"; crate::g(); }",
        ),
        (
            "b.rs",
            "/* use crate::A; */ pub fn g() {} const C: char = '\\''; fn h<'a>(x: &'a u8) {}\n#[cfg(test)]\nmod tests { use crate::A; }",
        ),
    ]);
    let edges = c.edges();
    assert_eq!(names(&loops(&edges)), Vec::<Vec<String>>::new());
    // `crate::g` reached through the root's re-export: charged to `b`.
    assert!(edges[&vec!["a".to_string()]].contains(&vec!["b".to_string()]));
    assert!(edges[&Vec::new()].is_empty());
}

#[test]
fn use_trees_expand() {
    assert_eq!(
        expand("crate::a::{b,c::{d,e},self}"),
        [
            vec!["crate", "a", "b"],
            vec!["crate", "a", "c", "d"],
            vec!["crate", "a", "c", "e"],
            vec!["crate", "a"],
        ]
    );
}

/// The budgets docs/architecture.md states: the primitives crate stays small, the
/// examples' library holds program helpers only.
#[test]
fn the_primitives_and_the_examples_library_stay_within_their_budgets() {
    let root = root();
    let dtensor = lines(&root.join("crates/dtensor/src"));
    assert!(
        dtensor > 1000 && dtensor < 4000,
        "bonfire-dtensor: {dtensor} lines"
    );
    let examples = lines(&root.join("examples/src"));
    assert!(
        examples > 100 && examples <= 800,
        "examples/src: {examples} lines"
    );
}
