//! `cargo xtask deps`, second half: no loops between the files of a crate.
//!
//! A file that imports a file that imports it back (directly, or round a longer loop)
//! can be read only together with the other: neither is the simpler one to read first,
//! and a change to either may break the other. ARCHITECTURE.md states the rule; this
//! check holds every crate's `src/` to it.
//!
//! It reads the module tree from the `mod name;` declarations (test modules, behind
//! `#[cfg(test)]`, left out) and, in each file's code before its tests, every path that
//! starts with `crate::`, `super::` or `self::` (in `use` items, braces included, and
//! inline). A path goes to the deepest module it names, through re-exports
//! (`pub use module::Item`) when its next segment is an item. A module's references to
//! its own submodules are not edges: a parent is made of its children. Comments and
//! string literals are skipped, so doc links do not count.
//!
//! It reads text, not Rust's name resolution: a macro that builds paths, or an import
//! through `use` of an external crate's re-export, is invisible to it. That is enough
//! for the loops people write by hand.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// A module's path from the crate root (`[]` is the root).
type ModPath = Vec<String>;

/// One loop between files of a crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Loop {
    /// The crate's `src` folder.
    pub(crate) src: PathBuf,
    /// The files of the loop, relative to `src`, the first repeated at the end.
    pub(crate) files: Vec<String>,
    /// How many files the tangle holds in all (every file that reaches each other):
    /// more than the loop's when several loops share files.
    pub(crate) tangle: usize,
}

impl std::fmt::Display for Loop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.src.display(), self.files.join(" → "))?;
        let others = self.tangle + 1 - self.files.len();
        if others > 0 {
            write!(f, " (and {others} more file(s) in the same tangle)")?;
        }
        Ok(())
    }
}

/// A crate's module tree: each module's file, its code (tests and comments cut), and
/// its re-exports.
struct Crate {
    files: BTreeMap<ModPath, (String, String)>,
    reexports: BTreeMap<ModPath, BTreeMap<String, ModPath>>,
}

/// The loops of every crate under `crates/` of the workspace at `root`.
pub(crate) fn check_workspace(root: &Path) -> Result<Vec<Loop>> {
    let mut loops = Vec::new();
    let dir = root.join("crates");
    let mut crates: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path().join("src")))
        .filter(|src| src.is_dir())
        .collect();
    crates.sort();
    for src in crates {
        for root_file in ["lib.rs", "main.rs"] {
            if src.join(root_file).is_file() {
                loops.extend(check_crate(&src, root_file)?);
            }
        }
    }
    Ok(loops)
}

/// The loops of the crate whose root file is `src/root_file`.
pub(crate) fn check_crate(src: &Path, root_file: &str) -> Result<Vec<Loop>> {
    let krate = Crate::read(src, root_file)?;
    let mut edges: BTreeMap<&ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (module, (_, code)) in &krate.files {
        let targets = edges.entry(module).or_default();
        for path in paths(code) {
            let Some(target) = krate.resolve(module, &path) else { continue };
            // A module's own submodules are its parts, not its imports.
            if !target.starts_with(module) {
                targets.insert(target);
            }
        }
    }
    let name = |m: &ModPath| krate.files[m].0.clone();
    Ok(cycles(&edges)
        .into_iter()
        .map(|(mut cycle, tangle)| {
            cycle.push(cycle[0].clone());
            Loop { src: src.to_owned(), files: cycle.iter().map(name).collect(), tangle }
        })
        .collect())
}

impl Crate {
    fn read(src: &Path, root_file: &str) -> Result<Self> {
        let mut krate = Self { files: BTreeMap::new(), reexports: BTreeMap::new() };
        krate.visit(src, Vec::new(), &src.join(root_file), src)?;
        Ok(krate)
    }

