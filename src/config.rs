//! Configuration: the layers (built-in defaults → TOML file → environment →
//! command-line flags, later wins), merged with figment, then validated into a
//! [`Config`] in one pass before anything is connected.
//!
//! One table below declares every key: its type, default, rule and flag. The
//! struct, the flags, the environment names, the validation and the
//! `check-config` rendering all come from it, so a new key is one line there
//! plus its rule. The contract of each key is in `docs/design.md`.
//!
//! Every key remembers which layer gave it its value, so an error names the key,
//! where it came from and what is allowed, e.g.
//! `poll_ms = 0 (environment variable OUTBOX_POLL_MS): must be from 1 to 60000`.
//!
//! Merging the layers and the typed reads of each key are in `load`; the
//! rules that read one value and its `check-config` rendering in `read`;
//! the connection targets a URL becomes in `target`.

mod dsn;
pub(crate) mod file;
mod load;
mod read;
mod target;

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use figment::value::{Dict, Value};

use crate::template::{MessageIdTemplate, RoutingKey};
use load::Validator;
pub use load::{Loaded, Sources, env_var, flag_name};
use read::{
    Fallback, Flag, Parse, Render, SCHEMA_NAME, TABLE_NAME, TenantList, int, keys, parsed,
    short_text,
};
pub use target::{
    AmqpEndpoint, AmqpTarget, DATABASE_CONNECT_TIMEOUT, DatabaseTarget, KEEPALIVE_IDLE,
    KEEPALIVE_INTERVAL, KEEPALIVE_RETRIES,
};

/// The prefix of every configuration variable.
pub const ENV_PREFIX: &str = "OUTBOX_";

/// The variable that names the configuration file when `--config` is absent.
pub const CONFIG_FILE_VAR: &str = "OUTBOX_CONFIG";

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A number that fits `u64`/`usize` by its rule's range.
const NO_MAX: i64 = i64::MAX;

keys! {
    /// Tenants to relay, comma-separated; * relays every tenant with pending rows
    tenants: Tenants ["NAMES"] = Fallback::Required, TenantList;
    /// With tenants = *: tenants with series of their own; the rest share one overflow label
    max_tenants: usize ["N"] = 10_000, int(1, 1_000_000);
    /// Poll interval when idle, ms (1..=60000)
    poll_ms: u64 ["MS"] = 200, int(1, 60_000);
    /// Lag past which /healthz answers 503, ms
    max_lag_ms: u64 ["MS"] = 60_000, int(1, NO_MAX);
    /// Longest per-tenant back-off, ms
    max_backoff_ms: u64 ["MS"] = 30_000, int(1, NO_MAX);
    /// Rows per sweep (1..=10000)
    batch_size: usize ["N"] = 256, int(1, 10_000);
    /// Unconfirmed messages at most (1..=batch_size)
    max_in_flight: usize ["N"] = batch_size, int(1, 10_000),
        check |n: &usize| at_most(*n, "batch_size", batch_size);
    /// Tenants swept at once (1..=1024)
    concurrency: usize ["N"] = 4, int(1, 1024);
    /// PostgreSQL URL or key=value string [env: OUTBOX_DATABASE_URL, DATABASE_URL]
    database_url: DatabaseTarget ["URL"] = default_target::<DatabaseTarget>(DEFAULT_DATABASE_URL), parsed(),
        env "DATABASE_URL";
    /// sequence (the default: the id sequence watched while rows flow), notify (LISTEN for new rows) or poll (the poll alone)
    wakeup: Wakeup ["MODE"] = Wakeup::Sequence, Parse(Wakeup::parse);
    /// PostgreSQL URL of the LISTEN connection (direct, not through PgBouncer in transaction mode; default: database_url)
    listen_database_url: DatabaseTarget ["URL"] = database_url.clone(), parsed();
    /// Database connections (> concurrency)
    pool_size: usize ["N"] = concurrency + 2, int(1, 10_000),
        check |n: &usize| above_concurrency(*n, concurrency);
    /// Schema of the outbox table
    schema: String ["NAME"] = "public".to_string(), SCHEMA_NAME;
    /// Name of the outbox table
    table: String ["NAME"] = "outbox_message".to_string(), TABLE_NAME;
    /// RabbitMQ URL, or several comma-separated (nodes of one cluster, tried in order) [env: OUTBOX_AMQP_URL, AMQP_URL]
    amqp_url: AmqpTarget ["URL"] = default_target::<AmqpTarget>(DEFAULT_AMQP_URL), parsed(), env "AMQP_URL";
    /// Exchange to publish to
    exchange: String ["NAME"] = "outbox".to_string(), short_text();
    /// Exchange type: direct, fanout, topic, headers or x-…
    exchange_type: String ["TYPE"] = "topic".to_string(), Parse(exchange_type);
    /// Declare the exchange (durable) on connect
    declare_exchange: bool ["BOOL"] = true, Flag,
        check |declare: &bool| declarable(*declare, &exchange, &exchange_type);
    /// Routing key template: {tenant}, {kind}, {subject}
    routing_key: RoutingKey ["TEMPLATE"] = default_routing_key(), parsed(),
        check |key: &RoutingKey| every_tenant_fits(key, tenants.listed());
    /// content_type of every message
    content_type: String ["TYPE"] = "application/json".to_string(), short_text();
    /// message_id template: {id}, {schema}, {table}
    message_id: MessageIdTemplate ["TEMPLATE"] = default_message_id(), parsed(),
        check |id: &MessageIdTemplate| id.bind(&schema, &table).map(drop);
    /// Delete rows published longer ago than this, ms (0 = keep them)
    retention_ms: u64 ["MS"] = 0, int(0, NO_MAX),
        check |ms: &u64| retention_fits(*ms);
    /// A confirm not seen in this long is a refusal, ms
    confirm_timeout_ms: u64 ["MS"] = 10_000, int(1, NO_MAX),
        check |ms: &u64| claim_bound_fits(*ms);
    /// Larger payloads are refused as too_large
    max_payload_bytes: usize ["BYTES"] = 16_777_216, int(1, i64::from(u32::MAX));
    /// Park a row when its own refusal (too_large, invalid) reaches this many attempts; 0 = never
    park_after_attempts: u64 ["N"] = 0, int(0, i64::from(i32::MAX));
    /// Relay-wide budget of row bytes read and in flight (≥ 3 × max_payload_bytes + 10.5 MiB)
    max_bytes_in_flight: usize ["BYTES"] = 64 << 20, int(1, NO_MAX),
        check |n: &usize| holds_one_row(*n, max_payload_bytes);
    /// Address of the HTTP endpoints
    http_addr: SocketAddr ["ADDR"] = SocketAddr::from(([0, 0, 0, 0], 9780)), Parse(socket_addr);
    /// How long running sweeps may finish after SIGTERM, ms
    shutdown_grace_ms: u64 ["MS"] = 20_000, int(0, NO_MAX);
    /// Apply migrations at start
    migrate: bool ["BOOL"] = false, Flag;
    /// json, text or auto
    log_format: LogFormat ["FORMAT"] = LogFormat::Auto, Parse(LogFormat::parse);
    /// Tracing filter [env: OUTBOX_LOG, RUST_LOG]
    log: String ["FILTER"] = "info".to_string(), Parse(tracing_filter), env "RUST_LOG";
}

