//! The two connection targets, parsed once from `database_url` and `amqp_url`
//! into what the store and the publisher take. Each keeps its URL with the
//! password masked for printing; neither's `Debug` or `Display` shows a secret,
//! and no parse error quotes the URL.

mod tls;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use lapin::uri::{AMQPScheme, AMQPUri};
use tokio_postgres::config::SslMode;

use crate::redact::MASK;
use tls::Check;

/// Deadline for opening a database connection (TCP, TLS, authentication),
/// unless the URL sets `connect_timeout`.
pub const DATABASE_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Heartbeat asked of the broker unless the URL sets one: a silent peer is
/// noticed within two intervals even when nothing is being published.
const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// Where the outbox table lives: the driver's configuration plus what the
/// driver does not do itself: TLS as libpq's `sslmode` (`require`,
/// `verify-ca`, `verify-full`), `sslrootcert`, `sslcert` and `sslkey` ask.
#[derive(Clone)]
pub struct DatabaseTarget {
    pub config: tokio_postgres::Config,
    /// The TLS client configuration when `sslmode` asks for TLS; `None`: plain.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    redacted: String,
}

/// The connection-string parameters the relay handles itself.
const DATABASE_TLS_KEYS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

impl FromStr for DatabaseTarget {
    type Err = String;

    /// Parses a URL (`postgres://…`) or key-value (`host=… dbname=…`)
    /// connection string, and reads the TLS files it names. The error text
    /// never contains the string itself.
    fn from_str(url: &str) -> Result<DatabaseTarget, String> {
        let mut tls_params: Vec<(String, String)> = Vec::new();
        let mut keep = |key: &str, value: &str| -> Option<(String, String)> {
            if DATABASE_TLS_KEYS.contains(&key) {
                tls_params.push((key.into(), value.into()));
                None
            } else {
                Some((key.into(), value.into()))
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
                .filter_map(|(k, v)| keep(&k, &v))
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
                .filter_map(|(k, v)| keep(k, v))
                .collect();
            super::dsn::join(&pairs)
        };
        let param = |key: &str| last(&tls_params, key);
        let files = tls::Files {
            roots: param("sslrootcert"),
            cert: param("sslcert"),
            key: param("sslkey"),
        };
        let check = match param("sslmode").map(|(_, mode)| mode) {
            None | Some("disable") => None,
            Some("require" | "verify-full") => Some(Check::ChainAndName),
            Some("verify-ca") => Some(Check::ChainOnly),
            Some(mode @ ("prefer" | "allow")) => {
                return Err(format!(
                    "sslmode={mode} would connect without TLS when the server offers none; \
                     use sslmode=require, verify-ca or verify-full (or disable)"
                ));
            }
            Some(_) => {
                return Err("sslmode must be disable, require, verify-ca or verify-full".into());
            }
        };
        let tls = match check {
            Some(check) => Some(Arc::new(tls::client_config(&files, check)?)),
            None => {
                if let Some((key, _)) = files.roots.or(files.cert).or(files.key) {
                    return Err(format!(
                        "{key} needs sslmode=require, verify-ca or verify-full \
                         (without sslmode the connection is plain)"
                    ));
                }
                None
            }
        };
        let mut config: tokio_postgres::Config =
            cleaned.parse().map_err(|e: tokio_postgres::Error| {
                format!("not a valid PostgreSQL connection string: {e}")
            })?;
        if config.get_hosts().is_empty() {
            return Err("names no host".into());
        }
        // Plain unless sslmode asks for TLS (docs/design.md); TLS is then
        // always verified, by the client configuration above.
        config.ssl_mode(if tls.is_some() {
            SslMode::Require
        } else {
            SslMode::Disable
        });
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
        let shown_tls: Vec<(&str, &str)> = ["sslmode", "sslrootcert", "sslcert", "sslkey"]
            .into_iter()
            .filter_map(param)
            .collect();
        let redacted = shown_database(&config, &shown_tls, url_form);
        Ok(DatabaseTarget {
            config,
            tls,
            redacted,
        })
    }
}

/// The broker to publish to: one endpoint or several (nodes of one
/// cluster), tried in order and rotated on failure by the publisher.
#[derive(Clone)]
pub struct AmqpTarget {
    /// At least one; all of the same scheme, user and virtual host.
    pub endpoints: Vec<AmqpEndpoint>,
    redacted: String,
}

/// One broker node to connect to.
#[derive(Clone)]
pub struct AmqpEndpoint {
    pub uri: AMQPUri,
    /// TLS for `amqps://`; `None` for `amqp://`.
    pub tls: Option<AmqpTls>,
    redacted: String,
}

impl AmqpTarget {
    /// Each endpoint's `host:port`, in list order.
    pub fn addresses(&self) -> Vec<String> {
        self.endpoints.iter().map(AmqpEndpoint::address).collect()
    }
}

impl AmqpEndpoint {
    /// `host:port`, as logs and the `outbox_amqp_endpoint` gauge name it:
    /// never the user name or the password.
    pub fn address(&self) -> String {
        format!("{}:{}", self.uri.authority.host, self.uri.authority.port)
    }
}

impl FromStr for AmqpTarget {
    type Err = String;

