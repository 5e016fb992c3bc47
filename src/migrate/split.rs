//! The statements of a migration that runs outside a transaction, one by one:
//! `CREATE INDEX CONCURRENTLY` refuses to run in a transaction block, and a
//! multi-statement query string is one implicit transaction.

/// Splits `sql` at its top-level semicolons. A semicolon inside a quoted
/// string (`'…'`, `E'…'`), a quoted identifier (`"…"`), a dollar-quoted body
/// (`$tag$…$tag$`) or a comment (`-- …`, `/* … */`, nested as PostgreSQL
/// nests them) does not end a statement. Statements that are only
/// whitespace and comments are dropped.
pub fn statements(sql: &str) -> Vec<String> {
    let bytes = sql.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    let mut at = 0;
    while at < bytes.len() {
        at = match bytes[at] {
            b';' => {
                push_statement(&mut out, &sql[start..at]);
                start = at + 1;
                at + 1
            }
            b'\'' => {
                let escapes = at > 0
                    && matches!(bytes[at - 1], b'E' | b'e')
                    && (at < 2 || !is_word_byte(bytes[at - 2]));
                skip_quoted(bytes, at, b'\'', escapes)
            }
            b'"' => skip_quoted(bytes, at, b'"', false),
            b'-' if bytes.get(at + 1) == Some(&b'-') => {
                sql[at..].find('\n').map_or(bytes.len(), |n| at + n + 1)
            }
            b'/' if bytes.get(at + 1) == Some(&b'*') => skip_block_comment(bytes, at),
            b'$' if at == 0 || !is_word_byte(bytes[at - 1]) => skip_dollar_quoted(sql, at),
            _ => at + 1,
        };
    }
    push_statement(&mut out, &sql[start..]);
    out
}

fn push_statement(out: &mut Vec<String>, text: &str) {
    if !is_blank(text) {
        out.push(text.trim().to_string());
    }
}

/// Whether `text` holds nothing but whitespace and comments.
fn is_blank(text: &str) -> bool {
    without_leading_comments(text).is_empty()
}

/// `text` from its first byte that is neither whitespace nor in a comment.
fn without_leading_comments(text: &str) -> &str {
    let mut rest = text.trim_start();
    loop {
        if let Some(after) = rest.strip_prefix("--") {
            rest = after.split_once('\n').map_or("", |(_, next)| next);
        } else if rest.starts_with("/*") {
            rest = &rest[skip_block_comment(rest.as_bytes(), 0).min(rest.len())..];
        } else {
            return rest;
        }
        rest = rest.trim_start();
    }
}

fn is_word_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_' || byte >= 0x80
}

/// Past the closing `quote` of a string opened at `open`; a doubled quote is
/// one quote, and with `escapes` a backslash escapes the next byte.
fn skip_quoted(bytes: &[u8], open: usize, quote: u8, escapes: bool) -> usize {
    let mut at = open + 1;
    while at < bytes.len() {
        match bytes[at] {
            b'\\' if escapes => at += 2,
            byte if byte == quote => {
                if bytes.get(at + 1) == Some(&quote) {
                    at += 2;
                } else {
                    return at + 1;
                }
            }
            _ => at += 1,
        }
    }
    bytes.len()
}

/// Past the end of a block comment opened at `open`, nested ones included.
fn skip_block_comment(bytes: &[u8], open: usize) -> usize {
    let mut depth = 0;
    let mut at = open;
    while at < bytes.len() {
        if bytes[at..].starts_with(b"/*") {
            depth += 1;
            at += 2;
        } else if bytes[at..].starts_with(b"*/") {
            depth -= 1;
            at += 2;
            if depth == 0 {
                return at;
            }
        } else {
            at += 1;
        }
    }
    bytes.len()
}

/// Past the closing tag of a dollar-quoted string opened at `open`; a `$`
/// that opens no tag (a parameter such as `$1`) is passed over alone.
fn skip_dollar_quoted(sql: &str, open: usize) -> usize {
    let rest = &sql[open + 1..];
    let Some(close) = rest.find('$') else {
        return open + 1;
    };
    let tag = &rest[..close];
    let valid_tag = tag
        .bytes()
        .enumerate()
        .all(|(i, b)| is_word_byte(b) && !(i == 0 && b.is_ascii_digit()));
    if !valid_tag {
        return open + 1;
    }
    let delimiter = &sql[open..open + tag.len() + 2];
    let body = open + delimiter.len();
    sql[body..]
        .find(delimiter)
        .map_or(sql.len(), |end| body + end + delimiter.len())
}