    /// Reads the module at `file` and, recursively, its file submodules; `dir` is
    /// where they live.
    fn visit(&mut self, src: &Path, module: ModPath, file: &Path, dir: &Path) -> Result<()> {
        let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let code = before_tests(&strip(&text));
        self.reexports.insert(module.clone(), reexports(&code).into_iter().collect());
        let rel = file.strip_prefix(src).unwrap_or(file).display().to_string();
        for child in file_modules(&code) {
            let flat = dir.join(format!("{child}.rs"));
            let nested = dir.join(&child).join("mod.rs");
            let (child_file, child_dir) = if flat.is_file() {
                (flat, dir.join(&child))
            } else if nested.is_file() {
                (nested, dir.join(&child))
            } else {
                continue;
            };
            let mut path = module.clone();
            path.push(child);
            self.visit(src, path, &child_file, &child_dir)?;
        }
        self.files.insert(module, (rel, code));
        Ok(())
    }

    /// The module `path` (written in `from`) refers to: the deepest module it names,
    /// through re-exports.
    fn resolve(&self, from: &ModPath, path: &[String]) -> Option<ModPath> {
        let mut at: ModPath = Vec::new();
        let mut rest = path;
        match rest.first().map(String::as_str)? {
            "crate" => rest = &rest[1..],
            "self" => {
                at.clone_from(from);
                rest = &rest[1..];
            }
            "super" => {
                at.clone_from(from);
                while rest.first().map(String::as_str) == Some("super") {
                    at.pop()?;
                    rest = &rest[1..];
                }
            }
            _ => return None,
        }
        self.descend(at, rest, 0)
    }

    /// The deepest module of `rest` below `at`; an item `at` re-exports stands for the
    /// module it comes from.
    fn descend(&self, mut at: ModPath, rest: &[String], depth: usize) -> Option<ModPath> {
        for segment in rest {
            let mut child = at.clone();
            child.push(segment.clone());
            if self.files.contains_key(&child) {
                at = child;
                continue;
            }
            let origin = self.reexports.get(&at).and_then(|r| r.get(segment));
            if let Some(origin) = origin.filter(|_| depth < 8) {
                let from = at.clone();
                return match origin.first().map(String::as_str) {
                    Some("crate" | "super" | "self") => self.resolve(&from, origin),
                    // `pub use child::Item`: relative to the re-exporting module.
                    _ => self.descend(from, origin, depth + 1),
                };
            }
            break;
        }
        Some(at)
    }
}

/// `text` with comments and the contents of string and character literals blanked.
fn strip(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            }
            b'r' if matches!(b.get(i + 1), Some(b'#' | b'"'))
                && (!is_ident(b.get(i.wrapping_sub(1)))
                    || (b.get(i.wrapping_sub(1)) == Some(&b'b') && !is_ident(b.get(i.wrapping_sub(2))))) =>
            {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                let close: Vec<u8> = std::iter::once(b'"').chain(std::iter::repeat_n(b'#', hashes)).collect();
                i += 2 + hashes;
                while i < b.len() && !b[i..].starts_with(&close) {
                    i += 1;
                }
                i += close.len();
                out.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            // A character literal (`'x'`, `'\n'`), not a lifetime (`'a`).
            b'\'' if b.get(i + 2) == Some(&b'\'') || b.get(i + 1) == Some(&b'\\') => {
                i += 1;
                while i < b.len() && b[i] != b'\'' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("' '");
            }
            _ => {
                // Multi-byte characters are copied whole.
                let len = text[i..].chars().next().map_or(1, char::len_utf8);
                out.push_str(&text[i..i + len]);
                i += len;
            }
        }
    }
    out
}

