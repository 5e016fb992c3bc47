//! How one key's raw value (a TOML value, or the text of a variable or flag)
//! becomes its typed value, and how a typed value is shown by `check-config`.
//! The key table in `config.rs` names one [`Rule`] per key; the `keys!` macro
//! turns the table into the struct, the flags, the reading and the rendering.

use std::net::SocketAddr;

use figment::value::Value;

use super::target::{AmqpTarget, DatabaseTarget};
use super::{LogFormat, Tenants, Wakeup};
use crate::template::{MessageIdTemplate, RoutingKey};

/// Why a value was refused: what to show of it and what is allowed.
#[derive(Debug)]
pub struct Rejected {
    pub shown: String,
    pub reason: String,
}

/// A key's value when no layer sets it.
pub enum Fallback<T> {
    Value(T),
    /// The key must be set.
    Required,
}

impl<T> From<T> for Fallback<T> {
    fn from(value: T) -> Fallback<T> {
        Fallback::Value(value)
    }
}

/// Reads a key's raw value into its type.
pub trait Rule<T> {
    fn read(&self, raw: &Value) -> Result<T, Rejected>;
}

/// A whole number in `min..=max`.
pub struct Int {
    min: i64,
    max: i64,
}

pub fn int(min: i64, max: i64) -> Int {
    Int { min, max }
}

impl<T: TryFrom<i64>> Rule<T> for Int {
    fn read(&self, raw: &Value) -> Result<T, Rejected> {
        let value = match raw {
            Value::Num(_, n) => n.to_i128().and_then(|n| i64::try_from(n).ok()),
            Value::String(_, s) => s.trim().parse::<i64>().ok(),
            _ => None,
        };
        let shown = match raw {
            Value::String(_, s) if s.trim().parse::<i128>().is_ok() => s.trim().to_string(),
            other => value_text(other),
        };
        let reason = if self.max == i64::MAX {
            format!("must be a whole number of at least {}", self.min)
        } else {
            format!("must be a whole number from {} to {}", self.min, self.max)
        };
        value
            .filter(|n| (self.min..=self.max).contains(n))
            .and_then(|n| T::try_from(n).ok())
            .ok_or(Rejected { shown, reason })
    }
}

/// `true` or `false` (also `1` or `0`).
pub struct Flag;

impl Rule<bool> for Flag {
    fn read(&self, raw: &Value) -> Result<bool, Rejected> {
        let refuse = |shown: String| Rejected {
            shown,
            reason: "must be true or false".into(),
        };
        match raw {
            Value::Bool(_, b) => Ok(*b),
            Value::String(_, s) => match s.trim().to_ascii_lowercase().as_str() {
                "true" | "1" => Ok(true),
                "false" | "0" => Ok(false),
                _ => Err(refuse(s.clone())),
            },
            other => Err(refuse(value_text(other))),
        }
    }
}

/// Text, parsed by a function that says why it refuses.
pub struct Parse<F>(pub F);

/// A parsing function: the value, or why it is refused.
type ParseFn<T> = fn(&str) -> Result<T, String>;

/// Any text.
pub fn text() -> Parse<ParseFn<String>> {
    Parse(|s| Ok(s.to_string()))
}

/// Text of at most 255 bytes: an AMQP short string.
pub fn short_text() -> Parse<ParseFn<String>> {
    Parse(|s| {
        if s.len() > 255 {
            Err("must be at most 255 bytes".into())
        } else {
            Ok(s.to_string())
        }
    })
}

/// A type's own `FromStr`, its error as the reason.
pub fn parsed<T: std::str::FromStr<Err: ToString>>() -> Parse<ParseFn<T>> {
    Parse(|s| s.parse::<T>().map_err(|e| e.to_string()))
}

impl<T, F: Fn(&str) -> Result<T, String>> Rule<T> for Parse<F> {
    fn read(&self, raw: &Value) -> Result<T, Rejected> {
        let text = match raw {
            Value::String(_, s) => s.clone(),
            Value::Num(_, n) => num_text(*n),
            Value::Bool(_, b) => b.to_string(),
            other => {
                return Err(Rejected {
                    shown: value_text(other),
                    reason: "must be a string".into(),
                });
            }
        };
        (self.0)(&text).map_err(|reason| Rejected {
            shown: text,
            reason,
        })
    }
}

