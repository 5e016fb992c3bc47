//! RabbitMQ: one connection, kept up by a supervisor that reconnects with
//! back-off, rotating through the configured endpoints (see `rotation`); one
//! confirm-mode channel shared by the sweeps (see `confirms`);
//! and the publishing of a batch with at most `max_in_flight` unconfirmed
//! messages.
//!
//! A batch's publishes are issued without awaiting each hand-off to the I/O
//! side in turn (each `basic_publish` is polled once, in row order, which is
//! where lapin assigns the delivery tag and queues the frames); the channel's
//! collector resolves the confirms, each within `confirm_timeout_ms` of its
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
//!
//! The rooms, each using only those below it: `supervisor` (keeping the
//! connection up) and `publishing` (one batch) work through `link` (what the
//! handles share); `link` holds a `session` (a connection and its shared
//! channel); the session starts the `confirms` collector and owns the
//! `alarm` the collector raises; `isolation` judges what the broker closed a
//! channel over; `outcome` says what a confirm means, for every sender.
//! `open` makes connections, `rotation` orders the endpoints, `spans` traces
//! each row, and `error` is what goes wrong that is no row's doing.

mod alarm;
mod confirms;
mod error;
mod isolation;
mod link;
mod open;
mod outcome;
mod publishing;
mod rotation;
mod session;
mod spans;
mod supervisor;

use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;

use crate::config::Config;
use crate::domain::OutboxRow;
use link::Link;

pub use error::PublishError;
pub use open::{
    OpenError, close, exchange_kind, in_time, open_channel, open_connection, open_first,
};
pub use outcome::{ConfirmOutcome, unroutable};
pub use publishing::{PROGRESS_STEP, Progress, Publishing};
pub(crate) use spans::message as traced_message;
pub use supervisor::CONNECT_TIMEOUT;

/// The relay's side of the broker. Cheap to clone.
#[derive(Clone)]
pub struct Publisher {
    link: Arc<Link>,
}

impl Publisher {
    pub fn new(config: &Config) -> Result<Publisher, PublishError> {
        Ok(Publisher {
            link: Arc::new(Link::new(config)?),
        })
    }

    /// Connected to the broker, blocked or not: a blocked connection is up
    /// and kept, and delivery resumes by itself when the broker unblocks it.
    pub fn is_ready(&self) -> bool {
        self.link
            .session()
            .is_some_and(|s| s.connection.status().connected())
    }

    /// Connected, and the broker is not blocking publishers: sweeps may start.
    pub fn can_publish(&self) -> bool {
        self.link.session().is_some_and(|s| {
            let status = s.connection.status();
            status.connected() && !status.blocked()
        })
    }

    /// A receiver that changes whenever the connection comes up or goes down.
    pub fn watch_connected(&self) -> watch::Receiver<bool> {
        self.link.watch_connected()
    }

    /// A receiver that changes whenever the broker blocks or unblocks the
    /// connection (`false` while not connected).
    pub fn watch_blocked(&self) -> watch::Receiver<bool> {
        self.link.watch_blocked()
    }

    /// A receiver that changes whenever the endpoint connected to does
    /// (`None`: not connected); the index is into the target's endpoints.
    pub fn watch_endpoint(&self) -> watch::Receiver<Option<usize>> {
        self.link.watch_endpoint()
    }

    /// Keeps a connection up until `shutdown` resolves, then closes it
    /// cleanly (see `supervisor`): each round tries the endpoints in turn,
    /// each within [`CONNECT_TIMEOUT`]; the back-off grows with the rounds
    /// that all failed. A lost connection moves on to the next endpoint.
    pub async fn supervise(self, shutdown: impl Future<Output = ()>) {
        supervisor::supervise(&self.link, shutdown).await;
    }

    /// Drops the connection (after a confirm timeout or a lost channel); the
    /// supervisor reconnects. Not while the broker blocks it.
    pub fn reset(&self) {
        self.link.reset();
    }

    /// Closes the connection cleanly (shutdown). A blocked connection can
    /// write no `connection.close`: it is dropped at once.
    pub async fn close(&self) {
        supervisor::close(&self.link).await;
    }

    /// Starts publishing `rows` of `tenant`, in order: the caller drives it
    /// with [`Publishing::next`], passing the rows and the claim each time.
    /// Only the first run of rows that go the same way (alone, or on the
    /// shared channel) is published: see [`Publishing::cut_short`].
    pub fn publish<'a>(&'a self, tenant: &'a str, rows: &[OutboxRow]) -> Publishing<'a> {
        Publishing::new(&self.link, tenant, rows)
    }
}