/// The index a `CREATE [UNIQUE] INDEX CONCURRENTLY [IF NOT EXISTS] name`
/// statement builds, unquoted; `None` for any other statement. An
/// interrupted concurrent build leaves an INVALID index of that name, which
/// `IF NOT EXISTS` would keep: the runner drops it and builds again.
pub fn concurrent_index_name(statement: &str) -> Option<String> {
    let mut rest = keyword(without_leading_comments(statement), "create")?;
    rest = keyword(rest, "unique").unwrap_or(rest);
    rest = keyword(keyword(rest, "index")?, "concurrently")?;
    if let Some(after) = keyword(rest, "if") {
        rest = keyword(keyword(after, "not")?, "exists")?;
    }
    first_ident(rest.trim_start())
}

/// `text` after its first word when that is `word` (any case).
fn keyword<'a>(text: &'a str, word: &str) -> Option<&'a str> {
    let text = text.trim_start();
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    text[..end].eq_ignore_ascii_case(word).then(|| &text[end..])
}

/// The identifier `text` starts with, as the catalog stores it: `"a""b"` is
/// `a"b`; an unquoted one is folded to lower case.
fn first_ident(text: &str) -> Option<String> {
    if let Some(quoted) = text.strip_prefix('"') {
        let end = skip_quoted(text.as_bytes(), 0, b'"', false);
        return Some(quoted[..end.checked_sub(2)?].replace("\"\"", "\""));
    }
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$'))
        .unwrap_or(text.len());
    (end > 0).then(|| text[..end].to_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_at_top_level_semicolons_only() {
        let sql = "CREATE INDEX CONCURRENTLY a ON t (x);\n\
                   -- a comment; with a semicolon\n\
                   SELECT 'it''s; quoted', \"odd;name\", E'back\\'slash;';\n\
                   /* block; /* nested; */ still; */ SELECT 2;\n\
                   DO $body$ BEGIN PERFORM 1; END $body$;\n\
                   SELECT $1, $$x;y$$;\n\
                   -- trailing comment only\n";
        assert_eq!(
            statements(sql),
            vec![
                "CREATE INDEX CONCURRENTLY a ON t (x)",
                "-- a comment; with a semicolon\nSELECT 'it''s; quoted', \"odd;name\", E'back\\'slash;'",
                "/* block; /* nested; */ still; */ SELECT 2",
                "DO $body$ BEGIN PERFORM 1; END $body$",
                "SELECT $1, $$x;y$$",
            ]
        );
    }

    #[test]
    fn a_statement_without_a_final_semicolon_is_kept() {
        assert_eq!(
            statements("SELECT 1; SELECT 2"),
            vec!["SELECT 1", "SELECT 2"]
        );
        assert!(statements(" \n-- nothing\n/* here */ ").is_empty());
    }

    #[test]
    fn a_standard_string_ends_at_its_quote_whatever_backslashes_it_holds() {
        assert_eq!(
            statements(r"SELECT 'a\'; SELECT 2"),
            vec![r"SELECT 'a\'", "SELECT 2"]
        );
    }

    #[test]
    fn names_the_index_a_concurrent_build_makes() {
        assert_eq!(
            concurrent_index_name(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"we\"\"ird_pending\" ON t (x)"
            ),
            Some("we\"ird_pending".into())
        );
        assert_eq!(
            concurrent_index_name("CREATE INDEX CONCURRENTLY \"a b\" ON t (x)"),
            Some("a b".into())
        );
        assert_eq!(
            concurrent_index_name("-- why\n/* and how */ CREATE INDEX CONCURRENTLY i ON t (x)"),
            Some("i".into())
        );
        assert_eq!(
            concurrent_index_name("create unique index concurrently Idx on t (x)"),
            Some("idx".into())
        );
        assert_eq!(
            concurrent_index_name("CREATE INDEX CONCURRENTLY if_x ON t (x)"),
            Some("if_x".into())
        );
        assert_eq!(concurrent_index_name("CREATE INDEX idx ON t (x)"), None);
        assert_eq!(concurrent_index_name("DROP INDEX CONCURRENTLY idx"), None);
    }
}
