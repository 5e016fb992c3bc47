//! The shape of `src/`, checked so that it stays one a newcomer can hold:
//! no import cycle between its top-level modules, no file over
//! [`MAX_FILE_LINES`] lines of non-test code and no function over
//! [`MAX_FN_LINES`].
//!
//! A module here is a top-level module: `src/foo.rs` together with
//! `src/foo/**`, with `lib.rs` a node of its own. An edge is a `crate::X`
//! path (or a `super::` path reaching the crate root) in non-test code; a
//! `crate::Name` that is not a top-level module (a re-export or an item of
//! `lib.rs`) is an edge to `lib`. Non-test code is what lies outside items
//! marked `#[cfg(test)]`. The checks read the source as text, with strings,
//! characters and comments blanked first so their braces do not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The most lines of non-test code one file may have.
const MAX_FILE_LINES: usize = 700;
/// The most lines one non-test function may have, from `fn` to its `}`.
const MAX_FN_LINES: usize = 100;

#[test]
fn no_import_cycle_between_top_level_modules() {
    let sources = Sources::read();
    let graph = sources.module_graph();
    assert!(
        graph.contains_key("store") && graph.contains_key("relay"),
        "the graph was read: {graph:?}"
    );
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "import cycle between top-level modules: {}",
            cycle.join(" → ")
        );
    }
}

#[test]
fn no_file_over_the_line_limit() {
    let sources = Sources::read();
    let over: Vec<String> = sources
        .files
        .iter()
        .filter(|f| f.non_test_lines() > MAX_FILE_LINES)
        .map(|f| format!("{} ({})", f.name, f.non_test_lines()))
        .collect();
    assert!(
        over.is_empty(),
        "files over {MAX_FILE_LINES} lines of non-test code: {over:?}"
    );
}

#[test]
fn no_function_over_the_line_limit() {
    let sources = Sources::read();
    let mut over = Vec::new();
    for file in &sources.files {
        for (name, lines) in file.functions() {
            if lines > MAX_FN_LINES {
                over.push(format!("{}: {name} ({lines})", file.name));
            }
        }
    }
    assert!(
        over.is_empty(),
        "non-test functions over {MAX_FN_LINES} lines: {over:?}"
    );
}

#[test]
fn the_reader_blanks_strings_and_comments_and_sees_test_items() {
    let text = "fn a() {\n    let s = \"}}\"; // }\n    let r = r#\"{\"#;\n    let c = '{';\n    let l: &'static str = \"\";\n}\n#[cfg(test)]\nmod tests {\n    fn b() {}\n}\n";
    let file = SourceFile::new("x.rs".into(), 1, text);
    assert_eq!(file.functions(), vec![("a".to_string(), 6)]);
    assert_eq!(file.non_test_lines(), 6);
    let graph_text = "use crate::{a::X, b};\nuse super::c::Y;\n#[cfg(test)]\nuse crate::d;\n";
    let file = SourceFile::new("m.rs".into(), 1, graph_text);
    assert_eq!(
        file.targets(),
        BTreeSet::from(["a".to_string(), "b".to_string(), "c".to_string()])
    );
}

/// Every `.rs` file under `src/`, but `main.rs` (a crate of its own, which
/// reaches the library by its name, not by `crate::`) counts for sizes only.
struct Sources {
    files: Vec<SourceFile>,
    /// The top-level modules `lib.rs` declares.
    modules: BTreeSet<String>,
}

impl Sources {
    fn read() -> Self {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut paths = Vec::new();
        collect(&src, &mut paths);
        paths.sort();
        let mut files: Vec<SourceFile> = paths
            .iter()
            .map(|path| {
                let relative = path.strip_prefix(&src).expect("under src");
                let name = relative.display().to_string();
                let depth = relative.components().count();
                let text = std::fs::read_to_string(path).expect("a source file reads");
                SourceFile::new(name, depth, &text)
            })
            .collect();
        // Files that are test modules of their own (`#[cfg(test)] mod x;`).
        let test_files: BTreeSet<String> =
            files.iter().flat_map(|f| f.test_module_files()).collect();
        files.retain(|f| !test_files.contains(&f.name));
        let lib = files.iter().find(|f| f.name == "lib.rs").expect("lib.rs");
        let modules = lib.declared_modules();
        Self { files, modules }
    }

