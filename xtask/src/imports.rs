//! The files of every library crate import in one direction: no loop. A file *imports* another
//! when its code names an item the other defines — through a `use` (not a `pub use`
//! re-export, which only forwards a name) or a path in the code (`crate::a::b::f(…)`,
//! `super::x`, a macro's `$crate::…`). A name reached through re-exports is charged to the
//! file that defines it; `mod` declarations are no imports. The unit tests below run in the
//! gate (`cargo test --workspace`) over `crates/*/src`, `kernels/src` and `examples/src`;
//! they also hold the architecture's size budgets (docs/architecture.md).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path below its crate root (`[]` for the root, `["engine", "state"]`, …).
type ModPath = Vec<String>;

/// One crate's modules: each module's file, source (comments and literals blanked), and
/// the names its `pub use` / `pub(crate) use` statements forward (name → full path).
pub struct Crate {
    files: BTreeMap<ModPath, PathBuf>,
    code: BTreeMap<ModPath, String>,
    forwards: BTreeMap<ModPath, BTreeMap<String, ModPath>>,
}

/// `text` with comments, string and char literals replaced by spaces (lines kept).
pub fn strip(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && is_raw_start(&b, i) {
            let hashes = b[i + 1..].iter().take_while(|&&h| h == '#').count();
            let mut j = i + 2 + hashes;
            while j < b.len() && !(b[j] == '"' && b[j + 1..].iter().take(hashes).all(|&h| h == '#'))
            {
                j += 1;
            }
            let end = (j + 1 + hashes).min(b.len());
            out.extend(b[i..end].iter().map(|&c| blank(c)));
            i = end;
        } else if c == '"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != '"' {
                j += if b[j] == '\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(b.len());
            out.extend(b[i..end].iter().map(|&c| blank(c)));
            i = end;
        } else if c == '\'' && is_char_literal(&b, i) {
            let mut j = i + 1;
            while j < b.len() && b[j] != '\'' {
                j += if b[j] == '\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(b.len());
            out.extend(b[i..end].iter().map(|&c| blank(c)));
            i = end;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether `r` at `i` starts a raw string (`r"…"`, `r#"…"#`), not an identifier's last `r`.
fn is_raw_start(b: &[char], i: usize) -> bool {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let after = b[i + 1..].iter().find(|&&h| h != '#') == Some(&'"');
    after && (i == 0 || !ident(b[i - 1]))
}

/// Whether `'` at `i` opens a char literal (`'a'`, `'\n'`, `'\u{1F}'`), not a lifetime.
fn is_char_literal(b: &[char], i: usize) -> bool {
    matches!(
        (b.get(i + 1), b.get(i + 2)),
        (Some('\\'), _) | (Some(_), Some('\''))
    )
}

impl Crate {
    /// The crate whose root is `src/lib.rs` under `src`.
    pub fn read(src: &Path) -> Result<Self, String> {
        let mut files = BTreeMap::new();
        collect(src, src, &mut files)?;
        let mut code = BTreeMap::new();
        for (m, f) in &files {
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            code.insert(m.clone(), strip(&text));
        }
        let mut forwards = BTreeMap::new();
        for (m, text) in &code {
            let mut names = BTreeMap::new();
            for (public, tree) in uses(text) {
                if !public {
                    continue;
                }
                for path in expand(&tree) {
                    let Some(full) = absolute(m, &path, &files) else {
                        continue;
                    };
                    let name = path.last().cloned().unwrap_or_default();
                    names.insert(name, full);
                }
            }
            forwards.insert(m.clone(), names);
        }
        Ok(Self {
            files,
            code,
            forwards,
        })
    }

    /// The module that defines what `path` (absolute, from the crate root) names.
    fn owner(&self, path: &[String], depth: usize) -> Option<ModPath> {
        if depth > 16 {
            return None;
        }
        // The longest prefix that is a module.
        let mut k = path.len();
        while k > 0 && !self.files.contains_key(&path[..k]) {
            k -= 1;
        }
        let module: ModPath = path[..k].to_vec();
        if k < path.len()
            && let Some(target) = self.forwards.get(&module).and_then(|f| f.get(&path[k]))
        {
            let mut next = target.clone();
            next.extend_from_slice(&path[k + 1..]);
            if next != path {
                return self.owner(&next, depth + 1);
            }
        }
        Some(module)
    }

    /// Which files each file imports (the files named by their paths from the source root).
    pub fn edges(&self) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
        self.named_edges()
            .into_iter()
            .map(|(m, to)| (m, to.into_keys().collect()))
            .collect()
    }

    /// [`edges`](Self::edges) with, for each, the paths that make it.
    pub fn named_edges(&self) -> BTreeMap<ModPath, BTreeMap<ModPath, BTreeSet<String>>> {
        let mut out = BTreeMap::new();
        for (m, text) in &self.code {
            let mut to: BTreeMap<ModPath, BTreeSet<String>> = BTreeMap::new();
            let inline = inline_modules(text);
            for (at, path) in referenced(text) {
                let here = module_at(m, &inline, at);
                if here.iter().any(|n| n == "#test") {
                    continue;
                }
                if let Some(full) = absolute(&here, &path, &self.files)
                    && let Some(owner) = self.owner(&full, 0)
                    && owner != *m
                {
                    to.entry(owner).or_default().insert(path.join("::"));
                }
            }
            out.insert(m.clone(), to);
        }
        out
    }

    /// The file of module `m`, relative to `root`.
    pub fn file(&self, m: &ModPath, root: &Path) -> String {
        self.files[m]
            .strip_prefix(root)
            .unwrap_or(&self.files[m])
            .display()
            .to_string()
    }
}

/// Every `.rs` file under `dir` as a module of the crate rooted at `src`.
fn collect(src: &Path, dir: &Path, out: &mut BTreeMap<ModPath, PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.is_dir() {
            collect(src, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(src).expect("under src");
            let mut m: ModPath = rel
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if m == ["lib"] || m.last().is_some_and(|l| l == "mod") {
                m.pop();
            }
            out.insert(m, path);
        }
    }
    Ok(())
}

/// The `use` statements of `code`: (whether re-exported, the use tree's text).
fn uses(code: &str) -> Vec<(bool, String)> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = find_word(rest, "use") {
        let before = rest[..at].trim_end();
        let public = before.ends_with("pub") || before.ends_with("pub(crate)");
        let tail = &rest[at + 3..];
        let end = tail.find(';').unwrap_or(tail.len());
        out.push((public, tail[..end].split_whitespace().collect()));
        rest = &tail[end..];
    }
    out
}