    /// Parses one `amqp[s]://` URL or several, comma-separated: the list is
    /// cut only where a comma is followed by `amqp://` or `amqps://`, so a
    /// comma in a password or a parameter stays in its URL. Each endpoint
    /// is parsed as on its own; an error names it by its position, never
    /// quoting it.
    fn from_str(list: &str) -> Result<AmqpTarget, String> {
        if list.trim_end().ends_with(',') {
            return Err("ends with a comma: list endpoints as amqp://…,amqp://…".into());
        }
        let parts = split_endpoints(list);
        let count = parts.len();
        let at = |index: usize, error: String| {
            if count == 1 {
                error
            } else {
                format!("endpoint {} of {count}: {error}", index + 1)
            }
        };
        let mut endpoints: Vec<AmqpEndpoint> = Vec::with_capacity(count);
        for (index, part) in parts.into_iter().enumerate() {
            let endpoint: AmqpEndpoint = part.parse().map_err(|error| at(index, error))?;
            if let Some(first) = endpoints.first() {
                if endpoint.uri.scheme != first.uri.scheme {
                    return Err(at(
                        index,
                        "mixes amqp:// and amqps://: every endpoint must use the same scheme, \
                         so that a failover never falls back to a plain connection"
                            .into(),
                    ));
                }
                if endpoint.uri.authority.userinfo.username != first.uri.authority.userinfo.username
                {
                    // Also what refuses a password holding `,amqp://`
                    // unencoded: its tail would be the next endpoint's user.
                    return Err(at(
                        index,
                        "names another user than endpoint 1: users are the cluster's, \
                         the same on every node"
                            .into(),
                    ));
                }
                if endpoint.uri.vhost != first.uri.vhost {
                    return Err(at(
                        index,
                        "names another virtual host than endpoint 1: the endpoints are nodes \
                         of one cluster and must name the same one"
                            .into(),
                    ));
                }
            }
            endpoints.push(endpoint);
        }
        let redacted = endpoints
            .iter()
            .map(|endpoint| endpoint.redacted.as_str())
            .collect::<Vec<_>>()
            .join(",");
        Ok(AmqpTarget {
            endpoints,
            redacted,
        })
    }
}

/// `list` cut where a new URL starts: at each comma followed (after optional
/// white space) by `amqp://` or `amqps://`, in any case. Parts are trimmed.
fn split_endpoints(list: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut start = 0;
    for (comma, _) in list.match_indices(',') {
        if starts_with_amqp_scheme(list[comma + 1..].trim_start()) {
            parts.push(list[start..comma].trim());
            start = comma + 1;
        }
    }
    parts.push(list[start..].trim());
    parts
}

/// Whether `text` starts with `amqp://` or `amqps://`, in any case.
fn starts_with_amqp_scheme(text: &str) -> bool {
    let starts = |scheme: &[u8]| {
        text.as_bytes()
            .get(..scheme.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(scheme))
    };
    starts(b"amqp://") || starts(b"amqps://")
}

/// An `amqps://` target's TLS, from RabbitMQ's URI parameters (`cacertfile`,
/// `certfile`, `keyfile`, `verify`, `server_name_indication`).
#[derive(Clone)]
pub struct AmqpTls {
    pub config: Arc<rustls::ClientConfig>,
    /// The name the certificate is checked against and sent as SNI: the
    /// URL's host unless `server_name_indication` names another.
    pub server_name: String,
}

/// The `amqps://` parameters the relay handles (the AMQP client ignores them).
const AMQP_TLS_KEYS: [&str; 5] = [
    "cacertfile",
    "certfile",
    "keyfile",
    "verify",
    "server_name_indication",
];

impl FromStr for AmqpEndpoint {
    type Err = String;

