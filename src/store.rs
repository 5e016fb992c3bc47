//! PostgreSQL: the pool, the claim of a tenant, the read of its batch, the
//! marking of what the broker confirmed, the lag queries, and the check of the
//! table's columns (see [`columns`]). Every statement
//! the relay runs is in `src/store/*.sql`; `{table}` stands for the configured
//! `"schema"."table"`.
//!
//! A [`Claim`] is one open transaction on one pooled connection holding a
//! tenant's advisory lock. It marks the confirmed prefix of its batch ahead
//! ([`Claim::mark_ahead`]) while the rest is still being confirmed, and ends by
//! [`Claim::settle`] (commit) or by being dropped: a dropped claim takes its
//! connection out of the pool and closes it, so the server rolls the
//! transaction back and no half-used connection is ever handed to another
//! sweep.
//!
//! Every statement goes out unnamed (`query_typed`: parse, bind and execute in
//! one message sequence, with its parameters' types given here), never as a
//! named prepared statement: through PgBouncer in transaction pooling, a
//! connection's next transaction may run on another server connection, where
//! a name prepared before means nothing, or means another client's statement.
//! Nothing else is kept in the session either: the claim's settings are
//! transaction-local (but for the server's TCP keepalives, see [`connect`]).
//!
//! Several hosts: each connection tries them in turn (see [`connect`]). A
//! server that stops taking writes (a primary demoted in a failover) is
//! noticed by the claim and the poll, and on the marks (SQLSTATE 25006): its
//! connections are discarded, every idle one with them, so new ones go to
//! the writable host. That is an outage, never a tenant's failure.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{
    BuildError, Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime, Timeouts,
};
use futures_util::TryStreamExt;
use futures_util::future::BoxFuture;
use time::OffsetDateTime;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::types::{Kind, ToSql, Type};
use tokio_postgres::{Client, Connection, Socket};

use crate::config::{Config, DatabaseTarget, Tenants};
use crate::domain::{BatchReport, FailureReason, Lease, OutboxRow, Payload};
use crate::sql::{quote_literal, wakeup_channel};
// Defined in `sql`; kept at these paths for the wake-up.
pub use crate::sql::{qualified_table, quote_ident};
use crate::started::Started;
pub use columns::Drift;
use columns::{OccurredAt, Raw};

/// Deadline of each round trip of a sweep, and of the poll and lag queries.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline for opening a connection (TCP, TLS, authentication).
pub const CONNECT_TIMEOUT: Duration = crate::config::DATABASE_CONNECT_TIMEOUT;
/// How long a caller waits for a free pooled connection.
pub const POOL_WAIT_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens a sweep's transaction. Its commit does not wait for the WAL flush: if
/// PostgreSQL crashed right after, the marks of the last moments could be lost,
/// and those rows would be published again — a duplicate, never a loss, which
/// at-least-once allows. It takes the disk flush out of every batch's path.
const BEGIN: &str = "BEGIN; SET LOCAL synchronous_commit = off";
const CLAIM: &str = include_str!("store/claim.sql");
const READ_BATCH: &str = include_str!("store/read_batch.sql");
const READ_PAYLOAD: &str = include_str!("store/read_payload.sql");
const MARK_PUBLISHED: &str = include_str!("store/mark_published.sql");
const RECORD_REFUSAL: &str = include_str!("store/record_refusal.sql");
const UNMARK_PUBLISHED: &str = include_str!("store/unmark_published.sql");
const PENDING_TENANTS: &str = include_str!("store/pending_tenants.sql");
const TENANT_LAG: &str = include_str!("store/tenant_lag.sql");
const TENANT_STATUS: &str = include_str!("store/tenant_status.sql");
const COLUMNS: &str = include_str!("store/columns.sql");
const REQUEUE: &str = include_str!("store/requeue.sql");
const REQUEUE_TENANT: &str = include_str!("store/requeue_tenant.sql");
const DISCARD: &str = include_str!("store/discard.sql");
const REPLAY_BATCH: &str = include_str!("store/replay_batch.sql");
const SEQUENCE: &str = include_str!("store/sequence.sql");
const WRITERS: &str = include_str!("store/writers.sql");
const WRITERS_FREE: &str = include_str!("store/writers_free.sql");
/// Where the id sequence stands, and the tenants of its newest rows (see
/// [`Store::watch`]).
const WATCH: &str = include_str!("store/watch.sql");
/// Where the id sequence stands, alone: the watch's read between moves.
const POSITION: &str = include_str!("store/position.sql");

mod columns;

/// A failure to talk to PostgreSQL. Its text carries the server's own message
/// and SQLSTATE where there is one, never a password or a payload.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no database connection: {}", describe_pool(.0))]
    Pool(#[source] PoolError),
    #[error("database error: {}", describe(.0))]
    Query(#[source] tokio_postgres::Error),
    #[error("database did not answer {0} within {1:?}")]
    Timeout(&'static str, Duration),
    #[error("cannot build the connection pool: {0}")]
    Build(#[source] BuildError),
    /// The server takes no writes: a standby, or a primary demoted in a
    /// failover. With several hosts and `target_session_attrs=read-write`,
    /// the next connection goes to the writable one.
    #[error(
        "the database is read-only (a standby, or a primary demoted in a failover); \
         waiting for a writable host (target_session_attrs=read-write)"
    )]
    ReadOnly,
    /// A column the relay reads is missing, or of a type it cannot read as
    /// the application wrote it (e.g. a `bytea` payload): found on a read's
    /// row description, or by [`Store::check_columns`]. Nothing of the
    /// table is read until it is fixed.
    #[error(transparent)]
    Columns(#[from] Drift),
    /// The id sequence cannot give a safe bound for commit order (see
    /// [`Store::check_sequence`]).
    #[error("{0}")]
    Sequence(String),
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(error: tokio_postgres::Error) -> StoreError {
        StoreError::Query(error)
    }
}

impl StoreError {
    /// The server's SQLSTATE, when the server refused a statement.
    pub fn sqlstate(&self) -> Option<&str> {
        let error = match self {
            StoreError::Query(error) | StoreError::Pool(PoolError::Backend(error)) => error,
            _ => return None,
        };
        error.as_db_error().map(|db| db.code().code())
    }

    /// Whether the database could not be reached at all: no connection could
    /// be had, the connection closed or broke, a deadline passed, or the
    /// server is shutting down (SQLSTATE classes 08 and 57P). Anything else
    /// is a server that answered with an error (a data error, a permission, a
    /// missing table) or a value the relay cannot decode: the database is
    /// reachable, and the failure belongs to what was asked.
    /// A server that takes no writes counts as unreachable too: no tenant's
    /// failure, and no place to sweep.
    pub fn is_unreachable(&self) -> bool {
        match self {
            StoreError::Pool(_)
            | StoreError::Timeout(..)
            | StoreError::Build(_)
            | StoreError::ReadOnly => true,
            StoreError::Query(error) => connection_lost(error),
            StoreError::Columns(_) | StoreError::Sequence(_) => false,
        }
    }

    /// The unfit column, when that is what failed.
    pub fn drift(&self) -> Option<&Drift> {
        match self {
            StoreError::Columns(drift) => Some(drift),
            _ => None,
        }
    }

    /// Whether the server turned out to take no writes.
    pub fn is_read_only(&self) -> bool {
        matches!(self, StoreError::ReadOnly) || self.sqlstate() == Some(READ_ONLY_SQL_TRANSACTION)
    }
}

/// SQLSTATE of a write refused by a server that takes none.
const READ_ONLY_SQL_TRANSACTION: &str = "25006";

/// Whether a driver error says the connection is gone rather than that the
/// server refused a statement or a value did not decode.
fn connection_lost(error: &tokio_postgres::Error) -> bool {
    if let Some(db) = error.as_db_error() {
        let code = db.code().code();
        return code.starts_with("08")
            || code.starts_with("57P")
            || code == READ_ONLY_SQL_TRANSACTION;
    }
    error.is_closed()
        || std::error::Error::source(error).is_some_and(|cause| cause.is::<std::io::Error>())
}

/// The server's message and SQLSTATE when there is one, else the driver's
/// error and its cause ("db error" alone tells an operator nothing).
pub(crate) fn describe(error: &tokio_postgres::Error) -> String {
    if let Some(db) = error.as_db_error() {
        return format!(
            "{}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        );
    }
    match std::error::Error::source(error) {
        Some(cause) => format!("{error}: {cause}"),
        None => error.to_string(),
    }
}

fn describe_pool(error: &PoolError) -> String {
    match error {
        PoolError::Backend(error) => describe(error),
        other => other.to_string(),
    }
}

/// A configured tenant's lag as the database's clock sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantLag {
    pub tenant: String,
    /// The lowest pending id; `None` when nothing is pending.
    pub oldest_id: Option<i64>,
    /// The age of that row, clamped to 0 … 10,000 years; 0 when none.
    pub lag_ms: i64,
}

/// A tenant the poll found with pending rows (configured or not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingTenant {
    pub tenant: String,
    /// Its lowest pending id: the row it waits on.
    pub oldest_id: i64,
    /// The age of that row by the database's clock, clamped to 0 … 10,000
    /// years (an infinite or future `occurred_at` gives 0 or the cap).
    pub lag_ms: i64,
}

/// Which tenants a poll reads: at most `limit`, from the first after
/// `after` (from the first of all without it), in the index's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub after: Option<String>,
    pub limit: usize,
}

