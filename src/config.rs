//! Configuration: the layers (built-in defaults → TOML file → environment →
//! command-line flags, later wins), merged with figment, then validated into a
//! [`Config`] in one pass before anything is connected.
//!
//! Every key remembers which layer gave it its value, so an error names the key,
//! where it came from and what is allowed, e.g.
//! `poll_ms = 0 (environment variable OUTBOX_POLL_MS): must be from 1 to 60000`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Format, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};

use crate::redact::redact_url;
use crate::template::RoutingKey;

/// The prefix of every configuration variable.
pub const ENV_PREFIX: &str = "OUTBOX_";

/// The variable that names the configuration file when `--config` is absent.
pub const CONFIG_FILE_VAR: &str = "OUTBOX_CONFIG";

/// Every configuration key, in the order `check-config` prints them.
pub const KEYS: &[&str] = &[
    "tenants",
    "poll_ms",
    "max_lag_ms",
    "max_backoff_ms",
    "batch_size",
    "max_in_flight",
    "concurrency",
    "database_url",
    "pool_size",
    "schema",
    "table",
    "amqp_url",
    "exchange",
    "exchange_type",
    "declare_exchange",
    "routing_key",
    "content_type",
    "confirm_timeout_ms",
    "max_payload_bytes",
    "http_addr",
    "shutdown_grace_ms",
    "migrate",
    "log_format",
    "log",
];

/// Unprefixed variables honoured when the `OUTBOX_` one is not set.
const ENV_FALLBACKS: &[(&str, &str)] = &[
    ("database_url", "DATABASE_URL"),
    ("amqp_url", "AMQP_URL"),
    ("log", "RUST_LOG"),
];

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The validated configuration of one relay process.
#[derive(Debug, Clone)]
pub struct Config {
    pub tenants: Vec<String>,
    pub poll_ms: u64,
    pub max_lag_ms: u64,
    pub max_backoff_ms: u64,
    pub batch_size: usize,
    pub max_in_flight: usize,
    pub concurrency: usize,
    pub database_url: String,
    pub pool_size: usize,
    pub schema: String,
    pub table: String,
    pub amqp_url: String,
    pub exchange: String,
    pub exchange_type: String,
    pub declare_exchange: bool,
    pub routing_key: RoutingKey,
    pub content_type: String,
    pub confirm_timeout_ms: u64,
    pub max_payload_bytes: usize,
    pub http_addr: SocketAddr,
    pub shutdown_grace_ms: u64,
    pub migrate: bool,
    pub log_format: LogFormat,
    pub log: String,
}

impl Config {
    pub fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.poll_ms)
    }

    pub fn confirm_timeout(&self) -> Duration {
        Duration::from_millis(self.confirm_timeout_ms)
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
    #[error("{key} is required: set it in the config file, as {var} or as --{flag}")]
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

/// The raw inputs of every layer but the defaults.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// `--config PATH` or `OUTBOX_CONFIG`.
    pub file: Option<PathBuf>,
    /// The process environment (all of it; only relevant names are read).
    pub env: Vec<(String, String)>,
    /// Values given as command-line flags, by key.
    pub flags: Dict,
}

/// A loaded configuration with where each value came from.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub origins: BTreeMap<&'static str, Origin>,
    /// `OUTBOX_*` variables that name no key: ignored, warned about once.
    pub unknown_env: Vec<String>,
}

