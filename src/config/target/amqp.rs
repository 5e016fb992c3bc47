//! The broker target: `amqp_url` parsed into its endpoints, each with its
//! TLS from RabbitMQ's URI parameters, and shown with the password masked.

use std::str::FromStr;
use std::sync::Arc;

use lapin::uri::{AMQPScheme, AMQPUri};

use super::tls::{self, Check};
use super::{last, misplaced_userinfo, push_query};
use crate::redact::MASK;

/// Heartbeat asked of the broker unless the URL sets one: a silent peer is
/// noticed within two intervals even when nothing is being published.
pub(super) const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// The broker to publish to: one endpoint or several (nodes of one
/// cluster), tried in order and rotated on failure by the publisher.
#[derive(Clone)]
pub struct AmqpTarget {
    /// At least one; all of the same scheme, user and virtual host.
    pub endpoints: Vec<AmqpEndpoint>,
    pub(super) redacted: String,
}

/// One broker node to connect to.
#[derive(Clone)]
pub struct AmqpEndpoint {
    pub uri: AMQPUri,
    /// TLS for `amqps://`; `None` for `amqp://`.
    pub tls: Option<AmqpTls>,
    pub(super) redacted: String,
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

/// The `amqp[s]://` parameters the AMQP client reads.
const AMQP_CLIENT_KEYS: [&str; 5] = [
    "heartbeat",
    "frame_max",
    "channel_max",
    "connection_timeout",
    "auth_mechanism",
];

/// The least `frame_max` AMQP 0-9-1 allows (0 is "the broker's").
const AMQP_FRAME_MIN: u32 = 4096;

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
        if let Some(frame_max) = uri.query.frame_max
            && frame_max != 0
            && frame_max < AMQP_FRAME_MIN
        {
            return Err(format!(
                "frame_max={frame_max} is below AMQP's least frame size ({AMQP_FRAME_MIN}): the broker would refuse every connection"
            ));
        }
        let given: Vec<(String, String)> = url::Url::parse(url)
            .map_err(|e| format!("not a valid AMQP URL: {e}"))?
            .query_pairs()
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        if let Some((key, _)) = given.iter().find(|(key, _)| {
            !AMQP_TLS_KEYS.contains(&key.as_str()) && !AMQP_CLIENT_KEYS.contains(&key.as_str())
        }) {
            return Err(format!(
                "holds the parameter {:?}, which the relay does not know (known: {}, {})",
                crate::printable::cut(key, 40),
                AMQP_CLIENT_KEYS.join(", "),
                AMQP_TLS_KEYS.join(", ")
            ));
        }
        let query: Vec<(String, String)> = given
            .iter()
            .filter(|(k, _)| AMQP_TLS_KEYS.contains(&k.as_str()))
            .cloned()
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
        let redacted = shown_amqp(&uri, &given);
        Ok(AmqpEndpoint { uri, tls, redacted })
    }
}

/// An AMQP target as printed, built from what was parsed (and its TLS
/// parameters, file paths and names, none of them secret).
fn shown_amqp(uri: &AMQPUri, parameters: &[(String, String)]) -> String {
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
    push_query(&mut shown, parameters);
    shown
}
