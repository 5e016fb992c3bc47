//! The operator's statements on parked and published rows: `requeue`,
//! `discard`, and the pages `replay` reads.

use deadpool_postgres::Object;
use tokio_postgres::types::{ToSql, Type};

use super::query::deadline;
use super::read::{FIELD_LIMIT, RETAINED_READ_MAX, decode, in_column_order, read_bytes};
use super::statements::Statements;
use super::{Store, StoreError, columns};
use crate::domain::OutboxRow;

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

/// A row a `requeue` or `discard` changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changed {
    pub id: i64,
    pub tenant: String,
}

/// A row of requeue.sql, requeue_tenant.sql or discard.sql.
fn changed(row: &tokio_postgres::Row) -> Result<Changed, tokio_postgres::Error> {
    Ok(Changed {
        id: row.try_get(0)?,
        tenant: row.try_get(1)?,
    })
}

impl Store {
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
        let conn = self.connection().await?;
        let work = async {
            let rows = conn
                .query_typed(&self.statements().replay_batch, &params)
                .await?;
            let mut page = Vec::with_capacity(rows.len());
            for row in rows {
                columns::check_row(table, &row)?;
                debug_assert!(in_column_order(&row), "replay_batch.sql's columns");
                page.push(decode(row, max_payload_bytes)?);
            }
            Ok(page)
        };
        let page: Result<Vec<OutboxRow>, StoreError> = deadline("the replay read", work).await;
        // As a claim's (see `Claim`'s drop): a connection that read a large
        // row is not pooled with its grown buffer, nor one that failed.
        let largest = page.as_ref().map_or(usize::MAX, |page| {
            page.iter().map(read_bytes).max().unwrap_or(0)
        });
        if largest > RETAINED_READ_MAX {
            drop(Object::take(conn));
        }
        page
    }
}
