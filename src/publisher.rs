//! RabbitMQ: one connection, kept up by a supervisor that reconnects with
//! back-off; confirm-mode channels, one per sweep at a time; and the publish of
//! a batch with at most `max_in_flight` unconfirmed messages.
//!
//! A batch's publishes are issued without awaiting each hand-off to the I/O
//! side in turn (each `basic_publish` is polled once, in row order, which is
//! where lapin assigns the delivery tag and queues the frames), then their
//! confirms are settled in order, each within `confirm_timeout_ms` of its send.
//!
//! lapin reports a returned (unroutable) message as an ack that carries it, and
//! with a multiple-ack it may attach the return to a neighbour's confirm. The
//! returned message's `message_id` is the row id, so that is what identifies
//! the refused row.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Waker};
use std::time::{Duration, SystemTime};

use futures_util::StreamExt;
use futures_util::future::{MaybeDone, maybe_done};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::uri::AMQPUri;
use lapin::{Channel, Confirmation, Connection, ConnectionProperties, Event, ExchangeKind};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::config::Config;
use crate::envelope::{Envelope, Refusal};
use crate::metrics::{FailureReason, Metrics};
use crate::redact::redact_url;
use crate::store::OutboxRow;

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

    fn refuse(&mut self, index: usize, refusal: Refusal) {
        if self.refusal.as_ref().is_none_or(|(at, _)| index < *at) {
            self.refusal = Some((index, refusal));
        }
    }
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

    /// A message was settled: while nothing is refused, the prefix reaches
    /// over every row confirmed from the start.
    fn settled(&mut self, confirmed: &[Option<SystemTime>], report: &BatchReport) {
        if report.refusal.is_none() {
            self.prefix += confirmed[self.prefix..]
                .iter()
                .take_while(|at| at.is_some())
                .count();
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

/// A live connection and its idle confirm-mode channels.
struct Session {
    connection: Connection,
    idle_channels: Mutex<Vec<Channel>>,
    broken: Notify,
}

impl Session {
    fn is_usable(&self) -> bool {
        let status = self.connection.status();
        status.connected() && !status.blocked()
    }

    async fn checkout(&self) -> Result<Channel, lapin::Error> {
        let idle = self
            .idle_channels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        if let Some(channel) = idle.filter(|c| c.status().connected()) {
            return Ok(channel);
        }
        let channel = self.connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(channel)
    }

    fn checkin(&self, channel: Channel) {
        if channel.status().connected() {
            self.idle_channels
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(channel);
        }
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

type ConfirmFuture<'a> =
    Pin<Box<MaybeDone<Pin<Box<dyn Future<Output = lapin::Result<Confirmation>> + Send + 'a>>>>>;

/// A published message whose confirm is not settled yet.
struct InFlight<'a> {
    index: usize,
    deadline: Instant,
    confirm: ConfirmFuture<'a>,
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
            idle_channels: Mutex::new(Vec::new()),
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
            let channels = std::mem::take(
                &mut *session
                    .idle_channels
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()),
            );
            for channel in channels {
                let _ = tokio::time::timeout(
                    Duration::from_secs(1),
                    channel.close(200, "shutdown".into()),
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
        let channel = match tokio::time::timeout(CONNECT_TIMEOUT, session.checkout()).await {
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

        let (clean, report) = self
            .publish_on(
                &session,
                &channel,
                tenant,
                rows,
                claim_held,
                Progress::new(progress),
            )
            .await;
        if clean {
            session.checkin(channel);
        } else {
            // The channel may hold unsettled confirms: never reuse it.
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(1),
                    channel.close(200, "abandoned".into()),
                )
                .await;
            });
        }
        report
    }

    /// Returns whether the channel ended with nothing unsettled, and the report.
    async fn publish_on<'a>(
        &self,
        session: &Session,
        channel: &'a Channel,
        tenant: &str,
        rows: &'a [OutboxRow],
        claim_held: &(dyn Fn() -> bool + Sync),
        mut progress: Progress<'_>,
    ) -> (bool, BatchReport) {
        let mut outcome = BatchReport::default();
        let report = &mut outcome;
        let mut in_flight: VecDeque<InFlight<'a>> =
            VecDeque::with_capacity(self.inner.max_in_flight);
        let mut confirmed: Vec<Option<SystemTime>> = vec![None; rows.len()];
        let mut clean = true;

        'send: for (index, row) in rows.iter().enumerate() {
            while in_flight.len() >= self.inner.max_in_flight {
                if !self
                    .settle_oldest(session, rows, &mut in_flight, &mut confirmed, report)
                    .await
                {
                    clean = false;
                    break 'send;
                }
                progress.settled(&confirmed, report);
            }
            progress.report(PROGRESS_STEP);
            if report.refusal.is_some() || !claim_held() {
                break;
            }
            let message = match self.inner.envelope.message(tenant, row) {
                Ok(message) => message,
                Err(refusal) => {
                    report.refuse(index, refusal);
                    break;
                }
            };
            let send = channel.basic_publish(
                self.inner.exchange.clone(),
                message.routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                message.body,
                message.properties,
            );
            let publish: Pin<Box<dyn Future<Output = lapin::Result<Confirmation>> + Send + 'a>> =
                Box::pin(async move { send.await?.await });
            let mut confirm = Box::pin(maybe_done(publish));
            // The first poll assigns the delivery tag and queues the frames, in
            // row order. It leaves a no-op waker behind: lapin's I/O thread
            // would otherwise wake this task once when the frames are written
            // and once when the confirm lands, for every message. Only the
            // message being settled registers a real waker (see `settle`).
            let _ = confirm
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()));
            in_flight.push_back(InFlight {
                index,
                deadline: Instant::now() + self.inner.confirm_timeout,
                confirm,
            });
        }

        if clean {
            // Settle everything sent, even after a refusal: a later confirm may
            // carry the return of an earlier row, and the channel must be empty
            // before it is reused. In steps: the broker confirms mostly in
            // order, so waiting for a step's newest confirm first (within the
            // oldest's deadline) wakes this task once per step rather than
            // once per ack frame; the step is then settled in order.
            'settle: while !in_flight.is_empty() {
                let step = in_flight.len().min(PROGRESS_STEP);
                let deadline = in_flight[0].deadline;
                let newest = &mut in_flight[step - 1];
                let _ = tokio::time::timeout_at(deadline, newest.confirm.as_mut()).await;
                for _ in 0..step {
                    if !self
                        .settle_oldest(session, rows, &mut in_flight, &mut confirmed, report)
                        .await
                    {
                        clean = false;
                        break 'settle;
                    }
                    progress.settled(&confirmed, report);
                }
                // The last step is left to the caller's commit.
                if !in_flight.is_empty() {
                    progress.report(1);
                }
            }
        }

        let limit = report.refusal.as_ref().map_or(rows.len(), |(at, _)| *at);
        report.confirmed_at = confirmed
            .into_iter()
            .take(limit)
            .map_while(|at| at)
            .collect();
        (clean, outcome)
    }

    /// Settles the oldest message in flight (see `settle`).
    async fn settle_oldest(
        &self,
        session: &Session,
        rows: &[OutboxRow],
        in_flight: &mut VecDeque<InFlight<'_>>,
        confirmed: &mut [Option<SystemTime>],
        report: &mut BatchReport,
    ) -> bool {
        let oldest = in_flight.pop_front().expect("a message is in flight");
        self.settle(session, rows, oldest, confirmed, report).await
    }

    /// Waits for one message's confirm. Returns `false` when the channel can no
    /// longer be trusted (timeout or error).
    async fn settle(
        &self,
        session: &Session,
        rows: &[OutboxRow],
        mut message: InFlight<'_>,
        confirmed: &mut [Option<SystemTime>],
        report: &mut BatchReport,
    ) -> bool {
        if tokio::time::timeout_at(message.deadline, message.confirm.as_mut())
            .await
            .is_err()
        {
            report.refuse(
                message.index,
                Refusal::new(
                    FailureReason::Timeout,
                    format!(
                        "no confirm from the broker within {} ms",
                        self.inner.confirm_timeout.as_millis()
                    ),
                ),
            );
            self.reset();
            return false;
        }
        let outcome = message
            .confirm
            .as_mut()
            .take_output()
            .expect("a completed future has its output");
        match outcome {
            Ok(Confirmation::Ack(None)) => {
                confirmed[message.index] = Some(SystemTime::now());
                true
            }
            Ok(Confirmation::Ack(Some(returned))) => {
                let returned_id = returned
                    .delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|id| id.as_str().parse::<i64>().ok());
                let index = returned_id
                    .and_then(|id| rows.binary_search_by_key(&id, |r| r.id).ok())
                    .unwrap_or(message.index);
                if index != message.index {
                    confirmed[message.index] = Some(SystemTime::now());
                }
                let detail = format!(
                    "returned by the broker: {} {} (no queue bound for routing key {:?})",
                    returned.reply_code,
                    returned.reply_text,
                    returned.delivery.routing_key.as_str()
                );
                report.refuse(index, Refusal::new(FailureReason::Unroutable, detail));
                true
            }
            Ok(Confirmation::Nack(_)) => {
                report.refuse(
                    message.index,
                    Refusal::new(FailureReason::Nack, "the broker nacked the message"),
                );
                true
            }
            Ok(Confirmation::NotRequested) => {
                report.refuse(
                    message.index,
                    Refusal::new(FailureReason::Other, "the channel is not in confirm mode"),
                );
                false
            }
            Err(error) => {
                let reason = if session.connection.status().connected() {
                    FailureReason::Other
                } else {
                    FailureReason::Connection
                };
                report.refuse(message.index, Refusal::new(reason, error.to_string()));
                if reason == FailureReason::Connection {
                    self.reset();
                }
                false
            }
        }
    }
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