    /// Parses an `amqp://` or `amqps://` URL and reads the TLS files it
    /// names; the error never contains the URL.
    fn from_str(url: &str) -> Result<AmqpEndpoint, String> {
        if !starts_with_amqp_scheme(url) {
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
        let query: Vec<(String, String)> = url::Url::parse(url)
            .map_err(|e| format!("not a valid AMQP URL: {e}"))?
            .query_pairs()
            .filter(|(k, _)| AMQP_TLS_KEYS.contains(&k.as_ref()))
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        let param = |key: &str| last(&query, key);
        let tls = match uri.scheme {
            AMQPScheme::AMQP => {
                if let Some((key, _)) = query.first() {
                    return Err(format!("{key} needs amqps://"));
                }
                None
            }
            AMQPScheme::AMQPS => {
                match param("verify").map(|(_, v)| v) {
                    None | Some("verify_peer") => {}
                    Some("verify_none") => {
                        return Err("verify=verify_none is refused: the broker's certificate \
                                    is always verified (name its CA with cacertfile)"
                            .into());
                    }
                    Some(_) => return Err("verify must be verify_peer".into()),
                }
                let (check, server_name) = match param("server_name_indication") {
                    None => (Check::ChainAndName, uri.authority.host.clone()),
                    Some((_, "disable")) => (Check::ChainOnly, uri.authority.host.clone()),
                    Some((_, name)) => (Check::ChainAndName, name.to_string()),
                };
                if rustls::pki_types::ServerName::try_from(server_name.as_str()).is_err() {
                    return Err("the server name (host or server_name_indication) is not a valid DNS name or IP address".into());
                }
                let files = tls::Files {
                    roots: param("cacertfile"),
                    cert: param("certfile"),
                    key: param("keyfile"),
                };
                let mut config = tls::client_config(&files, check)?;
                config.enable_sni = check == Check::ChainAndName;
                Some(AmqpTls {
                    config: Arc::new(config),
                    server_name,
                })
            }
        };
        let redacted = shown_amqp(&uri, &query);
        Ok(AmqpEndpoint { uri, tls, redacted })
    }
}

/// The value of the last parameter named `key` (a later one wins, as in
/// libpq), with its name.
fn last<'a>(params: &'a [(String, String)], key: &str) -> Option<(&'a str, &'a str)> {
    params
        .iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(k, v)| (k.as_str(), v.as_str()))
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
fn shown_database(config: &tokio_postgres::Config, tls: &[(&str, &str)], url_form: bool) -> String {
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
    if url_form {
        let userinfo = match (user.is_empty(), password) {
            (true, _) => String::new(),
            (false, true) => format!("{user}:{MASK}@"),
            (false, false) => format!("{user}@"),
        };
        let mut shown = format!("postgres://{userinfo}{}/{dbname}", hosts.join(","));
        let query: Vec<String> = tls.iter().map(|(k, v)| format!("{k}={v}")).collect();
        if !query.is_empty() {
            shown.push('?');
            shown.push_str(&query.join("&"));
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
        pairs.extend(tls.iter().map(|(k, v)| format!("{k}={v}")));
        pairs.join(" ")
    }
}

/// An AMQP target as printed, built from what was parsed (and its TLS
/// parameters, file paths and names, none of them secret).
fn shown_amqp(uri: &AMQPUri, tls: &[(String, String)]) -> String {
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
    let mut shown = format!("{scheme}://{userinfo}{}:{}/{vhost}", auth.host, auth.port);
    let query: Vec<String> = tls.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if !query.is_empty() {
        shown.push('?');
        shown.push_str(&query.join("&"));
    }
    shown
}

/// The targets print as their URL with the password masked.
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
shown_redacted!(DatabaseTarget, AmqpTarget, AmqpEndpoint);

#[cfg(test)]
mod tests {
    use super::*;

    /// A private CA, and a certificate and key it signed, made with the
    /// machine's `openssl`, in a temporary directory.
    fn private_ca() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let run = |args: &[&str]| {
            let status = std::process::Command::new("openssl")
                .args(args)
                .current_dir(dir.path())
                .stderr(std::process::Stdio::null())
                .status()
                .unwrap();
            assert!(status.success(), "openssl {args:?}");
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=test CA",
        ]);
        run(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "client.key",
            "-out",
            "client.csr",
            "-subj",
            "/CN=relay",
        ]);
        std::fs::write(
            dir.path().join("client.ext"),
            "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
        )
        .unwrap();
        run(&[
            "x509",
            "-req",
            "-in",
            "client.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "client.pem",
            "-days",
            "2",
            "-extfile",
            "client.ext",
        ]);
        dir
    }

    #[test]
    fn database_urls_and_key_value_strings_parse_with_the_relays_defaults() {
        let ca = private_ca();
        let path = |name: &str| ca.path().join(name).display().to_string();
        let target: DatabaseTarget = format!(
            "postgres://app:pa55@db:6432/orders?sslmode=verify-full&sslrootcert={}",
            path("ca.pem")
        )
        .parse()
        .unwrap();
        assert_eq!(target.config.get_dbname(), Some("orders"));
        assert_eq!(target.config.get_ssl_mode(), SslMode::Require);
        assert!(target.tls.is_some());
        assert_eq!(
            target.config.get_connect_timeout(),
            Some(&DATABASE_CONNECT_TIMEOUT)
        );
        let shown = format!("{target} {target:?}");
        assert!(!shown.contains("pa55"), "{shown}");

        let plain: DatabaseTarget = "host=db user=app password=pa55 dbname=x".parse().unwrap();
        assert_eq!(plain.config.get_ssl_mode(), SslMode::Disable);
        assert!(plain.tls.is_none());
        assert!(!format!("{plain:?}").contains("pa55"));

        for mode in ["require", "verify-ca", "verify-full"] {
            let kv: DatabaseTarget = format!(
                "host=db user=app sslmode={mode} sslrootcert={} sslcert={} sslkey={}",
                path("ca.pem"),
                path("client.pem"),
                path("client.key")
            )
            .parse()
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
            assert_eq!(kv.config.get_ssl_mode(), SslMode::Require);
            assert!(
                kv.tls
                    .as_ref()
                    .unwrap()
                    .client_auth_cert_resolver
                    .has_certs()
            );
        }
    }

    #[test]
    fn database_tls_settings_that_would_not_hold_are_refused_naming_the_parameter() {
        let ca = private_ca();
        let path = |name: &str| ca.path().join(name).display().to_string();
        let refused = |url: String, says: &str| {
            let error = url.parse::<DatabaseTarget>().unwrap_err();
            assert!(error.contains(says), "{url}: {error}");
            assert!(!error.contains("pa55"), "{error}");
        };
        for mode in ["prefer", "allow"] {
            refused(
                format!("postgres://u:pa55@db/x?sslmode={mode}"),
                &format!("sslmode={mode} would connect without TLS"),
            );
        }
        refused(
            "postgres://u:pa55@db/x?sslmode=on".into(),
            "sslmode must be",
        );
        refused(
            format!("postgres://u:pa55@db/x?sslrootcert={}", path("ca.pem")),
            "sslrootcert needs sslmode=",
        );
        refused(
            "postgres://u:pa55@db/x?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem".into(),
            "sslrootcert /nonexistent/ca.pem: No such file",
        );
        refused(
            format!(
                "postgres://u:pa55@db/x?sslmode=verify-full&sslrootcert={}",
                path("client.key")
            ),
            "sslrootcert",
        );
        refused(
            format!(
                "postgres://u:pa55@db/x?sslmode=require&sslrootcert={}&sslcert={}",
                path("ca.pem"),
                path("client.pem")
            ),
            "sslcert needs a key",
        );
        refused(
            format!(
                "host=db password=pa55 sslmode=require sslrootcert={} sslcert={} sslkey={}",
                path("ca.pem"),
                path("client.pem"),
                path("client.pem")
            ),
            "sslkey",
        );
        refused(
            format!(
                "host=db password=pa55 sslmode=require sslrootcert={} sslcert={} sslkey={}",
                path("ca.pem"),
                path("client.pem"),
                path("ca.key")
            ),
            "do not go together",
        );
    }

    #[test]
    fn amqps_urls_take_rabbitmqs_tls_parameters() {
        let ca = private_ca();
        let path = |name: &str| ca.path().join(name).display().to_string();
        let url = format!(
            "amqps://u:pa55@mq:5671/%2f?cacertfile={}&certfile={}&keyfile={}&verify=verify_peer&heartbeat=5",
            path("ca.pem"),
            path("client.pem"),
            path("client.key")
        );
        let target: AmqpEndpoint = url.parse().unwrap();
        let tls = target.tls.as_ref().unwrap();
        assert_eq!(tls.server_name, "mq");
        assert!(tls.config.enable_sni);
        assert!(tls.config.client_auth_cert_resolver.has_certs());
        assert_eq!(target.uri.query.heartbeat, Some(5));
        assert!(!target.to_string().contains("pa55"), "{target}");
        assert!(target.to_string().contains("cacertfile="), "{target}");

        let named: AmqpEndpoint = format!(
            "amqps://mq/%2f?cacertfile={}&server_name_indication=rabbit.internal",
            path("ca.pem")
        )
        .parse()
        .unwrap();
        assert_eq!(named.tls.unwrap().server_name, "rabbit.internal");
        let unnamed: AmqpEndpoint = format!(
            "amqps://mq/%2f?cacertfile={}&server_name_indication=disable",
            path("ca.pem")
        )
        .parse()
        .unwrap();
        assert!(!unnamed.tls.unwrap().config.enable_sni);
        let plain: AmqpEndpoint = "amqp://mq/%2f".parse().unwrap();
        assert!(plain.tls.is_none());

        for (bad, says) in [
            (
                format!("amqp://u:pa55@mq/%2f?cacertfile={}", path("ca.pem")),
                "cacertfile needs amqps://",
            ),
            (
                "amqps://u:pa55@mq/%2f?verify=verify_none".into(),
                "verify=verify_none is refused",
            ),
            (
                "amqps://u:pa55@mq/%2f?cacertfile=/nonexistent/ca.pem".into(),
                "cacertfile /nonexistent/ca.pem",
            ),
            (
                format!(
                    "amqps://u:pa55@mq/%2f?cacertfile={}&certfile={}",
                    path("ca.pem"),
                    path("client.pem")
                ),
                "certfile needs a key",
            ),
        ] {
            let error = bad.parse::<AmqpTarget>().unwrap_err();
            assert!(error.contains(says), "{bad}: {error}");
            assert!(!error.contains("pa55"), "{error}");
        }
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
        assert_eq!(
            target.endpoints[0].uri.query.heartbeat,
            Some(DEFAULT_HEARTBEAT_SECS)
        );
        assert_eq!(target.to_string(), "amqp://u:***@mq:5672/%2f");
        assert!(!format!("{target:?}").contains("pa55"));
        let error = "http://u:pa55@mq/".parse::<AmqpTarget>().unwrap_err();
        assert!(!error.contains("pa55"), "{error}");
    }

    #[test]
    fn several_endpoints_are_cut_only_where_a_new_url_starts() {
        let target: AmqpTarget =
            "amqp://u:pa,55@mq-0:5672/%2f, AMQP://u:pa,55@mq-1/%2f,amqp://u:pa,55@mq-2:5673/%2f"
                .parse()
                .unwrap();
        let addresses: Vec<String> = target.endpoints.iter().map(AmqpEndpoint::address).collect();
        assert_eq!(addresses, ["mq-0:5672", "mq-1:5672", "mq-2:5673"]);
        assert_eq!(target.endpoints[0].uri.authority.userinfo.password, "pa,55");
        assert_eq!(target.endpoints[1].uri.authority.userinfo.password, "pa,55");
        assert_eq!(
            target.to_string(),
            "amqp://u:***@mq-0:5672/%2f,amqp://u:***@mq-1:5672/%2f,amqp://u:***@mq-2:5673/%2f"
        );
        assert!(!format!("{target:?}").contains("pa,55"));
        let one: AmqpTarget = "amqp://u:a,b,c@mq/%2f".parse().unwrap();
        assert_eq!(one.endpoints.len(), 1);
        assert_eq!(one.endpoints[0].uri.authority.userinfo.password, "a,b,c");
    }

    #[test]
    fn a_bad_endpoint_is_named_by_its_position_and_never_quoted() {
        for (list, says) in [
            (
                "amqp://u:pa,55@mq-0/%2f,amqp://u:pa,55@mq-1:port/%2f",
                "endpoint 2 of 2: not a valid AMQP URL",
            ),
            (
                "amqp://u:pa,55@mq-0/%2f,amqps://u:pa,55@mq-1/%2f",
                "endpoint 2 of 2: mixes amqp:// and amqps://",
            ),
            (
                "amqp://u:pa,55@mq-0/%2f,amqp://u:pa,55@mq-1/%2f,amqp://u:pa,55@mq-2/other",
                "endpoint 3 of 3: names another virtual host",
            ),
            (
                "amqp://u:pa,55@mq-0/%2f,amqp://v:pa,55@mq-1/%2f",
                "endpoint 2 of 2: names another user",
            ),
            (
                "amqp://u:12,amqp://55@mq-0/%2f",
                "endpoint 2 of 2: names another user",
            ),
            (
                "amqp://u:pa/55@mq-0/%2f, amqp://mq-1/%2f",
                "endpoint 1 of 2: the part before `@`",
            ),
            ("amqp://u:pa,55@mq-0/%2f, ", "ends with a comma"),
        ] {
            let error = list.parse::<AmqpTarget>().unwrap_err();
            assert!(error.contains(says), "{list}: {error}");
            assert!(
                !error.contains("pa,55") && !error.contains("55@"),
                "{error}"
            );
        }
    }
}
