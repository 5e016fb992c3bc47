//! PostgreSQL: the pool, the claim of a tenant, the read of its batch, the
//! marking of what the broker confirmed, and the lag queries. Every statement
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

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use deadpool_postgres::{
    BuildError, Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime, Timeouts,
};
use futures_util::future::{MaybeDone, maybe_done};
use tokio_postgres::types::ToSql;

use crate::config::{Config, DatabaseTarget};
use crate::domain::{BatchReport, Lease, OutboxRow};

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
const MARK_PUBLISHED: &str = include_str!("store/mark_published.sql");
const RECORD_REFUSAL: &str = include_str!("store/record_refusal.sql");
const UNMARK_PUBLISHED: &str = include_str!("store/unmark_published.sql");
const PENDING_TENANTS: &str = include_str!("store/pending_tenants.sql");
const TENANT_LAG: &str = include_str!("store/tenant_lag.sql");
const TENANT_STATUS: &str = include_str!("store/tenant_status.sql");

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
    #[error("sslrootcert {}: {source}", path.display())]
    RootCert {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot build the connection pool: {0}")]
    Build(#[source] BuildError),
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
}

/// The server's message and SQLSTATE when there is one, else the driver's
/// error and its cause ("db error" alone tells an operator nothing).
fn describe(error: &tokio_postgres::Error) -> String {
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

/// A tenant's lag as the database's clock sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantLag {
    pub tenant: String,
    pub pending: bool,
    pub lag_ms: i64,
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
}

/// The statements with the configured table substituted.
#[derive(Debug)]
struct Statements {
    read_batch: String,
    mark_published: String,
    unmark_published: String,
    record_refusal: String,
    pending_tenants: String,
    tenant_lag: String,
    tenant_status: String,
}

/// The outbox table of one relay: a pool and its statements.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    statements: Arc<Statements>,
    /// `'<schema>.<table>'`: the first advisory-lock key.
    lock_key: Arc<str>,
    batch_size: i64,
}

/// `"schema"."table"`, each identifier quoted.
pub fn qualified_table(schema: &str, table: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(table))
}

/// A PostgreSQL identifier in double quotes.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn tls_connector(
    root_cert: Option<&Path>,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, StoreError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        // A system certificate the TLS library cannot use is skipped, not fatal.
        let _ = roots.add(cert);
    }
    if let Some(path) = root_cert {
        let unusable = |source| StoreError::RootCert {
            path: path.to_path_buf(),
            source,
        };
        let pem = std::fs::read(path).map_err(unusable)?;
        for cert in pem_certificates(&pem) {
            roots
                .add(cert)
                .map_err(|e| unusable(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
        }
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(tls))
}

/// The certificates of a PEM file (any other blocks are skipped).
fn pem_certificates(pem: &[u8]) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect()
}

