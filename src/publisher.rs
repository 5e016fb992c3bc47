//! RabbitMQ: one connection, kept up by a supervisor that reconnects with
//! back-off, rotating through the configured endpoints (see `rotation`); one
//! confirm-mode channel shared by the sweeps (see `confirms`);
//! and the publishing of a batch with at most `max_in_flight` unconfirmed
//! messages.
//!
//! A batch's publishes are issued without awaiting each hand-off to the I/O
//! side in turn (each `basic_publish` is polled once, in row order, which is
//! where lapin assigns the delivery tag and queues the frames); the channel's
//! collector settles the confirms, each within `confirm_timeout_ms` of its
//! send. The sweep drives a [`Publishing`], which tells it each time the
//! confirmed prefix has grown by a step, and at last the batch's report.
//!
//! A broker that blocks publishers (`connection.blocked`, a resource alarm)
//! keeps its connection: lapin writes no frame on it until it is unblocked,
//! so nothing new is handed to it meanwhile (see [`Publisher::can_publish`]),
//! the confirms in flight end as timeouts that drop nothing, and the
//! connection is neither reset nor closed while the block lasts. Only a
//! silent connection that is not blocked is dropped and made again.
//!
//! A row that may make the broker close a channel (a suspect, see
//! `isolation`) goes alone, on a channel of its own: a batch is published
//! either as a run of such rows, one at a time, or as a run of the others on
//! the shared channel, and the rest of it is left to the next sweep. A
//! channel-level error never takes the connection down.

mod confirms;
mod isolation;
mod outcome;
mod rotation;
mod spans;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::StreamExt;
use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::{AMQPUriTcpExt, RustlsConnector, TLSConfig};
use lapin::types::{FieldTable, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Channel, Connection, ConnectionProperties, Event, ExchangeKind};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::config::{AmqpEndpoint, AmqpTarget, Config};
use crate::domain::{BatchReport, FailureReason, Lease, OutboxRow, Refusal};
use crate::envelope::Envelope;
use crate::traces::PublishSpan;
use confirms::{Batch, ConfirmChannel};
use isolation::Isolation;
use rotation::Rotation;

pub use outcome::ConfirmOutcome;

/// Deadline for connecting to one endpoint (TCP, TLS, AMQP handshake) and
/// for opening a channel.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The confirmed prefix is reported (see [`Progress::Confirmed`]) in steps
/// of this many rows while the rest of a batch is still being confirmed.
pub const PROGRESS_STEP: usize = 64;
/// Reconnect back-off, after a lost connection and after each round of
/// endpoints that all failed: from this…
const RECONNECT_MIN: Duration = Duration::from_millis(250);
/// …to this.
const RECONNECT_MAX: Duration = Duration::from_secs(10);

