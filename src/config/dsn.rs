//! PostgreSQL's key=value connection strings, read as libpq reads them:
//! `key = value` with spaces around `=` or not, values bare (a backslash
//! escapes the next character) or in single quotes (`\'` and `\\` inside).
//! The relay rewrites a few keys (`sslmode`, `sslrootcert`) before the
//! driver parses the rest, so it must split pairs exactly as libpq does: a
//! naive split on spaces would drop a quoted password with spaces, or keep
//! `password` without its value. A `postgres://` URL is read into the same
//! pairs ([`url_pairs`]), so that both forms are split into one connection
//! string per host alike ([`per_host`]). Errors never quote a value.

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

/// The pairs of a `postgres://` (or `postgresql://`) URL, read as the
/// driver reads it: `user[:password]@`, hosts `host[:port]` (or
/// `[v6addr][:port]`) separated by commas, `/dbname`, then `?key=value&…`;
/// every part percent-decoded. A host without a port gets 5432.
pub fn url_pairs(url: &str) -> Result<Vec<(String, String)>, String> {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .ok_or("must start with postgres:// or postgresql://")?;
    let decode = |part: &str, what: &str| {
        percent_encoding::percent_decode_str(part)
            .decode_utf8()
            .map(|decoded| decoded.into_owned())
            .map_err(|_| format!("{what} is not UTF-8 once percent-decoded"))
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, rest) = rest.split_at(end);
    let mut pairs = Vec::new();
    let hosts = match authority.rfind('@') {
        Some(at) => {
            let (user, password) = match authority[..at].split_once(':') {
                Some((user, password)) => (user, Some(password)),
                None => (&authority[..at], None),
            };
            pairs.push(("user".to_string(), decode(user, "the user name")?));
            if let Some(password) = password {
                pairs.push(("password".to_string(), decode(password, "the password")?));
            }
            &authority[at + 1..]
        }
        None => authority,
    };
    if !hosts.is_empty() {
        let (mut names, mut ports) = (Vec::new(), Vec::new());
        for chunk in hosts.split(',') {
            let (host, port) =
                match chunk.strip_prefix('[') {
                    Some(bracketed) => {
                        let (host, after) = bracketed
                            .split_once(']')
                            .ok_or("a host in [brackets] has no closing `]`")?;
                        match after {
                            "" => (host, None),
                            _ => (
                                host,
                                Some(after.strip_prefix(':').ok_or(
                                    "a host in [brackets] is followed by more than a port",
                                )?),
                            ),
                        }
                    }
                    None => match chunk.split_once(':') {
                        Some((host, port)) => (host, Some(port)),
                        None => (chunk, None),
                    },
                };
            names.push(decode(host, "a host")?);
            ports.push(decode(port.unwrap_or("5432"), "a port")?);
        }
        pairs.push(("host".to_string(), names.join(",")));
        pairs.push(("port".to_string(), ports.join(",")));
    }
    let (path, query) = match rest.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (rest, None),
    };
    let dbname = path.strip_prefix('/').unwrap_or(path);
    if !dbname.is_empty() {
        pairs.push(("dbname".to_string(), decode(dbname, "the database name")?));
    }
    for parameter in query.unwrap_or_default().split('&') {
        if parameter.is_empty() {
            continue;
        }
        let (key, value) = parameter
            .split_once('=')
            .ok_or("a parameter after `?` has no `=`")?;
        let key = decode(key, "a parameter's name")?;
        let value = decode(value, &format!("the value of {}", named(&key)))?;
        pairs.push((key, value));
    }
    Ok(pairs)
}

/// The keys that say where to connect: one connection string per host is
/// made by giving each its own.
const HOST_KEYS: [&str; 4] = ["host", "hostaddr", "port", "load_balance_hosts"];

/// One set of pairs per host of `pairs` (its `host`, `hostaddr` and `port`
/// lists, as the driver read them into `config`), in the order given: each
/// names that host alone, with its port (or the one port for all).
pub fn per_host(
    pairs: &[(String, String)],
    config: &tokio_postgres::Config,
) -> Vec<Vec<(String, String)>> {
    use tokio_postgres::config::Host;
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    let ports = config.get_ports();
    let common: Vec<(String, String)> = pairs
        .iter()
        .filter(|(key, _)| !HOST_KEYS.contains(&key.as_str()))
        .cloned()
        .collect();
    (0..hosts.len().max(addrs.len()))
        .map(|i| {
            let mut own = common.clone();
            if let Some(host) = hosts.get(i) {
                let name = match host {
                    Host::Tcp(name) => name.clone(),
                    Host::Unix(path) => path.display().to_string(),
                };
                own.push(("host".into(), name));
            }
            if let Some(addr) = addrs.get(i) {
                own.push(("hostaddr".into(), addr.to_string()));
            }
            if let Some(port) = ports.get(i).or(ports.first()) {
                own.push(("port".into(), port.to_string()));
            }
            own
        })
        .collect()
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
    fn reads_urls_into_the_same_pairs() {
        assert_eq!(
            url_pairs("postgres://app:p%40ss:w@h1:5433,[::1],h3/orders%2F1?target_session_attrs=read-write&application_name=a%20b").unwrap(),
            [
                kv("user", "app"),
                kv("password", "p@ss:w"),
                kv("host", "h1,::1,h3"),
                kv("port", "5433,5432,5432"),
                kv("dbname", "orders/1"),
                kv("target_session_attrs", "read-write"),
                kv("application_name", "a b"),
            ]
        );
        assert_eq!(
            url_pairs("postgresql://db").unwrap(),
            [kv("host", "db"), kv("port", "5432")]
        );
        assert_eq!(
            url_pairs("postgres:///x?host=%2Ftmp").unwrap(),
            [kv("dbname", "x"), kv("host", "/tmp")]
        );
        for bad in [
            "postgres://u:s3cret%FF@db/x",
            "postgres://u:s3cret@[::1/x",
            "postgres://u:s3cret@db/x?s3cret",
        ] {
            let error = url_pairs(bad).unwrap_err();
            assert!(!error.contains("s3cret"), "{error}");
        }
    }

    #[test]
    fn splits_one_connection_string_per_host() {
        let read = p("host=h1,h2 port=5432,5433 dbname=x load_balance_hosts=disable");
        let config: tokio_postgres::Config = join(&read).parse().unwrap();
        let hosts = per_host(&read, &config);
        assert_eq!(
            hosts,
            [
                vec![kv("dbname", "x"), kv("host", "h1"), kv("port", "5432")],
                vec![kv("dbname", "x"), kv("host", "h2"), kv("port", "5433")],
            ]
        );
        let read = p("host=a,b hostaddr=10.0.0.1,10.0.0.2 port=6432");
        let config: tokio_postgres::Config = join(&read).parse().unwrap();
        assert_eq!(
            per_host(&read, &config)[1],
            [
                kv("host", "b"),
                kv("hostaddr", "10.0.0.2"),
                kv("port", "6432")
            ]
        );
    }

    #[test]
    fn joins_what_it_read() {
        let read = p("password='a b\\'c\\\\' host=db");
        assert_eq!(pairs(&join(&read)).unwrap(), read);
    }
}
