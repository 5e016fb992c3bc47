//! The two connection targets, parsed once from `database_url` and `amqp_url`
//! into what the store and the publisher take. Each keeps its URL with the
//! password masked for printing; neither's `Debug` or `Display` shows a secret,
//! and no parse error quotes the URL.

mod amqp;
mod tls;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::config::{LoadBalanceHosts, SslMode, TargetSessionAttrs};

use crate::redact::MASK;
pub use amqp::{AmqpEndpoint, AmqpTarget};
use tls::Check;

/// Deadline for opening a database connection (TCP, TLS, authentication),
/// unless the URL sets `connect_timeout`.
pub const DATABASE_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The sessions' `application_name` when the URL gives none.
const APPLICATION_NAME: &str = "outbox-relay";

/// Where the outbox table lives: the driver's configuration plus what the
/// driver does not do itself: TLS as libpq's `sslmode` (`require`,
/// `verify-ca`, `verify-full`), `sslrootcert`, `sslcert` and `sslkey` ask.
#[derive(Clone)]
pub struct DatabaseTarget {
    /// Every host, as given (what is printed, and what holds for all hosts).
    pub config: tokio_postgres::Config,
    /// One configuration per host, in the order given (shuffled per connect
    /// with `load_balance_hosts=random`): each host is tried alone, within
    /// its own connect timeout, so a host that never answers does not spend
    /// the deadline of the others.
    hosts: Vec<tokio_postgres::Config>,
    /// The TLS client configuration when `sslmode` asks for TLS; `None`: plain.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    redacted: String,
}

impl DatabaseTarget {
    /// The configuration of each host, in the order to try them.
    pub fn hosts(&self) -> Vec<&tokio_postgres::Config> {
        let mut hosts: Vec<&tokio_postgres::Config> = self.hosts.iter().collect();
        if self.config.get_load_balance_hosts() == LoadBalanceHosts::Random {
            let start = random_index(hosts.len());
            hosts.rotate_left(start);
        }
        hosts
    }

    /// How long one host may take to connect (TCP, TLS, authentication and,
    /// with `target_session_attrs`, the check of what the server is).
    pub fn connect_timeout(&self) -> Duration {
        self.config
            .get_connect_timeout()
            .copied()
            .unwrap_or(DATABASE_CONNECT_TIMEOUT)
    }

    /// How long a connection may take with every host tried in turn.
    pub fn connect_deadline(&self) -> Duration {
        self.connect_timeout()
            .saturating_mul(u32::try_from(self.hosts.len()).unwrap_or(u32::MAX).max(1))
    }

    /// Whether only a server that accepts writes will do
    /// (`target_session_attrs=read-write`).
    pub fn wants_writable(&self) -> bool {
        self.config.get_target_session_attrs() == TargetSessionAttrs::ReadWrite
    }

    /// Names every session this target opens.
    pub fn set_application_name(&mut self, name: &str) {
        self.config.application_name(name);
        for host in &mut self.hosts {
            host.application_name(name);
        }
    }
}

/// Client-side TCP keepalives of every database connection: a dead peer is
/// noticed in about 30 s even when no query is running. The server's side of
/// the connection is asked for the same (see `store::connect`).
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
pub const KEEPALIVE_RETRIES: u32 = 3;

/// What the relay sets on every database configuration it did not get from
/// the connection string.
fn with_relay_defaults(config: &mut tokio_postgres::Config, tls: bool) {
    // Plain unless sslmode asks for TLS (docs/design.md); TLS is then always
    // verified, by the client configuration.
    config.ssl_mode(if tls {
        SslMode::Require
    } else {
        SslMode::Disable
    });
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(DATABASE_CONNECT_TIMEOUT);
    }
    if config.get_application_name().is_none() {
        config.application_name(APPLICATION_NAME);
    }
    config
        .keepalives(true)
        .keepalives_idle(KEEPALIVE_IDLE)
        .keepalives_interval(KEEPALIVE_INTERVAL)
        .keepalives_retries(KEEPALIVE_RETRIES);
}

