//! Whether the wake-up connection keeps its session between transactions,
//! asked before it takes the wake-up lock or LISTENs. Through a pool that
//! lends a server connection per transaction (PgBouncer's transaction
//! pooling), a LISTEN and a session-level lock would land on whichever
//! server connection was lent, and stay there for its next clients.
//!
//! A pool usually lends the connection it got back last, so two statements
//! in a row share a backend pid even through one. So a second connection to
//! the same URL holds a transaction open in between, which keeps whatever
//! server connection it was lent: the wake-up connection's session holds
//! when it sees the same backend pid in both of its statements and the
//! second connection another one. A statement of its own session never
//! waits for the other's transaction: one that does has no session of its
//! own (nor the pool a server connection to lend).

use std::time::Duration;

use tokio_postgres::{Client, Connection, Socket};

use super::{Lost, Wakeups, first_value, simple_while_listening};
use crate::config::DatabaseTarget;
use crate::store::{TlsStream, connect};

/// How long the wake-up connection's second statement may wait while the
/// other connection holds its transaction: its own session answers at once.
const LEND_WAIT: Duration = Duration::from_secs(3);

/// Whether the connection (`client`, `connection`) to `target` keeps its
/// session between transactions. It runs two statements, and nothing that
/// stays in the session.
pub(super) async fn keeps_session(
    target: &DatabaseTarget,
    client: &Client,
    connection: &mut Connection<Socket, TlsStream>,
    wakeups: &Wakeups,
) -> Result<bool, Lost> {
    const PID: &str = "SELECT pg_backend_pid()";
    let first = simple_while_listening(client, connection, wakeups, PID).await?;
    let (other, other_connection) = connect(target).await?;
    let check = async {
        let held = other.simple_query(&format!("BEGIN; {PID}")).await?;
        let second = tokio::time::timeout(
            LEND_WAIT,
            simple_while_listening(client, connection, wakeups, PID),
        )
        .await;
        other.batch_execute("ROLLBACK").await?;
        let Ok(second) = second else {
            return Ok(false);
        };
        let [first, second, held] = [&first, &second?, &held].map(|answer| first_value(answer));
        Ok::<_, Lost>(first.is_some() && first == second && held != first)
    };
    tokio::pin!(other_connection);
    tokio::select! {
        checked = check => checked,
        closed = &mut other_connection => Err(closed.err().map_or(Lost::Closed, Lost::from)),
    }
}