fn default_target<T: std::str::FromStr<Err = String>>(url: &str) -> T {
    url.parse()
        .unwrap_or_else(|e| panic!("the built-in default URL is valid: {e}"))
}

fn default_routing_key() -> RoutingKey {
    RoutingKey::parse("{tenant}.{kind}").expect("the built-in template is valid")
}

fn default_message_id() -> MessageIdTemplate {
    MessageIdTemplate::parse("{id}").expect("the built-in template is valid")
}

fn at_most(n: usize, other: &str, limit: usize) -> Result<(), String> {
    if n > limit {
        return Err(format!("must be from 1 to {other} ({limit})"));
    }
    Ok(())
}

/// PostgreSQL's largest `idle_in_transaction_session_timeout`, in ms (int4).
const PG_TIMEOUT_MAX_MS: u64 = i32::MAX as u64;

/// What the claim's idle bound adds to twice `confirm_timeout_ms`.
const CLAIM_IDLE_MARGIN: Duration = Duration::from_secs(5);

/// The longest `retention_ms`: 100 years. The database computes `now()`
/// minus it, which past some 6,700 years is before its earliest timestamp
/// and fails every round; a longer retention keeps rows just the same.
const RETENTION_MAX_MS: u64 = 36_525 * 24 * 60 * 60 * 1_000;

fn retention_fits(ms: u64) -> Result<(), String> {
    if ms > RETENTION_MAX_MS {
        return Err(format!(
            "must be at most {RETENTION_MAX_MS} (100 years): retention deletes what ended before now() minus it, which the database cannot compute far back; 0 keeps rows for ever"
        ));
    }
    Ok(())
}

/// The claim sets `idle_in_transaction_session_timeout` to twice
/// `confirm_timeout_ms` plus 5 s ([`Config::claim_idle_timeout`]); past
/// PostgreSQL's int4 every claim would fail.
fn claim_bound_fits(confirm_timeout_ms: u64) -> Result<(), String> {
    let margin = CLAIM_IDLE_MARGIN.as_millis() as u64;
    let max = (PG_TIMEOUT_MAX_MS - margin) / 2;
    if confirm_timeout_ms > max {
        return Err(format!(
            "must be at most {max}: the claim sets idle_in_transaction_session_timeout to 2 × confirm_timeout_ms + 5000 ms, which PostgreSQL caps at {PG_TIMEOUT_MAX_MS} ms"
        ));
    }
    Ok(())
}

/// The exchanges every RabbitMQ has, with their types: declaring one of
/// them again with its own type is a no-op.
const PREDECLARED: &[(&str, &str)] = &[
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
];

/// Whether the broker can ever accept the relay's declaration of
/// `exchange`: not the default exchange (""), and no new name under the
/// broker's reserved `amq.` prefix, nor a predeclared one of another type.
fn declarable(declare: bool, exchange: &str, exchange_type: &str) -> Result<(), String> {
    if !declare {
        return Ok(());
    }
    if exchange.is_empty() {
        return Err(
            "exchange is \"\" (the default exchange), which the broker refuses to declare: set declare_exchange = false to publish to it (the routing key then names a queue), or name an exchange".into(),
        );
    }
    if exchange.starts_with("amq.") {
        return match PREDECLARED.iter().find(|(name, _)| *name == exchange) {
            Some((_, kind)) if *kind == exchange_type => Ok(()),
            Some((_, kind)) => Err(format!(
                "exchange {exchange:?} is the broker's own, of type {kind}, but exchange_type is {exchange_type}: the declaration would be refused; set exchange_type = \"{kind}\" or declare_exchange = false"
            )),
            None => Err(format!(
                "exchange {exchange:?} starts with amq., which the broker reserves: it refuses to declare it; set declare_exchange = false to publish to an existing one, or choose another name"
            )),
        };
    }
    Ok(())
}

fn holds_one_row(budget: usize, max_payload_bytes: usize) -> Result<(), String> {
    let least = crate::budget::least_for(max_payload_bytes);
    if budget < least {
        return Err(format!(
            "must hold one row of max_payload_bytes ({max_payload_bytes}): at least 3 × max_payload_bytes + 10.5 MiB ({least})"
        ));
    }
    Ok(())
}

