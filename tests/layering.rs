//! The crate's structure (see `src/lib.rs`): every `crate::` path in a library file
//! points to its own layer or one below it, the top-level modules import each other
//! without circles, the dependencies that belong to one layer stay there
//! (`mistralrs-core` in `reference`, `clap` in the command line), and only
//! `model::Session` runs the model's forward pass; inside `model`, the file, text and
//! numerics parts import nothing above them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers from the bottom; a module may import its own layer and those below.
const LAYERS: &[&[&str]] = &[
    &[
        "error",
        "artifact",
        "rng",
        "wait",
        "http",
        "provenance",
        "lock",
        "metrics",
        "synthetic",
    ],
    &["model", "results", "test_support"],
    &["policy", "probe"],
    &["rag", "serve"],
    &["reference"],
    &["lab"],
];

fn rank(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The library's files (not the command line's) with their top-level module.
fn library_files() -> Vec<(String, PathBuf)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    files
        .into_iter()
        .filter_map(|path| {
            let rel = path.strip_prefix(&src).unwrap();
            let first = rel.components().next()?.as_os_str().to_str()?.to_string();
            let module = first.trim_end_matches(".rs").to_string();
            (!matches!(module.as_str(), "lib" | "main" | "cli")).then_some((module, path))
        })
        .collect()
}

/// The code of a file: line comments (and so doc comments) removed.
fn code(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| match line.find("//") {
            // "//" inside a string literal (a URL) keeps the line whole.
            Some(i) if line[..i].matches('"').count() % 2 == 0 => &line[..i],
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> String {
    s.trim_start()
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The items of a `{...}` group at the start of `s`, split at its top-level commas.
fn group_items(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut items) = (0, 1, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' | ',' if depth == 1 => {
                items.push(&s[start..i]);
                start = i + 1;
                if c == '}' {
                    break;
                }
            }
            '}' => depth -= 1,
            _ => {}
        }
    }
    items
}

/// The top-level modules a file names through `crate::` (in `use crate::{a::X, b}`
/// groups too).
fn imported_modules(code: &str) -> BTreeSet<String> {
    let mut names = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if rest.starts_with('{') {
            names.extend(group_items(rest).into_iter().map(ident));
        } else {
            names.push(ident(rest));
        }
    }
    names
        .into_iter()
        .filter(|n| !n.is_empty())
        // `crate::Error` and `crate::Result` are the root's re-exports from `error`.
        .map(|n| match n.as_str() {
            "Error" | "Result" => "error".to_string(),
            _ => n,
        })
        .collect()
}

#[test]
fn no_module_imports_a_layer_above_its_own() {
    let mut upward = Vec::new();
    for (module, path) in library_files() {
        let own = rank(&module)
            .unwrap_or_else(|| panic!("{}: module `{module}` has no layer", path.display()));
        for target in imported_modules(&code(&path)) {
            let theirs = rank(&target).unwrap_or_else(|| {
                panic!(
                    "{}: `crate::{target}` is not a layered module",
                    path.display()
                )
            });
            if theirs > own {
                upward.push(format!("{} imports crate::{target}", path.display()));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports up the layers:\n{}",
        upward.join("\n")
    );
}

#[test]
fn top_level_modules_import_each_other_without_circles() {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, path) in library_files() {
        let targets = imported_modules(&code(&path));
        let entry = edges.entry(module.clone()).or_default();
        entry.extend(targets.into_iter().filter(|t| *t != module));
    }
    // Depth-first search; a module met again while still on the path closes a circle.
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) {
        if let Some(at) = path.iter().position(|p| p == m) {
            panic!("module circle: {} -> {m}", path[at..].join(" -> "));
        }
        if done.contains(m) {
            return;
        }
        path.push(m.to_string());
        for next in edges.get(m).into_iter().flatten() {
            visit(next, edges, path, done);
        }
        path.pop();
        done.insert(m.to_string());
    }
    let mut done = BTreeSet::new();
    for m in edges.keys() {
        visit(m, &edges, &mut Vec::new(), &mut done);
    }
}

#[test]
fn layer_bound_dependencies_stay_in_their_layer() {
    for (module, path) in library_files() {
        let code = code(&path);
        if code.contains("mistralrs_core") {
            assert_eq!(
                module,
                "reference",
                "{}: only `reference` uses mistralrs-core",
                path.display()
            );
        }
        assert!(
            !code.contains("clap::"),
            "{}: clap types belong to the command line (src/cli)",
            path.display()
        );
    }
}

#[test]
fn the_layer_table_names_every_module_of_the_crate_root() {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let declared: BTreeSet<&str> = lib
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")?.strip_suffix(';')
        })
        .collect();
    let layered: BTreeSet<&str> = LAYERS.iter().flat_map(|l| l.iter().copied()).collect();
    assert_eq!(declared, layered);
}

/// The calls of `method(` in `code` that pass a `Logits::` argument (the model's forward
/// pass; `Linear::forward` and candle's modules take none).
fn model_calls<'a>(code: &'a str, method: &str) -> Vec<&'a str> {
    let mut calls = Vec::new();
    for (i, _) in code.match_indices(method) {
        let mut depth = 0;
        for (j, c) in code[i..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        let call = &code[i..i + j + 1];
                        if call.contains("Logits::") {
                            calls.push(call);
                        }
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    calls
}

#[test]
fn only_the_session_runs_the_forward_pass() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let allowed = [
        src.join("model/session.rs"),
        src.join("model/transformer.rs"),
    ];
    let mut outside = Vec::new();
    for path in files.iter().filter(|p| !allowed.contains(p)) {
        let code = code(path);
        for call in model_calls(&code, ".forward(") {
            outside.push(format!("{}: {call}", path.display()));
        }
    }
    assert!(
        outside.is_empty(),
        "forward passes outside model::Session:\n{}",
        outside.join("\n")
    );
}

/// Inside `model`, the parts below the forward pass: each may name (through
/// `crate::model::`) only itself and the parts listed with it.
const MODEL_FOUNDATIONS: &[(&str, &[&str])] =
    &[("file", &[]), ("text", &[]), ("numerics", &["file"])];

#[test]
fn the_models_files_text_and_numerics_import_nothing_above_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/model");
    let mut upward = Vec::new();
    for &(part, below) in MODEL_FOUNDATIONS {
        let mut files = Vec::new();
        rust_files(&src.join(part), &mut files);
        assert!(!files.is_empty(), "src/model/{part} has no files");
        for path in files {
            let code = code(&path);
            for (i, _) in code.match_indices("crate::model::") {
                let rest = &code[i + "crate::model::".len()..];
                let names: Vec<String> = if rest.starts_with('{') {
                    group_items(rest).into_iter().map(ident).collect()
                } else {
                    vec![ident(rest)]
                };
                for name in names {
                    if name != part && !below.contains(&name.as_str()) {
                        upward.push(format!("{}: crate::model::{name}", path.display()));
                    }
                }
            }
        }
    }
    assert!(
        upward.is_empty(),
        "model's file/text/numerics import above themselves:\n{}",
        upward.join("\n")
    );
}