/// The byte offset of the next `word` standing alone in `text`.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut from = 0;
    while let Some(i) = text[from..].find(word) {
        let at = from + i;
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        if !before.is_some_and(ident) && !after.is_some_and(ident) {
            return Some(at);
        }
        from = at + word.len();
    }
    None
}

/// A use tree (`crate::a::{b, c::{d, e}}`, whitespace removed) as its paths.
pub fn expand(tree: &str) -> Vec<Vec<String>> {
    fn go(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
        let tree = tree.trim_start_matches("::");
        match tree.find('{') {
            None => {
                let head = tree.split(" as ").next().unwrap_or(tree);
                let mut p = prefix.to_vec();
                p.extend(head.split("::").filter(|s| !s.is_empty()).map(String::from));
                if p.last().is_some_and(|l| l == "self") {
                    p.pop();
                }
                out.push(p);
            }
            Some(open) => {
                let mut p = prefix.to_vec();
                p.extend(
                    tree[..open]
                        .split("::")
                        .filter(|s| !s.is_empty())
                        .map(String::from),
                );
                let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
                let mut depth = 0;
                let mut start = 0;
                for (i, c) in inner.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            go(&p, &inner[start..i], out);
                            start = i + 1;
                        }
                        _ => {}
                    }
                }
                if !inner[start..].is_empty() {
                    go(&p, &inner[start..], out);
                }
            }
        }
    }
    let mut out = Vec::new();
    go(&[], &tree.replace(" as", " as "), &mut out);
    out
}