fn above_concurrency(n: usize, concurrency: usize) -> Result<(), String> {
    if n <= concurrency {
        return Err(format!(
            "must be greater than concurrency ({concurrency}): sweeps hold one connection each and the poll and /healthz need one more"
        ));
    }
    Ok(())
}

/// A tenant whose routing keys are over AMQP's 255 bytes even with an empty
/// kind and subject could never publish a row.
fn every_tenant_fits(key: &RoutingKey, tenants: &[String]) -> Result<(), String> {
    for tenant in tenants {
        let shortest = key.render(tenant, "", "").len();
        if shortest > 255 {
            let shown: String = tenant.chars().take(64).collect();
            return Err(format!(
                "makes every routing key of tenant {shown:?} at least {shortest} bytes; AMQP allows 255: shorten the tenant's name (tenants) or the template"
            ));
        }
    }
    Ok(())
}

fn exchange_type(kind: &str) -> Result<String, String> {
    if matches!(kind, "direct" | "fanout" | "topic" | "headers") || kind.starts_with("x-") {
        Ok(kind.to_string())
    } else {
        Err("must be direct, fanout, topic, headers or a plugin type starting with x-".into())
    }
}

fn socket_addr(addr: &str) -> Result<SocketAddr, String> {
    addr.parse()
        .map_err(|_| "must be an address and port such as 0.0.0.0:9780".to_string())
}

fn tracing_filter(filter: &str) -> Result<String, String> {
    tracing_subscriber::EnvFilter::builder()
        .parse(filter)
        .map(|_| filter.to_string())
        .map_err(|e| format!("is not a tracing filter: {e}"))
}

impl Config {
    pub fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.poll_ms)
    }

    pub fn confirm_timeout(&self) -> Duration {
        Duration::from_millis(self.confirm_timeout_ms)
    }

    /// How long a sweep's transaction may sit idle between two statements
    /// before the server ends it (`idle_in_transaction_session_timeout`,
    /// set in the claim): twice `confirm_timeout_ms` plus 5 s. The longest
    /// pause a sweep makes while holding its claim is a wait for confirms
    /// (each within `confirm_timeout_ms`; every step of them sends a mark),
    /// after a channel is opened; a relay cut off from the server loses its
    /// claims within this bound, and another replica takes the tenants.
    pub fn claim_idle_timeout(&self) -> Duration {
        self.confirm_timeout()
            .saturating_mul(2)
            .saturating_add(CLAIM_IDLE_MARGIN)
    }

    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }

    /// A configuration for tests and embedding: defaults, with the given tenants.
    pub fn with_tenants<I, S>(tenants: I) -> Config
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let list: Vec<Value> = tenants.into_iter().map(|t| Value::from(t.into())).collect();
        let mut flags = Dict::new();
        flags.insert("tenants".into(), Value::from(list));
        Sources {
            file: None,
            env: Vec::new(),
            flags,
        }
        .load()
        .map(|loaded| loaded.config)
        .unwrap_or_else(|e| panic!("invalid test configuration: {e}"))
    }
}

/// The tenants a relay relays: those it is configured for, or (`tenants =
/// "*"`) every tenant the poll finds with pending rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tenants {
    Listed(Vec<String>),
    Discovered,
}

impl Tenants {
    /// The configured tenants; none when they are discovered.
    pub fn listed(&self) -> &[String] {
        match self {
            Tenants::Listed(names) => names,
            Tenants::Discovered => &[],
        }
    }

    /// Whether every tenant with pending rows is relayed (`tenants = "*"`).
    pub fn discovers(&self) -> bool {
        *self == Tenants::Discovered
    }
}

impl<const N: usize> PartialEq<[&str; N]> for Tenants {
    fn eq(&self, other: &[&str; N]) -> bool {
        self.listed()
            .iter()
            .map(String::as_str)
            .eq(other.iter().copied())
            && !self.discovers()
    }
}

/// How the relay learns of new rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wakeup {
    /// While rows flow, watch the id sequence every few milliseconds and poll
    /// when it moves; once it stands still, LISTEN and ask writers for a
    /// notification (the wake-up lock), so an idle relay costs one poll per
    /// interval and a busy table takes no NOTIFY at every commit.
    Sequence,
    /// LISTEN on the trigger's channel and ask every insert to notify
    /// (the wake-up lock held for good); the poll still finds whatever no
    /// notification announced.
    Notify,
    /// The poll alone: no LISTEN connection.
    Poll,
}

impl Wakeup {
    fn as_str(self) -> &'static str {
        match self {
            Wakeup::Sequence => "sequence",
            Wakeup::Notify => "notify",
            Wakeup::Poll => "poll",
        }
    }

    fn parse(text: &str) -> Result<Wakeup, String> {
        match text {
            "sequence" => Ok(Wakeup::Sequence),
            "notify" => Ok(Wakeup::Notify),
            "poll" => Ok(Wakeup::Poll),
            _ => Err("must be sequence, notify or poll".into()),
        }
    }

    /// Whether the relay LISTENs (a wake-up connection of its own).
    pub fn listens(self) -> bool {
        self != Wakeup::Poll
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Json,
    Text,
    /// JSON when stdout is not a terminal, text when it is.
    Auto,
}

impl LogFormat {
    fn as_str(self) -> &'static str {
        match self {
            LogFormat::Json => "json",
            LogFormat::Text => "text",
            LogFormat::Auto => "auto",
        }
    }

    fn parse(text: &str) -> Result<LogFormat, String> {
        match text {
            "json" => Ok(LogFormat::Json),
            "text" => Ok(LogFormat::Text),
            "auto" => Ok(LogFormat::Auto),
            _ => Err("must be json, text or auto".into()),
        }
    }
}

