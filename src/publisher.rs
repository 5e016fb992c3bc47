//! RabbitMQ: one connection, kept up by a supervisor that reconnects with
//! back-off; one confirm-mode channel shared by the sweeps (see `confirms`);
//! and the publish of a batch with at most `max_in_flight` unconfirmed
//! messages.
//!
//! A batch's publishes are issued without awaiting each hand-off to the I/O
//! side in turn (each `basic_publish` is polled once, in row order, which is
//! where lapin assigns the delivery tag and queues the frames); the channel's
//! collector settles the confirms, each within `confirm_timeout_ms` of its
//! send, and the batch follows its confirmed prefix as it grows.

mod confirms;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::StreamExt;
use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties, Event, ExchangeKind};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::config::Config;
use crate::envelope::{Envelope, Refusal};
use crate::metrics::{FailureReason, Metrics};
use crate::redact::redact_url;
use crate::store::OutboxRow;
use confirms::{Batch, ConfirmChannel};

/// Deadline for connecting (TCP, TLS, AMQP handshake) and for opening a channel.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Heartbeat asked of the broker unless the URL sets one: a silent peer is
/// noticed within two intervals even when nothing is being published.
const DEFAULT_HEARTBEAT_SECS: u16 = 10;
/// The confirmed prefix is reported (see `publish_batch`'s `progress`) in steps
/// of this many rows while the rest of a batch is still being confirmed.
pub const PROGRESS_STEP: usize = 64;
/// Reconnect back-off: from this…
const RECONNECT_MIN: Duration = Duration::from_millis(250);
/// …to this.
const RECONNECT_MAX: Duration = Duration::from_secs(10);

/// Parses `amqp_url`; the error never contains the URL.
pub fn parse_amqp_url(url: &str) -> Result<AMQPUri, String> {
    if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
        return Err("must start with amqp:// or amqps://".into());
    }
    let mut uri: AMQPUri = url.parse().map_err(|e: String| {
        // The parser's message may quote the URL; keep only its kind.
        if e.contains(url) {
            "not a valid AMQP URL".to_string()
        } else {
            format!("not a valid AMQP URL: {e}")
        }
    })?;
    if uri.query.heartbeat.is_none() {
        uri.query.heartbeat = Some(DEFAULT_HEARTBEAT_SECS);
    }
    Ok(uri)
}

/// What became of a batch: how many rows from the start the broker confirmed,
/// when, and the first row that was refused.
#[derive(Debug, Default)]
pub struct BatchReport {
    /// Confirm times of the confirmed prefix, one per row.
    pub confirmed_at: Vec<SystemTime>,
    pub refusal: Option<(usize, Refusal)>,
}

impl BatchReport {
    pub fn confirmed(&self) -> usize {
        self.confirmed_at.len()
    }

    pub(crate) fn refuse(&mut self, index: usize, refusal: Refusal) {
        if self.refusal.as_ref().is_none_or(|(at, _)| index < *at) {
            self.refusal = Some((index, refusal));
        }
    }
}

/// Where a batch stands, as its publisher last looked.
struct BatchNow {
    in_flight: usize,
    refused: bool,
    done: bool,
}

/// The confirmed prefix of a batch as it grows, and whom to tell.
struct Progress<'p> {
    prefix: usize,
    reported: usize,
    tell: &'p mut (dyn FnMut(usize) + Send),
}

