//! The test harness: a private outbox table, a private exchange and queue with
//! a recording consumer, the relay in-process or as the real binary, and
//! polling with deadlines.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_relay::config::Config;
use outbox_relay::relay::Relay;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls};

pub const DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A name no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    format!(
        "{prefix}_{}_{}_{nanos:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Polls `check` every 25 ms until it holds; panics naming `what` after `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The state of one outbox row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowState {
    pub published: bool,
    pub attempts: i32,
    pub last_error: Option<String>,
}

/// A private outbox table in the `test` database.
pub struct Outbox {
    pub schema: String,
    pub table: String,
    pub client: Client,
}

/// A query of the test's own, bounded: a test that hangs tells CI nothing,
/// one that fails names what did not answer.
async fn within<T>(what: &str, query: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), query)
        .await
        .unwrap_or_else(|_| panic!("the test's own query did not answer within 30 s: {what}"))
}

pub async fn pg_client() -> Client {
    let (client, connection) = tokio_postgres::connect(DATABASE_URL, NoTls)
        .await
        .expect("the test database is reachable");
    tokio::spawn(connection);
    client
}

impl Outbox {
    /// Creates the schema and table with the relay's own migrations.
    pub async fn create() -> Outbox {
        let schema = unique("t");
        let table = "outbox_message".to_string();
        let mut config = Config::with_tenants(["migrate"]);
        config.database_url = DATABASE_URL.parse().expect("database url");
        config.schema = schema.clone();
        config.table = table.clone();
        let store = outbox_relay::store::Store::new(&config).expect("store");
        outbox_relay::migrate::run(&store, &config)
            .await
            .expect("migrations apply");
        Outbox {
            schema,
            table,
            client: pg_client().await,
        }
    }

    pub fn qualified(&self) -> String {
        format!("\"{}\".\"{}\"", self.schema, self.table)
    }

    /// Inserts one row and returns its id.
    pub async fn insert(
        &self,
        tenant: &str,
        kind: &str,
        subject: &str,
        payload: Option<&str>,
        headers: Option<serde_json::Value>,
    ) -> i64 {
        let sql = format!(
            "INSERT INTO {} (tenant_id, kind, subject_id, payload, headers) VALUES ($1, $2, $3, $4, $5) RETURNING id",
            self.qualified()
        );
        within(
            "insert",
            self.client
                .query_one(&sql, &[&tenant, &kind, &subject, &payload, &headers]),
        )
        .await
        .expect("insert")
        .get(0)
    }

    /// Inserts `n` rows for `tenant` in one statement; returns their ids in order.
    pub async fn insert_many(&self, tenant: &str, n: i64) -> Vec<i64> {
        let sql = format!(
            "INSERT INTO {} (tenant_id, kind, subject_id, payload)
             SELECT $1, 'thing.changed', 's-' || g, '{{\"n\":' || g || '}}' FROM generate_series(1, $2::bigint) g
             RETURNING id",
            self.qualified()
        );
        let mut ids: Vec<i64> = within("insert many", self.client.query(&sql, &[&tenant, &n]))
            .await
            .expect("insert many")
            .iter()
            .map(|r| r.get(0))
            .collect();
        ids.sort_unstable();
        ids
    }

    pub async fn execute(&self, sql: &str) {
        let sql = sql.replace("{outbox}", &self.qualified());
        within("a statement", self.client.batch_execute(&sql))
            .await
            .expect("statement");
    }