/// A failure on the broker side that is not one row's refusal.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A configured name does not fit an AMQP short string.
    #[error("{what} is {len} bytes; AMQP allows at most 255")]
    TooLong { what: &'static str, len: usize },
    /// The configured message templates do not fit AMQP.
    #[error("{0}")]
    Envelope(String),
    #[error("not connected to the broker")]
    NotConnected,
    #[error("cannot open a channel: {0}")]
    Channel(#[source] lapin::Error),
    #[error("opening a channel timed out")]
    ChannelTimeout,
    #[error("{BLOCKED}")]
    Blocked,
}

/// Why nothing more is sent while the broker blocks the connection: the
/// sweep's refusal (reason `timeout`, written on no row).
pub(crate) const BLOCKED: &str = "the broker blocks publishers (connection.blocked: a resource alarm); the rows wait for it to unblock";

impl PublishError {
    /// What a batch that met this error reports for its first row: the
    /// broker's trouble, not the row's, so nothing is written on the row.
    fn refusal(&self) -> Refusal {
        let reason = match self {
            PublishError::ChannelTimeout | PublishError::Blocked => FailureReason::Timeout,
            _ => FailureReason::Connection,
        };
        Refusal::shared(reason, self.to_string())
    }
}

fn short_string(what: &'static str, value: &str) -> Result<ShortString, PublishError> {
    ShortString::try_new(value.to_string()).map_err(|_| PublishError::TooLong {
        what,
        len: value.len(),
    })
}

/// How far a batch being published has come.
#[derive(Debug)]
pub enum Progress {
    /// The broker confirmed the batch's first rows, this many (at least
    /// [`PROGRESS_STEP`] more than last told); a refusal found later may
    /// still shorten the prefix: the report has the final word.
    Confirmed(usize),
    /// Everything sent is settled: what became of the batch.
    Settled(BatchReport),
}

/// A live connection and the confirm-mode channel its sweeps share.
struct Session {
    /// Which of the target's endpoints it is connected to.
    endpoint: usize,
    connection: Connection,
    confirm_channel: tokio::sync::Mutex<Option<Arc<ConfirmChannel>>>,
    broken: Notify,
}

impl Session {
    /// The broker has blocked the connection (and not unblocked it since):
    /// lapin writes nothing on it meanwhile.
    fn is_blocked(&self) -> bool {
        self.connection.status().blocked()
    }

    /// A publish failed or timed out: drop the connection, unless the broker
    /// blocks it, which explains the silence (it is kept until unblocked).
    fn broke(&self) {
        if !self.is_blocked() {
            self.broken.notify_one();
        }
    }

    /// The shared channel, opened anew if there is none or it failed.
    async fn confirm_channel(
        self: &Arc<Self>,
        inner: &Inner,
    ) -> Result<Arc<ConfirmChannel>, lapin::Error> {
        let mut slot = self.confirm_channel.lock().await;
        if let Some(channel) = slot.as_ref().filter(|c| c.is_usable()) {
            return Ok(channel.clone());
        }
        let channel = self.open_channel(inner).await?;
        let channel = ConfirmChannel::start(
            channel,
            self.frame_max(),
            self.connection.status().clone(),
            Arc::downgrade(self),
            inner.isolation.clone(),
        );
        *slot = Some(channel.clone());
        Ok(channel)
    }

    /// A new confirm-mode channel. With `declare_exchange`, the exchange is
    /// declared on it first, so that one deleted while the relay runs (which
    /// failed the channel before) is there again.
    async fn open_channel(&self, inner: &Inner) -> Result<Channel, lapin::Error> {
        let channel = self.connection.create_channel().await?;
        if inner.declare_exchange {
            inner.declare_exchange(&channel).await?;
        }
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(channel)
    }

    /// The negotiated frame size: every message's properties must fit one
    /// frame.
    fn frame_max(&self) -> u32 {
        self.connection.configuration().frame_max()
    }
}

struct Inner {
    target: AmqpTarget,
    /// Checked once here (configuration allows ≤ 255 bytes), cloned per message.
    exchange: ShortString,
    exchange_kind: ExchangeKind,
    declare_exchange: bool,
    envelope: Envelope,
    max_in_flight: usize,
    confirm_timeout: Duration,
    session: Mutex<Option<Arc<Session>>>,
    connected: watch::Sender<bool>,
    /// The broker blocks the connection (`connection.blocked`).
    blocked: watch::Sender<bool>,
    /// The endpoint connected to, by its index in the target.
    endpoint: watch::Sender<Option<usize>>,
    /// Rows to send alone, and what the broker's refusals taught.
    isolation: Arc<Isolation>,
}

impl Inner {
    async fn declare_exchange(&self, channel: &Channel) -> Result<(), lapin::Error> {
        channel
            .exchange_declare(
                self.exchange.clone(),
                self.exchange_kind.clone(),
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
    }
}

/// The relay's side of the broker. Cheap to clone.
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
}

impl Publisher {
    pub fn new(config: &Config) -> Result<Publisher, PublishError> {
        let exchange_kind = match config.exchange_type.as_str() {
            "direct" => ExchangeKind::Direct,
            "fanout" => ExchangeKind::Fanout,
            "topic" => ExchangeKind::Topic,
            "headers" => ExchangeKind::Headers,
            other => ExchangeKind::Custom(other.to_string()),
        };
        let (connected, _) = watch::channel(false);
        let (blocked, _) = watch::channel(false);
        let (endpoint, _) = watch::channel(None);
        Ok(Publisher {
            inner: Arc::new(Inner {
                target: config.amqp_url.clone(),
                exchange: short_string("exchange", &config.exchange)?,
                exchange_kind,
                declare_exchange: config.declare_exchange,
                envelope: Envelope::from_config(config).map_err(PublishError::Envelope)?,
                max_in_flight: config.max_in_flight,
                confirm_timeout: config.confirm_timeout(),
                session: Mutex::new(None),
                connected,
                blocked,
                endpoint,
                isolation: Arc::new(Isolation::new(&config.exchange, config.declare_exchange)),
            }),
        })
    }

    /// Connected to the broker, blocked or not: a blocked connection is up
    /// and kept, and delivery resumes by itself when the broker unblocks it.
    pub fn is_ready(&self) -> bool {
        self.session()
            .is_some_and(|s| s.connection.status().connected())
    }

    /// Connected, and the broker is not blocking publishers: sweeps may start.
    pub fn can_publish(&self) -> bool {
        self.session().is_some_and(|s| {
            let status = s.connection.status();
            status.connected() && !status.blocked()
        })
    }

    /// A receiver that changes whenever the connection comes up or goes down.
    pub fn watch_connected(&self) -> watch::Receiver<bool> {
        self.inner.connected.subscribe()
    }

    /// A receiver that changes whenever the broker blocks or unblocks the
    /// connection (`false` while not connected).
    pub fn watch_blocked(&self) -> watch::Receiver<bool> {
        self.inner.blocked.subscribe()
    }

    /// A receiver that changes whenever the endpoint connected to does
    /// (`None`: not connected); the index is into the target's endpoints.
    pub fn watch_endpoint(&self) -> watch::Receiver<Option<usize>> {
        self.inner.endpoint.subscribe()
    }

    fn session(&self) -> Option<Arc<Session>> {
        self.inner
            .session
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_session(&self, session: Option<Arc<Session>>) {
        let endpoint = session.as_ref().map(|s| s.endpoint);
        *self.inner.session.lock().unwrap_or_else(|e| e.into_inner()) = session;
        self.inner.connected.send_replace(endpoint.is_some());
        self.inner.endpoint.send_replace(endpoint);
        if endpoint.is_none() {
            self.inner.blocked.send_replace(false);
        }
    }

    /// Keeps a connection up until `shutdown` resolves, then closes it
    /// cleanly. Each round tries the endpoints in turn (see [`Rotation`]),
    /// each within [`CONNECT_TIMEOUT`]; the back-off grows with the rounds
    /// that all failed. A lost connection moves on to the next endpoint.
    pub async fn supervise(self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let backoff = Backoff::new(RECONNECT_MIN, RECONNECT_MAX);
        let mut rotation = Rotation::new(self.inner.target.endpoints.len());
        let mut failed_rounds = 0u32;
        loop {
            let connected = tokio::select! {
                connected = self.connect_round(&rotation) => connected,
                () = &mut shutdown => break,
            };
            match connected {
                Some(session) => {
                    failed_rounds = 0;
                    rotation.worked(session.endpoint);
                    let endpoint = self.inner.target.endpoints[session.endpoint].address();
                    tracing::info!(%endpoint, "connected to the broker");
                    self.set_session(Some(session.clone()));
                    let reason = tokio::select! {
                        reason = watch_session(&session, &self.inner.blocked) => reason,
                        () = &mut shutdown => {
                            self.close().await;
                            return;
                        }
                    };
                    self.set_session(None);
                    rotation.lost(session.endpoint);
                    tracing::warn!(%endpoint, reason = %reason, "broker connection lost; reconnecting");
                    // Close what is left so the broker sees the end, without waiting long.
                    let _ = tokio::time::timeout(
                        Duration::from_secs(1),
                        session.connection.close(320, "reconnecting".into()),
                    )
                    .await;
                }
                None => failed_rounds = failed_rounds.saturating_add(1),
            }
            let delay = backoff.delay(failed_rounds.saturating_sub(1));
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = &mut shutdown => break,
            }
        }
        self.close().await;
    }

    /// One round of connection attempts: the endpoints in the rotation's
    /// order, each within [`CONNECT_TIMEOUT`], until one connects.
    async fn connect_round(&self, rotation: &Rotation) -> Option<Arc<Session>> {
        for index in rotation.round() {
            let target = &self.inner.target.endpoints[index];
            let endpoint = target.address();
            match tokio::time::timeout(CONNECT_TIMEOUT, self.connect(index, target)).await {
                Ok(Ok(session)) => return Some(session),
                Ok(Err(error)) => {
                    tracing::warn!(%endpoint, %error, "cannot connect to the broker");
                }
                Err(_) => {
                    tracing::warn!(%endpoint, timeout = ?CONNECT_TIMEOUT, "cannot connect to the broker: timed out");
                }
            }
        }
        None
    }

    async fn connect(
        &self,
        index: usize,
        target: &AmqpEndpoint,
    ) -> Result<Arc<Session>, lapin::Error> {
        let connection = open_connection(target, "outbox-relay").await?;
        if self.inner.declare_exchange {
            let channel = connection.create_channel().await?;
            self.inner.declare_exchange(&channel).await?;
            let _ = channel.close(200, "declared".into()).await;
        }
        Ok(Arc::new(Session {
            endpoint: index,
            connection,
            confirm_channel: tokio::sync::Mutex::new(None),
            broken: Notify::new(),
        }))
    }

    /// Drops the connection (after a confirm timeout or a lost channel); the
    /// supervisor reconnects. Not while the broker blocks it (see
    /// [`Session::broke`]).
    pub fn reset(&self) {
        if let Some(session) = self.session() {
            session.broke();
        }
    }

    /// Closes the connection cleanly (shutdown). A blocked connection can
    /// write no `connection.close`: it is dropped at once.
    pub async fn close(&self) {
        let session = self.session();
        self.set_session(None);
        if let Some(session) = session {
            if session.is_blocked() {
                tracing::warn!(
                    "the broker blocks the connection, which can send nothing: dropped without closing"
                );
                return;
            }
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

    /// Starts publishing `rows` of `tenant`, in order, while `lease` holds:
    /// the caller drives it with [`Publishing::next`]. Only the first run of
    /// rows that go the same way (alone, or on the shared channel) is
    /// published: see [`Publishing::cut_short`].
    pub fn publish<'a>(
        &'a self,
        tenant: &'a str,
        rows: &'a [OutboxRow],
        lease: &'a dyn Lease,
    ) -> Publishing<'a> {
        let (alone, run) = self.inner.isolation.first_run(rows);
        Publishing {
            publisher: self,
            tenant,
            rows: &rows[..run],
            cut_short: run < rows.len(),
            alone,
            lease,
            channel: None,
            batch: Batch::new(run),
            sent: 0,
            sending: true,
            prefix: 0,
            reported: 0,
            spans: Vec::new(),
        }
    }

    /// The session's shared confirm channel; a failure drops the connection.
    /// Opening one is a round trip inside a sweep, which holds its claim
    /// meanwhile: it is bounded as a confirm is (`confirm_timeout_ms`), so
    /// that the claim's idle bound (`Config::claim_idle_timeout`) covers it.
    async fn confirm_channel(&self) -> Result<Arc<ConfirmChannel>, PublishError> {
        let session = self.publishing_session()?;
        let opened = tokio::time::timeout(
            self.inner.confirm_timeout,
            session.confirm_channel(&self.inner),
        )
        .await;
        self.opened(opened)
    }

    /// A confirm-mode channel of its own, for rows sent alone, and the
    /// connection's frame size; a failure drops the connection. Bounded as
    /// [`Self::confirm_channel`] is.
    async fn channel_alone(&self) -> Result<(Channel, u32), PublishError> {
        let session = self.publishing_session()?;
        let opened = tokio::time::timeout(
            self.inner.confirm_timeout,
            session.open_channel(&self.inner),
        )
        .await;
        Ok((self.opened(opened)?, session.frame_max()))
    }

    /// The session, if it is connected and not blocked: a channel opened
    /// on a blocked connection would wait for the unblock.
    fn publishing_session(&self) -> Result<Arc<Session>, PublishError> {
        let session = self.session().ok_or(PublishError::NotConnected)?;
        if session.is_blocked() {
            return Err(PublishError::Blocked);
        }
        Ok(session)
    }

    /// The broker blocks the connection in use: nothing more is to be sent.
    fn is_blocked(&self) -> bool {
        self.session().is_some_and(|s| s.is_blocked())
    }

    fn opened<T>(
        &self,
        opened: Result<Result<T, lapin::Error>, tokio::time::error::Elapsed>,
    ) -> Result<T, PublishError> {
        let error = match opened {
            Ok(Ok(channel)) => return Ok(channel),
            Ok(Err(error)) => PublishError::Channel(error),
            Err(_) => PublishError::ChannelTimeout,
        };
        self.reset();
        Err(error)
    }
}

/// One batch being published: its rows go out in order, at most
/// `max_in_flight` unconfirmed, until all are sent, one is refused, or the
/// lease is lost; every message sent is then settled.
pub struct Publishing<'a> {
    publisher: &'a Publisher,
    tenant: &'a str,
    /// The run of the batch this sweep publishes.
    rows: &'a [OutboxRow],
    /// Rows of the batch follow the run: they go another way.
    cut_short: bool,
    /// The run goes alone, one row at a time, on a channel of its own.
    alone: bool,
    lease: &'a dyn Lease,
    channel: Option<Arc<ConfirmChannel>>,
    batch: Arc<Batch>,
    /// Rows handed to the channel so far.
    sent: usize,
    /// More rows may still be sent.
    sending: bool,
    /// Rows confirmed from the start, as last seen, and as last told.
    prefix: usize,
    reported: usize,
    /// Each row's span, by its index, while tracing is on (empty when off).
    spans: Vec<Option<PublishSpan>>,
}