    /// Each top-level module's edges to the others.
    fn module_graph(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in &self.files {
            let Some(from) = file.module() else { continue };
            let edges = graph.entry(from.clone()).or_default();
            for target in file.targets() {
                let to = if self.modules.contains(&target) {
                    target
                } else {
                    "lib".to_string()
                };
                if to != from {
                    edges.insert(to);
                }
            }
        }
        graph
    }
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ reads") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// One source file: its text with strings, characters and comments blanked
/// (lines kept), and which of its lines are test code.
struct SourceFile {
    /// Its path under `src/`.
    name: String,
    /// Path components under `src/`: 1 for `src/foo.rs`, 2 for `src/foo/bar.rs`.
    depth: usize,
    /// The blanked text, one entry per line.
    lines: Vec<String>,
    /// Per line: inside an item marked `#[cfg(test)]`.
    test: Vec<bool>,
}

impl SourceFile {
    fn new(name: String, depth: usize, text: &str) -> Self {
        let blank = blank_literals(text);
        let lines: Vec<String> = blank.lines().map(str::to_string).collect();
        let test = test_lines(&lines);
        Self {
            name,
            depth,
            lines,
            test,
        }
    }

    fn non_test_lines(&self) -> usize {
        self.test.iter().filter(|t| !**t).count()
    }

    /// The top-level module the file belongs to; `None` for `main.rs`.
    fn module(&self) -> Option<String> {
        let first = self.name.split('/').next()?;
        let module = first.trim_end_matches(".rs");
        (module != "main").then(|| module.to_string())
    }

    /// The non-test code as one string.
    fn code(&self) -> String {
        self.lines
            .iter()
            .zip(&self.test)
            .map(|(line, test)| if *test { "" } else { line.as_str() })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The top-level names its non-test code reaches from the crate root.
    fn targets(&self) -> BTreeSet<String> {
        let code = self.code();
        let mut targets = BTreeSet::new();
        let mut rest = code.as_str();
        while let Some(at) = rest.find("crate::") {
            let before = rest[..at].chars().next_back();
            rest = &rest[at + "crate::".len()..];
            if before.is_some_and(is_ident) {
                continue;
            }
            first_segments(rest, &mut targets);
        }
        // `super::` reaching the root: as many as the file is deep.
        let root = "super::".repeat(self.depth);
        let mut rest = code.as_str();
        while let Some(at) = rest.find(&root) {
            rest = &rest[at + root.len()..];
            if !rest.starts_with("super::") {
                first_segments(rest, &mut targets);
            }
        }
        targets
    }

    /// Names and lengths of the functions in non-test code.
    fn functions(&self) -> Vec<(String, usize)> {
        let mut found = Vec::new();
        for (start, line) in self.lines.iter().enumerate() {
            if self.test[start] {
                continue;
            }
            let Some(name) = fn_name(line) else { continue };
            if let Some(end) = item_end(&self.lines, start) {
                found.push((name, end - start + 1));
            }
        }
        found
    }

    /// `mod name { … }` or `mod name;` lines at the top of `lib.rs`.
    fn declared_modules(&self) -> BTreeSet<String> {
        self.lines
            .iter()
            .zip(&self.test)
            .filter(|(_, test)| !**test)
            .filter_map(|(line, _)| mod_name(line))
            .collect()
    }

    /// Files that hold `#[cfg(test)] mod x;` declared in this file.
    fn test_module_files(&self) -> Vec<String> {
        let dir = match self.name.strip_suffix(".rs") {
            Some("lib" | "main") => String::new(),
            Some(stem) => match stem.strip_suffix("/mod") {
                Some(parent) => format!("{parent}/"),
                None => format!("{stem}/"),
            },
            None => String::new(),
        };
        self.lines
            .iter()
            .zip(&self.test)
            .filter(|(line, test)| **test && line.trim_end().ends_with(';'))
            .filter_map(|(line, _)| mod_name(line))
            .flat_map(|m| [format!("{dir}{m}.rs"), format!("{dir}{m}/mod.rs")])
            .collect()
    }
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The first path segment after `crate::`, or each one of a `{…}` group.
fn first_segments(rest: &str, out: &mut BTreeSet<String>) {
    if let Some(group) = rest.strip_prefix('{') {
        let mut depth = 0;
        let mut start = true;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => start = true,
                c if start && is_ident(c) => {
                    let name: String = group[i..].chars().take_while(|c| is_ident(*c)).collect();
                    if name != "self" {
                        out.insert(name);
                    }
                    start = false;
                }
                _ => {}
            }
        }
    } else {
        let name: String = rest.chars().take_while(|c| is_ident(*c)).collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
}

/// The name of a module declared on `line`, if it declares one.
fn mod_name(line: &str) -> Option<String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "mod")?;
    if words[..at]
        .iter()
        .any(|w| !w.starts_with("pub") && !w.starts_with("#["))
    {
        return None;
    }
    let name: String = words
        .get(at + 1)?
        .chars()
        .take_while(|c| is_ident(*c))
        .collect();
    (!name.is_empty()).then_some(name)
}