/// An index below `n`, different per call (every `RandomState` is freshly
/// keyed).
fn random_index(n: usize) -> usize {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    usize::try_from(random % u64::try_from(n.max(1)).unwrap_or(1)).unwrap_or(0)
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
        let read = if url_form {
            misplaced_userinfo(url)?;
            super::dsn::url_pairs(url)?
        } else if url.contains("://") {
            return Err(
                "must start with postgres:// or postgresql:// (or be key=value pairs)".into(),
            );
        } else {
            super::dsn::pairs(url)?
        };
        super::dsn::known_keys(read.iter().map(|(key, _)| key.as_str()))?;
        if let Some((key, _)) = read.iter().find(|(_, value)| value.contains('\0')) {
            return Err(format!(
                "its {key} holds a NUL character, which no connection to PostgreSQL can carry"
            ));
        }
        let pairs: Vec<(String, String)> = read.iter().filter_map(|(k, v)| keep(k, v)).collect();
        let param = |key: &str| last(&tls_params, key);
        let tls = database_tls(&tls_params)?;
        let parse = |pairs: &[(String, String)]| {
            let mut config: tokio_postgres::Config =
                super::dsn::join(pairs)
                    .parse()
                    .map_err(|e: tokio_postgres::Error| {
                        format!("not a valid PostgreSQL connection string: {e}")
                    })?;
            with_relay_defaults(&mut config, tls.is_some());
            Ok::<_, String>(config)
        };
        let mut config = parse(&pairs)?;
        if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
            return Err("names no host".into());
        }
        let mut hosts = super::dsn::per_host(&pairs, &config)
            .iter()
            .map(|pairs| parse(pairs))
            .collect::<Result<Vec<_>, _>>()?;
        // Several hosts are a primary and its standbys: the relay writes, so
        // unless told otherwise it connects only to one that takes writes.
        if hosts.len() > 1 && !pairs.iter().any(|(key, _)| key == "target_session_attrs") {
            for config in std::iter::once(&mut config).chain(&mut hosts) {
                config.target_session_attrs(TargetSessionAttrs::ReadWrite);
            }
        }
        if config.get_ports().len() > 1 && config.get_ports().len() != hosts.len() {
            return Err("names more than one port, but not one for each host".into());
        }
        if !config.get_hosts().is_empty()
            && !config.get_hostaddrs().is_empty()
            && config.get_hosts().len() != config.get_hostaddrs().len()
        {
            return Err("names a different number of hosts and hostaddrs".into());
        }
        let shown_tls: Vec<(&str, &str)> = ["sslmode", "sslrootcert", "sslcert", "sslkey"]
            .into_iter()
            .filter_map(param)
            .collect();
        let redacted = shown_database(&config, &shown_tls, url_form);
        Ok(DatabaseTarget {
            config,
            hosts,
            tls,
            redacted,
        })
    }
}