impl Page {
    /// Every pending tenant (the CLI's reads).
    pub fn all() -> Page {
        Page {
            after: None,
            limit: usize::MAX,
        }
    }
}

/// What one poll found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Polled {
    /// The tenants with pending rows (the page asked for), in the order of
    /// their names (the column's collation).
    pub pending: Vec<PendingTenant>,
    /// The application_name of each session LISTENing for wake-ups (see
    /// `wakeup`).
    pub listeners: Vec<String>,
    /// Each tenant with parked rows (not discarded), and how many.
    pub parked: Vec<(String, i64)>,
}

/// A row a `requeue` or `discard` changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changed {
    pub id: i64,
    pub tenant: String,
}

/// A tenant as `outbox-relay status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TenantStatus {
    pub tenant: String,
    pub pending: i64,
    pub lag_ms: i64,
    /// The lowest pending row: the one the tenant is waiting on.
    pub oldest_id: Option<i64>,
    pub attempts: Option<i32>,
    pub last_error: Option<String>,
    /// Rows parked (not discarded): out of the tenant's order, waiting for
    /// `requeue` or `discard`.
    pub parked: i64,
}

/// The statements with the configured table substituted, in one of two
/// variants: for a table with the columns of parking, or without them.
#[derive(Debug)]
struct Statements {
    read_batch: String,
    read_payload: String,
    mark_published: String,
    unmark_published: String,
    record_refusal: String,
    pending_tenants: String,
    watch: String,
    tenant_lag: String,
    tenant_status: String,
    requeue: String,
    requeue_tenant: String,
    discard: String,
    replay_batch: String,
    /// `"schema"."table"`, for the column checks.
    table: String,
}

impl Statements {
    /// The statements for `table`; with `parking` false, for a table without
    /// `parked_at` and `discarded_at` (see [`variant`]).
    /// `table` quoted, `channel` the wake-up channel as a quoted literal.
    fn new(table: &str, channel: &str, parking: bool) -> Statements {
        let sql = |text: &str| {
            variant(text, parking)
                .replace("{table}", table)
                .replace("{channel}", channel)
        };
        Statements {
            read_batch: sql(READ_BATCH),
            read_payload: sql(READ_PAYLOAD),
            mark_published: sql(MARK_PUBLISHED),
            unmark_published: sql(UNMARK_PUBLISHED),
            record_refusal: sql(RECORD_REFUSAL),
            pending_tenants: sql(PENDING_TENANTS),
            watch: sql(WATCH),
            tenant_lag: sql(TENANT_LAG),
            tenant_status: sql(TENANT_STATUS),
            requeue: sql(REQUEUE),
            requeue_tenant: sql(REQUEUE_TENANT),
            discard: sql(DISCARD),
            replay_batch: sql(REPLAY_BATCH),
            table: table.to_string(),
        }
    }
}

/// A statement for a table with the columns of parking (`parking`) or
/// without them: a line with the comment `-- lifecycle` is kept only with
/// them, a line with `-- legacy` only without.
fn variant(sql: &str, parking: bool) -> String {
    sql.lines()
        .filter(|line| {
            if line.contains("-- lifecycle") {
                parking
            } else if line.contains("-- legacy") {
                !parking
            } else {
                true
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Why a `requeue`, `discard` or `replay` could not run.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The table lacks `parked_at` and `discarded_at`.
    #[error(
        "{0} has no columns parked_at and discarded_at: no row was ever parked; run `outbox-relay migrate` (or apply the SQL of `outbox-relay migrate --print`)"
    )]
    NoParking(String),
}

/// The outbox table of one relay: a pool and its statements.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    /// With the columns of parking, and without them.
    statements: Arc<[Statements; 2]>,
    /// Whether the table has `parked_at` and `discarded_at`, as last checked
    /// (see [`Store::check_columns`]); assumed until a check says not.
    parking_columns: Arc<AtomicBool>,
    /// `park_after_attempts`, for the refusals that park (0: never).
    park_after_attempts: i32,
    /// `'<schema>.<table>'`: the first advisory-lock key.
    lock_key: Arc<str>,
    /// `idle_in_transaction_session_timeout` of a claim, in ms.
    claim_idle_ms: Arc<str>,
    batch_size: i64,
    max_payload_bytes: i64,
    /// The id sequence's oid, as the last [`Store::check_sequence`] found it:
    /// 0 when the id column draws from none, [`SEQUENCE_UNKNOWN`] before a
    /// check said.
    sequence: Arc<AtomicI64>,
}

/// Not checked yet (see [`Store::check_sequence`]).
const SEQUENCE_UNKNOWN: i64 = -1;

/// What a read of the id sequence found (see [`Store::watch`]).
#[derive(Debug, Default)]
pub struct Watched {
    pub position: i64,
    /// The tenants with rows pending, when the position moved (or had moved
    /// at the read before).
    pub tenants: Option<Vec<String>>,
}

/// What the writers' check found (see `store/writers.sql`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Writers {
    /// Where the id sequence stood just before the locks were read.
    pub position: i64,
    /// Every transaction holding a writers' lock of the table, any tenant.
    pub all: Vec<String>,
    /// For each tenant asked about, in order: the transactions holding its
    /// writers' lock.
    pub tenants: Vec<Vec<String>>,
}

/// The longest `subject_id` or `headers` (as JSON text) the batch read
/// returns: no AMQP frame of RabbitMQ's default `frame_max` (128 KiB) takes
/// more, so a longer one is refused without being read. It bounds what one
/// row can cost besides its payload (see `budget::ROW_FIELDS_MAX`).
pub const FIELD_LIMIT: i64 = 512 << 10;
const _: () = assert!(
    FIELD_LIMIT == 512 << 10,
    "budget::ROW_FIELDS_MAX counts on it"
);

/// A read whose rows were larger than this leaves its connection's read
/// buffer grown to hold them; such a connection is closed when its claim
/// ends rather than kept in the pool with that buffer (see
/// [`Claim::release`]).
const RETAINED_READ_MAX: usize = 1 << 20;

/// The payload of a row read, left where the server's answer put it: the
/// message body shares the row's buffer instead of copying it, and the
/// buffer goes with the last holder of the body.
struct PayloadOf {
    row: tokio_postgres::Row,
    column: usize,
}

impl AsRef<[u8]> for PayloadOf {
    fn as_ref(&self) -> &[u8] {
        match self.row.try_get::<_, Option<Raw>>(self.column) {
            Ok(Some(Raw(bytes))) => bytes,
            _ => &[],
        }
    }
}

/// The columns of `read_batch.sql` and `replay_batch.sql`, by position: a
/// row's values are read by index, as a lookup by name compares every
/// column's name for each value of each row.
mod column {
    pub const ID: usize = 0;
    pub const KIND: usize = 1;
    pub const SUBJECT_ID: usize = 3;
    pub const PAYLOAD: usize = 5;
    pub const PAYLOAD_BYTES: usize = 6;
    pub const HEADERS: usize = 7;
    pub const HEADERS_BYTES: usize = 8;
    pub const OCCURRED_AT: usize = 9;
    pub const COST: usize = 10;
    pub const WITHIN: usize = 11;
    /// Every column's name, in order.
    pub const NAMES: [&str; 12] = [
        "id",
        "kind",
        "kind_bytes",
        "subject_id",
        "subject_id_bytes",
        "payload",
        "payload_bytes",
        "headers",
        "headers_bytes",
        "occurred_at",
        "cost",
        "within",
    ];
}

