//! One live connection to the broker and the confirm-mode channel its sweeps
//! share; what ends it ([`watch_session`]). A publish that failed or timed
//! out raises the session's [`Alarm`] rather than reaching back to it.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, Event, ExchangeKind};
use tokio::sync::watch;

use super::alarm::Alarm;
use super::confirms::ConfirmChannel;
use super::isolation::Isolation;
use super::open::open_connection;
use crate::config::AmqpEndpoint;

/// The exchange the relay publishes to, and whether it declares it.
pub(super) struct Exchange {
    /// Checked once (configuration allows ≤ 255 bytes), cloned per message.
    pub name: ShortString,
    pub kind: ExchangeKind,
    /// `declare_exchange`: declared on connecting and on each new channel.
    pub declare: bool,
}

impl Exchange {
    async fn declare_on(&self, channel: &Channel) -> Result<(), lapin::Error> {
        channel
            .exchange_declare(
                self.name.clone(),
                self.kind.clone(),
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
    }
}

/// A live connection and the confirm-mode channel its sweeps share.
pub(super) struct Session {
    /// Which of the target's endpoints it is connected to.
    pub endpoint: usize,
    pub connection: Connection,
    confirm_channel: tokio::sync::Mutex<Option<Arc<ConfirmChannel>>>,
    /// Raised by a publish that failed or timed out; the supervisor drops the
    /// connection then (see [`watch_session`]).
    alarm: Alarm,
}

impl Session {
    /// A connection to endpoint `index`, `target`, with the exchange
    /// declared on it first if `exchange` says so.
    pub async fn open(
        index: usize,
        target: &AmqpEndpoint,
        exchange: &Exchange,
    ) -> Result<Arc<Session>, lapin::Error> {
        let connection = open_connection(target, "outbox-relay").await?;
        if exchange.declare {
            let channel = connection.create_channel().await?;
            exchange.declare_on(&channel).await?;
            let _ = channel.close(200, "declared".into()).await;
        }
        let alarm = Alarm::new(connection.status().clone());
        Ok(Arc::new(Session {
            endpoint: index,
            connection,
            confirm_channel: tokio::sync::Mutex::new(None),
            alarm,
        }))
    }

    /// The broker has blocked the connection (and not unblocked it since):
    /// lapin writes nothing on it meanwhile.
    pub fn is_blocked(&self) -> bool {
        self.connection.status().blocked()
    }

    /// A publish failed or timed out: drop the connection, unless the broker
    /// blocks it, which explains the silence (it is kept until unblocked).
    pub fn broke(&self) {
        self.alarm.raise();
    }

    /// The shared channel, opened anew if there is none or it failed.
    pub async fn confirm_channel(
        &self,
        exchange: &Exchange,
        isolation: &Arc<Isolation>,
    ) -> Result<Arc<ConfirmChannel>, lapin::Error> {
        let mut slot = self.confirm_channel.lock().await;
        if let Some(channel) = slot.as_ref().filter(|c| c.is_usable()) {
            return Ok(channel.clone());
        }
        let channel = self.open_channel(exchange).await?;
        let channel = ConfirmChannel::start(
            channel,
            self.frame_max(),
            self.connection.status().clone(),
            self.alarm.clone(),
            isolation.clone(),
        );
        *slot = Some(channel.clone());
        Ok(channel)
    }

    /// The shared channel, if there is one, taken away (shutdown).
    pub async fn take_confirm_channel(&self) -> Option<Arc<ConfirmChannel>> {
        self.confirm_channel.lock().await.take()
    }

    /// A new confirm-mode channel. With `declare_exchange`, the exchange is
    /// declared on it first, so that one deleted while the relay runs (which
    /// failed the channel before) is there again.
    pub async fn open_channel(&self, exchange: &Exchange) -> Result<Channel, lapin::Error> {
        let channel = self.connection.create_channel().await?;
        if exchange.declare {
            exchange.declare_on(&channel).await?;
        }
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(channel)
    }

    /// The negotiated frame size: every message's properties must fit one
    /// frame.
    pub fn frame_max(&self) -> u32 {
        self.connection.configuration().frame_max()
    }
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

/// Resolves when the session can no longer be used, with why; meanwhile
/// keeps `blocked` in step with the broker's blocking of the connection.
pub(super) async fn watch_session(session: &Session, blocked: &watch::Sender<bool>) -> String {
    let mut events = session.connection.events_listener();
    let mut check = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = session.alarm.raised() => {
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
