//! Whether the wake-up connection keeps its session between transactions,
//! asked before it takes the wake-up lock or LISTENs. Through a pool that
//! lends a server connection per transaction (PgBouncer's transaction
//! pooling), a LISTEN and a session-level lock would land on whichever
//! server connection was lent, and stay there for its next clients.
//!
//! A pool that lends the connection it got back last (PgBouncer's default)
//! has two statements in a row share a backend pid even through it; one that
//! spreads its lending (`server_round_robin`) gives the next statement
//! another, mostly. So the wake-up connection reads its backend pid twice in
//! a row, then once more while a second connection to the same URL holds a
//! transaction open, which keeps whatever server connection it was lent
//! (the one just released, from the first kind of pool), [`ROUNDS`] over.
//! The session holds when every read agrees and the second connection never
//! saw that pid. A statement of its own session never waits for the other's
//! transaction: one that does has no session of its own (nor the pool a
//! server connection to lend).

use std::time::Duration;

use tokio_postgres::{Client, Connection, Socket};

use super::{Lost, Wakeups, first_value, simple_while_listening};
use crate::config::DatabaseTarget;
use crate::store::{TlsStream, connect};

/// How long the wake-up connection's statement may wait while the other
/// connection holds its transaction: its own session answers at once.
const LEND_WAIT: Duration = Duration::from_secs(3);

/// The check's rounds. A busy pool can fool one: another client takes the
/// server connection just released before the other connection's `BEGIN`
/// does, and the wake-up connection, waiting beside it, gets it back (3
/// rounds were fooled in a suite sharing a 2-connection pool with busy
/// relays). A round costs four round trips, so the check stays well under
/// a second, and every round is another chance to see the pool lend.
const ROUNDS: usize = 16;

/// Whether the connection (`client`, `connection`) to `target` keeps its
/// session between transactions: in each of [`ROUNDS`] rounds, its backend
/// pid read twice in a row, then once more while the other connection holds
/// a transaction open, always the same, and never the other's. Nothing it
/// runs stays in a session.
pub(super) async fn keeps_session(
    target: &DatabaseTarget,
    client: &Client,
    connection: &mut Connection<Socket, TlsStream>,
    wakeups: &Wakeups,
) -> Result<bool, Lost> {
    const PID: &str = "SELECT pg_backend_pid()";
    let (other, other_connection) = connect(target).await?;
    let check = async {
        let own = first_value(&simple_while_listening(client, connection, wakeups, PID).await?);
        for _ in 0..ROUNDS {
            let again = simple_while_listening(client, connection, wakeups, PID).await?;
            let held = other.simple_query(&format!("BEGIN; {PID}")).await?;
            let meanwhile = tokio::time::timeout(
                LEND_WAIT,
                simple_while_listening(client, connection, wakeups, PID),
            )
            .await;
            other.batch_execute("ROLLBACK").await?;
            let Ok(meanwhile) = meanwhile else {
                return Ok(false);
            };
            let [again, held, meanwhile] =
                [&again, &held, &meanwhile?].map(|answer| first_value(answer));
            if own.is_none() || again != own || meanwhile != own || held == own {
                return Ok(false);
            }
        }
        Ok::<_, Lost>(true)
    };
    tokio::pin!(other_connection);
    tokio::select! {
        checked = check => checked,
        closed = &mut other_connection => Err(closed.err().map_or(Lost::Closed, Lost::from)),
    }
}
