//! Text from outside the relay (configuration values, message bodies, keys
//! and names) made fit to print on one line of a terminal or a log: control
//! characters escaped, and long text cut.

use std::fmt::Write as _;

/// `text` as written, but for what could break the line or drive a
/// terminal: control characters (C0, DEL, C1), the Unicode line and
/// paragraph separators and the bidirectional overrides are escaped
/// (`\n`, `\r`, `\t`, else `\u{..}`). Quotes and backslashes stay as they
/// are, so a JSON body reads as JSON.
pub fn escape_controls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if drives_the_terminal(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out
}

/// The first `width` characters of `text`, escaped (see
/// [`escape_controls`]), followed by `…` when there was more.
pub fn cut(text: &str, width: usize) -> String {
    let mut chars = text.char_indices();
    match chars.nth(width) {
        None => escape_controls(text),
        Some((end, _)) => {
            let mut shown = escape_controls(&text[..end]);
            shown.push('…');
            shown
        }
    }
}

/// `text` in a column `width` characters wide (at least 1): every character
/// that could break the line or drive a terminal (see [`escape_controls`])
/// shown as a space, so the column keeps its width, and text past the width
/// cut to `width - 1` characters and `…`.
pub fn fit(text: &str, width: usize) -> String {
    let one_line: String = text
        .chars()
        .map(|c| if drives_the_terminal(c) { ' ' } else { c })
        .collect();
    if one_line.chars().count() <= width {
        return one_line;
    }
    let mut short: String = one_line.chars().take(width.saturating_sub(1)).collect();
    short.push('…');
    short
}

/// `text` as a quoted string that reads the same in TOML and JSON, with
/// every character [`escape_controls`] escapes written `\uXXXX` (all are
/// in the Basic Multilingual Plane), so that printing it cannot break the
/// line or reorder the terminal's text.
pub fn quoted(text: &str) -> String {
    let json = serde_json::to_string(text).unwrap_or_default();
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if drives_the_terminal(c) {
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    out
}

/// What [`escape_controls`] escapes: a control character (C0, DEL, C1), or
/// one that moves text about on a screen (see [`is_layout_control`]).
fn drives_the_terminal(c: char) -> bool {
    c.is_control() || is_layout_control(c)
}

/// Characters that are not `Cc` controls but still move text about on a
/// screen: the line and paragraph separators and the bidirectional
/// embeddings, overrides and isolates.
fn is_layout_control(c: char) -> bool {
    matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_text_escapes_what_could_reorder_or_break_the_line() {
        assert_eq!(quoted("rtl\u{202e}abc"), r#""rtl\u202eabc""#);
        assert_eq!(quoted("a\u{2028}b\u{85}c\nd"), r#""a\u2028b\u0085c\nd""#);
        assert_eq!(quoted("q\"uote"), r#""q\"uote""#);
        let back: String = serde_json::from_str(&quoted("x\u{202e}\u{85}y")).unwrap();
        assert_eq!(back, "x\u{202e}\u{85}y", "the same text read back");
    }

    #[test]
    fn quotes_and_backslashes_are_shown_as_written() {
        let body = r#"{"total":"12.50","path":"C:\temp"}"#;
        assert_eq!(escape_controls(body), body);
    }

    #[test]
    fn line_breaks_and_tabs_are_escaped_so_one_message_stays_one_line() {
        assert_eq!(
            escape_controls("a\nb\r\nc\td"),
            r"a\nb\r\nc\td",
            "no raw line break or tab is left"
        );
    }

    #[test]
    fn terminal_controls_are_escaped() {
        // ESC (C0), DEL, CSI (C1), and a right-to-left override.
        let shown = escape_controls("\u{1b}[31mred\u{7f}\u{9b}2J\u{202e}txt");
        assert_eq!(shown, r"\u{1b}[31mred\u{7f}\u{9b}2J\u{202e}txt");
        assert!(!shown.chars().any(|c| c.is_control()));
    }

    #[test]
    fn other_text_is_untouched() {
        assert_eq!(escape_controls("zoë → 東京 🚀"), "zoë → 東京 🚀");
    }

    #[test]
    fn text_fit_to_a_column_keeps_its_width_and_drives_no_terminal() {
        assert_eq!(fit("acme", 8), "acme");
        assert_eq!(fit("a\nb\u{1b}[2Jc", 20), "a b [2Jc");
        assert_eq!(fit("evil\u{202e}txt.exe", 20), "evil txt.exe");
        assert_eq!(fit("abcdefghij", 5), "abcd…");
        assert_eq!(fit("ééééé", 5), "ééééé");
        assert_eq!(fit("abc", 1), "…");
    }

    #[test]
    fn long_text_is_cut_at_a_character_and_marked() {
        assert_eq!(cut("abc", 3), "abc");
        assert_eq!(cut("abcd", 3), "abc…");
        assert_eq!(cut("日本語です", 2), "日本…");
        assert_eq!(cut("\n\n\n\n", 2), "\\n\\n…");
        assert_eq!(cut(&"x".repeat(100_000_000), 5), "xxxxx…");
    }
}