impl Store {
    /// Builds the pool for the configured target; no connection is opened
    /// until one is needed.
    pub fn new(config: &Config) -> Result<Store, StoreError> {
        let DatabaseTarget {
            config: target,
            root_cert,
            ..
        } = config.database_url.clone();
        let tls = tls_connector(root_cert.as_deref())?;
        let manager = Manager::from_config(
            target,
            tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .timeouts(Timeouts {
                wait: Some(POOL_WAIT_TIMEOUT),
                create: Some(CONNECT_TIMEOUT),
                recycle: Some(CONNECT_TIMEOUT),
            })
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(StoreError::Build)?;
        let table = qualified_table(&config.schema, &config.table);
        let with_table = |sql: &str| sql.replace("{table}", &table);
        Ok(Store {
            pool,
            statements: Arc::new(Statements {
                read_batch: with_table(READ_BATCH),
                mark_published: with_table(MARK_PUBLISHED),
                unmark_published: with_table(UNMARK_PUBLISHED),
                record_refusal: with_table(RECORD_REFUSAL),
                pending_tenants: with_table(PENDING_TENANTS),
                tenant_lag: with_table(TENANT_LAG),
                tenant_status: with_table(TENANT_STATUS),
            }),
            lock_key: format!("{}.{}", config.schema, config.table).into(),
            batch_size: i64::try_from(config.batch_size).unwrap_or(i64::MAX),
        })
    }

    /// A pooled connection, within [`POOL_WAIT_TIMEOUT`].
    pub async fn connection(&self) -> Result<Object, StoreError> {
        self.pool.get().await.map_err(StoreError::Pool)
    }

    /// Opens a transaction, tries the tenant's advisory lock and reads its
    /// oldest pending rows, all in one round trip. `Ok(None)`: another relay
    /// holds the tenant.
    pub async fn claim(&self, tenant: &str) -> Result<Option<Claim>, StoreError> {
        let mut claim = Claim {
            conn: Some(Arc::new(self.connection().await?)),
            store: self.clone(),
            rows: Vec::new(),
            ahead: Mutex::new(MarksAhead::default()),
        };
        let client = claim.client();
        let work = async {
            let claim_stmt = client.prepare_cached(CLAIM).await?;
            let read_stmt = client.prepare_cached(&self.statements.read_batch).await?;
            // Prepared here (once per connection) so that marking ahead sends
            // its UPDATE at once.
            client
                .prepare_cached(&self.statements.mark_published)
                .await?;
            let lock_key: &str = &self.lock_key;
            let claim_params: [&(dyn ToSql + Sync); 2] = [&lock_key, &tenant];
            let read_params: [&(dyn ToSql + Sync); 2] = [&tenant, &self.batch_size];
            let (begin, taken, rows) = tokio::join!(
                client.batch_execute(BEGIN),
                client.query_one(&claim_stmt, &claim_params),
                client.query(&read_stmt, &read_params),
            );
            begin?;
            let taken: bool = taken?.try_get(1)?;
            let rows = rows?;
            Ok::<_, StoreError>((taken, rows))
        };
        let (taken, rows) = deadline("the claim", work).await?;
        if !taken {
            claim.rollback().await?;
            return Ok(None);
        }
        claim.rows = rows
            .iter()
            .map(|row| {
                Ok(OutboxRow {
                    id: row.try_get(0)?,
                    kind: row.try_get(1)?,
                    subject_id: row.try_get(2)?,
                    payload: row.try_get(3)?,
                    headers: row.try_get(4)?,
                    occurred_at: row.try_get(5)?,
                })
            })
            .collect::<Result<_, tokio_postgres::Error>>()?;
        Ok(Some(claim))
    }

    /// The configured tenants' lag, one statement.
    pub async fn tenant_lag(&self, tenants: &[String]) -> Result<Vec<TenantLag>, StoreError> {
        self.query_all(
            "the lag query",
            &self.statements.tenant_lag,
            &[&tenants],
            |row| {
                Ok(TenantLag {
                    tenant: row.try_get(0)?,
                    pending: row.try_get(1)?,
                    lag_ms: row.try_get(2)?,
                })
            },
        )
        .await
    }

    /// Pending rows, lag and the blocking row of each tenant, one statement.
    pub async fn tenant_status(&self, tenants: &[String]) -> Result<Vec<TenantStatus>, StoreError> {
        self.query_all(
            "the status query",
            &self.statements.tenant_status,
            &[&tenants],
            |row| {
                Ok(TenantStatus {
                    tenant: row.try_get(0)?,
                    pending: row.try_get(1)?,
                    lag_ms: row.try_get(2)?,
                    oldest_id: row.try_get(3)?,
                    attempts: row.try_get(4)?,
                    last_error: row.try_get(5)?,
                })
            },
        )
        .await
    }

    /// Every tenant with pending rows (configured or not) and its lag, one
    /// statement whose cost does not grow with idle tenants.
    pub async fn pending_tenants(&self) -> Result<Vec<(String, i64)>, StoreError> {
        self.query_all(
            "the poll query",
            &self.statements.pending_tenants,
            &[],
            |row| Ok((row.try_get(0)?, row.try_get(1)?)),
        )
        .await
    }

    /// One statement outside any sweep, on a pooled connection, within
    /// [`QUERY_TIMEOUT`]; a connection whose statement failed is discarded.
    async fn query_all<T>(
        &self,
        what: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        map: impl Fn(&tokio_postgres::Row) -> Result<T, tokio_postgres::Error>,
    ) -> Result<Vec<T>, StoreError> {
        let conn = self.connection().await?;
        let work = async {
            let stmt = conn.prepare_cached(sql).await?;
            let rows = conn.query(&stmt, params).await?;
            Ok(rows.iter().map(map).collect::<Result<Vec<T>, _>>()?)
        };
        let result = deadline(what, work).await;
        if result.is_err() {
            // It may be half-way through a statement on a stalled path: the
            // pool does not get it back.
            drop(Object::take(conn));
        }
        result
    }
}

async fn deadline<T>(
    what: &'static str,
    work: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(QUERY_TIMEOUT, work).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::Timeout(what, QUERY_TIMEOUT)),
    }
}

