//! The documentation against the code: the configuration keys. `src/config.rs`
//! declares every key once (`KEYS`); the key table of `docs/design.md` and
//! `config/outbox-relay.toml` must list exactly those, and every other key
//! table (the README's, any in `docs/`) may show only those, each with its
//! variable spelled `OUTBOX_<KEY>`. Plain file checks: no services needed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use outbox_relay::config::{ENV_PREFIX, KEYS};

const DESIGN: &str = "docs/design.md";
const CONFIG_FILE: &str = "config/outbox-relay.toml";

/// The documents whose key tables may show only declared keys.
const DOCUMENTS: &[&str] = &[
    "README.md",
    "CONTRIBUTING.md",
    "docs/design.md",
    "docs/operations.md",
    "docs/benchmarks.md",
    "docs/guarantees.md",
    "docs/runbook.md",
];

fn read(path: &str) -> String {
    let full = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {}: {e}", full.display()))
}

fn declared() -> BTreeSet<String> {
    KEYS.iter().map(|key| key.to_string()).collect()
}

/// One row of a key table: the keys its first cell names, and the
/// `OUTBOX_*` variables its `variable` cell names, if the table has one.
#[derive(Debug)]
struct KeyRow {
    line: usize,
    keys: Vec<String>,
    variables: Option<Vec<String>>,
}

/// The rows of every Markdown table (outside code blocks) whose first
/// column is headed `key`.
fn key_rows(text: &str) -> Vec<KeyRow> {
    let mut rows = Vec::new();
    let mut in_code = false;
    let mut header: Option<Vec<String>> = None;
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code || !line.starts_with('|') {
            header = None;
            continue;
        }
        let cells = cells(line);
        let Some(columns) = &header else {
            header = Some(cells);
            continue;
        };
        if cells
            .iter()
            .all(|c| c.chars().all(|ch| ch == '-' || ch == ':'))
        {
            continue;
        }
        if columns.first().map(String::as_str) != Some("key") {
            continue;
        }
        let variables = columns
            .iter()
            .position(|c| c == "variable")
            .and_then(|at| cells.get(at))
            .map(|cell| {
                code_spans(cell)
                    .into_iter()
                    .filter(|name| name.starts_with(ENV_PREFIX))
                    .collect()
            });
        rows.push(KeyRow {
            line: index + 1,
            keys: cells.first().map(|c| code_spans(c)).unwrap_or_default(),
            variables,
        });
    }
    rows
}

/// A table row's cells, split on the `|` outside code spans.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    let mut cells = vec![String::new()];
    let mut in_code = false;
    for ch in inner.chars() {
        match ch {
            '`' => {
                in_code = !in_code;
                cells.last_mut().unwrap().push(ch);
            }
            '|' if !in_code => cells.push(String::new()),
            _ => cells.last_mut().unwrap().push(ch),
        }
    }
    cells.into_iter().map(|c| c.trim().to_string()).collect()
}

/// The text of each `code span` in a cell.
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// Every key a document's key tables show, with the line of each mention.
fn keys_shown(path: &str) -> BTreeMap<String, Vec<usize>> {
    let mut shown: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for row in key_rows(&read(path)) {
        for key in row.keys {
            shown.entry(key).or_default().push(row.line);
        }
    }
    shown
}

/// The keys `config/outbox-relay.toml` sets, or shows set in a comment
/// (`# pool_size = 6`, for a key whose default is derived), with the line of
/// each. A comment line counts only when it parses as one TOML assignment.
fn keys_in_config_file() -> BTreeMap<String, Vec<usize>> {
    let mut found: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (index, line) in read(CONFIG_FILE).lines().enumerate() {
        let assignment = line.strip_prefix("# ").unwrap_or(line);
        if assignment.starts_with('#') || !assignment.contains(" = ") {
            continue;
        }
        let Ok(table) = assignment.parse::<toml::Table>() else {
            continue;
        };
        for key in table.keys() {
            found.entry(key.clone()).or_default().push(index + 1);
        }
    }
    found
}

