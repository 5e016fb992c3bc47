//! The round trips' deadlines, and the statements run alone on a pooled
//! connection.

use std::future::Future;
use std::time::Duration;

use deadpool_postgres::Object;
use tokio_postgres::types::{ToSql, Type};

use super::statements::{Statements, execute_mark};
use super::{Store, StoreError};

/// Deadline of each round trip of a sweep, and of the poll and lag queries.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

impl Store {
    /// One statement outside any sweep, on a pooled connection, within
    /// [`QUERY_TIMEOUT`]; a connection whose statement failed is discarded.
    pub(crate) async fn query_all<T>(
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

/// `work` within [`QUERY_TIMEOUT`].
pub(super) async fn deadline<T>(
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
pub(super) async fn update_ids(client: &Object, sql: &str, ids: &[i64]) -> Result<u64, StoreError> {
    if ids.is_empty() {
        return Ok(0);
    }
    Ok(client
        .execute_typed(sql, &[(&ids, Type::INT8_ARRAY)])
        .await?)
}

/// Marks `ids` published in a claim's transaction: by the mark the claim
/// `prepared` (see `Statements::prepare`), or by `mark_published.sql`; the
/// rows it left published (see `mark_published.sql`). No round trip for no
/// ids.
pub(super) async fn mark_ids(
    client: &Object,
    statements: &Statements,
    prepared: bool,
    ids: &[i64],
) -> Result<u64, StoreError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let row = if prepared {
        client.query_typed_one(&execute_mark(ids), &[]).await?
    } else {
        client
            .query_typed_one(&statements.mark_published, &[(&ids, Type::INT8_ARRAY)])
            .await?
    };
    Ok(u64::try_from(row.try_get::<_, i64>(0)?).unwrap_or(0))
}