impl Loaded {
    /// The effective configuration as TOML, secrets redacted, each line with its origin.
    pub fn render(&self) -> String {
        let c = &self.config;
        let quote = |s: &str| serde_json::to_string(s).unwrap_or_default();
        let mut out = String::new();
        for key in KEYS {
            let value = match *key {
                "tenants" => {
                    let list: Vec<String> = c.tenants.iter().map(|t| quote(t)).collect();
                    format!("[{}]", list.join(", "))
                }
                "poll_ms" => c.poll_ms.to_string(),
                "max_lag_ms" => c.max_lag_ms.to_string(),
                "max_backoff_ms" => c.max_backoff_ms.to_string(),
                "batch_size" => c.batch_size.to_string(),
                "max_in_flight" => c.max_in_flight.to_string(),
                "concurrency" => c.concurrency.to_string(),
                "database_url" => quote(&redact_url(&c.database_url)),
                "pool_size" => c.pool_size.to_string(),
                "schema" => quote(&c.schema),
                "table" => quote(&c.table),
                "amqp_url" => quote(&redact_url(&c.amqp_url)),
                "exchange" => quote(&c.exchange),
                "exchange_type" => quote(&c.exchange_type),
                "declare_exchange" => c.declare_exchange.to_string(),
                "routing_key" => quote(c.routing_key.as_str()),
                "content_type" => quote(&c.content_type),
                "confirm_timeout_ms" => c.confirm_timeout_ms.to_string(),
                "max_payload_bytes" => c.max_payload_bytes.to_string(),
                "http_addr" => quote(&c.http_addr.to_string()),
                "shutdown_grace_ms" => c.shutdown_grace_ms.to_string(),
                "migrate" => c.migrate.to_string(),
                "log_format" => quote(c.log_format.as_str()),
                "log" => quote(&c.log),
                other => unreachable!("key {other} has no rendering"),
            };
            let origin = self.origins.get(key).cloned().unwrap_or(Origin::Default);
            out.push_str(&format!("{key} = {value}  # {origin}\n"));
        }
        out
    }
}

/// The variable that sets `key`.
pub fn env_var(key: &str) -> String {
    format!("{ENV_PREFIX}{}", key.to_ascii_uppercase())
}

/// The flag that sets `key`.
pub fn flag_name(key: &str) -> String {
    format!("--{}", key.replace('_', "-"))
}

/// A figment layer with a fixed name: the environment or the command line.
struct Layer {
    name: &'static str,
    dict: Dict,
}

impl Provider for Layer {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name)
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.dict.clone()))
    }
}

impl Sources {
    /// Reads the process environment.
    pub fn from_process(file: Option<PathBuf>, flags: Dict) -> Sources {
        Sources {
            file,
            env: std::env::vars().collect(),
            flags,
        }
    }

    fn env_value(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Merges the layers and validates the result.
    pub fn load(&self) -> Result<Loaded, ConfigError> {
        let mut origins: BTreeMap<&'static str, Origin> = BTreeMap::new();
        let mut figment = Figment::new();

        if let Some(path) = &self.file {
            let file_dict = read_file(path)?;
            for key in file_dict.keys() {
                let known = KEYS.iter().find(|k| **k == key.as_str()).ok_or_else(|| {
                    ConfigError::UnknownKey {
                        key: key.clone(),
                        path: path.clone(),
                    }
                })?;
                origins.insert(known, Origin::File(path.clone()));
            }
            figment = figment.merge(Layer {
                name: "config file",
                dict: file_dict,
            });
        }

        let mut env = Dict::new();
        for key in KEYS {
            let var = env_var(key);
            let fallback = ENV_FALLBACKS
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| *v);
            let found = self
                .env_value(&var)
                .map(|v| (var.clone(), v))
                .or_else(|| fallback.and_then(|f| self.env_value(f).map(|v| (f.to_string(), v))));
            if let Some((name, raw)) = found {
                let value = if *key == "tenants" {
                    Value::from(
                        raw.split(',')
                            .map(|t| Value::from(t.trim().to_string()))
                            .collect::<Vec<_>>(),
                    )
                } else {
                    Value::from(raw.to_string())
                };
                env.insert((*key).into(), value);
                origins.insert(key, Origin::Env(name));
            }
        }
        figment = figment.merge(Layer {
            name: "environment",
            dict: env,
        });

        for key in self.flags.keys() {
            if let Some(known) = KEYS.iter().find(|k| **k == key.as_str()) {
                origins.insert(known, Origin::Flag(flag_name(key)));
            }
        }
        figment = figment.merge(Layer {
            name: "command line",
            dict: self.flags.clone(),
        });

        let unknown_env = self
            .env
            .iter()
            .filter_map(|(name, _)| {
                let key = name.strip_prefix(ENV_PREFIX)?;
                let known =
                    name == CONFIG_FILE_VAR || KEYS.iter().any(|k| k.eq_ignore_ascii_case(key));
                (!known).then(|| name.clone())
            })
            .collect();

        let config = Validator {
            figment: &figment,
            origins: &origins,
        }
        .validate()?;
        Ok(Loaded {
            config,
            origins,
            unknown_env,
        })
    }
}

