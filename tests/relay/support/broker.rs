//! The test's own broker side: a private topic exchange and queue with a
//! consumer that records every delivery, and side queues. The exchange and
//! queues are deleted when the `Broker` goes out of scope. A test that
//! changes the whole broker does it on a node of the run's own
//! (`support::node`), never on the machine's broker.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

use super::fixture::delete_on_broker;
use super::unique;

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A message as a consumer received it.
#[derive(Debug, Clone)]
pub struct Received {
    pub id: i64,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
    pub redelivered: bool,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(name))
    }

    pub fn tenant(&self) -> String {
        match self.header("outbox-tenant-id") {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            other => panic!("message {} has no tenant header: {other:?}", self.id),
        }
    }
}

/// A private topic exchange with a queue and a consumer that records every delivery.
pub struct Broker {
    pub exchange: String,
    pub queue: String,
    /// The broker's URL, for the relay and the cleanup at drop.
    url: String,
    connection: Connection,
    channel: Channel,
    received: Arc<Mutex<Vec<Received>>>,
    extra_queues: Mutex<Vec<String>>,
}

impl Broker {
    /// Declares the exchange and the consumer's queue, bound with `keys`.
    pub async fn create(keys: &[&str]) -> Broker {
        Broker::create_on(AMQP_URL, keys).await
    }

    /// `n` of [`Broker::create`].
    pub async fn create_several(n: usize, keys: &[&str]) -> Vec<Broker> {
        let mut brokers = Vec::with_capacity(n);
        for _ in 0..n {
            brokers.push(Broker::create(keys).await);
        }
        brokers
    }

    /// As [`Broker::create`], on the broker at `url` (a private node of the
    /// run's own: `support::node`).
    pub async fn create_on(url: &str, keys: &[&str]) -> Broker {
        let exchange = unique("x");
        let queue = unique("q");
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .expect("the broker is reachable");
        let channel = connection.create_channel().await.expect("channel");
        declare(&channel, &exchange, &queue, QueueDeclareOptions::default()).await;
        let broker = Broker {
            exchange,
            queue,
            url: url.to_string(),
            connection,
            channel,
            received: Arc::new(Mutex::new(Vec::new())),
            extra_queues: Mutex::new(Vec::new()),
        };
        for key in keys {
            broker.bind(key).await;
        }
        let consumer_channel = broker.connection.create_channel().await.expect("channel");
        let mut consumer = consumer_channel
            .basic_consume(
                broker.queue.as_str().into(),
                "recorder".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let received = broker.received.clone();
        tokio::spawn(async move {
            let _keep = consumer_channel;
            while let Some(Ok(delivery)) = consumer.next().await {
                // The row's id: the message_id (the default template), else
                // the `outbox-id` header (a message_id template of its own).
                let header_id = || match delivery
                    .properties
                    .headers()
                    .as_ref()?
                    .inner()
                    .get("outbox-id")
                {
                    Some(AMQPValue::LongLongInt(id)) => Some(*id),
                    _ => None,
                };
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|m| m.as_str().parse().ok())
                    .or_else(header_id)
                    .expect("every message has a numeric message_id or an outbox-id header");
                received.lock().unwrap().push(Received {
                    id,
                    routing_key: delivery.routing_key.as_str().to_string(),
                    body: delivery.data.clone(),
                    properties: delivery.properties.clone(),
                    redelivered: delivery.redelivered,
                });
                let _ = delivery.ack(BasicAckOptions::default()).await;
            }
        });
        broker
    }

    /// Binds the consumer's queue to `key`.
    pub async fn bind(&self, key: &str) {
        bind(&self.channel, &self.queue, &self.exchange, key).await;
    }

    /// Deletes the exchange (with it, the queue's bindings).
    pub async fn delete_exchange(&self) {
        self.channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await
            .expect("delete the exchange");
    }

    /// Declares the exchange again (after [`Broker::delete_exchange`]; bind
    /// the queue again too).
    pub async fn declare_exchange(&self) {
        declare_exchange(&self.channel, &self.exchange).await;
    }

    /// A queue bound to `key` that holds `length` messages and then rejects
    /// publishes, which the broker nacks. Returns its name.
    pub async fn capped_queue(&self, key: &str, length: i32) -> String {
        let mut arguments = FieldTable::default();
        arguments.insert("x-max-length".into(), AMQPValue::LongInt(length));
        arguments.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        self.side_queue(key, arguments).await
    }

    /// Declares another queue (no consumer) with `arguments`, bound to `key`.
    pub async fn side_queue(&self, key: &str, arguments: FieldTable) -> String {
        let name = unique("side");
        self.channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::default(),
                arguments,
            )
            .await
            .expect("side queue");
        self.channel
            .queue_bind(
                name.as_str().into(),
                self.exchange.as_str().into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind side queue");
        self.extra_queues.lock().unwrap().push(name.clone());
        name
    }

    pub async fn purge(&self, queue: &str) {
        self.channel
            .queue_purge(queue.into(), Default::default())
            .await
            .expect("purge");
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// The URL of the broker the exchange is on.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }
}

impl Drop for Broker {
    /// Deletes the queue, the side queues and the exchange.
    fn drop(&mut self) {
        let mut queues = vec![self.queue.clone()];
        queues.append(&mut self.extra_queues.lock().unwrap_or_else(|e| e.into_inner()));
        delete_on_broker(&self.url, &self.exchange, queues);
    }
}

/// Declares the durable topic `exchange` and the queue `queue` (declared
/// with `options`).
pub async fn declare(channel: &Channel, exchange: &str, queue: &str, options: QueueDeclareOptions) {
    declare_exchange(channel, exchange).await;
    channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
        .expect("queue");
}

/// Binds `queue` to `exchange` with `key`.
pub async fn bind(channel: &Channel, queue: &str, exchange: &str, key: &str) {
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
}

/// Each tenant's received ids in arrival order.
pub fn by_tenant(received: &[Received]) -> BTreeMap<String, Vec<i64>> {
    let mut map: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in received {
        map.entry(r.tenant()).or_default().push(r.id);
    }
    map
}

/// Declares `exchange`: durable, of type topic, as the relay's default.
pub async fn declare_exchange(channel: &Channel, exchange: &str) {
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare the exchange");
}
