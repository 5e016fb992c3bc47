//! Retention (`retention_ms` > 0): deletes rows that ended — published, or
//! discarded where the table records that — longer ago than `retention_ms`,
//! never a pending or parked row. A round every [`round_interval`] walks the
//! table by its primary key from the lowest id in batches of at most
//! [`BATCH_ROWS`], each a short transaction of its own on a pooled
//! connection (taken only while no sweep waits for one), with a pause
//! between batches; a round ends at a batch that deleted nothing and met
//! rows that ended too recently, or at the end of the table.
//!
//! Without `DELETE` on the table (SQLSTATE 42501) retention deletes nothing
//! and the relay goes on relaying: one ERROR names the `GRANT` that fixes it
//! (at start, by the check of `grants`, or at the first round refused), and
//! rounds say nothing more until one succeeds.
//!
//! One relay at a time: each batch's transaction holds a transaction-scoped
//! advisory lock (`store/retention_lock.sql`; never a session lock, which
//! PgBouncer in transaction pooling would leave on a server connection); a
//! relay that finds it held ends its round. Each round is one INFO line with
//! the count; `outbox_retention_deleted_total` adds it up.
//!
//! For very large tables, partitioning the table by time and dropping old
//! partitions is cheaper than any DELETE (see the runbook).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};

use crate::config::Config;
use crate::grants::MissingGrant;
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;
use crate::sql::{fill, qualified_table};
use crate::store::{Store, StoreError, within};

const COLUMNS: &str = include_str!("store/retention_columns.sql");
const LOCK: &str = include_str!("store/retention_lock.sql");
const DELETE: &str = include_str!("store/retention_delete.sql");

/// The first key of retention's advisory lock (`"RETE"` in ASCII); the
/// second is `hashtext('<schema>.<table>')`.
pub const LOCK_CLASS: i32 = 0x5245_5445;
/// Rows looked at (and at most deleted) per transaction.
pub const BATCH_ROWS: i64 = 2_000;
/// The pause between two batches of a round: the table's other users get
/// the server between them.
pub const BATCH_PAUSE: Duration = Duration::from_millis(50);
/// The deadline of one batch's round trips (the server's own
/// `statement_timeout` is set the same in the batch's transaction).
const BATCH_TIMEOUT: Duration = Duration::from_secs(15);

