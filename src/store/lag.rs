//! Each tenant's lag, for the endpoints and `status`, by the database's
//! clock.

use tokio_postgres::types::Type;

use super::{Page, Store, StoreError};
use crate::config::Tenants;

/// A configured tenant's lag as the database's clock sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantLag {
    pub tenant: String,
    /// The lowest pending id; `None` when nothing is pending.
    pub oldest_id: Option<i64>,
    /// The age of that row, clamped to 0 … 10,000 years; 0 when none.
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
    /// Rows parked (not discarded): out of the tenant's order, waiting for
    /// `requeue` or `discard`.
    pub parked: i64,
}

impl Store {
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
}
