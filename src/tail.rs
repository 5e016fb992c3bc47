//! `outbox-relay tail`: what the relay publishes, as a consumer sees it. A
//! temporary queue (exclusive, deleted when `tail` stops) is bound to the
//! exchange with a routing key (`#` by default) and each message is printed
//! as it arrives: one line (routing key, `message_id`, type, headers, the
//! body cut to a line), or one JSON object with the whole body. For a first
//! run with nothing else installed, and for looking at a live exchange
//! without disturbing its consumers.

use std::io::Write;

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};

use crate::config::Config;
use crate::printable::{cut, escape_controls};
use crate::publisher::{OpenError, close, exchange_kind, in_time, open_channel};

/// The widest body shown on a line.
const BODY_WIDTH: usize = 200;

/// Why `tail` stopped before it was asked to.
#[derive(Debug, thiserror::Error)]
pub enum TailError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("the broker refused the temporary queue: {0}")]
    Queue(#[source] lapin::Error),
    #[error("the broker closed the consumer: {0}")]
    Consumer(#[source] lapin::Error),
    #[error("cannot write: {0}")]
    Output(#[from] std::io::Error),
}

/// Prints each message published to the configured exchange with
/// `routing_key` until `stop` resolves.
pub async fn run(
    config: &Config,
    routing_key: &str,
    json: bool,
    out: &mut (dyn Write + Send),
    stop: impl Future<Output = ()>,
) -> Result<(), TailError> {
    let (connection, channel) = open_channel(&config.amqp_url, "outbox-relay tail").await?;
    if config.declare_exchange {
        // As the relay declares it: tail may start first.
        let kind = exchange_kind(&config.exchange_type);
        let declared = channel.exchange_declare(
            config.exchange.as_str().into(),
            kind,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        );
        in_time("declaring the exchange", declared)
            .await?
            .map_err(TailError::Queue)?;
    }
    let declared = channel.queue_declare(
        "".into(),
        QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    );
    let queue = in_time("declaring the queue", declared)
        .await?
        .map_err(TailError::Queue)?;
    let bound = channel.queue_bind(
        queue.name().clone(),
        config.exchange.as_str().into(),
        routing_key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    );
    in_time("binding the queue", bound)
        .await?
        .map_err(TailError::Queue)?;
    let consuming = channel.basic_consume(
        queue.name().clone(),
        "outbox-relay-tail".into(),
        BasicConsumeOptions {
            no_ack: true,
            ..BasicConsumeOptions::default()
        },
        FieldTable::default(),
    );
    let mut consumer = in_time("consuming", consuming)
        .await?
        .map_err(TailError::Queue)?;
    eprintln!(
        "outbox-relay tail: exchange {:?}, routing key {routing_key:?}; Ctrl-C to stop",
        config.exchange
    );
    tokio::pin!(stop);
    loop {
        let delivery = tokio::select! {
            () = &mut stop => break,
            delivery = consumer.next() => delivery,
        };
        let Some(delivery) = delivery else { break };
        let delivery = delivery.map_err(TailError::Consumer)?;
        let line = if json {
            as_json(&delivery)
        } else {
            as_line(&delivery)
        };
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    close(&connection, "tail stopped").await;
    Ok(())
}

fn headers(delivery: &lapin::message::Delivery) -> serde_json::Map<String, serde_json::Value> {
    let mut map = serde_json::Map::new();
    if let Some(headers) = delivery.properties.headers() {
        for (name, value) in headers.inner() {
            map.insert(name.to_string(), json_value(value));
        }
    }
    map
}

fn json_value(value: &AMQPValue) -> serde_json::Value {
    use serde_json::Value;
    match value {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::LongString(s) => Value::String(String::from_utf8_lossy(s.as_bytes()).into()),
        AMQPValue::ShortString(s) => Value::String(s.to_string()),
        AMQPValue::LongLongInt(n) => Value::from(*n),
        AMQPValue::LongInt(n) => Value::from(*n),
        AMQPValue::ShortInt(n) => Value::from(*n),
        AMQPValue::Double(f) => Value::from(*f),
        AMQPValue::Float(f) => Value::from(*f),
        AMQPValue::Void => Value::Null,
        other => Value::String(format!("{other:?}")),
    }
}

fn short(text: Option<&lapin::types::ShortString>) -> String {
    text.map(|s| s.to_string()).unwrap_or_default()
}

/// One line: control characters escaped (see [`escape_controls`]), the body
/// cut to [`BODY_WIDTH`].
fn as_line(delivery: &lapin::message::Delivery) -> String {
    let body = String::from_utf8_lossy(&delivery.data);
    let shown = cut(&body, BODY_WIDTH);
    format!(
        "{} message_id={} type={} headers={} body={shown}",
        escape_controls(delivery.routing_key.as_str()),
        escape_controls(&short(delivery.properties.message_id().as_ref())),
        escape_controls(&short(delivery.properties.kind().as_ref())),
        escape_controls(&serde_json::Value::Object(headers(delivery)).to_string()),
    )
}

/// One JSON object, the whole body as text.
fn as_json(delivery: &lapin::message::Delivery) -> String {
    serde_json::json!({
        "routing_key": delivery.routing_key.as_str(),
        "message_id": short(delivery.properties.message_id().as_ref()),
        "type": short(delivery.properties.kind().as_ref()),
        "headers": headers(delivery),
        "body": String::from_utf8_lossy(&delivery.data),
    })
    .to_string()
}