/// Runs an `UPDATE … WHERE id = ANY($1)` statement; no round trip for no ids.
async fn update_ids(client: &Object, sql: &str, ids: &[i64]) -> Result<u64, StoreError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let statement = client.prepare_cached(sql).await?;
    Ok(client.execute(&statement, &[&ids]).await?)
}

/// An UPDATE marking rows published ahead of the commit: sent when first
/// polled, its outcome read before the commit.
type MarkAhead = Pin<Box<MaybeDone<Pin<Box<dyn Future<Output = Result<u64, StoreError>> + Send>>>>>;

/// The marks a claim has sent ahead of its commit.
#[derive(Default)]
struct MarksAhead {
    /// Rows of the batch, from its start, that the marks cover.
    rows: usize,
    sent: Vec<MarkAhead>,
}

/// A tenant held by this relay: an open transaction with the advisory lock and
/// the batch it read.
pub struct Claim {
    /// Shared only with the marks sent ahead, which end before the claim does.
    conn: Option<Arc<Object>>,
    store: Store,
    rows: Vec<OutboxRow>,
    ahead: Mutex<MarksAhead>,
}

impl Claim {
    fn client(&self) -> &Object {
        self.conn
            .as_ref()
            .expect("a claim holds its connection until it ends")
    }

    /// The batch, in outbox order.
    pub fn rows(&self) -> &[OutboxRow] {
        &self.rows
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
        let update: Pin<Box<dyn Future<Output = _> + Send>> =
            Box::pin(
                async move { update_ids(&conn, &store.statements.mark_published, &ids).await },
            );
        ahead.sent.push(Box::pin(maybe_done(update)));
        // The first poll sends the statement. The marks sent before are
        // polled too: the driver hands a statement's answer over only once
        // the one before it has taken its own, so answers left waiting would
        // hold up the connection.
        let mut noop = Context::from_waker(Waker::noop());
        for mark in &mut ahead.sent {
            let _ = mark.as_mut().poll(&mut noop);
        }
    }

    /// Waits for the marks sent ahead, within [`QUERY_TIMEOUT`] of being
    /// asked (not of being sent: a long batch may be sending for longer);
    /// the rows they marked. A failed mark has aborted the transaction: the
    /// claim can only be dropped.
    pub async fn marks_ahead_done(&self) -> Result<u64, StoreError> {
        // Polled where they are: the claim must always know every holder of
        // its connection (see `Drop`), even if this wait is abandoned.
        let all_answered = std::future::poll_fn(|cx| {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            for mark in &mut ahead.sent {
                if mark.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            Poll::Ready(Ok(()))
        });
        deadline("marking ahead", all_answered).await?;
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let mut marked = 0;
        for mut mark in std::mem::take(&mut ahead.sent) {
            marked += mark
                .as_mut()
                .take_output()
                .expect("a finished mark has its outcome")?;
        }
        Ok(marked)
    }

    /// Ends the claim as the batch went: marks the confirmed prefix (what the
    /// marks sent ahead did not cover), undoes marks sent ahead past it,
    /// records a refusal known to be the row's, and commits, in one round trip; gives the batch
    /// back. On any error the transaction is abandoned and nothing is marked.
    pub async fn settle(mut self, report: &BatchReport) -> Result<Vec<OutboxRow>, StoreError> {
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
        let statements = &self.store.statements;
        let work = async {
            let record = client.prepare_cached(&statements.record_refusal).await?;
            let refused = async {
                match refused {
                    Some((id, refusal)) => {
                        // Why the row did not go out is always recorded; only
                        // the row's own refusals count as attempts.
                        let attempts = i32::from(refusal.reason.counts_as_attempt());
                        let last_error = refusal.last_error();
                        let params: [&(dyn ToSql + Sync); 3] = [&id, &last_error, &attempts];
                        client
                            .execute(&record, &params)
                            .await
                            .map_err(StoreError::from)
                    }
                    None => Ok(0),
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
            recorded?;
            commit?;
            Ok(())
        };
        deadline("the commit", work).await?;
        self.release();
        Ok(std::mem::take(&mut self.rows))
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

    /// Hands a connection whose transaction ended cleanly back to the pool.
    fn release(&mut self) {
        drop(self.conn.take());
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
        // The marks share the connection; they go first.
        self.ahead
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .sent
            .clear();
        if let Some(conn) = self.conn.take().and_then(Arc::into_inner) {
            // Still inside the transaction: close the connection, and with it
            // the transaction and the advisory lock.
            drop(Object::take(conn));
        }
    }
}
