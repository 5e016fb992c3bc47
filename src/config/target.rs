//! The two connection targets, parsed once from `database_url` and `amqp_url`
//! into what the store and the publisher take. Each keeps its URL with the
//! password masked for printing; neither's `Debug` or `Display` shows a secret,
//! and no parse error quotes the URL.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use lapin::uri::AMQPUri;
use tokio_postgres::config::SslMode;

use crate::redact::MASK;

/// Deadline for opening a database connection (TCP, TLS, authentication),
/// unless the URL sets `connect_timeout`.
pub const DATABASE_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Heartbeat asked of the broker unless the URL sets one: a silent peer is
/// noticed within two intervals even when nothing is being published.
const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// Where the outbox table lives: the driver's configuration plus what the
/// driver does not parse itself (`sslmode=verify-full`/`verify-ca`,
/// `sslrootcert`).
#[derive(Clone)]
pub struct DatabaseTarget {
    pub config: tokio_postgres::Config,
    pub root_cert: Option<PathBuf>,
    redacted: String,
}

impl FromStr for DatabaseTarget {
    type Err = String;

    /// Parses a URL (`postgres://…`) or key-value (`host=… dbname=…`)
    /// connection string. The error text never contains the string itself.
    fn from_str(url: &str) -> Result<DatabaseTarget, String> {
        let mut root_cert = None;
        let mut verify = false;
        let mut tls_asked = false;
        let mut rewrite = |key: &str, value: &str| -> Option<(String, String)> {
            match (key, value) {
                ("sslmode", "verify-full" | "verify-ca") => {
                    verify = true;
                    Some((key.into(), "require".into()))
                }
                ("sslmode", _) => {
                    tls_asked = true;
                    Some((key.into(), value.into()))
                }
                ("sslrootcert", path) => {
                    root_cert = Some(PathBuf::from(path));
                    None
                }
                _ => Some((key.into(), value.into())),
            }
        };
        let url_form = url.starts_with("postgres://") || url.starts_with("postgresql://");
        if url_form {
            misplaced_userinfo(url)?;
        }
        let cleaned = if url_form {
            let mut parsed = url::Url::parse(url).map_err(|e| format!("not a valid URL: {e}"))?;
            super::dsn::known_keys(
                parsed
                    .query_pairs()
                    .map(|(k, _)| k)
                    .collect::<Vec<_>>()
                    .iter()
                    .map(|k| k.as_ref()),
            )?;
            let pairs: Vec<(String, String)> = parsed
                .query_pairs()
                .filter_map(|(k, v)| rewrite(&k, &v))
                .collect();
            if pairs.is_empty() {
                parsed.set_query(None);
            } else {
                parsed.query_pairs_mut().clear().extend_pairs(pairs);
            }
            parsed.to_string()
        } else if url.contains("://") {
            return Err(
                "must start with postgres:// or postgresql:// (or be key=value pairs)".into(),
            );
        } else {
            let pairs: Vec<(String, String)> = super::dsn::known_pairs(url)?
                .iter()
                .filter_map(|(k, v)| rewrite(k, v))
                .collect();
            super::dsn::join(&pairs)
        };
        let mut config: tokio_postgres::Config =
            cleaned.parse().map_err(|e: tokio_postgres::Error| {
                format!("not a valid PostgreSQL connection string: {e}")
            })?;
        if config.get_hosts().is_empty() {
            return Err("names no host".into());
        }
        if verify {
            config.ssl_mode(SslMode::Require);
        }
        // Without an sslmode the connection is plain (docs/design.md): TLS is
        // asked for with sslmode=require or verify-full, and then always verified.
        if !tls_asked && !verify {
            config.ssl_mode(SslMode::Disable);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(DATABASE_CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("outbox-relay");
        }
        // A dead peer is noticed in about 30 s even when no query is running.
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(15))
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3);
        let redacted = shown_database(&config, root_cert.as_deref(), url_form);
        Ok(DatabaseTarget {
            config,
            root_cert,
            redacted,
        })
    }
}

/// The broker to publish to.
#[derive(Clone)]
pub struct AmqpTarget {
    pub uri: AMQPUri,
    redacted: String,
}

impl FromStr for AmqpTarget {
    type Err = String;

    /// Parses an `amqp://` or `amqps://` URL; the error never contains it.
    fn from_str(url: &str) -> Result<AmqpTarget, String> {
        if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
            return Err("must start with amqp:// or amqps://".into());
        }
        misplaced_userinfo(url)?;
        // The parser's message may quote any part of the URL, the password
        // included: none of it is passed on.
        let mut uri: AMQPUri = url.parse().map_err(|_: String| {
            "not a valid AMQP URL (amqp[s]://user:password@host:port/vhost, with reserved characters percent-encoded)".to_string()
        })?;
        if uri.query.heartbeat.is_none() {
            uri.query.heartbeat = Some(DEFAULT_HEARTBEAT_SECS);
        }
        let redacted = shown_amqp(&uri);
        Ok(AmqpTarget { uri, redacted })
    }
}