impl Publishing<'_> {
    /// Whether rows of the batch were left for the next sweep, because they
    /// go another way (alone, or on the shared channel) than those before
    /// them: the tenant is to be swept again at once.
    pub fn cut_short(&self) -> bool {
        self.cut_short
    }

    /// Sends what the window allows and waits until the confirmed prefix has
    /// grown by a [`PROGRESS_STEP`] or everything sent is settled.
    pub async fn next(&mut self) -> Progress {
        if self.alone {
            return Progress::Settled(self.publish_alone().await);
        }
        let channel = match &self.channel {
            Some(channel) => channel.clone(),
            None => match self.publisher.confirm_channel().await {
                Ok(channel) => self.channel.insert(channel).clone(),
                Err(error) => return Progress::Settled(BatchReport::refused(error.refusal())),
            },
        };
        loop {
            let now = self.follow();
            if now.done {
                return Progress::Settled(self.report());
            }
            // The last step is left to the caller's settlement.
            if self.prefix >= self.reported + PROGRESS_STEP {
                self.reported = self.prefix;
                return Progress::Confirmed(self.prefix);
            }
            if self.sending {
                if now.refused || self.sent == self.rows.len() || !self.lease.is_held() {
                    // Everything sent is settled, even after a refusal: a
                    // later confirm may carry the return of an earlier row.
                    self.sending = false;
                    channel.sending_done(&self.batch);
                    continue;
                }
                if now.in_flight < self.publisher.inner.max_in_flight {
                    if channel.is_blocked() {
                        // Nothing new is handed to lapin: the rows from here
                        // wait for the unblock; those in flight are settled.
                        self.batch
                            .state()
                            .report
                            .refuse(self.sent, Refusal::shared(FailureReason::Timeout, BLOCKED));
                        continue;
                    }
                    self.send(&channel);
                    continue;
                }
            }
            if !channel.changed(&self.batch).await {
                // Nothing of the batch is known to be settled: it is not marked.
                self.batch.state().report.refuse(
                    0,
                    Refusal::new(FailureReason::Other, "the confirm collector stopped"),
                );
                channel.retire();
                return Progress::Settled(self.report());
            }
        }
    }

    /// Sends the run's rows one at a time, each alone on a channel of its
    /// own and confirmed before the next, until one is refused: whatever the
    /// broker says of a row is that row's.
    async fn publish_alone(&self) -> BatchReport {
        let publisher = self.publisher;
        let inner = &publisher.inner;
        let (channel, frame_max) = match publisher.channel_alone().await {
            Ok(opened) => opened,
            Err(error) => return BatchReport::refused(error.refusal()),
        };
        let mut report = BatchReport::default();
        for (index, row) in self.rows.iter().enumerate() {
            if !self.lease.is_held() {
                break;
            }
            if publisher.is_blocked() {
                report.refuse(index, Refusal::shared(FailureReason::Timeout, BLOCKED));
                break;
            }
            let exchange = inner.exchange.as_str();
            let (message, span) =
                spans::message(&inner.envelope, exchange, self.tenant, row, frame_max);
            let sent = match message {
                Ok(message) => {
                    let sent = isolation::send_alone(
                        &inner.isolation,
                        &channel,
                        inner.exchange.clone(),
                        message,
                        row,
                        inner.confirm_timeout,
                    )
                    .await;
                    if let Some(span) = span {
                        match &sent {
                            Ok(at) => span.confirmed(*at),
                            Err(refusal) => spans::refused(span, self.tenant, row.id, refusal),
                        }
                    }
                    sent
                }
                Err(refusal) => Err(refusal),
            };
            match sent {
                Ok(confirmed_at) => report.confirmed_at.push(confirmed_at),
                Err(mut refusal) => {
                    if refusal.reason == FailureReason::Timeout {
                        if publisher.is_blocked() {
                            // Not the row's doing: the broker blocks.
                            refusal = Refusal::shared(FailureReason::Timeout, BLOCKED);
                        }
                        // A silent connection: drop it, as the collector
                        // does (not while blocked, see `Session::broke`).
                        publisher.reset();
                    }
                    report.refuse(index, refusal);
                    break;
                }
            }
        }
        if channel.status().connected() {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                channel.close(200, "sent alone".into()),
            )
            .await;
        }
        report
    }

    /// Hands the next row to the channel, or refuses it if it cannot be a
    /// message.
    fn send(&mut self, channel: &ConfirmChannel) {
        let index = self.sent;
        let row = &self.rows[index];
        self.sent += 1;
        let inner = &self.publisher.inner;
        let frame_max = channel.frame_max();
        let exchange = inner.exchange.as_str();
        let (message, span) =
            spans::message(&inner.envelope, exchange, self.tenant, row, frame_max);
        match message {
            Ok(message) => {
                if let Some(span) = span {
                    self.spans.resize_with(index, || None);
                    self.spans.push(Some(span));
                }
                channel.publish(
                    &self.batch,
                    (index, row.id),
                    inner.exchange.clone(),
                    message,
                    Instant::now() + inner.confirm_timeout,
                );
            }
            Err(refusal) => self.batch.state().report.refuse(index, refusal),
        }
    }

    /// Ends the spans of the rows sent (tracing on): each at its confirm, or
    /// with the batch's refusal.
    fn end_spans(&mut self, confirmed: &[Option<SystemTime>], refusal: Option<&(usize, Refusal)>) {
        for (index, span) in self.spans.drain(..).enumerate() {
            let Some(span) = span else { continue };
            let refusal = refusal.map(|(at, refusal)| (*at == index, refusal));
            let confirmed_at = confirmed.get(index).copied().flatten();
            spans::end(
                span,
                self.tenant,
                self.rows[index].id,
                confirmed_at,
                refusal,
            );
        }
    }

    /// Catches up with what the collector has settled: while nothing is
    /// refused, the prefix reaches over every row confirmed from the start.
    fn follow(&mut self) -> BatchNow {
        let state = self.batch.state();
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

    /// The batch's report: the confirmed prefix up to the first refusal.
    fn report(&mut self) -> BatchReport {
        let mut state = self.batch.state();
        let mut report = std::mem::take(&mut state.report);
        // A row the broker nacked or returned goes alone until it is
        // confirmed: retrying it with the window behind it would send those
        // rows again at every retry (duplicates for every other queue bound).
        if let Some((at, refusal)) = &report.refusal
            && refusal.attributed
            && matches!(
                refusal.reason,
                FailureReason::Nack | FailureReason::Unroutable
            )
            && let Some(row) = self.rows.get(*at)
        {
            self.publisher.inner.isolation.suspect(row.id);
        }
        let limit = report
            .refusal
            .as_ref()
            .map_or(self.rows.len(), |(at, _)| *at);
        report.confirmed_at = state
            .confirmed
            .iter()
            .take(limit)
            .map_while(|at| *at)
            .collect();
        // The spans end (and a refusal is logged) once the batch is let go.
        let confirmed = (!self.spans.is_empty()).then(|| state.confirmed.clone());
        drop(state);
        if let Some(confirmed) = confirmed {
            self.end_spans(&confirmed, report.refusal.as_ref());
        }
        report
    }
}