/// Whether a read's columns are those [`column`] names, in its order (every
/// row of a read has the same description, so its first row is asked).
fn in_column_order(row: &tokio_postgres::Row) -> bool {
    let names = row.columns().iter().map(|c| c.name());
    names.eq(column::NAMES.iter().copied())
}

/// Reads one row of `read_batch.sql` (whose columns [`columns::check_row`]
/// found fit, in [`column`]'s order). A value that cannot be read, or was
/// left in the database for its size, makes that row defective (refused as
/// `invalid` or `too_large`), never the batch.
fn decode(
    row: tokio_postgres::Row,
    max_payload_bytes: i64,
) -> Result<OutboxRow, tokio_postgres::Error> {
    let id: i64 = row.try_get(column::ID)?;
    let cost: i64 = row.try_get(column::COST)?;
    let mut defects = Vec::new();
    let mut text = |index: usize, what: &str, limit: i64| -> String {
        match row.try_get::<_, Option<String>>(index) {
            Ok(Some(value)) => value,
            Ok(None) => {
                // Its length is the column after it.
                let bytes: Option<i32> = row.try_get(index + 1).ok();
                let bytes = bytes.map_or_else(|| "?".to_string(), |b| b.to_string());
                defects.push(format!("{what} is {bytes} bytes, over {limit}"));
                String::new()
            }
            Err(error) => {
                defects.push(format!("{what} cannot be read: {error}"));
                String::new()
            }
        }
    };
    let kind = text(column::KIND, "kind", 255);
    let subject_id = text(column::SUBJECT_ID, "subject_id", FIELD_LIMIT);
    let payload_bytes: Option<i32> = row.try_get(column::PAYLOAD_BYTES)?;
    // The body itself is attached last, sharing the row (see `PayloadOf`).
    let payload = match (
        row.try_get::<_, Option<Raw>>(column::PAYLOAD),
        payload_bytes,
    ) {
        (Ok(Some(_)), _) => None,
        (Ok(None), None) => Some(Payload::Tombstone),
        (Ok(None), Some(bytes)) if i64::from(bytes) > max_payload_bytes => {
            Some(Payload::TooLarge {
                bytes: u64::try_from(bytes).unwrap_or_default(),
            })
        }
        (Ok(None), Some(bytes)) => Some(Payload::OverBudget {
            bytes: u64::try_from(bytes).unwrap_or_default(),
        }),
        (Err(error), _) => {
            defects.push(format!("payload cannot be read: {error}"));
            Some(Payload::Tombstone)
        }
    };
    let headers_bytes: Option<i32> = row.try_get(column::HEADERS_BYTES)?;
    let headers = match row.try_get::<_, Option<Raw>>(column::HEADERS) {
        Ok(None) if headers_bytes.is_some() => {
            defects.push(format!(
                "headers are {} bytes of JSON, over {FIELD_LIMIT}",
                headers_bytes.unwrap_or_default()
            ));
            None
        }
        Ok(headers) => headers.map(|Raw(json)| Bytes::copy_from_slice(json)),
        Err(error) => {
            defects.push(format!("headers cannot be read: {error}"));
            None
        }
    };
    let occurred_at = match row.try_get::<_, Option<OccurredAt>>(column::OCCURRED_AT) {
        Ok(Some(at)) => at.0,
        Ok(None) => {
            defects.push(
                "occurred_at is infinite or outside the years 1-9999, which no message can carry"
                    .into(),
            );
            OffsetDateTime::UNIX_EPOCH
        }
        Err(error) => {
            defects.push(format!("occurred_at cannot be read: {error}"));
            OffsetDateTime::UNIX_EPOCH
        }
    };
    let payload = match payload {
        Some(payload) => payload,
        None => Payload::Body(Bytes::from_owner(PayloadOf {
            row,
            column: column::PAYLOAD,
        })),
    };
    Ok(OutboxRow {
        id,
        kind,
        subject_id,
        payload,
        headers,
        occurred_at,
        defect: (!defects.is_empty()).then(|| defects.join("; ")),
        cost: usize::try_from(cost).unwrap_or(usize::MAX),
    })
}

/// What the server sent of `row` that the relay may hold: its payload and
/// headers (see [`RETAINED_READ_MAX`]).
fn read_bytes(row: &OutboxRow) -> usize {
    let payload = match &row.payload {
        Payload::Body(body) => body.len(),
        _ => 0,
    };
    payload + row.headers.as_ref().map_or(0, Bytes::len)
}

/// A row of requeue.sql, requeue_tenant.sql or discard.sql.
fn changed(row: &tokio_postgres::Row) -> Result<Changed, tokio_postgres::Error> {
    Ok(Changed {
        id: row.try_get(0)?,
        tenant: row.try_get(1)?,
    })
}

/// The connector the pool hands tokio-postgres: the target's TLS client
/// configuration, or, for a plain target (`sslmode=disable`, never asked to
/// use it), one that trusts nothing.
pub(crate) fn tls_connector(
    tls: Option<&rustls::ClientConfig>,
) -> tokio_postgres_rustls::MakeRustlsConnect {
    let config = match tls {
        Some(config) => config.clone(),
        None => rustls::ClientConfig::builder()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
    };
    tokio_postgres_rustls::MakeRustlsConnect::new(config)
}

/// The TLS stream of a database connection (plain when `sslmode` asks for
/// none).
pub(crate) type TlsStream =
    <tokio_postgres_rustls::MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

/// Connects to the first host of `target` that takes the connection (and,
/// with `target_session_attrs=read-write`, takes writes), trying them in
/// turn, each within its own connect timeout, so that a host that never
/// answers (a blackholed address, a stalled path) does not spend the others'
/// time. The last host has the rest of the caller's deadline; the error is
/// the last host's.
pub(crate) async fn connect(
    target: &DatabaseTarget,
) -> Result<(Client, Connection<Socket, TlsStream>), tokio_postgres::Error> {
    let tls = tls_connector(target.tls.as_deref());
    let hosts = target.hosts();
    let (last, earlier) = hosts
        .split_last()
        .expect("a database target names at least one host");
    for host in earlier {
        match tokio::time::timeout(target.connect_timeout(), host.connect(tls.clone())).await {
            Ok(Ok(connected)) => return Ok(connected),
            Ok(Err(error)) => {
                tracing::debug!(error = %describe(&error), "database host not taken; trying the next");
            }
            Err(_) => tracing::debug!(
                timeout = ?target.connect_timeout(),
                "database host did not answer in time; trying the next"
            ),
        }
    }
    last.connect(tls).await
}

/// The server's side of a connection's TCP keepalives, as the client's (see
/// `config::KEEPALIVE_IDLE`): a relay that vanishes without closing its
/// connections (a partition) is noticed by the server within about 30 s,
/// not the kernel's two hours. Session settings, set once per connection;
/// through PgBouncer they land on its server connection, where they are as
/// good.
pub(crate) fn session_keepalives() -> String {
    use crate::config::{KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_RETRIES};
    format!(
        "SET tcp_keepalives_idle = {}; SET tcp_keepalives_interval = {}; \
         SET tcp_keepalives_count = {KEEPALIVE_RETRIES}",
        KEEPALIVE_IDLE.as_secs(),
        KEEPALIVE_INTERVAL.as_secs()
    )
}

/// How the pool opens a connection: [`connect`], then the server's
/// keepalives.
struct HostByHost {
    target: DatabaseTarget,
    keepalives: String,
}

impl deadpool_postgres::Connect for HostByHost {
    fn connect(
        &self,
        _: &tokio_postgres::Config,
    ) -> BoxFuture<'_, Result<(Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>> {
        Box::pin(async move {
            let (client, connection) = connect(&self.target).await?;
            let task = tokio::spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(error = %describe(&error), "database connection ended");
                }
            });
            client.batch_execute(&self.keepalives).await?;
            Ok((client, task))
        })
    }
}

impl Store {
    /// Builds the pool for the configured target; no connection is opened
    /// until one is needed.
    pub fn new(config: &Config) -> Result<Store, StoreError> {
        Store::named(config, None)
    }