impl<'p> Progress<'p> {
    fn new(tell: &'p mut (dyn FnMut(usize) + Send)) -> Progress<'p> {
        Progress {
            prefix: 0,
            reported: 0,
            tell,
        }
    }

    /// Catches up with what the collector has settled of `batch`: while
    /// nothing is refused, the prefix reaches over every row confirmed from
    /// the start.
    fn follow(&mut self, batch: &Batch) -> BatchNow {
        let state = batch.state();
        if state.report.refusal.is_none() {
            self.prefix += state.confirmed[self.prefix..]
                .iter()
                .take_while(|at| at.is_some())
                .count();
        }
        BatchNow {
            in_flight: state.in_flight(),
            refused: state.report.refusal.is_some(),
            done: state.done,
        }
    }

    /// Tells the prefix if it grew by at least `step` since last told.
    fn report(&mut self, step: usize) {
        if self.prefix >= self.reported + step {
            self.reported = self.prefix;
            (self.tell)(self.prefix);
        }
    }
}

/// A live connection and the confirm-mode channel its sweeps share.
struct Session {
    connection: Connection,
    confirm_channel: tokio::sync::Mutex<Option<Arc<ConfirmChannel>>>,
    broken: Notify,
}

impl Session {
    fn is_usable(&self) -> bool {
        let status = self.connection.status();
        status.connected() && !status.blocked()
    }

    /// The shared channel, opened anew if there is none or it failed.
    async fn confirm_channel(self: &Arc<Self>) -> Result<Arc<ConfirmChannel>, lapin::Error> {
        let mut slot = self.confirm_channel.lock().await;
        if let Some(channel) = slot.as_ref().filter(|c| c.is_usable()) {
            return Ok(channel.clone());
        }
        let channel = self.connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let channel = ConfirmChannel::start(channel, Arc::downgrade(self));
        *slot = Some(channel.clone());
        Ok(channel)
    }
}

struct Inner {
    uri: AMQPUri,
    redacted_url: String,
    /// Checked once here (configuration allows ≤ 255 bytes), cloned per message.
    exchange: ShortString,
    exchange_kind: ExchangeKind,
    declare_exchange: bool,
    envelope: Envelope,
    max_in_flight: usize,
    confirm_timeout: Duration,
    session: Mutex<Option<Arc<Session>>>,
    connected: watch::Sender<bool>,
    metrics: Metrics,
}

/// The relay's side of the broker. Cheap to clone.
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
}

impl Publisher {
    pub fn new(config: &Config, metrics: Metrics) -> Result<Publisher, String> {
        let uri = parse_amqp_url(&config.amqp_url)?;
        let exchange_kind = match config.exchange_type.as_str() {
            "direct" => ExchangeKind::Direct,
            "fanout" => ExchangeKind::Fanout,
            "topic" => ExchangeKind::Topic,
            "headers" => ExchangeKind::Headers,
            other => ExchangeKind::Custom(other.to_string()),
        };
        let (connected, _) = watch::channel(false);
        Ok(Publisher {
            inner: Arc::new(Inner {
                uri,
                redacted_url: redact_url(&config.amqp_url),
                exchange: ShortString::try_new(config.exchange.clone())
                    .map_err(|e| format!("exchange: {e}"))?,
                exchange_kind,
                declare_exchange: config.declare_exchange,
                envelope: Envelope {
                    routing_key: config.routing_key.clone(),
                    content_type: ShortString::try_new(config.content_type.clone())
                        .map_err(|e| format!("content_type: {e}"))?,
                    max_payload_bytes: config.max_payload_bytes,
                },
                max_in_flight: config.max_in_flight,
                confirm_timeout: config.confirm_timeout(),
                session: Mutex::new(None),
                connected,
                metrics,
            }),
        })
    }

    /// Connected, and the broker is not blocking publishers.
    pub fn is_ready(&self) -> bool {
        self.session().is_some_and(|s| s.is_usable())
    }

    /// A receiver that changes whenever the connection comes up or goes down.
    pub fn watch_connected(&self) -> watch::Receiver<bool> {
        self.inner.connected.subscribe()
    }

