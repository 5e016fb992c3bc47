//! PostgreSQL: the pool, the claim of a tenant, the read of its batch, the
//! marking of what the broker confirmed, and the lag queries. Every statement
//! the relay runs is in `src/store/*.sql`; `{table}` stands for the configured
//! `"schema"."table"`.
//!
//! A [`Claim`] is one open transaction on one pooled connection holding a
//! tenant's advisory lock. It ends by [`Claim::finish`] (commit) or by being
//! dropped: a dropped claim takes its connection out of the pool and closes it,
//! so the server rolls the transaction back and no half-used connection is
//! ever handed to another sweep.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime, Timeouts};
use time::OffsetDateTime;
use tokio_postgres::config::SslMode;
use tokio_postgres::types::ToSql;

use crate::config::Config;

/// Deadline of each round trip of a sweep, and of the poll and lag queries.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline for opening a connection (TCP, TLS, authentication).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
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

/// A failure to talk to PostgreSQL. Never carries a password or a payload.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no database connection: {0}")]
    Pool(String),
    #[error("database error: {0}")]
    Query(String),
    #[error("database did not answer {0} within {1:?}")]
    Timeout(&'static str, Duration),
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(error: tokio_postgres::Error) -> StoreError {
        StoreError::Query(describe(&error))
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

/// One pending outbox row, as the relay publishes it.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub id: i64,
    pub kind: String,
    pub subject_id: String,
    /// `None` is a tombstone.
    pub payload: Option<String>,
    pub headers: Option<serde_json::Value>,
    pub occurred_at: OffsetDateTime,
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

/// A parsed `database_url`: the driver's config plus what the driver does not
/// parse itself (`sslmode=verify-full`/`verify-ca`, `sslrootcert`).
pub struct DatabaseTarget {
    pub config: tokio_postgres::Config,
    pub root_cert: Option<PathBuf>,
}

/// Parses `database_url` (URL or key-value form). The error text never contains
/// the URL itself.
pub fn parse_database_url(url: &str) -> Result<DatabaseTarget, String> {
    let mut root_cert = None;
    let mut verify = false;
    let mut tls_asked = false;
    let mut rewrite = |key: &str, value: &str| -> Option<(String, String)> {
        match (key, value) {
            ("sslmode", "verify-full" | "verify-ca") => {
                verify = true;
                Some((key.into(), "require".into()))
            }
            ("sslmode", _) => {
                tls_asked = true;
                Some((key.into(), value.into()))
            }
            ("sslrootcert", path) => {
                root_cert = Some(PathBuf::from(path));
                None
            }
            _ => Some((key.into(), value.into())),
        }
    };
    let cleaned = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let mut parsed = url::Url::parse(url).map_err(|e| format!("not a valid URL: {e}"))?;
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .filter_map(|(k, v)| rewrite(&k, &v))
            .collect();
        if pairs.is_empty() {
            parsed.set_query(None);
        } else {
            parsed.query_pairs_mut().clear().extend_pairs(pairs);
        }
        parsed.to_string()
    } else if url.contains("://") {
        return Err("must start with postgres:// or postgresql:// (or be key=value pairs)".into());
    } else {
        url.split_whitespace()
            .filter_map(|pair| {
                let (k, v) = pair.split_once('=')?;
                rewrite(k, v).map(|(k, v)| format!("{k}={v}"))
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut config: tokio_postgres::Config =
        cleaned.parse().map_err(|e: tokio_postgres::Error| {
            format!("not a valid PostgreSQL connection string: {e}")
        })?;
    if config.get_hosts().is_empty() {
        return Err("names no host".into());
    }
    if verify {
        config.ssl_mode(SslMode::Require);
    }
    // Without an sslmode the connection is plain, as DESIGN.md has it: TLS is
    // asked for with sslmode=require or verify-full, and then always verified.
    if !tls_asked && !verify {
        config.ssl_mode(SslMode::Disable);
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    if config.get_application_name().is_none() {
        config.application_name("outbox-relay");
    }
    // A dead peer is noticed in about 30 s even when no query is running.
    config
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(15))
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3);
    Ok(DatabaseTarget { config, root_cert })
}

fn tls_connector(
    root_cert: Option<&PathBuf>,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        // A system certificate the TLS library cannot use is skipped, not fatal.
        let _ = roots.add(cert);
    }
    if let Some(path) = root_cert {
        let pem =
            std::fs::read(path).map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
        let mut reader = std::io::BufReader::new(pem.as_slice());
        for cert in rustls_pemfile_certs(&mut reader) {
            roots
                .add(cert)
                .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
        }
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(tls))
}

/// The certificates of a PEM file (any other blocks are skipped).
fn rustls_pemfile_certs(
    reader: &mut dyn std::io::BufRead,
) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    let mut pem = Vec::new();
    if reader.read_to_end(&mut pem).is_err() {
        return Vec::new();
    }
    rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
        .filter_map(Result::ok)
        .collect()
}

impl Store {
    /// Builds the pool; no connection is opened until one is needed.
    pub fn new(config: &Config) -> Result<Store, String> {
        let target = parse_database_url(&config.database_url)?;
        let tls = tls_connector(target.root_cert.as_ref())?;
        let manager = Manager::from_config(
            target.config,
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
            .map_err(|e| e.to_string())?;
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
        self.pool
            .get()
            .await
            .map_err(|e| StoreError::Pool(e.to_string()))
    }

    /// Opens a transaction, tries the tenant's advisory lock and reads its
    /// oldest pending rows, all in one round trip. `Ok(None)`: another relay
    /// holds the tenant.
    pub async fn claim(&self, tenant: &str) -> Result<Option<Claim>, StoreError> {
        let conn = self.connection().await?;
        let mut claim = Claim {
            conn: Some(conn),
            store: self.clone(),
            rows: Vec::new(),
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
        finish_or_discard(conn, result)
    }
}

/// Returns a connection whose last use failed to the pool no more: it may be
/// half-way through a statement on a stalled path.
fn finish_or_discard<T>(conn: Object, result: Result<T, StoreError>) -> Result<T, StoreError> {
    if result.is_err() {
        drop(Object::take(conn));
    }
    result
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
async fn update_ids(
    client: &Object,
    statement: &tokio_postgres::Statement,
    ids: &[i64],
) -> Result<u64, tokio_postgres::Error> {
    if ids.is_empty() {
        return Ok(0);
    }
    client.execute(statement, &[&ids]).await
}

/// How a sweep ends its claim: which rows the broker confirmed and, if one was
/// refused, which one and why.
#[derive(Debug, Default)]
pub struct Settlement<'a> {
    /// Rows to mark published (those not already marked ahead).
    pub published: Vec<i64>,
    /// Rows marked ahead that are not in the confirmed prefix after all.
    pub unpublished: Vec<i64>,
    pub refused: Option<Refused<'a>>,
}

/// The row a sweep stopped at, and why.
#[derive(Debug, Clone, Copy)]
pub struct Refused<'a> {
    pub id: i64,
    /// Stored in `last_error`: `<reason>: <detail>`, never a payload.
    pub last_error: &'a str,
    /// A refusal by the broker (or of the row itself) counts in `attempts`; a
    /// lost connection does not.
    pub counts_as_attempt: bool,
}

/// A tenant held by this relay: an open transaction with the advisory lock and
/// the batch it read.
pub struct Claim {
    conn: Option<Object>,
    store: Store,
    rows: Vec<OutboxRow>,
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

    /// Whether the claim still holds: its connection (and with it the
    /// transaction and the advisory lock) is open. Once it is not, another
    /// relay may be publishing the same rows, so this one stops sending.
    pub fn is_held(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| !c.is_closed())
    }

    /// Sends the UPDATE marking `ids` published now, inside the claim's
    /// transaction, while the rest of the batch is still being confirmed; the
    /// marks become visible only at the commit. The returned future sends the
    /// statement when first polled and resolves to its outcome, which must be
    /// awaited before [`Claim::finish`]: a failed statement aborts the
    /// transaction. Rows marked ahead that end up outside the confirmed prefix
    /// go in [`Settlement::unpublished`].
    pub fn mark_ahead(
        &self,
        ids: Vec<i64>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + '_ {
        let client = self.client();
        let sql = &self.store.statements.mark_published;
        async move {
            deadline("marking ahead", async {
                let mark = client.prepare_cached(sql).await?;
                Ok(update_ids(client, &mark, &ids).await?)
            })
            .await
        }
    }

    /// Marks the published rows, undoes marks made ahead for rows that were
    /// not, records a refusal, and commits, in one round trip. On any error
    /// the transaction is abandoned and nothing is marked.
    pub async fn finish(mut self, settlement: Settlement<'_>) -> Result<(), StoreError> {
        let client = self.client();
        let statements = &self.store.statements;
        let work = async {
            let mark = client.prepare_cached(&statements.mark_published).await?;
            let unmark = client.prepare_cached(&statements.unmark_published).await?;
            let record = client.prepare_cached(&statements.record_refusal).await?;
            let published = update_ids(client, &mark, &settlement.published);
            let unpublished = update_ids(client, &unmark, &settlement.unpublished);
            let refused = async {
                match settlement.refused {
                    Some(refused) => {
                        let attempts = i32::from(refused.counts_as_attempt);
                        let params: [&(dyn ToSql + Sync); 3] =
                            [&refused.id, &refused.last_error, &attempts];
                        client.execute(&record, &params).await
                    }
                    None => Ok(0),
                }
            };
            let (marked, unmarked, recorded, commit) = tokio::join!(
                published,
                unpublished,
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
        Ok(())
    }

    /// Ends the transaction without changes.
    pub async fn rollback(mut self) -> Result<(), StoreError> {
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

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Still inside the transaction: close the connection, and with it
            // the transaction and the advisory lock.
            drop(Object::take(conn));
        }
    }
}