/// The name of a function whose `fn` keyword is on `line`.
fn fn_name(line: &str) -> Option<String> {
    let mut words = line.split(|c: char| !is_ident(c)).filter(|w| !w.is_empty());
    while let Some(word) = words.next() {
        if word == "fn" {
            return words.next().map(str::to_string);
        }
        if !matches!(
            word,
            "pub" | "crate" | "super" | "in" | "const" | "async" | "unsafe" | "extern" | "default"
        ) {
            return None;
        }
    }
    None
}

/// The line where the item starting at `start` ends: the `}` matching its
/// first `{`, or its `;` when it has no body.
fn item_end(lines: &[String], start: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut opened = false;
    for (i, line) in lines.iter().enumerate().skip(start) {
        for c in line.chars() {
            match c {
                '{' => {
                    depth += 1;
                    opened = true;
                }
                '}' => {
                    depth = depth.saturating_sub(1);
                    if opened && depth == 0 {
                        return Some(i);
                    }
                }
                ';' if !opened => return Some(i),
                _ => {}
            }
        }
    }
    None
}

/// Per line, whether it lies in an item marked `#[cfg(test)]` (the
/// attribute's own line included).
fn test_lines(lines: &[String]) -> Vec<bool> {
    let mut test = vec![false; lines.len()];
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim_start().starts_with("#[cfg(test)]") {
            // The item is what follows the attribute (maybe on its line).
            let end = item_end(lines, i).unwrap_or(lines.len() - 1);
            for t in &mut test[i..=end] {
                *t = true;
            }
            i = end + 1;
        } else {
            i += 1;
        }
    }
    test
}

/// `text` with the insides of string and character literals and of
/// comments replaced by spaces, newlines kept.
fn blank_literals(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let prev_ident = i > 0 && is_ident(chars[i - 1]);
        if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                blank(&mut out, chars[i]);
                i += 1;
            }
        } else if c == '/' && chars.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    blank(&mut out, '/');
                    blank(&mut out, '*');
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    blank(&mut out, '*');
                    blank(&mut out, '/');
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
        } else if !prev_ident && (c == 'r' || (c == 'b' && chars.get(i + 1) == Some(&'r'))) {
            // A raw string: r"…", r#"…"#, br"…".
            let mut j = i + if c == 'b' { 2 } else { 1 };
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            out.extend(&chars[i..=j]);
            i = j + 1;
            while i < chars.len() && !chars[i..].starts_with(&close) {
                blank(&mut out, chars[i]);
                i += 1;
            }
            out.extend(&close);
            i += close.len();
        } else if c == '"' {
            out.push('"');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
                if i < chars.len() {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
            out.push('"');
            i += 1;
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{7f}'), or a lifetime.
            let literal_end = if chars.get(i + 1) == Some(&'\\') {
                chars[i + 2..]
                    .iter()
                    .position(|c| *c == '\'')
                    .map(|p| i + 2 + p)
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match literal_end {
                Some(end) => {
                    out.push('\'');
                    for _ in i + 1..end {
                        out.push(' ');
                    }
                    out.push('\'');
                    i = end + 1;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// A cycle in `graph`, as the modules along it, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, graph, &mut Vec::new(), &mut done) {
            return Some(cycle);
        }
    }
    None
}