fn is_ident(c: Option<&u8>) -> bool {
    c.is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

/// The code before a file's `#[cfg(test)]` module.
fn before_tests(code: &str) -> String {
    let lines: Vec<&str> = code.lines().collect();
    let end = lines
        .iter()
        .enumerate()
        .position(|(i, l)| {
            l.trim() == "#[cfg(test)]"
                && lines[i + 1..]
                    .iter()
                    .find(|l| !l.trim().is_empty())
                    .is_some_and(|l| l.trim().starts_with("mod "))
        })
        .unwrap_or(lines.len());
    lines[..end].join("\n")
}

/// The names of the file modules `code` declares (`mod name;`), leaving out those
/// behind `#[cfg(test)]`.
fn file_modules(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut test_only = false;
    for line in code.lines().map(str::trim) {
        if line == "#[cfg(test)]" {
            test_only = true;
            continue;
        }
        let rest = line.strip_prefix("pub(crate) ").or_else(|| line.strip_prefix("pub ")).unwrap_or(line);
        if let Some(name) = rest.strip_prefix("mod ").and_then(|r| r.strip_suffix(';'))
            && !test_only
        {
            found.push(name.trim().to_owned());
        }
        if !line.starts_with("#[") {
            test_only = false;
        }
    }
    found
}

/// Every path in `code` that starts with `crate`, `super` or `self`, with `use` groups
/// (`crate::{a::b, c}`) expanded.
fn paths(code: &str) -> Vec<Vec<String>> {
    let tokens = tokens(code);
    let mut found = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i].as_str();
        let starts = matches!(t, "crate" | "super" | "self")
            && tokens.get(i + 1).is_some_and(|n| n == "::")
            && (i == 0 || tokens[i - 1] != "::");
        if starts {
            let (group, next) = path_tree(&tokens, i);
            found.extend(group);
            i = next;
        } else {
            i += 1;
        }
    }
    found
}

/// The items a module re-exports (`pub use path::{Item, Other as Alias}`,
/// `pub(crate) use …`), by their last segment, with the path they come from.
fn reexports(code: &str) -> Vec<(String, Vec<String>)> {
    let tokens = tokens(code);
    let mut found = Vec::new();
    for i in 1..tokens.len() {
        // `pub use` or `pub(crate) use`.
        if tokens[i] != "use" || !(tokens[i - 1] == "pub" || tokens[i - 1] == ")") {
            continue;
        }
        let (group, _) = path_tree(&tokens, i + 1);
        for path in group {
            if let Some(last) = path.last().filter(|l| *l != "*" && *l != "self") {
                found.push((last.clone(), path));
            }
        }
    }
    found
}

/// The paths of the path or `use` tree starting at `tokens[start]`, and the index after it.
fn path_tree(tokens: &[String], start: usize) -> (Vec<Vec<String>>, usize) {
    let mut prefix = Vec::new();
    let mut i = start;
    loop {
        match tokens.get(i).map(String::as_str) {
            Some("{") => {
                let mut found = Vec::new();
                i += 1;
                loop {
                    match tokens.get(i).map(String::as_str) {
                        None => return (found, i),
                        Some("}") => return (found, i + 1),
                        Some(",") => i += 1,
                        Some(_) => {
                            let (inner, next) = path_tree(tokens, i);
                            for p in inner {
                                let mut full = prefix.clone();
                                full.extend(p);
                                found.push(full);
                            }
                            i = next;
                        }
                    }
                }
            }
            Some(t) if t == "*" || t.chars().next().is_some_and(|c| c.is_alphanumeric() || c == '_') => {
                prefix.push(t.to_owned());
                i += 1;
                if tokens.get(i).map(String::as_str) == Some("as") {
                    // `Item as Alias`: the path is the item's; the alias is its name here.
                    i += 2;
                }
                if tokens.get(i).map(String::as_str) == Some("::") {
                    i += 1;
                } else {
                    return (vec![prefix], i);
                }
            }
            _ => return (vec![prefix], i),
        }
    }
}