/// The TLS of a database connection, from its `ssl*` parameters (the last
/// of each): none with `sslmode=disable` or no `sslmode` (and then no
/// certificate file may be named either), or the check `require`,
/// `verify-full` or `verify-ca` asks for. `prefer` and `allow` are refused:
/// they would connect without TLS when the server offers none.
fn database_tls(
    tls_params: &[(String, String)],
) -> Result<Option<Arc<rustls::ClientConfig>>, String> {
    let param = |key: &str| last(tls_params, key);
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
    match check {
        Some(check) => Ok(Some(Arc::new(tls::client_config(&files, check)?))),
        None => match files.roots.or(files.cert).or(files.key) {
            Some((key, _)) => Err(format!(
                "{key} needs sslmode=require, verify-ca or verify-full \
                 (without sslmode the connection is plain)"
            )),
            None => Ok(None),
        },
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
    let names: Vec<String> = if config.get_hosts().is_empty() {
        let addrs = config.get_hostaddrs().iter();
        addrs.map(ToString::to_string).collect()
    } else {
        let hosts = config.get_hosts().iter();
        hosts
            .map(|host| match host {
                Host::Tcp(name) => name.clone(),
                Host::Unix(path) => path.display().to_string(),
            })
            .collect()
    };
    let port = |i: usize| config.get_ports().get(i).or(config.get_ports().first());
    let hosts: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let name = if name.contains(':') && !name.starts_with('/') {
                format!("[{name}]")
            } else {
                name.clone()
            };
            match port(i) {
                Some(port) => format!("{name}:{port}"),
                None => name,
            }
        })
        .collect();
    let shown = shown_parameters(config, tls);
    let user = config.get_user().unwrap_or_default();
    let password = config.get_password().is_some();
    let dbname = config.get_dbname().unwrap_or_default();
    if url_form {
        let userinfo = match (user.is_empty(), password) {
            (true, _) => String::new(),
            (false, true) => format!("{user}:{MASK}@"),
            (false, false) => format!("{user}@"),
        };
        let mut url = format!("postgres://{userinfo}{}/{dbname}", hosts.join(","));
        push_query(&mut url, &shown);
        url
    } else {
        let mut pairs = vec![format!("host={}", names.join(","))];
        let ports: Vec<String> = config.get_ports().iter().map(u16::to_string).collect();
        if !ports.is_empty() {
            pairs.push(format!("port={}", ports.join(",")));
        }
        if !user.is_empty() {
            pairs.push(format!("user={user}"));
        }
        if password {
            pairs.push(format!("password={MASK}"));
        }
        if !dbname.is_empty() {
            pairs.push(format!("dbname={dbname}"));
        }
        pairs.extend(shown.iter().map(|(k, v)| format!("{k}={}", pair_quoted(v))));
        pairs.join(" ")
    }
}