fn read_file(path: &Path) -> Result<Dict, ConfigError> {
    let file_error = |reason: String| ConfigError::File {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
    let data = Toml::string(&text)
        .data()
        .map_err(|e| file_error(e.kind.to_string()))?;
    Ok(data.into_values().next().unwrap_or_default())
}

/// Typed reads of the merged layers, each error tied to its key and origin.
struct Validator<'a> {
    figment: &'a Figment,
    origins: &'a BTreeMap<&'static str, Origin>,
}

impl Validator<'_> {
    fn origin(&self, key: &str) -> Origin {
        self.origins.get(key).cloned().unwrap_or(Origin::Default)
    }

    fn invalid(
        &self,
        key: &'static str,
        value: impl fmt::Display,
        reason: impl Into<String>,
    ) -> ConfigError {
        let mut value = value.to_string();
        if key.ends_with("_url") {
            value = redact_url(&value);
        }
        ConfigError::Invalid {
            key,
            value,
            origin: self.origin(key),
            reason: reason.into(),
        }
    }

    fn raw(&self, key: &str) -> Option<Value> {
        self.figment.find_value(key).ok()
    }

    fn string(&self, key: &'static str, default: &str) -> Result<String, ConfigError> {
        match self.raw(key) {
            None => Ok(default.to_string()),
            Some(Value::String(_, s)) => Ok(s),
            Some(Value::Num(_, n)) => Ok(num_text(n)),
            Some(Value::Bool(_, b)) => Ok(b.to_string()),
            Some(other) => Err(self.invalid(key, value_text(&other), "must be a string")),
        }
    }

    fn int(&self, key: &'static str, default: i64, min: i64, max: i64) -> Result<i64, ConfigError> {
        let allowed = if max == i64::MAX {
            format!("must be a whole number of at least {min}")
        } else {
            format!("must be a whole number from {min} to {max}")
        };
        let value = match self.raw(key) {
            None => return Ok(default),
            Some(Value::Num(_, n)) => n.to_i128().and_then(|n| i64::try_from(n).ok()),
            Some(Value::String(_, s)) => s.trim().parse::<i64>().ok(),
            Some(_) => None,
        };
        let raw = match self.raw(key) {
            Some(Value::String(_, s)) if s.trim().parse::<i128>().is_ok() => s.trim().to_string(),
            Some(v) => value_text(&v),
            None => String::new(),
        };
        match value {
            Some(n) if (min..=max).contains(&n) => Ok(n),
            _ => Err(self.invalid(key, raw, allowed)),
        }
    }

    fn optional_int(
        &self,
        key: &'static str,
        min: i64,
        max: i64,
    ) -> Result<Option<i64>, ConfigError> {
        match self.raw(key) {
            None => Ok(None),
            Some(_) => self.int(key, 0, min, max).map(Some),
        }
    }

    fn boolean(&self, key: &'static str, default: bool) -> Result<bool, ConfigError> {
        match self.raw(key) {
            None => Ok(default),
            Some(Value::Bool(_, b)) => Ok(b),
            Some(Value::String(_, s)) => match s.trim().to_ascii_lowercase().as_str() {
                "true" | "1" => Ok(true),
                "false" | "0" => Ok(false),
                _ => Err(self.invalid(key, s, "must be true or false")),
            },
            Some(other) => Err(self.invalid(key, value_text(&other), "must be true or false")),
        }
    }

    fn tenants(&self) -> Result<Vec<String>, ConfigError> {
        let key = "tenants";
        let list = match self.raw(key) {
            None => {
                return Err(ConfigError::Missing {
                    key,
                    var: env_var(key),
                    flag: flag_name(key),
                });
            }
            Some(Value::Array(_, items)) => items,
            Some(Value::String(_, s)) => s
                .split(',')
                .map(|t| Value::from(t.trim().to_string()))
                .collect(),
            Some(other) => {
                return Err(self.invalid(
                    key,
                    value_text(&other),
                    "must be a list of tenant names",
                ));
            }
        };
        let shown = || {
            let names: Vec<String> = list.iter().map(value_text).collect();
            format!("[{}]", names.join(", "))
        };
        let mut tenants: Vec<String> = Vec::with_capacity(list.len());
        for item in &list {
            let Value::String(_, name) = item else {
                return Err(self.invalid(key, shown(), "every tenant must be a string"));
            };
            if name.trim().is_empty() {
                return Err(self.invalid(key, shown(), "tenant names must not be empty"));
            }
            if tenants.contains(name) {
                return Err(self.invalid(
                    key,
                    shown(),
                    format!("tenant \"{name}\" is listed twice"),
                ));
            }
            tenants.push(name.clone());
        }
        if tenants.is_empty() {
            return Err(self.invalid(key, shown(), "at least one tenant is required"));
        }
        Ok(tenants)
    }

    fn identifier(&self, key: &'static str, default: &str) -> Result<String, ConfigError> {
        let name = self.string(key, default)?;
        if name.is_empty() || name.len() > 63 || name.contains('\0') {
            return Err(self.invalid(
                key,
                format!("\"{name}\""),
                "must be a PostgreSQL identifier of 1 to 63 bytes",
            ));
        }
        Ok(name)
    }

    fn validate(&self) -> Result<Config, ConfigError> {
        let tenants = self.tenants()?;
        let poll_ms = self.int("poll_ms", 200, 1, 60_000)?;
        let max_lag_ms = self.int("max_lag_ms", 60_000, 1, i64::MAX)?;
        let max_backoff_ms = self.int("max_backoff_ms", 30_000, 1, i64::MAX)?;
        let batch_size = self.int("batch_size", 256, 1, 10_000)?;
        let max_in_flight = self.int("max_in_flight", batch_size, 1, 10_000)?;
        if max_in_flight > batch_size {
            return Err(self.invalid(
                "max_in_flight",
                max_in_flight,
                format!("must be from 1 to batch_size ({batch_size})"),
            ));
        }
        let concurrency = self.int("concurrency", 4, 1, 1024)?;
        let pool_size = match self.optional_int("pool_size", 1, 10_000)? {
            Some(n) if n <= concurrency => {
                return Err(self.invalid(
                    "pool_size",
                    n,
                    format!(
                        "must be greater than concurrency ({concurrency}): sweeps hold one connection each and the poll and /healthz need one more"
                    ),
                ));
            }
            Some(n) => n,
            None => concurrency + 2,
        };

        let database_url = self.string("database_url", DEFAULT_DATABASE_URL)?;
        if let Err(reason) = crate::store::parse_database_url(&database_url) {
            return Err(self.invalid("database_url", &database_url, reason));
        }
        let amqp_url = self.string("amqp_url", DEFAULT_AMQP_URL)?;
        if let Err(reason) = crate::publisher::parse_amqp_url(&amqp_url) {
            return Err(self.invalid("amqp_url", &amqp_url, reason));
        }

        let schema = self.identifier("schema", "public")?;
        let table = self.identifier("table", "outbox_message")?;

        let exchange = self.string("exchange", "outbox")?;
        if exchange.len() > 255 {
            return Err(self.invalid("exchange", &exchange, "must be at most 255 bytes"));
        }
        let exchange_type = self.string("exchange_type", "topic")?;
        if !matches!(
            exchange_type.as_str(),
            "direct" | "fanout" | "topic" | "headers"
        ) && !exchange_type.starts_with("x-")
        {
            return Err(self.invalid(
                "exchange_type",
                &exchange_type,
                "must be direct, fanout, topic, headers or a plugin type starting with x-",
            ));
        }
        let declare_exchange = self.boolean("declare_exchange", true)?;
        let template = self.string("routing_key", "{tenant}.{kind}")?;
        let routing_key = RoutingKey::parse(&template)
            .map_err(|e| self.invalid("routing_key", &template, e.to_string()))?;
        let content_type = self.string("content_type", "application/json")?;
        if content_type.len() > 255 {
            return Err(self.invalid("content_type", &content_type, "must be at most 255 bytes"));
        }
        let confirm_timeout_ms = self.int("confirm_timeout_ms", 10_000, 1, i64::MAX)?;
        let max_payload_bytes =
            self.int("max_payload_bytes", 16_777_216, 1, i64::from(u32::MAX))?;
        let addr = self.string("http_addr", "0.0.0.0:9780")?;
        let http_addr = addr.parse::<SocketAddr>().map_err(|_| {
            self.invalid(
                "http_addr",
                &addr,
                "must be an address and port such as 0.0.0.0:9780",
            )
        })?;
        let shutdown_grace_ms = self.int("shutdown_grace_ms", 20_000, 0, i64::MAX)?;
        let migrate = self.boolean("migrate", false)?;
        let format = self.string("log_format", "auto")?;
        let log_format = match format.as_str() {
            "json" => LogFormat::Json,
            "text" => LogFormat::Text,
            "auto" => LogFormat::Auto,
            _ => return Err(self.invalid("log_format", &format, "must be json, text or auto")),
        };
        let log = self.string("log", "info")?;
        if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&log) {
            return Err(self.invalid("log", &log, format!("is not a tracing filter: {e}")));
        }

        // Every number was range-checked above, so the conversions cannot fail.
        let size = |n: i64| usize::try_from(n).unwrap_or(usize::MAX);
        let ms = |n: i64| u64::try_from(n).unwrap_or(u64::MAX);
        Ok(Config {
            tenants,
            poll_ms: ms(poll_ms),
            max_lag_ms: ms(max_lag_ms),
            max_backoff_ms: ms(max_backoff_ms),
            batch_size: size(batch_size),
            max_in_flight: size(max_in_flight),
            concurrency: size(concurrency),
            database_url,
            pool_size: size(pool_size),
            schema,
            table,
            amqp_url,
            exchange,
            exchange_type,
            declare_exchange,
            routing_key,
            content_type,
            confirm_timeout_ms: ms(confirm_timeout_ms),
            max_payload_bytes: size(max_payload_bytes),
            http_addr,
            shutdown_grace_ms: ms(shutdown_grace_ms),
            migrate,
            log_format,
            log,
        })
    }
}

