//! Loading: the layers (built-in defaults → TOML file → environment →
//! command-line flags, later wins) merged with figment, with where each
//! key's value came from, and the typed reads that validate them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use figment::providers::{Format, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};

use super::file::{CONFIG_FILE_LIMIT, read_bounded};
use super::read::{Fallback, Render, Rule};
use super::{CONFIG_FILE_VAR, Config, ConfigError, ENV_FALLBACKS, ENV_PREFIX, KEYS, Origin};
use crate::printable::cut;

// What an error shows of text the user gave: escaped, and cut to these many
// characters, so that a value with control characters or of 100 MB makes
// one readable line.
/// Of a value.
const VALUE_WIDTH: usize = 200;
/// Of a key or variable name.
const NAME_WIDTH: usize = 100;
/// Of a reason (which may quote the value).
const REASON_WIDTH: usize = 500;

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
        let mut out = String::new();
        for (key, value) in self.config.rendered() {
            let origin = match (self.origins.get(key), key) {
                (Some(origin), _) => origin.to_string(),
                // Unset, it is database_url's value, wherever that came from.
                (None, "listen_database_url") => "unset: database_url's".to_string(),
                (None, _) => Origin::Default.to_string(),
            };
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
                        key: cut(key, NAME_WIDTH),
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
                env.insert((*key).into(), Value::from(raw.to_string()));
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
                (!known).then(|| cut(name, NAME_WIDTH))
            })
            .collect();

        let config = Config::read(&Validator {
            figment: &figment,
            origins: &origins,
        })?;
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
        reason: cut(&reason, REASON_WIDTH),
    };
    let bytes = read_bounded(path, CONFIG_FILE_LIMIT).map_err(file_error)?;
    let text = String::from_utf8(bytes).map_err(|_| file_error("not UTF-8 text".into()))?;
    // The TOML parser's own message quotes the offending line, which may be
    // the one with a password: only its line number and kind are shown.
    if let Err(error) = text.parse::<toml::Table>() {
        let at = error
            .span()
            .map(|span| format!(" at line {}", text[..span.start].matches('\n').count() + 1))
            .unwrap_or_default();
        let kind = error
            .message()
            .lines()
            .next()
            .unwrap_or("syntax error")
            .to_string();
        return Err(file_error(format!("not valid TOML{at}: {kind}")));
    }
    let data = Toml::string(&text)
        .data()
        .map_err(|e| file_error(e.kind.to_string()))?;
    Ok(data.into_values().next().unwrap_or_default())
}

/// Typed reads of the merged layers, each error tied to its key and origin.
pub(super) struct Validator<'a> {
    figment: &'a Figment,
    origins: &'a BTreeMap<&'static str, Origin>,
}

impl Validator<'_> {
    fn invalid(&self, key: &'static str, value: String, reason: String) -> ConfigError {
        // A value that failed to parse as a URL may hold a password anywhere:
        // none of it is shown, only why it was refused.
        let value = if key.ends_with("_url") {
            "(not shown: it may hold a password)".to_string()
        } else {
            cut(&value, VALUE_WIDTH)
        };
        ConfigError::Invalid {
            key,
            value,
            origin: self.origins.get(key).cloned().unwrap_or(Origin::Default),
            reason: cut(&reason, REASON_WIDTH),
        }
    }

    /// The key's value by its rule, or its fallback when no layer sets it.
    pub(super) fn read<T>(
        &self,
        key: &'static str,
        fallback: Fallback<T>,
        rule: &impl Rule<T>,
    ) -> Result<T, ConfigError> {
        match (self.figment.find_value(key).ok(), fallback) {
            (Some(raw), _) => rule
                .read(&raw)
                .map_err(|rejected| self.invalid(key, rejected.shown, rejected.reason)),
            (None, Fallback::Value(value)) => Ok(value),
            (None, Fallback::Required) => Err(ConfigError::Missing {
                key,
                var: env_var(key),
                flag: flag_name(key),
            }),
        }
    }

    /// A rule between this key and the keys above it.
    pub(super) fn check<T: Render>(
        &self,
        key: &'static str,
        value: &T,
        check: impl Fn(&T) -> Result<(), String>,
    ) -> Result<(), ConfigError> {
        check(value).map_err(|reason| self.invalid(key, value.render(), reason))
    }
}