/// The parameters a database target shows besides its hosts, user and
/// database: where to connect, the session's own settings where they are not
/// the relay's defaults, and the TLS parameters. None of it is secret.
fn shown_parameters<'a>(
    config: &tokio_postgres::Config,
    tls: &[(&'a str, &str)],
) -> Vec<(&'a str, String)> {
    let mut shown: Vec<(&str, String)> = Vec::new();
    if !config.get_hosts().is_empty() && !config.get_hostaddrs().is_empty() {
        let addrs: Vec<String> = config
            .get_hostaddrs()
            .iter()
            .map(ToString::to_string)
            .collect();
        shown.push(("hostaddr", addrs.join(",")));
    }
    match config.get_target_session_attrs() {
        TargetSessionAttrs::ReadWrite => shown.push(("target_session_attrs", "read-write".into())),
        TargetSessionAttrs::ReadOnly => shown.push(("target_session_attrs", "read-only".into())),
        _ => {}
    }
    if config.get_load_balance_hosts() == LoadBalanceHosts::Random {
        shown.push(("load_balance_hosts", "random".into()));
    }
    if let Some(timeout) = config.get_connect_timeout()
        && *timeout != DATABASE_CONNECT_TIMEOUT
    {
        shown.push(("connect_timeout", timeout.as_secs().to_string()));
    }
    if let Some(name) = config.get_application_name()
        && name != APPLICATION_NAME
    {
        shown.push(("application_name", name.to_string()));
    }
    if let Some(options) = config.get_options() {
        shown.push(("options", options.to_string()));
    }
    shown.extend(tls.iter().map(|(k, v)| (*k, (*v).to_string())));
    shown
}

/// Adds `?key=value&…` to `url`, each value [`url_encoded`]; nothing when
/// there are no parameters.
fn push_query<K: fmt::Display, V: AsRef<str>>(url: &mut String, parameters: &[(K, V)]) {
    let query: Vec<String> = parameters
        .iter()
        .map(|(k, v)| format!("{k}={}", url_encoded(v.as_ref())))
        .collect();
    if !query.is_empty() {
        url.push('?');
        url.push_str(&query.join("&"));
    }
}

/// A query value as a URL carries it: every byte but the unreserved ones
/// percent-encoded.
fn url_encoded(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' | b',' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A value as a key=value string carries it: quoted, with `'` and `\`
/// escaped, when it is empty or holds a space, a quote or a backslash;
/// control characters escaped (the output may reach a terminal).
fn pair_quoted(value: &str) -> String {
    let value = crate::printable::escape_controls(value);
    if !value.is_empty() && !value.contains([' ', '\'', '\\']) {
        return value;
    }
    let escaped = value.replace('\\', "\\\\").replace('\'', "\\'");
    format!("'{escaped}'")
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
        assert!(target.to_string().ends_with("&heartbeat=5"), "{target}");

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
    fn several_hosts_without_target_session_attrs_want_a_writable_one() {
        for url in [
            "postgres://app@h1:5432,h2:5433/db",
            "host=h1,h2 port=5432,5433 user=app dbname=db",
        ] {
            let target: DatabaseTarget = url.parse().unwrap();
            assert!(target.wants_writable(), "{url}");
            assert!(
                target
                    .hosts()
                    .iter()
                    .all(|host| host.get_target_session_attrs() == TargetSessionAttrs::ReadWrite),
                "{url}"
            );
            assert!(
                target
                    .to_string()
                    .contains("target_session_attrs=read-write"),
                "{url}"
            );
        }
        // Said otherwise, or one host: as given.
        for url in [
            "postgres://app@h1:5432,h2:5433/db?target_session_attrs=any",
            "host=h1,h2 user=app dbname=db target_session_attrs=any",
            "postgres://app@h1:5432/db",
            "host=h1 user=app dbname=db",
        ] {
            let target: DatabaseTarget = url.parse().unwrap();
            assert!(!target.wants_writable(), "{url}");
            assert!(
                target
                    .hosts()
                    .iter()
                    .all(|host| host.get_target_session_attrs() == TargetSessionAttrs::Any),
                "{url}"
            );
        }
    }

    #[test]
    fn the_sessions_own_settings_are_shown_as_given_in_either_form() {
        let url: DatabaseTarget = "postgres://app:pa55@h1/db?connect_timeout=7\
             &application_name=my%20app&options=-c%20statement_timeout%3D5000"
            .parse()
            .unwrap();
        assert_eq!(
            url.to_string(),
            "postgres://app:***@h1:5432/db?connect_timeout=7&application_name=my%20app\
             &options=-c%20statement_timeout%3D5000"
        );
        let pairs: DatabaseTarget = "host=h1 user=app password=pa55 dbname=db connect_timeout=7 \
             application_name=it\\'s options='-c statement_timeout=5000'"
            .parse()
            .unwrap();
        assert_eq!(
            pairs.to_string(),
            "host=h1 user=app password=*** dbname=db connect_timeout=7 \
             application_name='it\\'s' options='-c statement_timeout=5000'"
        );
    }

    #[test]
    fn several_hosts_are_each_tried_alone_and_shown_without_the_password() {
        let url: DatabaseTarget =
            "postgres://app:pa55@h1:5432,[::1]:5433/db?target_session_attrs=read-write&connect_timeout=2"
                .parse()
                .unwrap();
        assert_eq!(
            url.to_string(),
            "postgres://app:***@h1:5432,[::1]:5433/db?target_session_attrs=read-write&connect_timeout=2"
        );
        assert!(url.wants_writable());
        assert_eq!(url.connect_timeout(), Duration::from_secs(2));
        assert_eq!(url.connect_deadline(), Duration::from_secs(4));
        let hosts = url.hosts();
        assert_eq!(hosts.len(), 2);
        assert_eq!(hosts[1].get_ports(), [5433]);
        assert_eq!(hosts[1].get_password(), Some(&b"pa55"[..]));
        assert_eq!(
            hosts[0].get_target_session_attrs(),
            TargetSessionAttrs::ReadWrite
        );

        let pairs: DatabaseTarget =
            "host=h1,h2 port=5432,5433 user=app password=pa55 dbname=db target_session_attrs=read-write"
                .parse()
                .unwrap();
        assert_eq!(
            pairs.to_string(),
            "host=h1,h2 port=5432,5433 user=app password=*** dbname=db target_session_attrs=read-write"
        );
        assert_eq!(pairs.hosts()[1].get_dbname(), Some("db"));

        let by_address: DatabaseTarget = "hostaddr=10.0.0.1,10.0.0.2 port=6432 dbname=db"
            .parse()
            .unwrap();
        assert_eq!(by_address.hosts().len(), 2);
        assert_eq!(
            by_address.to_string(),
            "host=10.0.0.1,10.0.0.2 port=6432 dbname=db target_session_attrs=read-write"
        );

        for bad in [
            "host=h1,h2,h3 port=1,2 password=pa55",
            "host=h1,h2 hostaddr=10.0.0.1 password=pa55",
            "postgres://u:pa55@h1,[::1/db",
        ] {
            let error = bad.parse::<DatabaseTarget>().unwrap_err();
            assert!(!error.contains("pa55"), "{error}");
        }
    }

    #[test]
    fn bad_database_urls_are_refused_without_being_quoted() {
        for bad in ["mysql://u:pa55@db/x", "postgres://u:pa55@:5432/x?port=zz"] {
            let error = bad.parse::<DatabaseTarget>().unwrap_err();
            assert!(!error.contains("pa55"), "{error}");
        }
        for (bad, key) in [
            ("postgres://u:pa55@db/x\0y", "dbname"),
            ("postgres://u:pa\0 55@db/x", "password"),
            ("host=db user=u\0 password=pa55", "user"),
        ] {
            let error = bad.parse::<DatabaseTarget>().unwrap_err();
            assert!(!error.contains("pa55"), "{error}");
            assert!(error.contains(&format!("its {key} holds a NUL")), "{error}");
        }
    }

    #[test]
    fn an_amqp_parameter_no_part_reads_is_refused_and_the_known_ones_are_shown() {
        for typo in ["cacertfle=/etc/ca.pem", "bogus=1", "password=pa55"] {
            let error = format!("amqps://u:pa55@mq/%2f?{typo}")
                .parse::<AmqpEndpoint>()
                .unwrap_err();
            let key = typo.split('=').next().unwrap();
            assert!(
                error.contains(&format!(
                    "holds the parameter \"{key}\", which the relay does not know"
                )),
                "{error}"
            );
            assert!(!error.contains("pa55"), "{error}");
        }
        let shown = "amqp://u:pa55@mq/%2f?heartbeat=5&frame_max=131072&channel_max=10&connection_timeout=3000&auth_mechanism=plain"
            .parse::<AmqpEndpoint>()
            .unwrap()
            .to_string();
        assert_eq!(
            shown,
            "amqp://u:***@mq:5672/%2f?heartbeat=5&frame_max=131072&channel_max=10&connection_timeout=3000&auth_mechanism=plain"
        );
    }

    #[test]
    fn a_frame_max_the_broker_refuses_is_refused_at_load() {
        let error = "amqp://u:pa55@mq/%2f?frame_max=1000"
            .parse::<AmqpTarget>()
            .unwrap_err();
        assert!(
            error.contains("frame_max=1000") && error.contains("4096"),
            "{error}"
        );
        assert!(!error.contains("pa55"), "{error}");
        for fits in ["0", "4096", "131072"] {
            let url = format!("amqp://u:pa55@mq/%2f?frame_max={fits}");
            assert!(url.parse::<AmqpTarget>().is_ok(), "{url}");
        }
    }

    #[test]
    fn amqp_urls_get_a_heartbeat_and_never_print_their_password() {
        let target: AmqpTarget = "amqp://u:pa55@mq:5672/%2f".parse().unwrap();
        assert_eq!(
            target.endpoints[0].uri.query.heartbeat,
            Some(amqp::DEFAULT_HEARTBEAT_SECS)
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