/// Identifiers, `::`, and single punctuation characters.
fn tokens(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = code.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c.is_alphanumeric() || c == '_' {
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = chars.peek() {
                if d.is_alphanumeric() || d == '_' {
                    end = j + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            out.push(code[i..end].to_owned());
        } else if c == ':' && chars.peek().map(|&(_, d)| d) == Some(':') {
            chars.next();
            out.push("::".into());
        } else if !c.is_whitespace() {
            out.push(c.to_string());
        }
    }
    out
}

/// One loop per strongly connected component of more than one module (Tarjan): a
/// shortest loop through its first module, with the component's size.
fn cycles(edges: &BTreeMap<&ModPath, BTreeSet<ModPath>>) -> Vec<(Vec<ModPath>, usize)> {
    let nodes: Vec<&ModPath> = edges.keys().copied().collect();
    let index_of: BTreeMap<&ModPath, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let adj: Vec<Vec<usize>> =
        nodes.iter().map(|n| edges[n].iter().filter_map(|t| index_of.get(t).copied()).collect()).collect();
    let mut found = Vec::new();
    for component in tarjan(&adj) {
        if component.len() < 2 {
            continue;
        }
        let first = *component.iter().min().expect("non-empty");
        let inside: BTreeSet<usize> = component.iter().copied().collect();
        // Breadth-first from `first` back to itself, inside the component.
        let mut parent: BTreeMap<usize, usize> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([first]);
        let mut back = None;
        while let Some(n) = queue.pop_front() {
            for &m in &adj[n] {
                if m == first {
                    back = Some(n);
                    break;
                }
                if inside.contains(&m) && !parent.contains_key(&m) {
                    parent.insert(m, n);
                    queue.push_back(m);
                }
            }
            if back.is_some() {
                break;
            }
        }
        let mut path = Vec::new();
        let mut n = back.expect("a component of two or more has a loop through each member");
        while n != first {
            path.push(n);
            n = parent[&n];
        }
        path.push(first);
        path.reverse();
        found.push((path.into_iter().map(|i| nodes[i].clone()).collect(), component.len()));
    }
    found
}

/// Tarjan's strongly connected components of the graph `adj`.
fn tarjan(adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        adj: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in &s.adj[v] {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(component);
        }
    }
    let n = adj.len();
    let mut s = State {
        adj,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        for (path, text) in files {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
    }

    fn loops(files: &[(&str, &str)]) -> Vec<String> {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), files);
        check_crate(dir.path(), "lib.rs").unwrap().into_iter().map(|l| l.files.join(" → ")).collect()
    }

    #[test]
    fn a_loop_of_three_files_is_found_through_groups_and_reexports() {
        let found = loops(&[
            ("lib.rs", "mod io;\nmod lora;\nmod model;\npub use model::Model;\n"),
            ("io.rs", "use crate::{Result, Model};\n"),
            ("model.rs", "pub struct Model;\nuse crate::lora::{frozen, Projection as P};\n"),
            ("lora.rs", "fn f() { crate::io::write(); }\n"),
        ]);
        assert_eq!(found, ["io.rs → model.rs → lora.rs → io.rs"]);
    }

    #[test]
    fn parents_children_comments_strings_and_tests_are_not_loops() {
        let found = loops(&[
            ("lib.rs", "mod ops;\nmod portable;\npub use portable::Kernels;\n"),
            ("ops/mod.rs", "mod decode;\npub(crate) use decode::step;\npub fn rope() { crate::Kernels; }\n"),
            ("ops/decode.rs", "use super::rope;\npub fn step() {}\n"),
            (
                "portable.rs",
                "/// See [`crate::ops::rope`].\npub struct Kernels;\nconst S: &str = \"crate::ops::x\";\n\
                 fn f() { ops::rope(); }\n#[cfg(test)]\nmod tests {\n    use crate::ops::decode::step;\n}\n",
            ),
        ]);
        // ops/mod.rs → portable.rs only; portable's links, strings and tests do not count.
        assert!(found.is_empty(), "{found:?}");
        let found = loops(&[
            ("lib.rs", "mod ops;\nmod portable;\n"),
            ("ops/mod.rs", "pub(crate) struct Tables(crate::portable::DeviceTables);\n"),
            ("portable.rs", "pub(crate) struct DeviceTables;\nuse crate::ops::Tables;\n"),
        ]);
        assert_eq!(found, ["ops/mod.rs → portable.rs → ops/mod.rs"]);
    }

    #[test]
    fn super_paths_climb_from_the_file_module() {
        let found = loops(&[
            ("lib.rs", "mod cluster;\nmod app;\n"),
            ("cluster/mod.rs", "mod worker;\n"),
            ("cluster/worker.rs", "use super::super::app::load;\n"),
            ("app.rs", "use crate::cluster::worker::Worker;\n"),
        ]);
        assert_eq!(found, ["app.rs → cluster/worker.rs → app.rs"]);
    }
}