/// What is missing from `shown`, and what it names that is not declared.
fn differences(shown: &BTreeMap<String, Vec<usize>>) -> (Vec<String>, Vec<String>) {
    let declared = declared();
    let names: BTreeSet<String> = shown.keys().cloned().collect();
    (
        declared.difference(&names).cloned().collect(),
        names.difference(&declared).cloned().collect(),
    )
}

fn undeclared_message(
    path: &str,
    shown: &BTreeMap<String, Vec<usize>>,
    extra: &[String],
) -> String {
    extra
        .iter()
        .map(|key| {
            format!(
                "{path}:{:?} names `{key}`, which src/config.rs does not declare\n",
                shown[key]
            )
        })
        .collect()
}

fn repeated_message(path: &str, shown: &BTreeMap<String, Vec<usize>>) -> String {
    shown
        .iter()
        .filter(|(_, lines)| lines.len() > 1)
        .map(|(key, lines)| format!("{path}: `{key}` appears more than once, at lines {lines:?}\n"))
        .collect()
}

#[test]
fn the_design_key_table_lists_exactly_the_declared_keys() {
    let shown = keys_shown(DESIGN);
    let (missing, extra) = differences(&shown);
    let mut problems: String = missing
        .iter()
        .map(|key| format!("{DESIGN}: the key table lacks `{key}` (declared in src/config.rs)\n"))
        .collect();
    problems += &undeclared_message(DESIGN, &shown, &extra);
    problems += &repeated_message(DESIGN, &shown);
    assert!(problems.is_empty(), "{problems}");
}

#[test]
fn the_config_file_documents_each_declared_key_once() {
    let found = keys_in_config_file();
    let (missing, extra) = differences(&found);
    let mut problems: String = missing
        .iter()
        .map(|key| {
            format!(
                "{CONFIG_FILE} does not document `{key}` (declared in src/config.rs): \
                 add `{key} = …`, or `# {key} = …` when its default is derived\n"
            )
        })
        .collect();
    problems += &undeclared_message(CONFIG_FILE, &found, &extra);
    problems += &repeated_message(CONFIG_FILE, &found);
    assert!(problems.is_empty(), "{problems}");
}

#[test]
fn every_key_table_shows_only_declared_keys_with_their_variables() {
    let declared = declared();
    let mut problems = String::new();
    let mut tables = 0;
    for path in DOCUMENTS {
        for row in key_rows(&read(path)) {
            tables += 1;
            for key in row.keys.iter().filter(|key| !declared.contains(*key)) {
                problems += &format!(
                    "{path}:{} names `{key}`, which src/config.rs does not declare\n",
                    row.line
                );
            }
            let Some(variables) = row.variables else {
                continue;
            };
            let expected: Vec<String> = row
                .keys
                .iter()
                .map(|key| format!("{ENV_PREFIX}{}", key.to_uppercase()))
                .collect();
            if variables != expected {
                problems += &format!(
                    "{path}:{}: the variables of {:?} should read {expected:?}, not {variables:?}\n",
                    row.line, row.keys
                );
            }
        }
    }
    assert!(problems.is_empty(), "{problems}");
    assert!(tables > 0, "no key table found in {DOCUMENTS:?}");
}

#[test]
fn key_rows_are_read_from_tables_outside_code_blocks() {
    let text = "\
| key | variable | default |
|---|---|---|
| `schema`, `table` | `OUTBOX_SCHEMA`, `OUTBOX_TABLE` | `a|b` |
| `log` | `OUTBOX_LOG`, else `RUST_LOG` | `info` |

```
| key | variable |
|---|---|
| `ignored` | `OUTBOX_IGNORED` |
```

| name | type |
|---|---|
| `outbox_lag_seconds` | gauge |
";
    let rows = key_rows(text);
    let keys: Vec<&[String]> = rows.iter().map(|r| r.keys.as_slice()).collect();
    assert_eq!(
        keys,
        [
            &["schema".to_string(), "table".to_string()][..],
            &["log".to_string()][..]
        ]
    );
    assert_eq!(
        rows[1].variables.as_deref(),
        Some(&["OUTBOX_LOG".to_string()][..])
    );
    assert_eq!(rows[0].line, 3);
}