    fn session(&self) -> Option<Arc<Session>> {
        self.inner
            .session
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_session(&self, session: Option<Arc<Session>>) {
        let up = session.is_some();
        *self.inner.session.lock().unwrap_or_else(|e| e.into_inner()) = session;
        self.inner.metrics.amqp_connected.set(i64::from(up));
        self.inner.connected.send_replace(up);
    }

    /// Keeps a connection up until `shutdown` resolves, then closes it cleanly.
    pub async fn supervise(self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let backoff = Backoff::new(RECONNECT_MIN, RECONNECT_MAX);
        let mut failures = 0u32;
        loop {
            let attempt = tokio::time::timeout(CONNECT_TIMEOUT, self.connect());
            let result = tokio::select! {
                result = attempt => result,
                () = &mut shutdown => break,
            };
            match result {
                Ok(Ok(session)) => {
                    failures = 0;
                    tracing::info!(url = %self.inner.redacted_url, "connected to the broker");
                    self.set_session(Some(session.clone()));
                    let reason = tokio::select! {
                        reason = watch_session(&session) => reason,
                        () = &mut shutdown => {
                            self.close().await;
                            return;
                        }
                    };
                    self.set_session(None);
                    tracing::warn!(reason = %reason, "broker connection lost; reconnecting");
                    // Close what is left so the broker sees the end, without waiting long.
                    let _ = tokio::time::timeout(
                        Duration::from_secs(1),
                        session.connection.close(320, "reconnecting".into()),
                    )
                    .await;
                }
                Ok(Err(error)) => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(url = %self.inner.redacted_url, %error, "cannot connect to the broker");
                }
                Err(_) => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(url = %self.inner.redacted_url, timeout = ?CONNECT_TIMEOUT, "cannot connect to the broker: timed out");
                }
            }
            let delay = backoff.delay(failures.saturating_sub(1));
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = &mut shutdown => break,
            }
        }
        self.close().await;
    }

    async fn connect(&self) -> Result<Arc<Session>, lapin::Error> {
        let properties =
            ConnectionProperties::default().with_connection_name("outbox-relay".into());
        let connection = Connection::connect_uri(self.inner.uri.clone(), properties).await?;
        if self.inner.declare_exchange {
            let channel = connection.create_channel().await?;
            channel
                .exchange_declare(
                    self.inner.exchange.clone(),
                    self.inner.exchange_kind.clone(),
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            let _ = channel.close(200, "declared".into()).await;
        }
        Ok(Arc::new(Session {
            connection,
            confirm_channel: tokio::sync::Mutex::new(None),
            broken: Notify::new(),
        }))
    }

    /// Drops the connection (after a confirm timeout or a lost channel); the
    /// supervisor reconnects.
    pub fn reset(&self) {
        if let Some(session) = self.session() {
            session.broken.notify_one();
        }
    }

    /// Closes the connection cleanly (shutdown).
    pub async fn close(&self) {
        let session = self.session();
        self.set_session(None);
        if let Some(session) = session {
            let channel = session.confirm_channel.lock().await.take();
            if let Some(channel) = channel {
                let _ = tokio::time::timeout(
                    Duration::from_secs(1),
                    channel.channel().close(200, "shutdown".into()),
                )
                .await;
            }
            match tokio::time::timeout(
                Duration::from_secs(2),
                session.connection.close(200, "shutdown".into()),
            )
            .await
            {
                Ok(Ok(())) => tracing::info!("broker connection closed"),
                Ok(Err(error)) => tracing::debug!(%error, "broker connection was already closed"),
                Err(_) => tracing::warn!("broker connection did not close in time"),
            }
        }
    }

    /// Publishes `rows` of `tenant` in order and settles their confirms. Stops
    /// sending once `claim_held` says the tenant's claim is gone. While rows
    /// are still unconfirmed, `progress` is told the length of the prefix
    /// confirmed so far, every [`PROGRESS_STEP`] rows or more; a refusal
    /// found later may still shorten it (the report has the final word).
    pub async fn publish_batch(
        &self,
        tenant: &str,
        rows: &[OutboxRow],
        claim_held: &(dyn Fn() -> bool + Sync),
        progress: &mut (dyn FnMut(usize) + Send),
    ) -> BatchReport {
        let mut report = BatchReport::default();
        let Some(session) = self.session() else {
            report.refuse(
                0,
                Refusal::new(FailureReason::Connection, "not connected to the broker"),
            );
            return report;
        };
        let channel = match tokio::time::timeout(CONNECT_TIMEOUT, session.confirm_channel()).await {
            Ok(Ok(channel)) => channel,
            Ok(Err(error)) => {
                report.refuse(
                    0,
                    Refusal::new(
                        FailureReason::Connection,
                        format!("cannot open a channel: {error}"),
                    ),
                );
                self.reset();
                return report;
            }
            Err(_) => {
                report.refuse(
                    0,
                    Refusal::new(FailureReason::Timeout, "opening a channel timed out"),
                );
                self.reset();
                return report;
            }
        };
        self.publish_on(&channel, tenant, rows, claim_held, Progress::new(progress))
            .await
    }

    async fn publish_on(
        &self,
        channel: &ConfirmChannel,
        tenant: &str,
        rows: &[OutboxRow],
        claim_held: &(dyn Fn() -> bool + Sync),
        mut progress: Progress<'_>,
    ) -> BatchReport {
        let batch = Batch::new(rows.len());
        for (index, row) in rows.iter().enumerate() {
            // Within the window, and nothing refused so far.
            let refused = loop {
                let now = progress.follow(&batch);
                progress.report(PROGRESS_STEP);
                if now.refused || now.in_flight < self.inner.max_in_flight {
                    break now.refused;
                }
                if !channel.changed(&batch).await {
                    collector_stopped(channel, &batch);
                    break true;
                }
            };
            if refused || !claim_held() {
                break;
            }
            let message = match self.inner.envelope.message(tenant, row) {
                Ok(message) => message,
                Err(refusal) => {
                    batch.state().report.refuse(index, refusal);
                    break;
                }
            };
            channel.publish(
                &batch,
                (index, row.id),
                self.inner.exchange.clone(),
                message,
                Instant::now() + self.inner.confirm_timeout,
            );
        }

        // Everything sent is settled, even after a refusal: a later confirm
        // may carry the return of an earlier row.
        channel.sending_done(&batch);
        loop {
            if progress.follow(&batch).done {
                break;
            }
            // The last step is left to the caller's commit.
            progress.report(PROGRESS_STEP);
            if !channel.changed(&batch).await {
                collector_stopped(channel, &batch);
                break;
            }
        }

        let mut state = batch.state();
        let mut report = std::mem::take(&mut state.report);
        let limit = report.refusal.as_ref().map_or(rows.len(), |(at, _)| *at);
        report.confirmed_at = state
            .confirmed
            .iter()
            .take(limit)
            .map_while(|at| *at)
            .collect();
        report
    }
}

/// Nothing of `batch` is known to be settled: it is not marked.
fn collector_stopped(channel: &ConfirmChannel, batch: &Batch) {
    batch.state().report.refuse(
        0,
        Refusal::new(FailureReason::Other, "the confirm collector stopped"),
    );
    channel.retire();
}

/// Resolves when the session can no longer be used, with why.
async fn watch_session(session: &Session) -> String {
    let mut events = session.connection.events_listener();
    let mut check = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = session.broken.notified() => return "a publish failed or timed out".into(),
            event = events.next() => match event {
                Some(Event::Error(error)) => return error.to_string(),
                Some(Event::ConnectionBlocked(reason)) => {
                    tracing::warn!(%reason, "the broker is blocking publishers");
                }
                Some(Event::ConnectionUnblocked) => tracing::info!("the broker unblocked publishers"),
                Some(_) => {}
                None => return "the connection ended".into(),
            },
            _ = check.tick() => {
                let status = session.connection.status();
                if !status.connected() {
                    return "the connection is no longer open".into();
                }
            }
        }
    }
}