/// A PostgreSQL identifier: 1 to `max` bytes (63 for PostgreSQL's own
/// limit, less for a name the relay derives others from), no NUL.
pub struct Identifier {
    pub max: usize,
    /// Why the limit is lower than PostgreSQL's, if it is.
    pub because: &'static str,
}

/// A schema's name.
pub const SCHEMA_NAME: Identifier = Identifier {
    max: 63,
    because: "",
};

/// A table's name: its partial index is named `<table>_pending`, which must
/// fit PostgreSQL's 63 bytes too (a longer one is cut, and the relay would
/// not find its index).
pub const TABLE_NAME: Identifier = Identifier {
    max: 63 - "_pending".len(),
    because: " (its partial index is named <table>_pending, within PostgreSQL's 63)",
};

impl Rule<String> for Identifier {
    fn read(&self, raw: &Value) -> Result<String, Rejected> {
        let name = text().read(raw)?;
        if name.is_empty() || name.len() > self.max || name.contains('\0') {
            return Err(Rejected {
                shown: format!("\"{name}\""),
                reason: format!(
                    "must be a PostgreSQL identifier of 1 to {} bytes{}",
                    self.max, self.because
                ),
            });
        }
        Ok(name)
    }
}

/// The longest tenant name: it goes out in every message's
/// `outbox-tenant-id` header, which must fit one AMQP frame with the rest.
pub const MAX_TENANT_BYTES: usize = 65_536;

/// What `tenants` is set to for discovered tenants.
pub const DISCOVER: &str = "*";

/// A list of tenant names: a TOML array, or comma-separated text (a variable
/// or a flag). Non-empty names without control characters, each once, at
/// least one. `"*"` alone (a string, or the only item): discovered tenants.
/// Linear in the number of names (one hash set).
pub struct TenantList;

impl Rule<Tenants> for TenantList {
    fn read(&self, raw: &Value) -> Result<Tenants, Rejected> {
        let star = |v: &Value| matches!(v, Value::String(_, s) if s.trim() == DISCOVER);
        match raw {
            Value::Array(_, items) if items.len() == 1 && star(&items[0]) => {
                return Ok(Tenants::Discovered);
            }
            raw if star(raw) => return Ok(Tenants::Discovered),
            _ => {}
        }
        let list: Vec<Value> = match raw {
            Value::Array(_, items) => items.clone(),
            Value::String(_, s) => s
                .split(',')
                .map(|t| Value::from(t.trim().to_string()))
                .collect(),
            other => {
                return Err(Rejected {
                    shown: value_text(other),
                    reason: "must be a list of tenant names".into(),
                });
            }
        };
        let refuse = |reason: String| Rejected {
            shown: value_text(&Value::from(list.clone())),
            reason,
        };
        let mut tenants: Vec<String> = Vec::with_capacity(list.len());
        let mut seen = std::collections::HashSet::with_capacity(list.len());
        for item in &list {
            let Value::String(_, name) = item else {
                return Err(refuse("every tenant must be a string".into()));
            };
            if name.trim().is_empty() {
                return Err(refuse("tenant names must not be empty".into()));
            }
            if name.chars().any(char::is_control) {
                return Err(refuse(format!(
                    "tenant {:?} holds a control character",
                    name.chars().take(64).collect::<String>()
                )));
            }
            if name.len() > MAX_TENANT_BYTES {
                return Err(refuse(format!(
                    "a tenant name is {} bytes; its outbox-tenant-id header could never fit an AMQP frame (at most {MAX_TENANT_BYTES})",
                    name.len()
                )));
            }
            if !seen.insert(name.as_str()) {
                return Err(refuse(format!("tenant \"{name}\" is listed twice")));
            }
            if name.trim() == DISCOVER {
                return Err(refuse(format!(
                    "\"{DISCOVER}\" (every tenant with pending rows) stands alone, not among names"
                )));
            }
            tenants.push(name.clone());
        }
        if tenants.is_empty() {
            return Err(refuse("at least one tenant is required".into()));
        }
        Ok(Tenants::Listed(tenants))
    }
}