    /// As [`Store::new`], every session named `application_name` when given
    /// (a relay with `wakeup = poll` is seen by its replicas by its pool's
    /// sessions: see `wakeup`).
    pub fn named(config: &Config, application_name: Option<&str>) -> Result<Store, StoreError> {
        let mut target = config.database_url.clone();
        if let Some(name) = application_name {
            target.set_application_name(name);
        }
        // Every host's connect timeout, and the keepalives' round trip.
        let create = target.connect_deadline().saturating_add(CONNECT_TIMEOUT);
        let manager = Manager::from_connect(
            target.config.clone(),
            HostByHost {
                target,
                keepalives: session_keepalives(),
            },
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .timeouts(Timeouts {
                wait: Some(POOL_WAIT_TIMEOUT),
                create: Some(create),
                recycle: Some(CONNECT_TIMEOUT),
            })
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(StoreError::Build)?;
        let table = qualified_table(&config.schema, &config.table);
        let channel = quote_literal(&wakeup_channel(&config.schema, &config.table));
        Ok(Store {
            pool,
            statements: Arc::new([
                Statements::new(&table, &channel, true),
                Statements::new(&table, &channel, false),
            ]),
            parking_columns: Arc::new(AtomicBool::new(true)),
            park_after_attempts: i32::try_from(config.park_after_attempts).unwrap_or(i32::MAX),
            lock_key: format!("{}.{}", config.schema, config.table).into(),
            claim_idle_ms: config.claim_idle_timeout().as_millis().to_string().into(),
            batch_size: i64::try_from(config.batch_size).unwrap_or(i64::MAX),
            max_payload_bytes: i64::try_from(config.max_payload_bytes).unwrap_or(i64::MAX),
            sequence: Arc::new(AtomicI64::new(SEQUENCE_UNKNOWN)),
        })
    }

    /// The statements for the table as last checked.
    fn statements(&self) -> &Statements {
        let [with, without] = &*self.statements;
        if self.has_parking_columns() {
            with
        } else {
            without
        }
    }

    /// Whether the table has `parked_at` and `discarded_at`, as the last
    /// [`Store::check_columns`] found (assumed until one did).
    pub fn has_parking_columns(&self) -> bool {
        self.parking_columns.load(Ordering::Relaxed)
    }

    /// `park_after_attempts` when `reason` is one that parks (the row's own
    /// `too_large` or `invalid`), else 0 (never).
    fn parks_at(&self, reason: FailureReason) -> i32 {
        match reason {
            FailureReason::TooLarge | FailureReason::Invalid => self.park_after_attempts,
            _ => 0,
        }
    }

    /// Whether a caller waits for a pooled connection, or would have to:
    /// work that can wait (retention) leaves the pool to the sweeps then.
    pub fn pool_is_busy(&self) -> bool {
        let status = self.pool.status();
        status.waiting > 0 || (status.available == 0 && status.size >= status.max_size)
    }

    /// A pooled connection, within [`POOL_WAIT_TIMEOUT`].
    pub async fn connection(&self) -> Result<Object, StoreError> {
        self.pool.get().await.map_err(StoreError::Pool)
    }

    /// Passes `result` on; when it says the server takes no writes, first
    /// drops every idle pooled connection (they are on that server too), so
    /// that the next ones go to the writable host.
    fn dropping_idle_if_read_only<T>(
        &self,
        result: Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if let Err(error) = &result
            && error.is_read_only()
        {
            let dropped = self.pool.retain(|_, _| false).removed.len();
            tracing::debug!(
                dropped,
                "the database takes no writes: idle connections dropped"
            );
        }
        result
    }

    /// Opens a transaction, tries the tenant's advisory lock and reads its
    /// oldest pending rows, as many as fit `budget` bytes (at least one), all
    /// in one round trip. `Ok(None)`: another relay holds the tenant.
    ///
    /// The rows stop at the claim's fence (see `store/claim.sql`): where the
    /// id sequence stands when no writer of the tenant is in flight, else
    /// `safe`, a bound the caller found safe earlier (see
    /// [`Store::writers`]). [`Claim::writers`] says which.
    pub async fn claim(
        &self,
        tenant: &str,
        budget: usize,
        safe: i64,
    ) -> Result<Option<Claim>, StoreError> {
        let claimed = self.claim_on_writable(tenant, budget, safe).await;
        self.dropping_idle_if_read_only(claimed)
    }

    async fn claim_on_writable(
        &self,
        tenant: &str,
        budget: usize,
        safe: i64,
    ) -> Result<Option<Claim>, StoreError> {
        let sequence = self.sequence().await?;
        let mut claim = Claim {
            conn: Some(Arc::new(self.connection().await?)),
            store: self.clone(),
            tenant: tenant.into(),
            rows: Vec::new(),
            cut_by_budget: false,
            writers: false,
            position: 0,
            largest_read: 0,
            ahead: Mutex::new(MarksAhead::default()),
        };
        let client = claim.client();
        let work = async {
            let lock_key: &str = &self.lock_key;
            let idle_ms: &str = &self.claim_idle_ms;
            let claim_params: [(&(dyn ToSql + Sync), Type); 5] = [
                (&lock_key, Type::TEXT),
                (&tenant, Type::TEXT),
                (&idle_ms, Type::TEXT),
                (&sequence, Type::INT8),
                (&safe, Type::INT8),
            ];
            // One round trip: the server runs them in order, in the
            // transaction BEGIN opens.
            let (begin, taken, batch) = tokio::join!(
                client.batch_execute(BEGIN),
                client.query_typed_one(CLAIM, &claim_params),
                self.read_batch(client, tenant, i64::MIN, budget),
            );
            begin?;
            let claimed = taken?;
            let (taken, read_only): (bool, bool) = (claimed.try_get(1)?, claimed.try_get(2)?);
            let fence = (claimed.try_get("writers")?, claimed.try_get("position")?);
            Ok::<_, StoreError>((taken, read_only, fence, batch?))
        };
        let (
            taken,
            read_only,
            (writers, position),
            Batch {
                rows,
                cut_by_budget,
                largest_read,
            },
        ) = deadline("the claim", work).await?;
        if read_only {
            // Dropped: the connection is closed, not pooled.
            return Err(StoreError::ReadOnly);
        }
        if !taken {
            claim.rollback().await?;
            return Ok(None);
        }
        claim.rows = rows;
        claim.cut_by_budget = cut_by_budget;
        claim.writers = writers;
        claim.position = position;
        claim.largest_read = largest_read;
        Ok(Some(claim))
    }

    /// The id sequence's oid (0: none), checked first if no check has said.
    async fn sequence(&self) -> Result<i64, StoreError> {
        match self.sequence.load(Ordering::Relaxed) {
            SEQUENCE_UNKNOWN => self.check_sequence().await,
            known => Ok(known),
        }
    }

    /// Checks the id sequence the fences read (see `store/sequence.sql`):
    /// `CACHE 1`, a positive increment, no cycle, and readable by this role.
    /// Returns its oid, 0 when the table (or its id column's sequence) does
    /// not exist, in which case no fence holds rows back; an unfit sequence
    /// is [`StoreError::Sequence`], and nothing may be relayed in order.
    pub async fn check_sequence(&self) -> Result<i64, StoreError> {
        let table = &self.statements().table;
        let found = self
            .query_all(
                "the id sequence check",
                SEQUENCE,
                &[(table, Type::TEXT)],
                |row| {
                    Ok((
                        row.try_get::<_, String>("sequence")?,
                        row.try_get::<_, i64>("sequence_oid")?,
                        row.try_get::<_, i64>("cache")?,
                        row.try_get::<_, i64>("increment")?,
                        row.try_get::<_, bool>("cycles")?,
                        row.try_get::<_, bool>("readable")?,
                    ))
                },
            )
            .await?;
        let Some((name, oid, cache, increment, cycles, readable)) = found.into_iter().next() else {
            self.sequence.store(0, Ordering::Relaxed);
            return Ok(0);
        };
        let unfit = if cache != 1 {
            Some(format!(
                "has CACHE {cache}: a draw shows the end of its session's cached range to every other session; fix: ALTER SEQUENCE {name} CACHE 1"
            ))
        } else if increment <= 0 {
            Some(format!(
                "has INCREMENT {increment}: ids must ascend; fix: ALTER SEQUENCE {name} INCREMENT 1"
            ))
        } else if cycles {
            Some(format!(
                "CYCLEs: an id may come round again; fix: ALTER SEQUENCE {name} NO CYCLE"
            ))
        } else if !readable {
            Some(format!(
                "cannot be read by this role; fix: GRANT SELECT ON SEQUENCE {name} TO <the relay's role>"
            ))
        } else {
            None
        };
        if let Some(unfit) = unfit {
            self.sequence.store(SEQUENCE_UNKNOWN, Ordering::Relaxed);
            return Err(StoreError::Sequence(format!(
                "the id sequence {name} of {table} {unfit}; the relay reads its position to keep each tenant's rows in commit order, so nothing is relayed until it is fixed"
            )));
        }
        self.sequence.store(oid, Ordering::Relaxed);
        Ok(oid)
    }

    /// Where the id sequence stands (0 when the table has none), and, when
    /// it moved since `watched` (or `moved` says the last read saw it move),
    /// the tenants with rows pending among the ids after `since`, the last
    /// `span` at most: the wake-up watches the sequence while rows flow
    /// (`wakeup = sequence`, see `store/watch.sql`).
    pub async fn watch(
        &self,
        watched: i64,
        moved: bool,
        since: i64,
        span: i64,
    ) -> Result<Watched, StoreError> {
        let sequence = self.sequence().await?;
        if !moved {
            // Most reads find the sequence where it stood: the position
            // alone says so, and the server plans no read of the table.
            let found = self
                .query_all(
                    "the id sequence's position",
                    POSITION,
                    &[(&sequence, Type::INT8)],
                    |row| row.try_get::<_, i64>(0),
                )
                .await?;
            let position = found.into_iter().next().unwrap_or_default();
            if position == watched {
                return Ok(Watched {
                    position,
                    tenants: None,
                });
            }
        }
        let found = self
            .query_all(
                "the id sequence's watch",
                &self.statements().watch,
                &[
                    (&sequence, Type::INT8),
                    (&watched, Type::INT8),
                    (&moved, Type::BOOL),
                    (&since, Type::INT8),
                    (&span, Type::INT8),
                ],
                |row| {
                    Ok(Watched {
                        position: row.try_get(0)?,
                        tenants: row.try_get::<_, Option<Vec<String>>>(1)?,
                    })
                },
            )
            .await?;
        Ok(found.into_iter().next().unwrap_or_default())
    }

    /// Whether each of `tenants` has no writer in flight, and where the id
    /// sequence stood just before (see `store/writers_free.sql`): a free
    /// tenant's ids up to it are committed or gone. Cheaper than
    /// [`Store::writers`] (no read of `pg_locks`), but it never clears a
    /// tenant that always has some writer in flight.
    pub async fn writers_free(&self, tenants: &[&str]) -> Result<(i64, Vec<bool>), StoreError> {
        let sequence = self.sequence().await?;
        if sequence == 0 {
            return Ok((i64::MAX, vec![true; tenants.len()]));
        }
        let lock_key: &str = &self.lock_key;
        let rows = self
            .query_all(
                "the writers' free check",
                WRITERS_FREE,
                &[
                    (&lock_key, Type::TEXT),
                    (&sequence, Type::INT8),
                    (&tenants, Type::TEXT_ARRAY),
                ],
                |row| {
                    Ok((
                        row.try_get::<_, bool>("free")?,
                        row.try_get::<_, i64>("position")?,
                    ))
                },
            )
            .await?;
        let position = rows.first().map_or(0, |(_, position)| *position);
        Ok((position, rows.into_iter().map(|(free, _)| free).collect()))
    }

    /// Which transactions hold the writers' lock of each of `tenants` (and of
    /// any tenant), and where the id sequence stood just before: one
    /// statement (see `store/writers.sql`). Once every transaction named for
    /// a tenant has ended, its ids up to the position are committed or gone.
    pub async fn writers(&self, tenants: &[&str]) -> Result<Writers, StoreError> {
        let sequence = self.sequence().await?;
        if sequence == 0 {
            return Ok(Writers {
                position: i64::MAX,
                all: Vec::new(),
                tenants: vec![Vec::new(); tenants.len()],
            });
        }
        let lock_key: &str = &self.lock_key;
        let rows = self
            .query_all(
                "the writers check",
                WRITERS,
                &[
                    (&lock_key, Type::TEXT),
                    (&sequence, Type::INT8),
                    (&tenants, Type::TEXT_ARRAY),
                ],
                |row| {
                    Ok((
                        row.try_get::<_, Option<String>>("tenant")?.is_none(),
                        row.try_get::<_, Vec<String>>("holders")?,
                        row.try_get::<_, Option<i64>>("position")?,
                    ))
                },
            )
            .await?;
        let mut writers = Writers::default();
        for (overall, holders, position) in rows {
            if overall {
                writers.all = holders;
                writers.position = position.unwrap_or_default();
            } else {
                writers.tenants.push(holders);
            }
        }
        Ok(writers)
    }

    /// The tenant's oldest pending rows after id `after`, as many as fit
    /// `budget` bytes (at least one), decoded one at a time as they arrive
    /// (each payload stays in its row's buffer, see `PayloadOf`). Read in
    /// the claim's transaction, which alone lets the statement return rows.
    async fn read_batch(
        &self,
        client: &Object,
        tenant: &str,
        after: i64,
        budget: usize,
    ) -> Result<Batch, StoreError> {
        let budget = i64::try_from(budget).unwrap_or(i64::MAX);
        let params: [(&(dyn ToSql + Sync), Type); 6] = [
            (&tenant, Type::TEXT),
            (&self.batch_size, Type::INT8),
            (&self.max_payload_bytes, Type::INT8),
            (&budget, Type::INT8),
            (&FIELD_LIMIT, Type::INT8),
            (&after, Type::INT8),
        ];
        let rows = client
            .query_typed_raw(&self.statements().read_batch, params)
            .await?;
        let mut rows = std::pin::pin!(rows);
        let mut batch = Batch::default();
        let mut checked = false;
        while let Some(row) = rows.try_next().await? {
            // Every row of a read has the same description: the first one
            // tells whether the table's columns still fit.
            if !checked {
                columns::check_row(&self.statements().table, &row)?;
                debug_assert!(in_column_order(&row), "read_batch.sql's columns");
                checked = true;
            }
            // Past the budget: not part of the batch, only a sign that
            // more rows are pending behind it.
            if !batch.rows.is_empty() && !row.try_get::<_, bool>(column::WITHIN)? {
                batch.cut_by_budget = true;
                continue;
            }
            let row = decode(row, self.max_payload_bytes)?;
            batch.largest_read = batch.largest_read.max(read_bytes(&row));
            batch.rows.push(row);
        }
        Ok(batch)
    }

    /// Marks rows the broker confirmed whose claim ended without its commit
    /// (see `relay`'s settlement retry): one statement, a transaction of its
    /// own, on a pooled connection (never the claim's, which is gone); the
    /// rows it marked. Idempotent: a row marked already keeps its time.
    pub async fn mark_confirmed(&self, ids: &[i64]) -> Result<u64, StoreError> {
        let conn = self.connection().await?;
        let result = deadline(
            "marking confirmed rows again",
            update_ids(&conn, &self.statements().mark_published, ids),
        )
        .await;
        if result.is_err() {
            drop(Object::take(conn));
        }
        self.dropping_idle_if_read_only(result)
    }

    /// The configured tenants' lag, one statement.
    pub async fn tenant_lag(&self, tenants: &[String]) -> Result<Vec<TenantLag>, StoreError> {
        self.query_all(
            "the lag query",
            &self.statements().tenant_lag,
            &[(&tenants, Type::TEXT_ARRAY)],
            |row| {
                Ok(TenantLag {
                    tenant: row.try_get(0)?,
                    oldest_id: row.try_get(1)?,
                    lag_ms: row.try_get(2)?,
                })
            },
        )
        .await
    }

    /// The lag of every tenant with pending rows (`tenants = "*"`): the
    /// poll's statement, one round trip, its listeners left out.
    pub async fn pending_lag(&self) -> Result<Vec<TenantLag>, StoreError> {
        // No LISTEN connection is named '' (the pattern matches that alone).
        let polled = self.pending_tenants("", &Page::all()).await?;
        Ok(polled
            .pending
            .into_iter()
            .map(|p| TenantLag {
                tenant: p.tenant,
                oldest_id: Some(p.oldest_id),
                lag_ms: p.lag_ms,
            })
            .collect())
    }

    /// The tenants with pending or parked rows, in name order, for
    /// `status` with `tenants = "*"`: the poll's statement, one round trip.
    pub async fn tenants_with_rows(&self) -> Result<Vec<String>, StoreError> {
        let polled = self.pending_tenants("", &Page::all()).await?;
        let mut names: Vec<String> = polled
            .pending
            .into_iter()
            .map(|p| p.tenant)
            .chain(polled.parked.into_iter().map(|(tenant, _)| tenant))
            .collect();
        names.sort_unstable();
        names.dedup();
        Ok(names)
    }

    /// The lag of the tenants the relay relays: the configured ones, or
    /// every one with pending rows.
    pub async fn relayed_lag(&self, tenants: &Tenants) -> Result<Vec<TenantLag>, StoreError> {
        match tenants {
            Tenants::Listed(names) => self.tenant_lag(names).await,
            Tenants::Discovered => self.pending_lag().await,
        }
    }

    /// Pending rows, lag and the blocking row of each tenant, one statement.
    pub async fn tenant_status(&self, tenants: &[String]) -> Result<Vec<TenantStatus>, StoreError> {
        self.query_all(
            "the status query",
            &self.statements().tenant_status,
            &[(&tenants, Type::TEXT_ARRAY)],
            |row| {
                Ok(TenantStatus {
                    tenant: row.try_get(0)?,
                    pending: row.try_get(1)?,
                    lag_ms: row.try_get(2)?,
                    oldest_id: row.try_get(3)?,
                    attempts: row.try_get(4)?,
                    last_error: row.try_get(5)?,
                    parked: row.try_get(6)?,
                })
            },
        )
        .await
    }

    /// The tenants with pending rows in `page` (configured or not), each
    /// with its lowest pending id and its lag; every tenant's count of parked
    /// rows; and the application_name of every session of this database LIKE
    /// `listeners`: one statement whose cost does not grow with idle tenants,
    /// nor past the page with pending ones.
    /// Refused as [`StoreError::ReadOnly`] on a server that takes no writes.
    pub async fn pending_tenants(
        &self,
        listeners: &str,
        page: &Page,
    ) -> Result<Polled, StoreError> {
        let after = page.after.as_deref().unwrap_or("");
        let from_start = page.after.is_none();
        let limit = i64::try_from(page.limit).unwrap_or(i64::MAX);
        let rows = self
            .query_all(
                "the poll query",
                &self.statements().pending_tenants,
                &[
                    (&listeners, Type::TEXT),
                    (&after, Type::TEXT),
                    (&from_start, Type::BOOL),
                    (&limit, Type::INT8),
                ],
                |row| {
                    if let Some(writable) = row.try_get::<_, Option<bool>>(5)? {
                        return Ok(Found::Writable(writable));
                    }
                    Ok(
                        match (
                            row.try_get::<_, Option<String>>(0)?,
                            row.try_get::<_, Option<i64>>(4)?,
                        ) {
                            (Some(tenant), None) => Found::Pending(PendingTenant {
                                tenant,
                                oldest_id: row.try_get(1)?,
                                lag_ms: row.try_get(2)?,
                            }),
                            (Some(tenant), Some(parked)) => Found::Parked(tenant, parked),
                            (None, _) => Found::Listener(row.try_get(3)?),
                        },
                    )
                },
            )
            .await?;
        let mut polled = Polled {
            pending: Vec::new(),
            listeners: Vec::new(),
            parked: Vec::new(),
        };
        for found in rows {
            match found {
                Found::Pending(tenant) => polled.pending.push(tenant),
                Found::Parked(tenant, parked) => polled.parked.push((tenant, parked)),
                Found::Listener(name) => polled.listeners.push(name),
                Found::Writable(false) => {
                    return self.dropping_idle_if_read_only(Err(StoreError::ReadOnly));
                }
                Found::Writable(true) => {}
            }
        }
        Ok(polled)
    }

    /// Holds the table's columns, as the catalog has them, against what the
    /// relay reads, by the same check as every read's row description (see
    /// [`columns`]). `Ok(false)`: the table does not exist (yet), nothing
    /// was checked; an unfit or missing column is [`StoreError::Columns`].
    /// Notes whether the table has the columns of parking, which decides the
    /// statements the store runs from now on (see [`variant`]).
    pub async fn check_columns(&self) -> Result<bool, StoreError> {
        let table = &self.statements().table;
        let found = self
            .query_all("the column check", COLUMNS, &[(table, Type::TEXT)], |row| {
                let name: Option<String> = row.try_get(0)?;
                let ty = match name {
                    Some(_) => {
                        let oid: u32 = row.try_get(1)?;
                        Some(match Type::from_oid(oid) {
                            Some(ty) => ty,
                            None => Type::new(row.try_get(2)?, oid, Kind::Simple, row.try_get(3)?),
                        })
                    }
                    None => None,
                };
                let parking: bool = row.try_get(4)?;
                Ok((name.zip(ty), parking))
            })
            .await?;
        let Some((_, parking)) = found.first() else {
            return Ok(false);
        };
        self.parking_columns.store(*parking, Ordering::Relaxed);
        let found: Vec<(String, Type)> = found.into_iter().filter_map(|(c, _)| c).collect();
        columns::check(
            table,
            found.iter().map(|(name, ty)| (name.as_str(), ty)),
            true,
        )?;
        Ok(true)
    }

    /// `outbox-relay requeue --id`: the parked row `id` (not discarded)
    /// becomes pending again; one statement. Empty when no such row.
    pub async fn requeue(&self, id: i64) -> Result<Vec<Changed>, LifecycleError> {
        let sql = &self.lifecycle_statements().await?.requeue;
        Ok(self
            .query_all("requeue", sql, &[(&id, Type::INT8)], |row| changed(&row))
            .await?)
    }

    /// `outbox-relay requeue --tenant`: every parked row of `tenant` (not
    /// discarded) becomes pending again; one statement.
    pub async fn requeue_tenant(&self, tenant: &str) -> Result<Vec<Changed>, LifecycleError> {
        let sql = &self.lifecycle_statements().await?.requeue_tenant;
        Ok(self
            .query_all("requeue", sql, &[(&tenant, Type::TEXT)], |row| {
                changed(&row)
            })
            .await?)
    }

    /// `outbox-relay discard --id`: ends the parked row `id` unsent; one
    /// statement. Empty when no such row.
    pub async fn discard(&self, id: i64) -> Result<Vec<Changed>, LifecycleError> {
        let sql = &self.lifecycle_statements().await?.discard;
        Ok(self
            .query_all("discard", sql, &[(&id, Type::INT8)], |row| changed(&row))
            .await?)
    }

    /// The statements, once a check found the table with the columns of
    /// parking.
    async fn lifecycle_statements(&self) -> Result<&Statements, LifecycleError> {
        // Only the columns of parking matter here: these statements read no
        // payload.
        match self.check_columns().await {
            Ok(_) | Err(StoreError::Columns(_)) => {}
            Err(error) => return Err(error.into()),
        }
        if !self.has_parking_columns() {
            return Err(LifecycleError::NoParking(self.statements().table.clone()));
        }
        Ok(self.statements())
    }

    /// A page of `outbox-relay replay`: the tenant's published rows (never a
    /// discarded one) with `after` < id <= `to`, in id order, at most a
    /// batch and about `budget` bytes (at least one row), decoded as a
    /// sweep's batch is.
    pub async fn replay_page(
        &self,
        tenant: &str,
        after: i64,
        to: i64,
        budget: usize,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        let budget = i64::try_from(budget).unwrap_or(i64::MAX);
        let max_payload_bytes = self.max_payload_bytes;
        let params: [(&(dyn ToSql + Sync), Type); 7] = [
            (&tenant, Type::TEXT),
            (&self.batch_size, Type::INT8),
            (&max_payload_bytes, Type::INT8),
            (&budget, Type::INT8),
            (&FIELD_LIMIT, Type::INT8),
            (&after, Type::INT8),
            (&to, Type::INT8),
        ];
        let table = &self.statements().table;
        let rows = self
            .query_all(
                "the replay read",
                &self.statements().replay_batch,
                &params,
                |row| match columns::check_row(table, &row) {
                    Ok(()) => {
                        debug_assert!(in_column_order(&row), "replay_batch.sql's columns");
                        decode(row, max_payload_bytes).map(Ok)
                    }
                    Err(drift) => Ok(Err(drift)),
                },
            )
            .await?;
        Ok(rows.into_iter().collect::<Result<_, _>>()?)
    }

    /// One statement outside any sweep, on a pooled connection, within
    /// [`QUERY_TIMEOUT`]; a connection whose statement failed is discarded.
    async fn query_all<T>(
        &self,
        what: &'static str,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
        map: impl Fn(tokio_postgres::Row) -> Result<T, tokio_postgres::Error>,
    ) -> Result<Vec<T>, StoreError> {
        let conn = self.connection().await?;
        let work = async {
            let rows = conn.query_typed(sql, params).await?;
            Ok(rows.into_iter().map(map).collect::<Result<Vec<T>, _>>()?)
        };
        let result = deadline(what, work).await;
        if result.is_err() {
            // It may be half-way through a statement on a stalled path (or
            // on a server that takes no writes): the pool does not get it
            // back.
            drop(Object::take(conn));
        }
        self.dropping_idle_if_read_only(result)
    }
}

async fn deadline<T>(
    what: &'static str,
    work: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    within(what, QUERY_TIMEOUT, work).await
}

/// `work`, or [`StoreError::Timeout`] naming `what` once `limit` has passed.
pub(crate) async fn within<T>(
    what: &'static str,
    limit: Duration,
    work: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, work)
        .await
        .unwrap_or(Err(StoreError::Timeout(what, limit)))
}