/// Where a key's effective value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Default,
    File(PathBuf),
    Env(String),
    Flag(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => f.write_str("built-in default"),
            Origin::File(path) => write!(f, "config file {}", path.display()),
            Origin::Env(var) => write!(f, "environment variable {var}"),
            Origin::Flag(flag) => write!(f, "command-line flag {flag}"),
        }
    }
}

/// A configuration that cannot be used. Shown once, as one line; exit code 2.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConfigError {
    #[error("{key} = {value} ({origin}): {reason}")]
    Invalid {
        key: &'static str,
        value: String,
        origin: Origin,
        reason: String,
    },
    #[error("{key} is required: set it in the config file, as {var} or as {flag}")]
    Missing {
        key: &'static str,
        var: String,
        flag: String,
    },
    #[error("unknown key `{key}` in config file {}{}", path.display(), suggestion(key))]
    UnknownKey { key: String, path: PathBuf },
    #[error("config file {}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
}

fn suggestion(key: &str) -> String {
    KEYS.iter()
        .map(|k| (edit_distance(key, k), *k))
        .filter(|(d, _)| *d <= 3)
        .min()
        .map(|(_, k)| format!(" (did you mean `{k}`?)"))
        .unwrap_or_default()
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redact::redact_url;

    fn sources(
        file: Option<&str>,
        env: &[(&str, &str)],
        flags: &[(&str, Value)],
    ) -> (Sources, Option<tempfile_path::TempPath>) {
        let temp = file.map(tempfile_path::TempPath::with_contents);
        let sources = Sources {
            file: temp.as_ref().map(|t| t.path.clone()),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            flags: flags
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        };
        (sources, temp)
    }

    fn load(
        file: Option<&str>,
        env: &[(&str, &str)],
        flags: &[(&str, Value)],
    ) -> Result<Loaded, ConfigError> {
        let (s, _temp) = sources(file, env, flags);
        s.load()
    }

    fn error(file: Option<&str>, env: &[(&str, &str)]) -> String {
        load(file, env, &[])
            .expect_err("configuration should be refused")
            .to_string()
    }

    /// A file in the temp directory, removed when dropped.
    mod tempfile_path {
        use std::path::PathBuf;
        use std::sync::atomic::{AtomicUsize, Ordering};

        pub struct TempPath {
            pub path: PathBuf,
        }

        impl TempPath {
            pub fn with_contents(contents: &str) -> TempPath {
                static N: AtomicUsize = AtomicUsize::new(0);
                let path = std::env::temp_dir().join(format!(
                    "outbox-relay-config-{}-{}.toml",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::write(&path, contents).expect("write temp config");
                TempPath { path }
            }
        }

        impl Drop for TempPath {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }

    #[test]
    fn defaults_follow_the_design() {
        let c = load(None, &[("OUTBOX_TENANTS", "a,b")], &[])
            .unwrap()
            .config;
        assert_eq!(c.tenants, ["a", "b"]);
        assert_eq!(c.poll_ms, 200);
        assert_eq!(c.max_lag_ms, 60_000);
        assert_eq!(c.max_backoff_ms, 30_000);
        assert_eq!(c.batch_size, 256);
        assert_eq!(c.max_in_flight, 256);
        assert_eq!(c.concurrency, 4);
        assert_eq!(c.pool_size, 6);
        assert_eq!(c.database_url.to_string(), DEFAULT_DATABASE_URL);
        let amqp = &c.amqp_url.endpoints[0].uri;
        assert_eq!(
            (amqp.authority.host.as_str(), amqp.authority.port),
            ("127.0.0.1", 5672)
        );
        assert_eq!(
            (
                amqp.authority.userinfo.username.as_str(),
                amqp.authority.userinfo.password.as_str(),
                amqp.vhost.as_str()
            ),
            ("guest", "guest", "/")
        );
        assert_eq!(c.amqp_url.to_string(), redact_url(DEFAULT_AMQP_URL));
        assert_eq!(
            (c.schema.as_str(), c.table.as_str()),
            ("public", "outbox_message")
        );
        assert_eq!(
            (c.exchange.as_str(), c.exchange_type.as_str()),
            ("outbox", "topic")
        );
        assert!(c.declare_exchange);
        assert_eq!(c.routing_key.as_str(), "{tenant}.{kind}");
        assert_eq!(c.content_type, "application/json");
        assert_eq!(c.confirm_timeout_ms, 10_000);
        assert_eq!(c.max_payload_bytes, 16_777_216);
        assert_eq!(c.http_addr.to_string(), "0.0.0.0:9780");
        assert_eq!(c.shutdown_grace_ms, 20_000);
        assert!(!c.migrate);
        assert_eq!(c.log_format, LogFormat::Auto);
        assert_eq!(c.log, "info");
    }

    #[test]
    fn later_layers_win() {
        let file = "tenants = [\"f\"]\npoll_ms = 100\nbatch_size = 50\nconcurrency = 3\n";
        let loaded = load(
            Some(file),
            &[("OUTBOX_POLL_MS", "300"), ("OUTBOX_BATCH_SIZE", "60")],
            &[("batch_size", Value::from(70))],
        )
        .unwrap();
        let c = &loaded.config;
        assert_eq!(c.tenants, ["f"]);
        assert_eq!(c.poll_ms, 300);
        assert_eq!(c.batch_size, 70);
        assert_eq!(c.concurrency, 3);
        assert!(matches!(loaded.origins["tenants"], Origin::File(_)));
        assert_eq!(
            loaded.origins["poll_ms"],
            Origin::Env("OUTBOX_POLL_MS".into())
        );
        assert_eq!(
            loaded.origins["batch_size"],
            Origin::Flag("--batch-size".into())
        );
        assert!(!loaded.origins.contains_key("log"));
    }

    #[test]
    fn unprefixed_fallbacks_yield_to_prefixed_variables() {
        let only_fallback = load(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("DATABASE_URL", "postgres://u@db/x"),
                ("RUST_LOG", "debug"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(
            only_fallback.config.database_url.to_string(),
            "postgres://u@db:5432/x"
        );
        assert_eq!(only_fallback.config.log, "debug");
        assert_eq!(
            only_fallback.origins["database_url"],
            Origin::Env("DATABASE_URL".into())
        );
        let both = load(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("AMQP_URL", "amqp://a@h1/%2f"),
                ("OUTBOX_AMQP_URL", "amqp://b@h2/%2f"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(both.config.amqp_url.to_string(), "amqp://b:***@h2:5672/%2f");
    }

    #[test]
    fn unknown_environment_variables_are_reported_not_fatal() {
        let loaded = load(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_PORT", "tcp://10.0.0.1:80"),
                ("OUTBOX_SERVICE_HOST", "10.0.0.1"),
                ("OUTBOX_CONFIG", "/nowhere"),
                ("HOME", "/root"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(loaded.unknown_env, ["OUTBOX_PORT", "OUTBOX_SERVICE_HOST"]);
    }

    #[test]
    fn an_error_shows_a_value_escaped_and_cut_to_one_short_line() {
        let huge = "1\u{1b}[2J\n".repeat(1_000_000);
        let said = error(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_BATCH_SIZE", huge.as_str()),
            ],
        );
        assert!(said.len() < 1_000, "{} bytes", said.len());
        assert!(!said.chars().any(char::is_control), "{said}");
        assert!(
            said.contains("OUTBOX_BATCH_SIZE") && said.contains("whole number"),
            "{said}"
        );
        let key = error(Some(r#""batch\u001bsize" = 1"#), &[("OUTBOX_TENANTS", "a")]);
        assert!(key.contains("unknown key `batch\\u{1b}size`"), "{key}");
        assert!(!key.chars().any(char::is_control), "{key}");
    }

    #[test]
    fn tenants_are_required_non_empty_and_unique() {
        assert!(error(None, &[]).contains("tenants is required"));
        let empty = error(None, &[("OUTBOX_TENANTS", "a,,b")]);
        assert!(
            empty.contains("environment variable OUTBOX_TENANTS"),
            "{empty}"
        );
        assert!(empty.contains("must not be empty"), "{empty}");
        let dup = error(Some("tenants = [\"a\", \"b\", \"a\"]"), &[]);
        assert!(
            dup.contains("listed twice") && dup.contains("config file"),
            "{dup}"
        );
        assert!(error(Some("tenants = []"), &[]).contains("at least one tenant"));
    }

    #[test]
    fn a_star_discovers_tenants() {
        let from_env = load(None, &[("OUTBOX_TENANTS", "*")], &[]).unwrap();
        assert!(from_env.config.tenants.discovers());
        assert_eq!(from_env.config.max_tenants, 10_000);
        assert!(
            from_env
                .render()
                .contains("tenants = \"*\"  # environment variable")
        );
        let from_file = load(Some("tenants = \"*\"\nmax_tenants = 50"), &[], &[]).unwrap();
        assert!(from_file.config.tenants.discovers());
        assert_eq!(from_file.config.max_tenants, 50);
        assert!(
            load(Some("tenants = [\"*\"]"), &[], &[])
                .unwrap()
                .config
                .tenants
                .discovers()
        );
        let mixed = error(None, &[("OUTBOX_TENANTS", "a,*")]);
        assert!(mixed.contains("stands alone"), "{mixed}");
        let cap = error(
            None,
            &[("OUTBOX_TENANTS", "*"), ("OUTBOX_MAX_TENANTS", "0")],
        );
        assert!(cap.starts_with("max_tenants = 0"), "{cap}");
    }

    #[test]
    fn many_tenants_are_validated_in_linear_time() {
        let names = |n: usize| (0..n).map(|i| format!("tenant-{i:06}")).collect::<Vec<_>>();
        let time = |n: usize| {
            let list = names(n).join(",");
            let started = std::time::Instant::now();
            let loaded = load(None, &[("OUTBOX_TENANTS", list.as_str())], &[]).unwrap();
            assert_eq!(loaded.config.tenants.listed().len(), n);
            started.elapsed()
        };
        time(1_000);
        let (small, large) = (time(5_000), time(40_000));
        // 8 × the names: linear is ~8 × the time, quadratic ~64 ×.
        assert!(
            large < small * 24 + std::time::Duration::from_millis(50),
            "5,000 names: {small:?}; 40,000: {large:?}"
        );
    }

    #[test]
    fn tenant_names_that_could_never_be_published_are_refused() {
        let control = error(None, &[("OUTBOX_TENANTS", "a,b\nforged")]);
        assert!(control.contains("control character"), "{control}");
        let nul = error(Some("tenants = [\"a\\u0000b\"]"), &[]);
        assert!(nul.contains("control character"), "{nul}");
        let long = "t".repeat(260);
        let key = error(None, &[("OUTBOX_TENANTS", long.as_str())]);
        assert!(
            key.starts_with(
                "routing_key = \"{tenant}.{kind}\" (built-in default): makes every routing key"
            ),
            "{key}"
        );
        assert!(
            key.ends_with("shorten the tenant's name (tenants) or the template"),
            "{key}"
        );
        let fits = load(
            None,
            &[
                ("OUTBOX_TENANTS", long.as_str()),
                ("OUTBOX_ROUTING_KEY", "{kind}"),
            ],
            &[],
        );
        assert!(fits.is_ok(), "a template without {{tenant}} fits");
        let huge = "t".repeat(70_000);
        let header = error(
            None,
            &[
                ("OUTBOX_TENANTS", huge.as_str()),
                ("OUTBOX_ROUTING_KEY", "{kind}"),
            ],
        );
        assert!(header.contains("could never fit an AMQP frame"), "{header}");
    }

    #[test]
    fn the_byte_budget_holds_one_row_of_the_largest_payload() {
        let e = error(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_MAX_PAYLOAD_BYTES", "1048576"),
                ("OUTBOX_MAX_BYTES_IN_FLIGHT", "3000000"),
            ],
        );
        assert!(
            e.starts_with("max_bytes_in_flight = 3000000 (environment variable OUTBOX_MAX_BYTES_IN_FLIGHT): must hold one row"),
            "{e}"
        );
        let c = load(None, &[("OUTBOX_TENANTS", "a")], &[]).unwrap().config;
        assert_eq!(c.max_bytes_in_flight, 64 << 20);
        assert!(c.max_bytes_in_flight >= crate::budget::least_for(c.max_payload_bytes));
    }

    #[test]
    fn numbers_out_of_range_name_key_and_source() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "OUTBOX_POLL_MS",
                "0",
                "poll_ms = 0 (environment variable OUTBOX_POLL_MS): must be a whole number from 1 to 60000",
            ),
            ("OUTBOX_POLL_MS", "60001", "from 1 to 60000"),
            ("OUTBOX_BATCH_SIZE", "10001", "batch_size = 10001"),
            ("OUTBOX_CONCURRENCY", "0", "concurrency = 0"),
            ("OUTBOX_CONCURRENCY", "1025", "from 1 to 1024"),
            (
                "OUTBOX_MAX_LAG_MS",
                "-5",
                "max_lag_ms = -5 (environment variable OUTBOX_MAX_LAG_MS): must be a whole number of at least 1",
            ),
            (
                "OUTBOX_CONFIRM_TIMEOUT_MS",
                "soon",
                "confirm_timeout_ms = \"soon\"",
            ),
            (
                "OUTBOX_MAX_PAYLOAD_BYTES",
                "0",
                "max_payload_bytes = 0 (environment variable OUTBOX_MAX_PAYLOAD_BYTES)",
            ),
            ("OUTBOX_MAX_BACKOFF_MS", "0", "max_backoff_ms = 0"),
        ];
        for (var, value, expected) in cases {
            let e = error(None, &[("OUTBOX_TENANTS", "a"), (var, value)]);
            assert!(e.contains(expected), "{var}={value}: {e}");
        }
    }

    #[test]
    fn cross_key_rules() {
        let e = error(
            Some("tenants = [\"a\"]\nbatch_size = 10\nmax_in_flight = 11"),
            &[],
        );
        assert!(e.starts_with("max_in_flight = 11 (config file"), "{e}");
        assert!(e.contains("batch_size (10)"), "{e}");
        let e = error(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_CONCURRENCY", "8"),
                ("OUTBOX_POOL_SIZE", "8"),
            ],
        );
        assert!(
            e.starts_with("pool_size = 8 (environment variable OUTBOX_POOL_SIZE)"),
            "{e}"
        );
        let c = load(
            None,
            &[("OUTBOX_TENANTS", "a"), ("OUTBOX_BATCH_SIZE", "10")],
            &[],
        )
        .unwrap()
        .config;
        assert_eq!(c.max_in_flight, 10, "max_in_flight defaults to batch_size");
    }

    #[test]
    fn derived_settings_out_of_range_are_refused_naming_the_key() {
        let base = ("OUTBOX_TENANTS", "a");
        // The claim's idle_in_transaction_session_timeout is 2 × confirm + 5 s,
        // an int4 of ms for PostgreSQL.
        let e = error(None, &[base, ("OUTBOX_CONFIRM_TIMEOUT_MS", "1073739324")]);
        assert!(
            e.starts_with("confirm_timeout_ms = 1073739324 (environment variable OUTBOX_CONFIRM_TIMEOUT_MS): must be at most 1073739323")
                && e.contains("idle_in_transaction_session_timeout"),
            "{e}"
        );
        let c = load(
            None,
            &[base, ("OUTBOX_CONFIRM_TIMEOUT_MS", "1073739323")],
            &[],
        )
        .unwrap()
        .config;
        assert_eq!(c.claim_idle_timeout().as_millis(), i32::MAX as u128 - 1);
        // now() minus retention_ms must be a timestamp.
        let e = error(None, &[base, ("OUTBOX_RETENTION_MS", "300000000000000")]);
        assert!(
            e.starts_with("retention_ms = 300000000000000 (environment variable OUTBOX_RETENTION_MS): must be at most 3155760000000"),
            "{e}"
        );
        assert!(load(None, &[base, ("OUTBOX_RETENTION_MS", "3155760000000")], &[]).is_ok());
        let e = error(
            None,
            &[
                base,
                ("OUTBOX_AMQP_URL", "amqp://u:pa55@mq/%2f?frame_max=512"),
            ],
        );
        assert!(
            e.starts_with("amqp_url = (not shown") && e.contains("frame_max=512"),
            "{e}"
        );
    }

    #[test]
    fn an_exchange_the_broker_refuses_to_declare_is_refused() {
        let base = ("OUTBOX_TENANTS", "a");
        let e = error(None, &[base, ("OUTBOX_EXCHANGE", "")]);
        assert!(
            e.starts_with("declare_exchange = true (built-in default): exchange is \"\" (the default exchange)"),
            "{e}"
        );
        let c = load(
            None,
            &[
                base,
                ("OUTBOX_EXCHANGE", ""),
                ("OUTBOX_DECLARE_EXCHANGE", "false"),
            ],
            &[],
        )
        .unwrap()
        .config;
        assert!(
            c.exchange.is_empty() && !c.declare_exchange,
            "published to as it is"
        );
        let e = error(
            Some("tenants = [\"a\"]\nexchange = \"amq.orders\"\ndeclare_exchange = true"),
            &[],
        );
        assert!(
            e.starts_with("declare_exchange = true (config file") && e.contains("amq."),
            "{e}"
        );
        let e = error(None, &[base, ("OUTBOX_EXCHANGE", "amq.direct")]);
        assert!(
            e.contains("of type direct") && e.contains("exchange_type is topic"),
            "{e}"
        );
        assert!(load(None, &[base, ("OUTBOX_EXCHANGE", "amq.topic")], &[]).is_ok());
        assert!(
            load(
                None,
                &[
                    base,
                    ("OUTBOX_EXCHANGE", "amq.orders"),
                    ("OUTBOX_DECLARE_EXCHANGE", "0")
                ],
                &[]
            )
            .is_ok()
        );
    }

    #[test]
    fn unknown_file_keys_are_refused_with_a_suggestion() {
        let e = error(Some("tenants = [\"a\"]\npol_ms = 5"), &[]);
        assert!(e.starts_with("unknown key `pol_ms` in config file"), "{e}");
        assert!(e.contains("did you mean `poll_ms`"), "{e}");
        let e = error(Some("tenants = [\"a\"]\n[database]\nurl = \"x\""), &[]);
        assert!(e.contains("unknown key `database`"), "{e}");
    }

    #[test]
    fn unreadable_or_malformed_files_are_refused() {
        let missing = Sources {
            file: Some("/nonexistent/outbox.toml".into()),
            ..Sources::default()
        };
        let e = missing.load().unwrap_err().to_string();
        assert!(
            e.starts_with("config file /nonexistent/outbox.toml:"),
            "{e}"
        );
        let e = error(Some("tenants = [\"a\"\npoll_ms ="), &[]);
        assert!(e.starts_with("config file"), "{e}");
    }

    #[test]
    fn routing_key_placeholders_are_checked() {
        let e = error(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_ROUTING_KEY", "{tenant}.{kid}"),
            ],
        );
        assert!(
            e.starts_with("routing_key = {tenant}.{kid} (environment variable OUTBOX_ROUTING_KEY)"),
            "{e}"
        );
        assert!(e.contains("{kid}"), "{e}");
    }

    #[test]
    fn urls_in_errors_are_redacted() {
        let e = error(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_DATABASE_URL", "mysql://admin:hunter2@db/x"),
            ],
        );
        assert!(!e.contains("hunter2"), "{e}");
        assert!(e.contains("database_url"), "{e}");
        let e = error(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_AMQP_URL", "http://u:hunter2@mq/"),
            ],
        );
        assert!(!e.contains("hunter2") && e.contains("amqp_url"), "{e}");
    }

    #[test]
    fn other_values_are_checked() {
        let base = ("OUTBOX_TENANTS", "a");
        assert!(
            error(None, &[base, ("OUTBOX_LOG_FORMAT", "yaml")])
                .contains("must be json, text or auto")
        );
        assert!(error(None, &[base, ("OUTBOX_HTTP_ADDR", "9780")]).contains("http_addr"));
        assert!(error(None, &[base, ("OUTBOX_MIGRATE", "maybe")]).contains("true or false"));
        assert!(error(None, &[base, ("OUTBOX_EXCHANGE_TYPE", "fan")]).contains("exchange_type"));
        assert!(error(None, &[base, ("OUTBOX_LOG", "info,[[")]).contains("tracing filter"));
        assert!(error(None, &[base, ("OUTBOX_TABLE", "")]).contains("identifier"));
        let long = "t".repeat(56);
        let e = error(None, &[base, ("OUTBOX_TABLE", long.as_str())]);
        assert!(e.contains("1 to 55 bytes") && e.contains("_pending"), "{e}");
        let fits = "t".repeat(55);
        assert!(load(None, &[base, ("OUTBOX_TABLE", fits.as_str())], &[]).is_ok());
        let c = load(
            None,
            &[
                base,
                ("OUTBOX_MIGRATE", "true"),
                ("OUTBOX_LOG_FORMAT", "json"),
            ],
            &[],
        )
        .unwrap()
        .config;
        assert!(c.migrate);
        assert_eq!(c.log_format, LogFormat::Json);
    }

    #[test]
    fn rendering_redacts_secrets_and_names_origins() {
        let loaded = load(
            Some("tenants = [\"a\"]\namqp_url = \"amqp://user:s3cret@mq:5672/%2f\""),
            &[("OUTBOX_DATABASE_URL", "postgres://app:pa55@db/app")],
            &[],
        )
        .unwrap();
        let text = loaded.render();
        assert!(!text.contains("s3cret") && !text.contains("pa55"), "{text}");
        assert!(text.contains("database_url = \"postgres://app:***@db:5432/app\"  # environment variable OUTBOX_DATABASE_URL"), "{text}");
        assert!(text.contains("poll_ms = 200  # built-in default"), "{text}");
        assert_eq!(text.lines().count(), KEYS.len());
    }

    /// Passwords with every character that breaks a naive URL or key=value
    /// reading, in every shape a user may write: whatever the relay makes of
    /// it (a configuration, or an error), the password never shows.
    #[test]
    fn no_password_shape_ever_shows_in_any_output() {
        let core = "Zq9xW";
        let specials = [
            "", "#", "/", "?", "@", ":", " ", "'", "\"", "%", "&", "=", "\\", "#/?@", "a b c", ",",
            ",amqp://",
        ];
        let mut shapes: Vec<(&str, String)> = Vec::new();
        for special in specials {
            for password in [
                format!("{core}{special}"),
                format!("{special}{core}"),
                format!("{core}{special}{core}"),
            ] {
                for url in [
                    format!("postgres://app:{password}@db:5432/orders"),
                    format!("postgresql://app:{password}@db/orders?sslmode=require"),
                    format!("postgres://db/orders?user=app&password={password}"),
                ] {
                    shapes.push(("OUTBOX_DATABASE_URL", url));
                }
                let quoted = password.replace('\\', "\\\\").replace('\'', "\\'");
                for dsn in [
                    format!("host=db user=app password={password} dbname=orders"),
                    format!("host=db user=app password = {password} dbname=orders"),
                    format!("host=db password='{quoted}' dbname=orders"),
                    format!("host=db password = '{quoted}'"),
                ] {
                    shapes.push(("OUTBOX_DATABASE_URL", dsn));
                }
                for url in [
                    format!("amqp://app:{password}@mq:5672/%2f"),
                    format!("amqps://app:{password}@mq/vh"),
                    format!("amqp://app:{password}@mq-0/%2f,amqp://app:{password}@mq-1/%2f"),
                    format!("amqp://mq-0/%2f, amqp://app:{password}@mq-1:port/%2f"),
                ] {
                    shapes.push(("OUTBOX_AMQP_URL", url));
                }
            }
        }
        assert!(shapes.len() > 300);
        for (var, value) in &shapes {
            let shown = match load(None, &[("OUTBOX_TENANTS", "a"), (var, value.as_str())], &[]) {
                Ok(loaded) => format!(
                    "{}\n{:?}\n{} {:?} {} {:?}",
                    loaded.render(),
                    loaded.config,
                    loaded.config.database_url,
                    loaded.config.database_url,
                    loaded.config.amqp_url,
                    loaded.config.amqp_url
                ),
                Err(error) => format!("{error}\n{error:?}"),
            };
            assert!(
                !shown.contains(core),
                "{var}={value:?} shows its password:\n{shown}"
            );
        }
    }

    #[test]
    fn a_toml_error_on_the_passwords_line_does_not_quote_it() {
        let e = error(
            Some("tenants = [\"a\"]\ndatabase_url = \"postgres://app:Zq9xW@db/x\" oops\n"),
            &[],
        );
        assert!(!e.contains("Zq9xW"), "{e}");
        assert!(e.contains("not valid TOML at line 2"), "{e}");
    }

    #[test]
    fn key_value_passwords_are_read_as_libpq_reads_them() {
        let c = load(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                (
                    "OUTBOX_DATABASE_URL",
                    "host=db user=app password = 'two words' dbname=x",
                ),
            ],
            &[],
        )
        .unwrap()
        .config;
        assert_eq!(
            c.database_url.config.get_password(),
            Some(&b"two words"[..])
        );
        assert_eq!(c.database_url.config.get_dbname(), Some("x"));
    }

    #[test]
    fn wakeup_is_notify_or_poll() {
        let base = ("OUTBOX_TENANTS", "a");
        let c = load(None, &[base], &[]).unwrap().config;
        assert_eq!(c.wakeup, Wakeup::Sequence, "sequence by default");
        let c = load(None, &[base, ("OUTBOX_WAKEUP", "poll")], &[])
            .unwrap()
            .config;
        assert_eq!(c.wakeup, Wakeup::Poll);
        let e = error(None, &[base, ("OUTBOX_WAKEUP", "listen")]);
        assert!(
            e.contains("wakeup") && e.contains("OUTBOX_WAKEUP") && e.contains("notify or poll"),
            "{e}"
        );
        let e = error(Some("tenants = [\"a\"]\nwakeup = \"Notify\""), &[]);
        assert!(e.contains("wakeup") && e.contains("config file"), "{e}");
    }

    #[test]
    fn listen_database_url_defaults_to_database_url_and_is_redacted() {
        let loaded = load(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("DATABASE_URL", "postgres://app:pa55@bouncer:6432/app"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(
            loaded.config.listen_database_url.to_string(),
            loaded.config.database_url.to_string(),
            "the pool's target unless set"
        );
        assert!(
            loaded
                .render()
                .contains("6432/app\"  # unset: database_url's\n"),
            "{}",
            loaded.render()
        );
        let loaded = load(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("DATABASE_URL", "postgres://app:pa55@bouncer:6432/app"),
                (
                    "OUTBOX_LISTEN_DATABASE_URL",
                    "postgres://app:s3cret@db:5432/app?sslmode=disable",
                ),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(
            loaded.config.listen_database_url.config.get_hosts(),
            [tokio_postgres::config::Host::Tcp("db".into())]
        );
        let text = loaded.render();
        assert!(!text.contains("s3cret") && !text.contains("pa55"), "{text}");
        assert!(
            text.contains("listen_database_url = \"postgres://app:***@db:5432/app")
                && text.contains("environment variable OUTBOX_LISTEN_DATABASE_URL"),
            "{text}"
        );
        let e = error(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_LISTEN_DATABASE_URL", "postgres://app:s3cret@/app"),
            ],
        );
        assert!(
            e.contains("listen_database_url") && !e.contains("s3cret"),
            "{e}"
        );
        // Only the prefixed variable: an unprefixed LISTEN_DATABASE_URL is no one's.
        let c = load(
            None,
            &[
                ("OUTBOX_TENANTS", "a"),
                ("LISTEN_DATABASE_URL", "postgres://other@elsewhere/x"),
            ],
            &[],
        )
        .unwrap()
        .config;
        assert_eq!(
            c.listen_database_url.to_string(),
            DEFAULT_DATABASE_URL,
            "only OUTBOX_LISTEN_DATABASE_URL sets it"
        );
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("poll_ms", "poll_ms"), 0);
        assert_eq!(edit_distance("pol_ms", "poll_ms"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
