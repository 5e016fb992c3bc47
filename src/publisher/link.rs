//! What the publisher's handles share: what the configuration fixed, the
//! session in use (if any), what watchers are told of it, and the channels
//! a batch publishes on.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::Channel;
use lapin::types::ShortString;
use tokio::sync::watch;

use super::confirms::ConfirmChannel;
use super::error::PublishError;
use super::isolation::Isolation;
use super::open::exchange_kind;
use super::session::{Exchange, Session};
use crate::config::{AmqpTarget, Config};
use crate::envelope::Envelope;

/// The relay's link to the broker, shared by every clone of a `Publisher`.
pub(super) struct Link {
    pub target: AmqpTarget,
    pub exchange: Exchange,
    pub envelope: Envelope,
    pub max_in_flight: usize,
    pub confirm_timeout: Duration,
    session: Mutex<Option<Arc<Session>>>,
    connected: watch::Sender<bool>,
    /// The broker blocks the connection (`connection.blocked`).
    pub blocked: watch::Sender<bool>,
    /// The endpoint connected to, by its index in the target.
    endpoint: watch::Sender<Option<usize>>,
    /// Rows to send alone, and what the broker's refusals taught.
    pub isolation: Arc<Isolation>,
}

impl Link {
    pub fn new(config: &Config) -> Result<Link, PublishError> {
        let kind = exchange_kind(&config.exchange_type);
        let (connected, _) = watch::channel(false);
        let (blocked, _) = watch::channel(false);
        let (endpoint, _) = watch::channel(None);
        Ok(Link {
            target: config.amqp_url.clone(),
            exchange: Exchange {
                name: short_string("exchange", &config.exchange)?,
                kind,
                declare: config.declare_exchange,
            },
            envelope: Envelope::from_config(config).map_err(PublishError::Envelope)?,
            max_in_flight: config.max_in_flight,
            confirm_timeout: config.confirm_timeout(),
            session: Mutex::new(None),
            connected,
            blocked,
            endpoint,
            isolation: Arc::new(Isolation::new(&config.exchange, config.declare_exchange)),
        })
    }

    /// A receiver that changes whenever the connection comes up or goes down.
    pub fn watch_connected(&self) -> watch::Receiver<bool> {
        self.connected.subscribe()
    }

    /// A receiver that changes whenever the broker blocks or unblocks the
    /// connection.
    pub fn watch_blocked(&self) -> watch::Receiver<bool> {
        self.blocked.subscribe()
    }

    /// A receiver that changes whenever the endpoint connected to does.
    pub fn watch_endpoint(&self) -> watch::Receiver<Option<usize>> {
        self.endpoint.subscribe()
    }

    pub fn session(&self) -> Option<Arc<Session>> {
        self.session
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn set_session(&self, session: Option<Arc<Session>>) {
        let endpoint = session.as_ref().map(|s| s.endpoint);
        *self.session.lock().unwrap_or_else(|e| e.into_inner()) = session;
        self.connected.send_replace(endpoint.is_some());
        self.endpoint.send_replace(endpoint);
        if endpoint.is_none() {
            self.blocked.send_replace(false);
        }
    }

    /// Drops the connection (after a confirm timeout or a lost channel); the
    /// supervisor reconnects. Not while the broker blocks it (see
    /// [`Session::broke`]).
    pub fn reset(&self) {
        if let Some(session) = self.session() {
            session.broke();
        }
    }

    /// The session's shared confirm channel; a failure drops the connection.
    /// Opening one is a round trip inside a sweep, which holds its claim
    /// meanwhile: it is bounded as a confirm is (`confirm_timeout_ms`), so
    /// that the claim's idle bound (`Config::claim_idle_timeout`) covers it.
    pub async fn confirm_channel(&self) -> Result<Arc<ConfirmChannel>, PublishError> {
        let session = self.publishing_session()?;
        let opened = tokio::time::timeout(
            self.confirm_timeout,
            session.confirm_channel(&self.exchange, &self.isolation),
        )
        .await;
        self.opened(opened)
    }

    /// A confirm-mode channel of its own, for rows sent alone, and the
    /// connection's frame size; a failure drops the connection. Bounded as
    /// [`Self::confirm_channel`] is.
    pub async fn channel_alone(&self) -> Result<(Channel, u32), PublishError> {
        let session = self.publishing_session()?;
        let opened =
            tokio::time::timeout(self.confirm_timeout, session.open_channel(&self.exchange)).await;
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
    pub fn is_blocked(&self) -> bool {
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

fn short_string(what: &'static str, value: &str) -> Result<ShortString, PublishError> {
    ShortString::try_new(value.to_string()).map_err(|_| PublishError::TooLong {
        what,
        len: value.len(),
    })
}