/// Runs an `UPDATE … WHERE id = ANY($1)` statement; no round trip for no ids.
async fn update_ids(client: &Object, sql: &str, ids: &[i64]) -> Result<u64, StoreError> {
    if ids.is_empty() {
        return Ok(0);
    }
    Ok(client
        .execute_typed(sql, &[(&ids, Type::INT8_ARRAY)])
        .await?)
}

/// An UPDATE marking rows published ahead of the commit: sent when first
/// polled, its outcome read before the commit.
type MarkAhead = Started<Result<u64, StoreError>>;

/// The read of the next batch, sent ahead in the claim's transaction while
/// the current batch is published.
type ReadAhead = Started<Result<Batch, StoreError>>;

/// What [`Claim::answered`] waits for.
#[derive(Clone, Copy)]
enum Answers {
    /// Every mark and the read.
    All,
    /// The read ahead (and so every mark sent before it).
    ReadAhead,
}

/// Rows read for one batch.
#[derive(Default)]
struct Batch {
    rows: Vec<OutboxRow>,
    /// More rows were pending than the byte budget let the batch hold.
    cut_by_budget: bool,
    /// The most any one row brought (see [`RETAINED_READ_MAX`]).
    largest_read: usize,
}

/// What a claim has sent ahead of its commit on its connection: marks, and
/// the read of its next batch. Their answers come back in the order they
/// were sent, so whoever waits for one polls them all.
#[derive(Default)]
struct MarksAhead {
    /// Rows of the batch, from its start, that the marks cover.
    rows: usize,
    sent: Vec<MarkAhead>,
    next: Option<ReadAhead>,
}