/// How often a round starts: a tenth of `retention_ms`, from 1 s to 1 min.
pub fn round_interval(retention: Duration) -> Duration {
    (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// When a row ended, over the table alias `row`, as the table's columns
/// allow: a parked row has not ended; a discarded one ended when discarded.
fn ended(row: &str, parked_at: bool, discarded_at: bool) -> String {
    let published = if parked_at {
        format!("CASE WHEN {row}.parked_at IS NULL THEN {row}.published_at END")
    } else {
        format!("{row}.published_at")
    };
    if discarded_at {
        format!("COALESCE({row}.discarded_at, {published})")
    } else {
        published
    }
}

/// The DELETE of one batch for a table with these columns.
fn delete_statement(table: &str, parked_at: bool, discarded_at: bool) -> String {
    fill(
        DELETE,
        &[
            ("{table}", table.to_string()),
            ("{ended_o}", ended("o", parked_at, discarded_at)),
            ("{ended_t}", ended("t", parked_at, discarded_at)),
        ],
    )
}

/// What one batch of a round did: the rows it looked at, the last of
/// their ids, the rows it deleted, and those that ended too recently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DeletionBatch {
    scanned: i64,
    last_id: Option<i64>,
    deleted: i64,
    recent: i64,
}

impl DeletionBatch {
    /// Whether the round goes on after this batch.
    fn more(&self) -> bool {
        self.scanned >= BATCH_ROWS && (self.deleted > 0 || self.recent == 0)
    }
}

/// SQLSTATE `insufficient_privilege`.
const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// Whether retention's `DELETE` is refused, as the check at start or a round
/// found it: the ERROR naming the grant is said once, until a round succeeds.
#[derive(Debug, Default)]
pub struct Denied(AtomicBool);

impl Denied {
    /// Records a refusal; whether it is news (not said since the last
    /// success).
    pub fn refused(&self) -> bool {
        !self.0.swap(true, Ordering::Relaxed)
    }

    /// Records a round that succeeded; whether retention was refused before.
    fn granted(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }
}

/// The retention task of one relay.
pub struct Retention {
    store: Store,
    metrics: Metrics,
    retention_ms: i64,
    /// `"schema"."table"`.
    table: String,
    /// `'<schema>.<table>'`: the second lock key, hashed.
    lock_key: String,
    /// What is said without `DELETE`, and whether it was.
    missing: MissingGrant,
    denied: Arc<Denied>,
}

impl Retention {
    pub fn new(config: &Config, store: Store, metrics: Metrics, denied: Arc<Denied>) -> Retention {
        Retention {
            missing: MissingGrant::delete(config),
            denied,
            store,
            metrics,
            retention_ms: i64::try_from(config.retention_ms).unwrap_or(i64::MAX),
            table: qualified_table(&config.schema, &config.table),
            lock_key: format!("{}.{}", config.schema, config.table),
        }
    }

    fn retention(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.retention_ms).unwrap_or_default())
    }

    /// Runs a round every [`round_interval`] until `stop` fires.
    pub async fn run(self, stop: Shutdown) {
        let every = round_interval(self.retention());
        loop {
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = stop.clone().fired() => return,
            }
            match self.round(&stop).await {
                Ok(Some(deleted)) => {
                    if self.denied.granted() {
                        tracing::info!("retention may delete again");
                    }
                    tracing::info!(deleted, retention_ms = self.retention_ms, "retention round")
                }
                Ok(None) => tracing::debug!("retention: another relay's turn, or the pool is busy"),
                Err(error) if error.sqlstate() == Some(INSUFFICIENT_PRIVILEGE) => {
                    if self.denied.refused() {
                        tracing::error!(%error, "{}", self.missing);
                    }
                }
                Err(error) => tracing::warn!(%error, "retention round failed; next round retries"),
            }
        }
    }

    /// One round: batches until the round is done, another relay holds the
    /// turn (`Ok(None)` when that is so at the first batch) or `stop` fires.
    /// The rows deleted.
    pub async fn round(&self, stop: &Shutdown) -> Result<Option<u64>, StoreError> {
        let Some((parked_at, discarded_at)) = self.columns().await? else {
            return Ok(None);
        };
        let delete = delete_statement(&self.table, parked_at, discarded_at);
        let mut after = i64::MIN;
        let mut deleted = 0u64;
        let mut first = true;
        loop {
            if self.store.pool_is_busy() {
                if first {
                    return Ok(None);
                }
                break;
            }
            let Some(batch) = self.batch(&delete, after).await? else {
                if first {
                    return Ok(None);
                }
                break;
            };
            first = false;
            let rows = u64::try_from(batch.deleted).unwrap_or_default();
            deleted += rows;
            self.metrics.count_retention_deleted(rows);
            match batch.last_id {
                Some(last) if batch.more() => after = last,
                _ => break,
            }
            tokio::select! {
                () = tokio::time::sleep(BATCH_PAUSE) => {}
                () = stop.clone().fired() => break,
            }
        }
        Ok(Some(deleted))
    }

    /// Whether the table has `parked_at` and `discarded_at`; `None` when
    /// the table does not exist (yet).
    async fn columns(&self) -> Result<Option<(bool, bool)>, StoreError> {
        let conn = self.store.connection().await?;
        let table: &str = &self.table;
        let rows = within("the retention column check", BATCH_TIMEOUT, async {
            Ok(conn.query_typed(COLUMNS, &[(&table, Type::TEXT)]).await?)
        })
        .await?;
        match rows.first() {
            Some(row) => Ok(Some((row.try_get(0)?, row.try_get(1)?))),
            None => Ok(None),
        }
    }

    /// One batch in a transaction of its own; `None` when another relay
    /// holds retention's turn.
    async fn batch(&self, delete: &str, after: i64) -> Result<Option<DeletionBatch>, StoreError> {
        let conn = self.store.connection().await?;
        let lock_key: &str = &self.lock_key;
        let lock_params: [(&(dyn ToSql + Sync), Type); 2] =
            [(&LOCK_CLASS, Type::INT4), (&lock_key, Type::TEXT)];
        let delete_params: [(&(dyn ToSql + Sync), Type); 3] = [
            (&after, Type::INT8),
            (&BATCH_ROWS, Type::INT8),
            (&self.retention_ms, Type::INT8),
        ];
        let work = async {
            conn.batch_execute("BEGIN; SET LOCAL synchronous_commit = off")
                .await?;
            let taken: bool = conn.query_typed_one(LOCK, &lock_params).await?.try_get(2)?;
            if !taken {
                conn.batch_execute("ROLLBACK").await?;
                return Ok(None);
            }
            let row = conn.query_typed_one(delete, &delete_params).await?;
            let batch = DeletionBatch {
                scanned: row.try_get(0)?,
                last_id: row.try_get(1)?,
                deleted: row.try_get(2)?,
                recent: row.try_get(3)?,
            };
            conn.batch_execute("COMMIT").await?;
            Ok(Some(batch))
        };
        let result = within("a retention batch", BATCH_TIMEOUT, work).await;
        if result.is_err() {
            // Maybe inside the transaction still: the pool does not get it back.
            drop(deadpool_postgres::Object::take(conn));
        }
        result
    }
}