/// Refuses a URL whose `@` comes after a `/`, `?` or `#` of its authority: its
/// password holds one of them unencoded, so the parser would split it into
/// host, port or path, and show pieces of it. The message never quotes it.
fn misplaced_userinfo(url: &str) -> Result<(), String> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    if let Some(at) = rest.rfind('@')
        && rest[..at].contains(['/', '?', '#'])
    {
        return Err("the part before `@` holds a `/`, `?` or `#`: percent-encode them in the user name and password (%2F, %3F, %23)".into());
    }
    Ok(())
}

/// A database target as printed: built from what was parsed, never from the
/// text given, so no malformed input can carry a password into the output.
fn shown_database(
    config: &tokio_postgres::Config,
    root_cert: Option<&std::path::Path>,
    url_form: bool,
) -> String {
    use tokio_postgres::config::Host;
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let name = match host {
                Host::Tcp(name) => name.clone(),
                Host::Unix(path) => path.display().to_string(),
            };
            match config.get_ports().get(i).or(config.get_ports().first()) {
                Some(port) => format!("{name}:{port}"),
                None => name,
            }
        })
        .collect();
    let user = config.get_user().unwrap_or_default();
    let password = config.get_password().is_some();
    let dbname = config.get_dbname().unwrap_or_default();
    let sslmode = match config.get_ssl_mode() {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        SslMode::Require => "require",
        _ => "other",
    };
    if url_form {
        let userinfo = match (user.is_empty(), password) {
            (true, _) => String::new(),
            (false, true) => format!("{user}:{MASK}@"),
            (false, false) => format!("{user}@"),
        };
        let mut shown = format!("postgres://{userinfo}{}/{dbname}", hosts.join(","));
        if sslmode != "disable" {
            shown.push_str(&format!("?sslmode={sslmode}"));
            if let Some(path) = root_cert {
                shown.push_str(&format!("&sslrootcert={}", path.display()));
            }
        }
        shown
    } else {
        let mut pairs = vec![format!("host={}", hosts.join(","))];
        if !user.is_empty() {
            pairs.push(format!("user={user}"));
        }
        if password {
            pairs.push(format!("password={MASK}"));
        }
        if !dbname.is_empty() {
            pairs.push(format!("dbname={dbname}"));
        }
        pairs.push(format!("sslmode={sslmode}"));
        if let Some(path) = root_cert {
            pairs.push(format!("sslrootcert={}", path.display()));
        }
        pairs.join(" ")
    }
}

/// An AMQP target as printed, built from what was parsed.
fn shown_amqp(uri: &AMQPUri) -> String {
    let scheme = match uri.scheme {
        lapin::uri::AMQPScheme::AMQP => "amqp",
        lapin::uri::AMQPScheme::AMQPS => "amqps",
    };
    let auth = &uri.authority;
    let user = &auth.userinfo.username;
    let userinfo = if auth.userinfo.password.is_empty() {
        format!("{user}@")
    } else {
        format!("{user}:{MASK}@")
    };
    let vhost: String = uri
        .vhost
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02x}"),
        })
        .collect();
    format!("{scheme}://{userinfo}{}:{}/{vhost}", auth.host, auth.port)
}

/// Both targets print as their URL with the password masked.
macro_rules! shown_redacted {
    ($($target:ty),*) => {$(
        impl fmt::Display for $target {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.redacted)
            }
        }

        impl fmt::Debug for $target {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($target), self.redacted)
            }
        }
    )*};
}
shown_redacted!(DatabaseTarget, AmqpTarget);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls_and_key_value_strings_parse_with_the_relays_defaults() {
        let target: DatabaseTarget =
            "postgres://app:pa55@db:6432/orders?sslmode=verify-full&sslrootcert=/ca.pem"
                .parse()
                .unwrap();
        assert_eq!(target.config.get_dbname(), Some("orders"));
        assert_eq!(target.config.get_ssl_mode(), SslMode::Require);
        assert_eq!(target.root_cert, Some(PathBuf::from("/ca.pem")));
        assert_eq!(
            target.config.get_connect_timeout(),
            Some(&DATABASE_CONNECT_TIMEOUT)
        );
        let shown = format!("{target} {target:?}");
        assert!(!shown.contains("pa55"), "{shown}");

        let plain: DatabaseTarget = "host=db user=app password=pa55 dbname=x".parse().unwrap();
        assert_eq!(plain.config.get_ssl_mode(), SslMode::Disable);
        assert!(!format!("{plain:?}").contains("pa55"));
    }

    #[test]
    fn bad_database_urls_are_refused_without_being_quoted() {
        for bad in ["mysql://u:pa55@db/x", "postgres://u:pa55@:5432/x?port=zz"] {
            let error = bad.parse::<DatabaseTarget>().unwrap_err();
            assert!(!error.contains("pa55"), "{error}");
        }
    }

    #[test]
    fn amqp_urls_get_a_heartbeat_and_never_print_their_password() {
        let target: AmqpTarget = "amqp://u:pa55@mq:5672/%2f".parse().unwrap();
        assert_eq!(target.uri.query.heartbeat, Some(DEFAULT_HEARTBEAT_SECS));
        assert_eq!(target.to_string(), "amqp://u:***@mq:5672/%2f");
        assert!(!format!("{target:?}").contains("pa55"));
        let error = "http://u:pa55@mq/".parse::<AmqpTarget>().unwrap_err();
        assert!(!error.contains("pa55"), "{error}");
    }
}