impl MarksAhead {
    /// Whether a read ahead is still under way.
    fn reading(&self) -> bool {
        self.next.as_ref().is_some_and(|next| !next.is_done())
    }

    /// Polls everything sent; ready when every mark has its answer and the
    /// read (if any) is done.
    fn poll_all(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut done = true;
        for mark in &mut self.sent {
            done &= mark.poll_done(cx).is_ready();
        }
        if let Some(next) = &mut self.next {
            done &= next.poll_done(cx).is_ready();
        }
        if done { Poll::Ready(()) } else { Poll::Pending }
    }

    /// Polls everything sent with a waker that does nothing, so answers
    /// that arrived are taken off the connection.
    fn poll_now(&mut self) {
        for mark in &mut self.sent {
            mark.poll_now();
        }
        if let Some(next) = &mut self.next {
            next.poll_now();
        }
    }
}

/// How a claim ended: its batch, and the row its refusal parked, if any.
#[derive(Debug)]
pub struct Settled {
    pub rows: Vec<OutboxRow>,
    pub parked: Option<Parked>,
}

/// A row parked as its sweep settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parked {
    pub id: i64,
    /// Its attempts, the refusal that parked it included.
    pub attempts: i32,
}

/// One row of the poll's statement.
enum Found {
    Pending(PendingTenant),
    Parked(String, i64),
    Listener(String),
    /// Whether the server takes writes.
    Writable(bool),
}

