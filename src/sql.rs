//! The names the relay writes into SQL, shared by the store, the migrations
//! and the wake-up: identifiers and string literals quoted as PostgreSQL
//! reads them, the configured table's qualified name, and the channel the
//! commit-order trigger notifies. Pure text; it imports nothing of the relay.

/// A PostgreSQL identifier in double quotes.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A string literal for `text` (standard_conforming_strings, as on every
/// supported server).
pub fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// `"schema"."table"`, each identifier quoted.
pub fn qualified_table(schema: &str, table: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(table))
}

/// `template` with each placeholder (`token`) replaced by its value, in one
/// pass: what is substituted is never read again, so a configured name that
/// holds a placeholder's text (a table `o{channel}x`) stays as it is. The
/// first token that matches wins: list a token before its prefixes.
pub fn fill<S: AsRef<str>>(template: &str, values: &[(&str, S)]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(next) = rest.chars().next() {
        match values.iter().find(|(token, _)| rest.starts_with(token)) {
            Some((token, value)) => {
                out.push_str(value.as_ref());
                rest = &rest[token.len()..];
            }
            None => {
                out.push(next);
                rest = &rest[next.len_utf8()..];
            }
        }
    }
    out
}

/// The channel the commit-order trigger notifies and the relay listens on:
/// `outbox.<schema>.<table>` when that fits PostgreSQL's 63 bytes, else
/// `outbox.` and a 64-bit FNV-1a hash of `<schema>.<table>` in hex.
pub fn wakeup_channel(schema: &str, table: &str) -> String {
    let readable = format!("outbox.{schema}.{table}");
    if readable.len() <= 63 {
        return readable;
    }
    let hash = fnv1a(format!("{schema}.{table}").as_bytes());
    format!("outbox.{hash:016x}")
}

/// What the members' name of every relay of the table starts with
/// (`outbox-relay:<channel hash>:`; see `wakeup`), whatever its tenants.
pub fn relays_prefix(schema: &str, table: &str) -> String {
    let channel = wakeup_channel(schema, table);
    format!("outbox-relay:{:016x}:", fnv1a(channel.as_bytes()))
}

/// The 64-bit FNV-1a hash: the same on every replica and every build.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_holding_a_placeholder_is_not_substituted_again() {
        let table = quote_ident("o{channel}x");
        let sql = fill(
            "SELECT {table}, {channel}",
            &[("{table}", table.as_str()), ("{channel}", "'outbox.s.t'")],
        );
        assert_eq!(sql, "SELECT \"o{channel}x\", 'outbox.s.t'");
    }

    #[test]
    fn the_channel_fits_postgresqls_identifiers() {
        assert_eq!(
            wakeup_channel("public", "outbox_message"),
            "outbox.public.outbox_message"
        );
        let long = wakeup_channel(&"s".repeat(63), &"t".repeat(55));
        assert_eq!(long.len(), "outbox.".len() + 16);
        assert_ne!(long, wakeup_channel(&"s".repeat(63), &"u".repeat(55)));
    }
}