/// How a key's effective value is written by `check-config`: as TOML, with
/// secrets masked.
pub trait Render {
    fn render(&self) -> String;
}

fn quote(text: &str) -> String {
    crate::printable::quoted(text)
}

macro_rules! rendered_as_number {
    ($($t:ty),*) => {$(
        impl Render for $t {
            fn render(&self) -> String {
                self.to_string()
            }
        }
    )*};
}
rendered_as_number!(u64, usize, bool);

macro_rules! rendered_as_text {
    ($($t:ty),*) => {$(
        impl Render for $t {
            fn render(&self) -> String {
                quote(&self.to_string())
            }
        }
    )*};
}
// The targets display with their passwords masked.
rendered_as_text!(
    String,
    SocketAddr,
    RoutingKey,
    MessageIdTemplate,
    DatabaseTarget,
    AmqpTarget
);

impl Render for LogFormat {
    fn render(&self) -> String {
        quote(self.as_str())
    }
}

impl Render for Wakeup {
    fn render(&self) -> String {
        quote(self.as_str())
    }
}

impl Render for Tenants {
    fn render(&self) -> String {
        match self {
            Tenants::Listed(names) => {
                let items: Vec<String> = names.iter().map(|t| quote(t)).collect();
                format!("[{}]", items.join(", "))
            }
            Tenants::Discovered => quote(DISCOVER),
        }
    }
}

pub fn num_text(n: figment::value::Num) -> String {
    match n.to_i128() {
        Some(i) => i.to_string(),
        None => n.to_f64().map(|f| f.to_string()).unwrap_or_default(),
    }
}

pub fn value_text(value: &Value) -> String {
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

/// The configuration keys, from one table: each key's doc line (its `--help`
/// text), type, flag value name, default (which may use keys above it), rule,
/// an optional check against keys above it, and an optional unprefixed
/// variable honoured when `OUTBOX_<KEY>` is not set. Generates [`KEYS`], the
/// `Config` struct, the `Flags` of the command line, the reading of every key
/// and the rendering for `check-config`.
///
/// [`KEYS`]: super::KEYS
macro_rules! keys {
    ($(
        $(#[doc = $doc:literal])*
        $key:ident: $ty:ty [$value_name:literal]
            = $default:expr, $rule:expr
            $(, check $check:expr)?
            $(, env $fallback:literal)?;
    )*) => {
        /// Every configuration key, in the order `check-config` prints them.
        pub const KEYS: &[&str] = &[$(stringify!($key)),*];

        /// Unprefixed variables honoured when the `OUTBOX_` one is not set.
        const ENV_FALLBACKS: &[(&str, &str)] = &[$($((stringify!($key), $fallback),)?)*];

        /// The validated configuration of one relay process.
        #[derive(Debug, Clone)]
        pub struct Config {
            $($(#[doc = $doc])* pub $key: $ty,)*
        }

        /// One flag per configuration key; each overrides file and environment.
        #[derive(Debug, Default, clap::Args)]
        pub struct Flags {
            $(
                $(#[doc = $doc])*
                #[arg(long, global = true, value_name = $value_name)]
                pub $key: Option<String>,
            )*
        }

        impl Flags {
            /// The flags that were given, as a configuration layer.
            pub fn layer(&self) -> Dict {
                let mut dict = Dict::new();
                $(
                    if let Some(value) = &self.$key {
                        dict.insert(stringify!($key).into(), Value::from(value.clone()));
                    }
                )*
                dict
            }
        }

        impl Config {
            /// Reads every key in table order, so a default or check may use
            /// the keys above it.
            fn read(v: &Validator<'_>) -> Result<Config, ConfigError> {
                $(
                    let $key: $ty = v.read(stringify!($key), Fallback::from($default), &$rule)?;
                    $(v.check(stringify!($key), &$key, $check)?;)?
                )*
                Ok(Config { $($key),* })
            }

            /// Each key and its value as `check-config` prints it.
            fn rendered(&self) -> Vec<(&'static str, String)> {
                vec![$((stringify!($key), Render::render(&self.$key))),*]
            }
        }
    };
}
pub(crate) use keys;