fn num_text(n: figment::value::Num) -> String {
    match n.to_i128() {
        Some(i) => i.to_string(),
        None => n.to_f64().map(|f| f.to_string()).unwrap_or_default(),
    }
}

fn value_text(value: &Value) -> String {
    match value {
        Value::String(_, s) => format!("\"{s}\""),
        Value::Num(_, n) => num_text(*n),
        Value::Bool(_, b) => b.to_string(),
        Value::Array(_, items) => {
            let items: Vec<String> = items.iter().map(value_text).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Dict(..) => "a table".to_string(),
        Value::Char(_, c) => format!("'{c}'"),
        Value::Empty(..) => "nothing".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(c.database_url, DEFAULT_DATABASE_URL);
        assert_eq!(c.amqp_url, DEFAULT_AMQP_URL);
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
        assert_eq!(only_fallback.config.database_url, "postgres://u@db/x");
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
        assert_eq!(both.config.amqp_url, "amqp://b@h2/%2f");
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
        assert!(text.contains("database_url = \"postgres://app:***@db/app\"  # environment variable OUTBOX_DATABASE_URL"), "{text}");
        assert!(text.contains("poll_ms = 200  # built-in default"), "{text}");
        assert_eq!(text.lines().count(), KEYS.len());
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("poll_ms", "poll_ms"), 0);
        assert_eq!(edit_distance("pol_ms", "poll_ms"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