/// Starts retention when `retention_ms` > 0, until `stop` fires; `denied`
/// is shared with the check at start.
pub fn spawn(
    config: &Arc<Config>,
    store: &Store,
    metrics: &Metrics,
    (stop, denied): (Shutdown, Arc<Denied>),
) -> Option<tokio::task::JoinHandle<()>> {
    (config.retention_ms > 0).then(|| {
        let retention = Retention::new(config, store.clone(), metrics.clone(), denied);
        tokio::spawn(retention.run(stop))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_statement_follows_the_tables_columns() {
        let code = |sql: String| -> String {
            sql.lines()
                .filter(|line| !line.starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let plain = code(delete_statement("\"s\".\"t\"", false, false));
        assert!(plain.contains("o.published_at AS ended_at"), "{plain}");
        assert!(plain.contains("AND t.published_at < now()"), "{plain}");
        assert!(!plain.contains("parked_at") && !plain.contains("discarded_at"));
        let parked = code(delete_statement("\"s\".\"t\"", true, false));
        assert!(parked.contains("CASE WHEN t.parked_at IS NULL THEN t.published_at END < now()"));
        let both = code(delete_statement("\"s\".\"t\"", true, true));
        assert!(both.contains(
            "COALESCE(t.discarded_at, CASE WHEN t.parked_at IS NULL THEN t.published_at END) < now()"
        ));
        assert!(!both.contains('{'), "every placeholder filled: {both}");
    }

    #[test]
    fn a_round_ends_at_recent_rows_or_the_end_of_the_table() {
        let batch = |scanned, deleted, recent| DeletionBatch {
            scanned,
            last_id: Some(1),
            deleted,
            recent,
        };
        assert!(batch(BATCH_ROWS, 10, 5).more(), "it deleted: go on");
        assert!(
            batch(BATCH_ROWS, 0, 0).more(),
            "only pending rows: go past them"
        );
        assert!(
            !batch(BATCH_ROWS, 0, 1).more(),
            "recent rows and nothing to delete"
        );
        assert!(!batch(BATCH_ROWS - 1, 10, 0).more(), "the end of the table");
    }

    #[test]
    fn rounds_come_often_enough_and_not_too_often() {
        assert_eq!(
            round_interval(Duration::from_millis(500)),
            Duration::from_secs(1)
        );
        assert_eq!(
            round_interval(Duration::from_secs(100)),
            Duration::from_secs(10)
        );
        assert_eq!(
            round_interval(Duration::from_secs(7 * 24 * 3600)),
            Duration::from_secs(60)
        );
    }
}
