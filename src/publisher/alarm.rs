//! The session's alarm: how a publish that failed or timed out asks for the
//! connection to be dropped and made again. The session owns it and its
//! supervisor waits on it; a confirm collector and the publisher only raise
//! it, and never reach the session itself.

use std::sync::Arc;

use lapin::ConnectionStatus;
use tokio::sync::Notify;

/// Raised when the connection it belongs to is to be dropped. Cheap to clone:
/// every clone raises the same alarm.
#[derive(Clone)]
pub(super) struct Alarm {
    raised: Arc<Notify>,
    /// The connection's status: whether the broker blocks it.
    status: ConnectionStatus,
}

impl Alarm {
    /// The alarm of the connection whose status is `status`.
    pub fn new(status: ConnectionStatus) -> Alarm {
        Alarm {
            raised: Arc::new(Notify::new()),
            status,
        }
    }

    /// A publish failed or timed out: drop the connection, unless the broker
    /// blocks it, which explains the silence (it is kept until unblocked).
    pub fn raise(&self) {
        if !self.status.blocked() {
            self.raised.notify_one();
        }
    }

    /// Resolves once the alarm is raised (a raise while nobody waits is kept
    /// for the next wait).
    pub async fn raised(&self) {
        self.raised.notified().await;
    }
}
