//! Keeping a connection up: the supervisor connects, rotating through the
//! configured endpoints (see `rotation`) with back-off between rounds that
//! all failed, watches the session until it breaks, and closes it cleanly at
//! shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::link::Link;
use super::rotation::Rotation;
use super::session::{Session, watch_session};
use crate::backoff::Backoff;

/// Deadline for connecting to one endpoint (TCP, TLS, AMQP handshake) and
/// for opening a channel.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Reconnect back-off, after a lost connection and after each round of
/// endpoints that all failed: from this…
const RECONNECT_MIN: Duration = Duration::from_millis(250);
/// …to this.
const RECONNECT_MAX: Duration = Duration::from_secs(10);

/// Keeps a connection up until `shutdown` resolves, then closes it
/// cleanly. Each round tries the endpoints in turn (see [`Rotation`]),
/// each within [`CONNECT_TIMEOUT`]; the back-off grows with the rounds
/// that all failed. A lost connection moves on to the next endpoint.
pub(super) async fn supervise(link: &Link, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    let backoff = Backoff::new(RECONNECT_MIN, RECONNECT_MAX);
    let mut rotation = Rotation::new(link.target.endpoints.len());
    let mut failed_rounds = 0u32;
    loop {
        let connected = tokio::select! {
            connected = connect_round(link, &rotation) => connected,
            () = &mut shutdown => break,
        };
        match connected {
            Some(session) => {
                failed_rounds = 0;
                rotation.worked(session.endpoint);
                let endpoint = link.target.endpoints[session.endpoint].address();
                tracing::info!(%endpoint, "connected to the broker");
                link.set_session(Some(session.clone()));
                let reason = tokio::select! {
                    reason = watch_session(&session, &link.blocked) => reason,
                    () = &mut shutdown => {
                        close(link).await;
                        return;
                    }
                };
                link.set_session(None);
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
    close(link).await;
}

/// One round of connection attempts: the endpoints in the rotation's
/// order, each within [`CONNECT_TIMEOUT`], until one connects.
async fn connect_round(link: &Link, rotation: &Rotation) -> Option<Arc<Session>> {
    for index in rotation.round() {
        let target = &link.target.endpoints[index];
        let endpoint = target.address();
        let connect = Session::open(index, target, &link.exchange);
        match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
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

/// Closes the connection cleanly (shutdown). A blocked connection can
/// write no `connection.close`: it is dropped at once.
pub(super) async fn close(link: &Link) {
    let session = link.session();
    link.set_session(None);
    if let Some(session) = session {
        if session.is_blocked() {
            tracing::warn!(
                "the broker blocks the connection, which can send nothing: dropped without closing"
            );
            return;
        }
        let channel = session.take_confirm_channel().await;
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
