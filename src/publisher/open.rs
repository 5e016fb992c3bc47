//! Connections made on request: a command of its own (`tail`, `replay`)
//! opens one with a channel, and the relay's session opens its own through
//! [`open_connection`], over TLS with the relay's client configuration for
//! `amqps://`.

use lapin::tcp::{AMQPUriTcpExt, RustlsConnector, TLSConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

use super::CONNECT_TIMEOUT;
use crate::config::{AmqpEndpoint, AmqpTarget};

/// Why a command's own connection and channel (`tail`, `replay`) could not
/// be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot reach the broker at {url}: {source}")]
    Connect {
        /// Redacted: never the password.
        url: String,
        #[source]
        source: lapin::Error,
    },
    #[error("the broker refused a channel: {0}")]
    Channel(#[source] lapin::Error),
    /// The broker accepted the connection but did not answer (or blocks
    /// publishers) within [`CONNECT_TIMEOUT`]: the command ends rather than
    /// hang.
    #[error("the broker did not answer within {} s ({step})", CONNECT_TIMEOUT.as_secs())]
    Silent { step: &'static str },
}

/// Closes a command's own connection, waiting at most a second for the
/// broker's answer (a blocked or silent broker gives none).
pub async fn close(connection: &Connection, reason: &str) {
    let closing = connection.close(200, reason.into());
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), closing).await;
}

/// One step of a command's own connection (`step`: what it does), within
/// [`CONNECT_TIMEOUT`].
pub async fn in_time<T>(
    step: &'static str,
    answer: impl Future<Output = lapin::Result<T>>,
) -> Result<lapin::Result<T>, OpenError> {
    tokio::time::timeout(CONNECT_TIMEOUT, answer)
        .await
        .map_err(|_| OpenError::Silent { step })
}

/// A connection named `name` to the first of `target`'s endpoints that takes
/// one, and a channel on it: what a command of its own (`tail`, `replay`)
/// publishes or consumes on.
pub async fn open_channel(
    target: &AmqpTarget,
    name: &str,
) -> Result<(Connection, Channel), OpenError> {
    let connection = open_first(target, name).await?;
    let channel = in_time("opening a channel", connection.create_channel())
        .await?
        .map_err(OpenError::Channel)?;
    Ok((connection, channel))
}

/// A connection to the first of `target`'s endpoints that takes one, tried
/// in order, each within [`CONNECT_TIMEOUT`] (as the relay's own session
/// tries them); the last endpoint's error if none does.
pub async fn open_first(target: &AmqpTarget, name: &str) -> Result<Connection, OpenError> {
    let mut endpoints = target.endpoints.iter();
    let mut last = endpoints.next().expect("a target has an endpoint");
    let connect = |endpoint| async move {
        in_time("connecting", open_connection(endpoint, name))
            .await?
            .map_err(|source| OpenError::Connect {
                url: target.to_string(),
                source,
            })
    };
    for next in endpoints {
        match connect(last).await {
            Ok(connection) => return Ok(connection),
            Err(error) => {
                tracing::debug!(endpoint = %last.address(), %error, "cannot connect; trying the next endpoint");
            }
        }
        last = next;
    }
    connect(last).await
}

/// A connection to `target` named `name` (as the broker's management shows
/// it), over TLS with the relay's own client configuration for `amqps://`.
pub async fn open_connection(
    target: &AmqpEndpoint,
    name: &str,
) -> Result<Connection, lapin::Error> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    match target.tls.clone() {
        None => Connection::connect_uri(target.uri.clone(), properties).await,
        Some(tls) => {
            let connector = RustlsConnector::from(tls.config);
            let server_name = tls.server_name;
            Connection::connector(
                target.uri.clone(),
                lapin::runtime::default_runtime()?,
                // The TCP connection as for `amqp://`, then the TLS handshake
                // with the relay's own client configuration (the CA file's
                // roots only, the client certificate, the checked name)
                // instead of the AMQP client's, which only adds to the
                // system's roots.
                async move |mut uri: AMQPUri, runtime| {
                    uri.scheme = AMQPScheme::AMQP;
                    let plain = uri
                        .connect_with_config_async(TLSConfig::default(), &runtime)
                        .await?;
                    Ok(plain.into_rustls(&connector, &server_name).await?)
                },
                properties,
            )
            .await
        }
    }
}

/// The exchange type `exchange_type` names (validated with the
/// configuration): the relay and `tail` declare the exchange alike.
pub fn exchange_kind(exchange_type: &str) -> ExchangeKind {
    match exchange_type {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "topic" => ExchangeKind::Topic,
        "headers" => ExchangeKind::Headers,
        other => ExchangeKind::Custom(other.to_string()),
    }
}
