//! What an upgrade step waits for: a lock on the table that other
//! transactions hold (each named by its pid, or a prepared transaction by
//! its gid), and relays older than this build that still read the table
//! (which `migrate --finish` refuses to run beside).

use std::fmt;

use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use super::{LEVEL, Migration};
use crate::config::Config;
use crate::sql::{qualified_table, quote_literal, relays_prefix};
use crate::store::{QUERY_TIMEOUT, Store, StoreError, within};

const HOLDERS: &str = include_str!("holders.sql");
const OLDER_RELAYS: &str = include_str!("older_relays.sql");

/// The lock modes `DROP`/`CREATE TRIGGER` (SHARE ROW EXCLUSIVE) does not
/// wait for: those of reads.
const READS: [&str; 2] = ["AccessShareLock", "RowShareLock"];

/// What `migration` waits for, said for the log: the lock, and who holds it.
pub(super) async fn lock_wait(
    client: &impl GenericClient,
    config: &Config,
    migration: &Migration,
) -> Result<String, StoreError> {
    let table = qualified_table(&config.schema, &config.table);
    let (passes, needs): (&[&str], _) = if migration.trigger_only {
        (&READS, "SHARE ROW EXCLUSIVE, to re-create the trigger")
    } else {
        (&[], "ACCESS EXCLUSIVE, to change the table")
    };
    let rows = within("the lock holders", QUERY_TIMEOUT, async {
        Ok(client
            .query_typed(
                HOLDERS,
                &[(&table, Type::TEXT), (&passes, Type::TEXT_ARRAY)],
            )
            .await?)
    })
    .await?;
    let mut holders = Vec::with_capacity(rows.len());
    for row in rows {
        let mode: String = row.try_get("mode")?;
        let since = row
            .try_get::<_, Option<String>>("since")?
            .unwrap_or_else(|| "an unknown time".into());
        let pid: Option<i32> = row.try_get("pid")?;
        let gid: Option<String> = row.try_get("gid")?;
        holders.push(match (pid, gid) {
            (Some(pid), _) => format!("pid {pid} ({mode}, its transaction open since {since})"),
            (None, Some(gid)) => format!(
                "the prepared transaction {} ({mode}, prepared at {since}: COMMIT PREPARED or \
                 ROLLBACK PREPARED ends it)",
                quote_literal(&gid)
            ),
            (None, None) => format!("a transaction without a pid ({mode})"),
        });
    }
    let holders = if holders.is_empty() {
        "a transaction that has ended since".to_string()
    } else {
        holders.join(", ")
    };
    Ok(format!(
        "{} waits for a lock on {table} ({needs}) held by {holders}",
        migration.name
    ))
}

/// A session of a relay older than this build, as `pg_stat_activity` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OlderRelay {
    pub pid: i32,
    /// NULL for a Unix socket, or another role's session without
    /// `pg_read_all_stats`.
    pub client_addr: Option<String>,
    pub backend_start: Option<String>,
    pub application_name: String,
}

/// The relays older than this build that read the configured table: the
/// sessions of this database (but the caller's) named with the table's
/// members' prefix and no upgrade level, or a lower one than [`LEVEL`].
pub async fn older_relays(store: &Store, config: &Config) -> Result<Vec<OlderRelay>, StoreError> {
    let prefix = relays_prefix(&config.schema, &config.table);
    store
        .query_all(
            "the older relays' check",
            OLDER_RELAYS,
            &[(&prefix, Type::TEXT), (&LEVEL, Type::INT4)],
            |row| {
                Ok(OlderRelay {
                    pid: row.try_get("pid")?,
                    client_addr: row.try_get("client_addr")?,
                    backend_start: row.try_get("backend_start")?,
                    application_name: row.try_get("application_name")?,
                })
            },
        )
        .await
}

/// Why `migrate --finish` refused: the older relays it saw.
#[derive(Debug, thiserror::Error)]
pub enum FinishError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{}", OlderRelays(.0))]
    OlderRelays(Vec<OlderRelay>),
}

/// The refusal's text: each older relay, then the fix.
struct OlderRelays<'a>(&'a [OlderRelay]);

impl fmt::Display for OlderRelays<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "migrate --finish refused: {} session(s) of relays older than this one (upgrade \
             level u{LEVEL}) read the table; once writers stop waiting for each other, an older \
             relay publishes a tenant's rows out of order:",
            self.0.len()
        )?;
        for relay in self.0 {
            writeln!(f, "  {}", relay.listed())?;
        }
        write!(
            f,
            "Stop or upgrade those relays (every replica, sidecar and fleet that relays the \
             table), then run `outbox-relay migrate --finish` again; `--force` takes the step \
             anyway. A session whose client_addr is not a relay's but a connection pooler's \
             (PgBouncer) may be the pooler's idle server connection, which keeps the name of \
             its last client: close it (PgBouncer: RECONNECT, or wait for server_idle_timeout)."
        )
    }
}

impl OlderRelay {
    /// One line of the refusal, or of the WARN of `--force`.
    pub fn listed(&self) -> String {
        format!(
            "pid {}, client_addr {}, backend_start {}, application_name {}",
            self.pid,
            self.client_addr.as_deref().unwrap_or("(local or hidden)"),
            self.backend_start.as_deref().unwrap_or("(hidden)"),
            self.application_name
        )
    }
}