    pub async fn pending(&self, tenant: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE tenant_id = $1 AND published_at IS NULL",
            self.qualified()
        );
        within("count pending", self.client.query_one(&sql, &[&tenant]))
            .await
            .expect("count")
            .get(0)
    }

    /// Pending rows of all of `tenants`.
    pub async fn pending_of(&self, tenants: &[&str]) -> i64 {
        let mut pending = 0;
        for tenant in tenants {
            pending += self.pending(tenant).await;
        }
        pending
    }

    pub async fn all_pending(&self) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE published_at IS NULL",
            self.qualified()
        );
        within("count all pending", self.client.query_one(&sql, &[]))
            .await
            .expect("count")
            .get(0)
    }

    /// The tenant's lowest pending row, if any.
    pub async fn first_pending(&self, tenant: &str) -> Option<RowState> {
        let sql = format!(
            "SELECT id FROM {} WHERE tenant_id = $1 AND published_at IS NULL ORDER BY id LIMIT 1",
            self.qualified()
        );
        let row = within("first pending", self.client.query_opt(&sql, &[&tenant]))
            .await
            .expect("first pending");
        match row {
            Some(row) => Some(self.row(row.get(0)).await),
            None => None,
        }
    }

    /// The refused publishes recorded over all of the tenant's rows.
    pub async fn attempts(&self, tenant: &str) -> i64 {
        let sql = format!(
            "SELECT COALESCE(sum(attempts), 0)::bigint FROM {} WHERE tenant_id = $1",
            self.qualified()
        );
        within("sum attempts", self.client.query_one(&sql, &[&tenant]))
            .await
            .expect("attempts")
            .get(0)
    }

    /// The tenant's rows that carry any blame: an attempt or a `last_error`.
    pub async fn blamed(&self, tenant: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE tenant_id = $1 AND (attempts > 0 OR last_error IS NOT NULL)",
            self.qualified()
        );
        within("count blamed", self.client.query_one(&sql, &[&tenant]))
            .await
            .expect("blamed")
            .get(0)
    }

    pub async fn row(&self, id: i64) -> RowState {
        let sql = format!(
            "SELECT published_at IS NOT NULL, attempts, last_error FROM {} WHERE id = $1",
            self.qualified()
        );
        let row = within("read a row", self.client.query_one(&sql, &[&id]))
            .await
            .expect("row");
        RowState {
            published: row.get(0),
            attempts: row.get(1),
            last_error: row.get(2),
        }
    }

    /// Ids marked published.
    pub async fn published_ids(&self) -> Vec<i64> {
        let sql = format!(
            "SELECT id FROM {} WHERE published_at IS NOT NULL ORDER BY id",
            self.qualified()
        );
        within("published ids", self.client.query(&sql, &[]))
            .await
            .expect("ids")
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    pub async fn drop_schema(self) {
        let _ = self
            .client
            .batch_execute(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .await;
    }
}

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

/// Tests that publish hold this shared; one that changes the whole broker
/// (its `max_message_size`) holds it exclusively, so it never runs beside
/// them. (A memory alarm is raised on a private node only: `flow`.) The
/// lock is fair: a test must take its share once, however many exchanges it
/// makes ([`Broker::create_several`]); a second share asked for while a
/// writer waits would wait behind it, and the writer behind the first.
fn broker_lock() -> Arc<tokio::sync::RwLock<()>> {
    static LOCK: std::sync::OnceLock<Arc<tokio::sync::RwLock<()>>> = std::sync::OnceLock::new();
    LOCK.get_or_init(|| Arc::new(tokio::sync::RwLock::new(())))
        .clone()
}

/// Either side of [`broker_lock`].
#[allow(dead_code)] // held for its Drop only
enum BrokerGuard {
    Shared(tokio::sync::OwnedRwLockReadGuard<()>),
    Exclusive(tokio::sync::OwnedRwLockWriteGuard<()>),
    /// Not on the machine's broker.
    None,
}

/// A private topic exchange with a queue and a consumer that records every delivery.
pub struct Broker {
    pub exchange: String,
    pub queue: String,
    _guard: Arc<BrokerGuard>,
    connection: Connection,
    channel: Channel,
    received: Arc<Mutex<Vec<Received>>>,
    extra_queues: Mutex<Vec<String>>,
}

impl Broker {
    /// Declares the exchange and the consumer's queue, bound with `keys`.
    pub async fn create(keys: &[&str]) -> Broker {
        let guard = BrokerGuard::Shared(broker_lock().read_owned().await);
        Broker::create_with(AMQP_URL, keys, Arc::new(guard)).await
    }

    /// As [`Broker::create`], on the broker at `url` (a private node of the
    /// test's own: the machine's broker is not locked for it).
    pub async fn create_on(url: &str, keys: &[&str]) -> Broker {
        Broker::create_with(url, keys, Arc::new(BrokerGuard::None)).await
    }

    /// `n` of [`Broker::create`], under one share of the broker's lock.
    pub async fn create_several(n: usize, keys: &[&str]) -> Vec<Broker> {
        let guard = Arc::new(BrokerGuard::Shared(broker_lock().read_owned().await));
        let mut brokers = Vec::with_capacity(n);
        for _ in 0..n {
            brokers.push(Broker::create_with(AMQP_URL, keys, guard.clone()).await);
        }
        brokers
    }

    /// As [`Broker::create`], while no other test uses the broker.
    pub async fn create_exclusive(keys: &[&str]) -> Broker {
        let guard = BrokerGuard::Exclusive(broker_lock().write_owned().await);
        Broker::create_with(AMQP_URL, keys, Arc::new(guard)).await
    }

    async fn create_with(url: &str, keys: &[&str], guard: Arc<BrokerGuard>) -> Broker {
        let exchange = unique("x");
        let queue = unique("q");
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .expect("the broker is reachable");
        let channel = connection.create_channel().await.expect("channel");
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("exchange");
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("queue");
        let broker = Broker {
            exchange,
            queue,
            _guard: guard,
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
        self.channel
            .queue_bind(
                self.queue.as_str().into(),
                self.exchange.as_str().into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind");
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
        self.channel
            .exchange_declare(
                self.exchange.as_str().into(),
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

    pub fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    pub async fn delete(self) {
        let _ = self
            .channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let extra = std::mem::take(&mut *self.extra_queues.lock().unwrap());
        for q in extra {
            let _ = self
                .channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = self
            .channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        let _ = self.connection.close(200, "done".into()).await;
    }
}

/// Each tenant's received ids in arrival order.
pub fn by_tenant(received: &[Received]) -> BTreeMap<String, Vec<i64>> {
    let mut map: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in received {
        map.entry(r.tenant()).or_default().push(r.id);
    }
    map
}

/// A relay configuration for this test's table and exchange.
pub fn config(outbox: &Outbox, broker: &Broker, tenants: &[&str]) -> Config {
    let mut config = Config::with_tenants(tenants.iter().copied());
    config.database_url = DATABASE_URL.parse().expect("database url");
    config.listen_database_url = config.database_url.clone();
    config.amqp_url = AMQP_URL.parse().expect("amqp url");
    config.schema = outbox.schema.clone();
    config.table = outbox.table.clone();
    config.exchange = broker.exchange.clone();
    config.http_addr = "127.0.0.1:0".parse().unwrap();
    config.poll_ms = 50;
    config.confirm_timeout_ms = 5_000;
    config.shutdown_grace_ms = 5_000;
    config
}

/// A relay running in this process.
pub struct RelayHandle {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

pub async fn start_relay(config: Config) -> RelayHandle {
    // `TEST_LOG=debug cargo test …` shows the relays' logs.
    if let Ok(filter) = std::env::var("TEST_LOG") {
        outbox_relay::telemetry::init(outbox_relay::config::LogFormat::Text, &filter);
    }
    let listener = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let relay = Arc::new(Relay::from_config(Arc::new(config)).expect("relay builds"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(outbox_relay::serve(relay, listener, async move {
        let _ = stopped.await;
    }));
    RelayHandle {
        addr,
        stop: Some(stop),
        task,
    }
}

impl RelayHandle {
    pub async fn get(&self, path: &str) -> (u16, String) {
        http_get(self.addr, path).await
    }

    /// Stops the relay as SIGTERM would and waits for it to finish.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), &mut self.task)
            .await
            .expect("the relay stops within its grace period")
            .expect("the relay task does not panic");
    }
}

/// A bare HTTP/1.0 GET: status and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the relay's HTTP");
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: relay\r\n\r\n").as_bytes())
        .await
        .expect("send request");
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .expect("read response");
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The relay binary, with a clean environment of relay variables.
pub fn relay_command() -> Command {
    binary_command(Path::new(env!("CARGO_BIN_EXE_outbox-relay")))
}

/// `binary` (a relay build) with none of the test process's relay
/// variables.
pub fn binary_command(binary: &Path) -> Command {
    let mut command = Command::new(binary);
    for (name, _) in std::env::vars() {
        if name.starts_with("OUTBOX_")
            || name.starts_with("OTEL_")
            || name == "DATABASE_URL"
            || name == "AMQP_URL"
            || name == "RUST_LOG"
        {
            command.env_remove(name);
        }
    }
    command.stdin(Stdio::null());
    command
}

/// A spawned relay process whose output goes to a file (read on failure).
pub struct RelayProcess {
    pub child: Child,
    pub log: PathBuf,
}

/// Environment for a relay binary over this test's table and exchange.
pub fn relay_env(outbox: &Outbox, broker: &Broker, tenants: &[&str]) -> Vec<(String, String)> {
    [
        ("OUTBOX_TENANTS", tenants.join(",")),
        ("OUTBOX_DATABASE_URL", DATABASE_URL.to_string()),
        ("OUTBOX_AMQP_URL", AMQP_URL.to_string()),
        ("OUTBOX_SCHEMA", outbox.schema.clone()),
        ("OUTBOX_TABLE", outbox.table.clone()),
        ("OUTBOX_EXCHANGE", broker.exchange.clone()),
        ("OUTBOX_HTTP_ADDR", "127.0.0.1:0".to_string()),
        ("OUTBOX_POLL_MS", "50".to_string()),
        ("OUTBOX_LOG_FORMAT", "json".to_string()),
        ("OUTBOX_LOG", "info".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Sets `key` in an environment list, replacing an earlier value.
pub fn set_env(env: &mut Vec<(String, String)>, key: &str, value: impl Into<String>) {
    env.retain(|(k, _)| k != key);
    env.push((key.to_string(), value.into()));
}

/// A relay binary started with `env`, once it serves HTTP.
pub async fn spawn_relay(env: &[(String, String)]) -> (RelayProcess, SocketAddr) {
    spawn_relay_of(relay_command(), env).await
}

/// `command` (a relay binary, this build's or another's) started with `env`,
/// once it serves HTTP.
pub async fn spawn_relay_of(
    mut command: Command,
    env: &[(String, String)],
) -> (RelayProcess, SocketAddr) {
    command.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let mut process = RelayProcess::spawn(command);
    let mut addr = None;
    eventually(
        "the relay binary serves HTTP",
        Duration::from_secs(20),
        || {
            let found = process.started_addr();
            let exited = process.child.try_wait().ok().flatten();
            assert!(
                exited.is_none(),
                "the relay exited early ({exited:?}):\n{}",
                process.output()
            );
            addr = found;
            async move { found.is_some() }
        },
    )
    .await;
    (process, addr.expect("address found"))
}

impl RelayProcess {
    /// The HTTP address the relay logged at start.
    fn started_addr(&self) -> Option<SocketAddr> {
        self.output().lines().find_map(|line| {
            let entry: serde_json::Value = serde_json::from_str(line).ok()?;
            if entry["message"] != "outbox-relay started" {
                return None;
            }
            entry["addr"].as_str()?.parse().ok()
        })
    }

    pub fn spawn(mut command: Command) -> RelayProcess {
        let log = std::env::temp_dir().join(format!("{}.log", unique("relay")));
        let file = std::fs::File::create(&log).expect("log file");
        command
            .stdout(file.try_clone().expect("log file"))
            .stderr(file);
        let child = command.spawn().expect("the relay binary starts");
        RelayProcess { child, log }
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Waits for exit within `limit`; returns the exit code.
    pub async fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.code();
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!(
                    "the relay did not exit within {limit:?}; output:\n{}",
                    self.output()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// The value of one exact series (`name{labels}` as the exposition writes it)
/// in a `/metrics` text.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Checks a history against what was committed: **L** every committed row was
/// received at least once and is marked published, **O** per tenant the first
/// occurrences of ids are exactly the committed ids in increasing order.
/// Returns the number of duplicate deliveries (for **D**).
pub async fn check_history(
    outbox: &Outbox,
    broker: &Broker,
    committed: &BTreeMap<String, Vec<i64>>,
    limit: Duration,
) -> usize {
    let total: usize = committed.values().map(Vec::len).sum();
    eventually("L: every committed row marked published", limit, || async {
        outbox.all_pending().await == 0
    })
    .await;
    // The consumer may trail the marks on a loaded machine: the same limit.
    eventually("L: every committed row received", limit, || async {
        broker
            .received()
            .iter()
            .map(|r| r.id)
            .collect::<std::collections::HashSet<_>>()
            .len()
            >= total
    })
    .await;
    let received = broker.received();
    for (tenant, ids) in by_tenant(&received) {
        let mut seen = std::collections::HashSet::new();
        let firsts: Vec<i64> = ids.into_iter().filter(|id| seen.insert(*id)).collect();
        let expected = committed
            .get(&tenant)
            .unwrap_or_else(|| panic!("unexpected tenant {tenant}"));
        assert!(
            firsts.windows(2).all(|w| w[0] < w[1]),
            "O: {tenant}'s first occurrences are not increasing"
        );
        assert_eq!(
            &firsts, expected,
            "L/O: {tenant} received exactly its committed rows, in order"
        );
    }
    assert_eq!(
        committed.len(),
        by_tenant(&received).len(),
        "L: every tenant received"
    );
    received.len() - total
}

/// A TCP port free on the loopback now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The newest PostgreSQL binaries on this machine.
pub fn postgres_bin() -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL binaries in /usr/lib/postgresql")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    versions.sort();
    versions.pop().expect("a PostgreSQL version").join("bin")
}

/// Creates a cluster's data directory `data` with the machine's `initdb`,
/// as user postgres, trust authentication (for the tests' own clusters).
pub fn initdb(data: &str) {
    let initdb = postgres_bin().join("initdb").display().to_string();
    let output = as_postgres(&[
        &initdb,
        "-D",
        data,
        "-U",
        "postgres",
        "-A",
        "trust",
        "--no-sync",
    ])
    .output()
    .expect("initdb runs");
    assert!(
        output.status.success(),
        "initdb: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A private cluster in a temporary folder of its own (`prefix…`), made by
/// [`initdb`] and started with `settings` (`name=value`), with a database
/// `test`: the failover and two-phase tests' servers.
pub fn private_cluster(what: &str, prefix: &str, settings: &[&str]) -> PrivateServer {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("cluster dir")
        .keep();
    let status = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(&dir)
        .status()
        .expect("chown");
    assert!(status.success());
    let base = dir.display().to_string();
    let data = format!("{base}/data");
    initdb(&data);
    let settings: Vec<String> = settings
        .iter()
        .flat_map(|setting| ["-c".to_string(), setting.to_string()])
        .collect();
    let server = PrivateServer::start(what, &data, &base, &base, &settings);
    server.psql("postgres", "CREATE DATABASE test");
    server
}

/// A PostgreSQL server of this test run's own (a second primary, a TLS
/// listener), started once from the machine's binaries on `data` (made by
/// [`initdb`]). Its shell parent stops it, and removes its directory, when
/// this process exits and its stdin closes.
pub struct PrivateServer {
    pub port: u16,
    /// Its Unix socket's directory, where its log is too.
    pub socket_dir: String,
    _stdin: Mutex<ChildStdin>,
    _child: Mutex<Child>,
}

impl PrivateServer {
    /// Starts the server on a free port, with `settings` (`-c name=value`
    /// pairs, as separate arguments) and waits until it accepts
    /// connections; `remove` goes with it at exit.
    pub fn start(
        what: &str,
        data: &str,
        socket_dir: &str,
        remove: &str,
        settings: &[String],
    ) -> PrivateServer {
        let bin = postgres_bin();
        let port = free_port();
        let postgres = bin.join("postgres").display().to_string();
        let script = r#"
            postgres=$1 data=$2 port=$3 sockets=$4 remove=$5
            shift 5
            "$postgres" -D "$data" -p "$port" -c listen_addresses=127.0.0.1 \
              -c unix_socket_directories="$sockets" -c fsync=off "$@" \
              >"$sockets/postgres.log" 2>&1 &
            pid=$!
            cat >/dev/null
            kill -INT "$pid"
            wait "$pid"
            rm -rf "$remove"
        "#;
        let port_text = port.to_string();
        let mut args = vec![
            "sh", "-c", script, "sh", &postgres, data, &port_text, socket_dir, remove,
        ];
        args.extend(settings.iter().map(String::as_str));
        let mut child = as_postgres(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres starts");
        let stdin = child.stdin.take().expect("stdin");
        let pg_isready = bin.join("pg_isready").display().to_string();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !Command::new(&pg_isready)
            .args(["-q", "-h", socket_dir, "-p", &port_text])
            .status()
            .is_ok_and(|s| s.success())
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the {what} did not start within 30 s: {}",
                std::fs::read_to_string(format!("{socket_dir}/postgres.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        PrivateServer {
            port,
            socket_dir: socket_dir.to_string(),
            _stdin: Mutex::new(stdin),
            _child: Mutex::new(child),
        }
    }

    /// Runs `sql` with psql as `postgres` over the Unix socket, in
    /// `database`; it must succeed.
    pub fn psql(&self, database: &str, sql: &str) {
        let psql = postgres_bin().join("psql").display().to_string();
        let port = self.port.to_string();
        let status = as_postgres(&[
            &psql,
            "-q",
            "-h",
            &self.socket_dir,
            "-p",
            &port,
            "-U",
            "postgres",
            "-d",
            database,
            "-c",
            sql,
        ])
        .status()
        .expect("psql runs");
        assert!(status.success(), "psql: {sql}");
    }
}

/// A command run as the `postgres` user (initdb refuses root).
pub fn as_postgres(args: &[&str]) -> Command {
    let mut command = Command::new("runuser");
    command.args(["-u", "postgres", "--"]).args(args);
    command
}