/// Every path `code` names, with where it stands — its non-pub `use` trees, expanded, and
/// the paths in its code (those of other crates are dropped by [`absolute`]).
fn referenced(code: &str) -> Vec<(usize, Vec<String>)> {
    let mut out = Vec::new();
    // `use` statements are read as trees (and blanked); the rest of the code as plain paths.
    let mut plain: Vec<char> = code.chars().collect();
    let chars = plain.clone();
    let text: String = chars.iter().collect();
    let mut from = 0;
    while let Some(i) = find_word(&text[byte(&chars, from)..], "use") {
        let at = from + text[byte(&chars, from)..][..i].chars().count();
        let before: String = chars[..at].iter().collect();
        let before = before.trim_end();
        let public = before.ends_with("pub") || before.ends_with("pub(crate)");
        let end = (at..chars.len())
            .find(|&k| chars[k] == ';')
            .unwrap_or(chars.len());
        if !public {
            let tree: String = chars[at + 3..end]
                .iter()
                .filter(|c| !c.is_whitespace())
                .collect();
            out.extend(expand(&tree).into_iter().map(|p| (at, p)));
        }
        for c in &mut plain[at..end] {
            *c = ' ';
        }
        from = end;
    }
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < plain.len() {
        if ident(plain[i]) || plain[i] == '$' {
            let start = i;
            let mut j = i;
            while j < plain.len() && (ident(plain[j]) || plain[j] == '$' || plain[j] == ':') {
                j += 1;
            }
            let path: String = plain[start..j].iter().collect();
            let preceded = start > 0 && plain[start - 1] == ':';
            if !preceded && path.contains("::") {
                let segments = path.split("::").filter(|s| !s.is_empty());
                out.push((start, segments.map(String::from).collect()));
            }
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// The byte offset of char `k` of `chars`.
fn byte(chars: &[char], k: usize) -> usize {
    chars[..k].iter().map(|c| c.len_utf8()).sum()
}

/// The inline modules of `code` (`mod name { … }`): each one's name and the char range of
/// its body. A test module (`#[cfg(test)]`) is named `#test`: its paths are no imports.
fn inline_modules(code: &str) -> Vec<(String, std::ops::Range<usize>)> {
    let chars: Vec<char> = code.chars().collect();
    let text: String = chars.iter().collect();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = find_word(&text[byte(&chars, from)..], "mod") {
        let at = from + text[byte(&chars, from)..][..i].chars().count();
        let mut k = at + 3;
        while k < chars.len() && chars[k].is_whitespace() {
            k += 1;
        }
        let name_start = k;
        while k < chars.len() && (chars[k].is_alphanumeric() || chars[k] == '_') {
            k += 1;
        }
        let name: String = chars[name_start..k].iter().collect();
        while k < chars.len() && chars[k].is_whitespace() {
            k += 1;
        }
        let attrs: String = chars[..at].iter().collect();
        let test = attrs.trim_end().ends_with("#[cfg(test)]");
        let name = if test { "#test".to_string() } else { name };
        if k < chars.len() && chars[k] == '{' && !name.is_empty() {
            let mut depth = 0;
            let mut end = k;
            for (e, &c) in chars.iter().enumerate().skip(k) {
                depth += match c {
                    '{' => 1,
                    '}' => -1,
                    _ => 0,
                };
                if depth == 0 {
                    end = e;
                    break;
                }
            }
            out.push((name, k..end));
        }
        from = k.max(at + 3);
    }
    out
}

/// The module a path at char `at` of file module `m` is written in (inside `inline`).
fn module_at(m: &ModPath, inline: &[(String, std::ops::Range<usize>)], at: usize) -> ModPath {
    let mut out = m.clone();
    out.extend(
        inline
            .iter()
            .filter(|(_, r)| r.contains(&at))
            .map(|(n, _)| n.clone()),
    );
    out
}

/// `path` (as written in module `m`) from the crate root; `None` for another crate's path.
/// A path that begins with a child module of `m` is relative to `m` (`use state::Holding;`).
fn absolute(
    m: &ModPath,
    path: &[String],
    files: &BTreeMap<ModPath, PathBuf>,
) -> Option<Vec<String>> {
    let first = path.first()?;
    let mut base: Vec<String> = match first.as_str() {
        "crate" | "$crate" => Vec::new(),
        "self" => m.clone(),
        child if files.contains_key(&[m.as_slice(), &[child.to_string()]].concat()) => {
            let mut b = m.clone();
            b.extend(path.iter().cloned());
            return Some(b);
        }
        "super" => {
            let mut b = m.clone();
            let mut k = 0;
            while path.get(k).is_some_and(|s| s == "super") {
                b.pop()?;
                k += 1;
            }
            b.extend(path[k..].iter().cloned());
            return Some(b);
        }
        _ => return None,
    };
    base.extend(path[1..].iter().cloned());
    Some(base)
}

/// The loops of `edges`: each strongly connected component of more than one file.
pub fn loops(edges: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    // Tarjan's algorithm, iterative over the sorted nodes.
    struct State<'a> {
        edges: &'a BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on: BTreeSet<&'a ModPath>,
        out: Vec<Vec<ModPath>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a ModPath) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v);
        for w in s.edges.get(v).into_iter().flatten() {
            let Some((w, _)) = s.edges.get_key_value(w) else {
                continue;
            };
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The library crates' source roots under the workspace `root`.
pub fn library_sources(root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("src"))
        .chain([root.join("kernels/src"), root.join("examples/src")])
        .filter(|src| src.join("lib.rs").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// Lines of Rust under `dir`, every file.
pub fn lines(dir: &Path) -> usize {
    let mut files = BTreeMap::new();
    collect(dir, dir, &mut files).unwrap_or_default();
    files
        .values()
        .map(|f| std::fs::read_to_string(f).map_or(0, |t| t.lines().count()))
        .sum()
}

#[cfg(test)]
mod tests;