/// Where a batch stands, as its publisher last looked.
struct BatchNow {
    in_flight: usize,
    refused: bool,
    done: bool,
}

/// An error the broker raised on one channel, closing it and not the
/// connection (an AMQP soft error).
fn is_channel_level(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if matches!(amqp.kind(), lapin::protocol::AMQPErrorKind::Soft(_))
    )
}

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
}

/// A connection named `name` to the first of `target`'s endpoints that takes
/// one, and a channel on it: what a command of its own (`tail`, `replay`)
/// publishes or consumes on.
pub async fn open_channel(
    target: &AmqpTarget,
    name: &str,
) -> Result<(Connection, Channel), OpenError> {
    let connection = open_first(target, name)
        .await
        .map_err(|source| OpenError::Connect {
            url: target.to_string(),
            source,
        })?;
    let channel = connection
        .create_channel()
        .await
        .map_err(OpenError::Channel)?;
    Ok((connection, channel))
}

/// A connection to the first of `target`'s endpoints that takes one, tried
/// in order; the last endpoint's error if none does.
pub async fn open_first(target: &AmqpTarget, name: &str) -> Result<Connection, lapin::Error> {
    let mut endpoints = target.endpoints.iter();
    let mut last = endpoints.next().expect("a target has an endpoint");
    for next in endpoints {
        match open_connection(last, name).await {
            Ok(connection) => return Ok(connection),
            Err(error) => {
                tracing::debug!(endpoint = %last.address(), %error, "cannot connect; trying the next endpoint");
            }
        }
        last = next;
    }
    open_connection(last, name).await
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

/// Resolves when the session can no longer be used, with why; meanwhile
/// keeps `blocked` in step with the broker's blocking of the connection.
async fn watch_session(session: &Session, blocked: &watch::Sender<bool>) -> String {
    let mut events = session.connection.events_listener();
    let mut check = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = session.broken.notified() => {
                // Asked for before the block was seen: the block explains
                // the silence, and the connection is kept.
                if session.is_blocked() {
                    tracing::debug!("a publish timed out while the broker blocks; the connection is kept");
                } else {
                    return "a publish failed or timed out".into();
                }
            }
            event = events.next() => match event {
                // A channel the broker closed (one message's refusal, say)
                // is the channel's business: the connection goes on.
                Some(Event::Error(error)) if is_channel_level(&error) && session.connection.status().connected() => {
                    tracing::debug!(%error, "a channel was closed by the broker");
                }
                Some(Event::Error(error)) => return error.to_string(),
                Some(Event::ConnectionBlocked(reason)) => {
                    tracing::warn!(%reason, "the broker is blocking publishers; the connection is kept, and the rows wait until it unblocks");
                    blocked.send_replace(true);
                }
                Some(Event::ConnectionUnblocked) => {
                    tracing::info!("the broker unblocked publishers");
                    blocked.send_replace(false);
                }
                Some(_) => {}
                None => return "the connection ended".into(),
            },
            _ = check.tick() => {
                let status = session.connection.status();
                if !status.connected() {
                    return "the connection is no longer open".into();
                }
                // The events may have been missed (a lagging listener).
                blocked.send_if_modified(|was| {
                    let changed = *was != status.blocked();
                    *was = status.blocked();
                    changed
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_a_timeout_written_on_no_row() {
        let refusal = PublishError::Blocked.refusal();
        assert_eq!(refusal.reason, FailureReason::Timeout);
        assert!(!refusal.attributed, "the broker's trouble, not the row's");
        assert!(refusal.detail.contains("blocks publishers"));
    }
}
