//! PostgreSQL's key=value connection strings, read as libpq reads them:
//! `key = value` with spaces around `=` or not, values bare (a backslash
//! escapes the next character) or in single quotes (`\'` and `\\` inside).
//! The relay rewrites a few keys (`sslmode`, `sslrootcert`) before the
//! driver parses the rest, so it must split pairs exactly as libpq does: a
//! naive split on spaces would drop a quoted password with spaces, or keep
//! `password` without its value. Errors never quote a value.

/// libpq's connection keywords: a key named in an error must be one of them,
/// since anything else may be a piece of a password that was not quoted.
const KEYWORDS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "channel_binding",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcertmode",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "requirepeer",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "krbsrvname",
    "gsslib",
    "gssdelegation",
    "service",
    "target_session_attrs",
    "load_balance_hosts",
];

/// A key as an error may name it.
fn named(key: &str) -> String {
    if KEYWORDS.contains(&key) {
        format!("`{key}`")
    } else {
        "a word that is no libpq keyword (a value with spaces must be in single quotes)".into()
    }
}

/// Refuses keys libpq does not know, without naming them.
pub fn known_keys<'a>(keys: impl IntoIterator<Item = &'a str>) -> Result<(), String> {
    match keys.into_iter().find(|key| !KEYWORDS.contains(key)) {
        Some(key) => Err(format!("holds {}", named(key))),
        None => Ok(()),
    }
}

/// The pairs of a key=value connection string, in order.
pub fn pairs(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut chars = text.chars().peekable();
    let mut pairs = Vec::new();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            return Err(format!("{} has no `=` and value", named(&key)));
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next() {
                    Some('\\') => match chars.next() {
                        Some(c) => value.push(c),
                        None => {
                            return Err(format!(
                                "the value of {} ends in a backslash",
                                named(&key)
                            ));
                        }
                    },
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => {
                        return Err(format!("the value of {} has no closing quote", named(&key)));
                    }
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                chars.next();
                if c == '\\' {
                    match chars.next() {
                        Some(c) => value.push(c),
                        None => {
                            return Err(format!(
                                "the value of {} ends in a backslash",
                                named(&key)
                            ));
                        }
                    }
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key, value));
    }
}

/// The pairs, once every key is one libpq knows.
pub fn known_pairs(text: &str) -> Result<Vec<(String, String)>, String> {
    let pairs = pairs(text)?;
    known_keys(pairs.iter().map(|(key, _)| key.as_str()))?;
    Ok(pairs)
}

/// A key=value connection string of `pairs`, every value quoted.
pub fn join(pairs: &[(String, String)]) -> String {
    pairs
        .iter()
        .map(|(key, value)| {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            format!("{key}='{quoted}'")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Vec<(String, String)> {
        pairs(text).unwrap()
    }

    fn kv(key: &str, value: &str) -> (String, String) {
        (key.to_string(), value.to_string())
    }

    #[test]
    fn reads_pairs_as_libpq_does() {
        assert_eq!(
            p("host=db  user = app password= 'a b\\'c' dbname =x"),
            [
                kv("host", "db"),
                kv("user", "app"),
                kv("password", "a b'c"),
                kv("dbname", "x")
            ]
        );
        assert_eq!(p("password=a\\ b\\\\c"), [kv("password", "a b\\c")]);
        assert_eq!(p("password=''"), [kv("password", "")]);
        assert!(p("  ").is_empty());
    }

    #[test]
    fn errors_name_the_key_never_the_value() {
        for bad in ["password='s3cret", "password", "password=s3cret\\"] {
            let error = pairs(bad).unwrap_err();
            assert!(!error.contains("s3cret"), "{error}");
            assert!(error.contains("password"), "{error}");
        }
    }

    #[test]
    fn joins_what_it_read() {
        let read = p("password='a b\\'c\\\\' host=db");
        assert_eq!(pairs(&join(&read)).unwrap(), read);
    }
}