/// A tenant held by this relay: an open transaction with the advisory lock and
/// the batch it read.
pub struct Claim {
    /// Shared only with the marks sent ahead, which end before the claim does.
    conn: Option<Arc<Object>>,
    store: Store,
    tenant: Arc<str>,
    rows: Vec<OutboxRow>,
    /// More rows were pending than the byte budget let the batch hold.
    cut_by_budget: bool,
    /// A writer of the tenant was in flight at the claim: the rows stop at
    /// the caller's safe bound, not at the sequence's position.
    writers: bool,
    /// Where the id sequence stood at the claim.
    position: i64,
    /// The most any one row read on the claim's connection brought.
    largest_read: usize,
    ahead: Mutex<MarksAhead>,
}

impl Claim {
    /// Whether a writer of the tenant was in flight at the claim, so that
    /// rows above the caller's safe bound may wait (see [`Store::claim`]).
    pub fn writers(&self) -> bool {
        self.writers
    }

    /// Where the id sequence stood at the claim.
    pub fn position(&self) -> i64 {
        self.position
    }

    fn client(&self) -> &Object {
        self.conn
            .as_ref()
            .expect("a claim holds its connection until it ends")
    }

    /// The batch, in outbox order.
    pub fn rows(&self) -> &[OutboxRow] {
        &self.rows
    }

    /// Whether the batch stopped at the byte budget with more rows pending
    /// behind it (so the tenant is swept again at once).
    pub fn cut_by_budget(&self) -> bool {
        self.cut_by_budget
    }

    /// What the batch holds of the byte budget.
    pub fn cost(&self) -> usize {
        self.rows.iter().map(|row| row.cost).sum()
    }

    /// The first row's cost when it alone was over the sweep's share of the
    /// budget, so its payload was not read (see [`Claim::read_withheld`]).
    pub fn withheld(&self) -> Option<usize> {
        self.rows
            .first()
            .filter(|row| matches!(row.payload, Payload::OverBudget { .. }))
            .map(|row| row.cost)
    }

    /// Reads the payload the batch read withheld for the budget; the caller
    /// holds the budget for it by now.
    pub async fn read_withheld(&mut self) -> Result<(), StoreError> {
        let Some(row) = self.rows.first() else {
            return Ok(());
        };
        let id = row.id;
        let client = self.client();
        let sql = &self.store.statements().read_payload;
        let table = &self.store.statements().table;
        let row = deadline("reading a payload", async {
            let row = client.query_typed_one(sql, &[(&id, Type::INT8)]).await?;
            columns::check_row(table, &row)?;
            Ok(row)
        })
        .await?;
        self.rows[0].payload = match row.try_get::<_, Option<Raw>>(0)? {
            Some(_) => Payload::Body(Bytes::from_owner(PayloadOf { row, column: 0 })),
            None => Payload::Tombstone,
        };
        self.largest_read = self.largest_read.max(read_bytes(&self.rows[0]));
        Ok(())
    }

    /// Sends the UPDATE marking the batch's first `prefix` rows published
    /// (those not marked yet), inside the claim's transaction, while the rest
    /// of the batch is still being confirmed; the marks become visible only at
    /// the commit, and [`Claim::settle`] undoes any that end up past the
    /// confirmed prefix.
    pub fn mark_ahead(&self, prefix: usize) {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let Some(ids) = self.rows.get(ahead.rows..prefix) else {
            return;
        };
        let ids: Vec<i64> = ids.iter().map(|row| row.id).collect();
        ahead.rows = prefix;
        let conn = self.conn.clone().expect("a claim holds its connection");
        let store = self.store.clone();
        // Started, the statement is sent. The marks sent before are polled
        // too: the driver hands a statement's answer over only once the one
        // before it has taken its own, so answers left waiting would hold up
        // the connection.
        ahead.sent.push(Started::new(async move {
            update_ids(&conn, &store.statements().mark_published, &ids).await
        }));
        ahead.poll_now();
    }

    /// Sends the read of the batch after this one (the tenant's pending rows
    /// after its last id, as many as `budget` bytes hold) in the claim's
    /// transaction, so that it is done while this batch is published; see
    /// [`Claim::reading_ahead`] and [`Claim::advance`].
    pub fn read_ahead(&self, budget: usize) {
        let Some(after) = self.rows.last().map(|row| row.id) else {
            return;
        };
        let conn = self.conn.clone().expect("a claim holds its connection");
        let (store, tenant) = (self.store.clone(), self.tenant.clone());
        let read =
            Started::new(async move { store.read_batch(&conn, &tenant, after, budget).await });
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        ahead.next = Some(read);
        ahead.poll_now();
    }

    /// Whether a read ahead is still under way.
    pub fn reading_ahead(&self) -> bool {
        self.ahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reading()
    }

    /// Drives what was sent ahead (the read, and the marks it holds up)
    /// until the read is done; the publishing loop awaits it beside the
    /// broker's confirms.
    pub async fn read_ahead_progress(&self) {
        std::future::poll_fn(|cx| {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            let _ = ahead.poll_all(cx);
            if ahead.reading() {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await
    }

    /// Once every row of this batch was confirmed: sends the mark of the
    /// rest of them (in the transaction) and makes the batch read ahead the
    /// claim's batch, as soon as that read is answered; the mark's answer is
    /// awaited later, beside the next batch's confirms (it comes after the
    /// read's, and a failed one fails the claim at its settlement).
    /// `Ok(false)`, and the claim unchanged but for its marks, when there is
    /// no next batch to go on with: none was read, it is empty, or its first
    /// row was too large for the read's share (its own sweep reads it).
    pub async fn advance(&mut self) -> Result<bool, StoreError> {
        self.mark_ahead(self.rows.len());
        let answered = self.answered(Answers::ReadAhead).await;
        self.store.dropping_idle_if_read_only(answered)?;
        let ahead = self.ahead.get_mut().unwrap_or_else(|e| e.into_inner());
        let Some(mut next) = ahead.next.take() else {
            return Ok(false);
        };
        let batch = next.take().expect("the read ahead is done once answered")?;
        let withheld = batch
            .rows
            .first()
            .is_some_and(|row| matches!(row.payload, Payload::OverBudget { .. }));
        if batch.rows.is_empty() || withheld {
            return Ok(false);
        }
        ahead.rows = 0;
        self.rows = batch.rows;
        self.cut_by_budget = batch.cut_by_budget;
        self.largest_read = self.largest_read.max(batch.largest_read);
        Ok(true)
    }

    /// Waits for the marks and the read sent ahead, within [`QUERY_TIMEOUT`]
    /// of being asked (not of being sent: a long batch may be sending for
    /// longer); the rows the marks marked. A failed mark or read has aborted
    /// the transaction: the claim can only be dropped.
    pub async fn marks_ahead_done(&self) -> Result<u64, StoreError> {
        let done = self.answered(Answers::All).await;
        self.store.dropping_idle_if_read_only(done)
    }

    /// Waits for `which` of what was sent ahead to be answered; the rows the
    /// marks answered so far marked, or the first error among them or the
    /// read's.
    async fn answered(&self, which: Answers) -> Result<u64, StoreError> {
        // Polled where they are: the claim must always know every holder of
        // its connection (see `Drop`), even if this wait is abandoned.
        let answered = std::future::poll_fn(|cx| {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            let all = ahead.poll_all(cx);
            match which {
                Answers::All => all.map(Ok),
                // The read's answer comes after those of the marks sent
                // before it.
                Answers::ReadAhead if ahead.reading() => Poll::Pending,
                Answers::ReadAhead => Poll::Ready(Ok(())),
            }
        });
        deadline("marking ahead", answered).await?;
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let mut marked = 0;
        let mut first_error = None;
        ahead.sent.retain_mut(|mark| match mark.take() {
            Some(Ok(rows)) => {
                marked += rows;
                false
            }
            Some(Err(error)) => {
                first_error.get_or_insert(error);
                false
            }
            None => true,
        });
        if let Some(error) = first_error {
            return Err(error);
        }
        // A failed read ahead has aborted the transaction too (its COMMIT
        // would only roll back): its error ends the claim. A batch read is
        // left for `advance`.
        if let Some(next) = &mut ahead.next
            && matches!(next.output(), Some(Err(_)))
            && let Some(Err(error)) = next.take()
        {
            ahead.next = None;
            return Err(error);
        }
        Ok(marked)
    }

    /// Ends the claim as the batch went: marks the confirmed prefix (what the
    /// marks sent ahead did not cover), undoes marks sent ahead past it,
    /// records a refusal known to be the row's (parking the row when the
    /// refusal is one that parks and its attempts reached
    /// `park_after_attempts`), and commits, in one round trip; gives the batch
    /// back. On any error the transaction is abandoned and nothing is marked.
    pub async fn settle(mut self, report: &BatchReport) -> Result<Settled, StoreError> {
        self.marks_ahead_done().await?;
        let confirmed = report.confirmed();
        let marked = self.ahead.get_mut().unwrap_or_else(|e| e.into_inner()).rows;
        let ids = |from: usize, to: usize| -> Vec<i64> {
            self.rows[from.min(to)..to].iter().map(|r| r.id).collect()
        };
        let (published, unpublished) = (ids(marked, confirmed), ids(confirmed, marked));
        // Only a refusal known to be the row's is written on it: a failure of
        // the channel or connection it shared with other tenants' rows blames
        // none of them (see `Refusal::attributed`).
        let refused = report
            .refusal
            .as_ref()
            .filter(|(_, refusal)| refusal.attributed)
            .and_then(|(at, refusal)| Some((self.rows.get(*at)?.id, refusal)));
        let client = self.client();
        let statements = self.store.statements();
        let parks_at = refused.map_or(0, |(_, refusal)| self.store.parks_at(refusal.reason));
        let work = async {
            let refused = async {
                match refused {
                    Some((id, refusal)) => {
                        // Why the row did not go out is always recorded; only
                        // the row's own refusals count as attempts.
                        let attempts = i32::from(refusal.reason.counts_as_attempt());
                        let last_error = refusal.last_error();
                        let params: [(&(dyn ToSql + Sync), Type); 4] = [
                            (&id, Type::INT8),
                            (&last_error, Type::TEXT),
                            (&attempts, Type::INT4),
                            (&parks_at, Type::INT4),
                        ];
                        let row = client
                            .query_typed_opt(&statements.record_refusal, &params)
                            .await?;
                        Ok::<_, StoreError>(match row {
                            Some(row) if row.try_get::<_, bool>(1)? => Some(Parked {
                                id,
                                attempts: row.try_get(0)?,
                            }),
                            _ => None,
                        })
                    }
                    None => Ok(None),
                }
            };
            let (marked, unmarked, recorded, commit) = tokio::join!(
                update_ids(client, &statements.mark_published, &published),
                update_ids(client, &statements.unmark_published, &unpublished),
                refused,
                client.batch_execute("COMMIT")
            );
            // A failed statement turns the COMMIT into a rollback: report the
            // statement's error, not the commit's success.
            marked?;
            unmarked?;
            let parked = recorded?;
            commit?;
            Ok(parked)
        };
        let committed = deadline("the commit", work).await;
        let parked = self.store.dropping_idle_if_read_only(committed)?;
        self.release();
        Ok(Settled {
            rows: std::mem::take(&mut self.rows),
            parked,
        })
    }

    /// Ends the transaction without changes.
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        self.marks_ahead_done().await?;
        let client = self.client();
        deadline("the rollback", async {
            Ok(client.batch_execute("ROLLBACK").await?)
        })
        .await?;
        self.release();
        Ok(())
    }

    /// Hands a connection whose transaction ended cleanly back to the pool,
    /// unless it read a row larger than [`RETAINED_READ_MAX`]: its read
    /// buffer grew to hold that row and would stay that large in the pool,
    /// uncounted by the byte budget, so it is closed instead.
    fn release(&mut self) {
        let conn = self.conn.take();
        if self.largest_read > RETAINED_READ_MAX
            && let Some(conn) = conn.and_then(Arc::into_inner)
        {
            drop(Object::take(conn));
        }
    }
}

impl Lease for Claim {
    /// Whether the claim still holds: its connection (and with it the
    /// transaction and the advisory lock) is open.
    fn is_held(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| !c.is_closed())
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        // The marks and the read ahead share the connection; they go first.
        let ahead = self.ahead.get_mut().unwrap_or_else(|e| e.into_inner());
        ahead.sent.clear();
        ahead.next = None;
        if let Some(conn) = self.conn.take().and_then(Arc::into_inner) {
            // Still inside the transaction: close the connection, and with it
            // the transaction and the advisory lock.
            drop(Object::take(conn));
        }
    }
}
