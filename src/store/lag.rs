//! Each tenant's lag, for the endpoints and `status`, by the database's
//! clock.

use tokio_postgres::types::Type;

use super::statements::TENANT_WRITERS;
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
    /// The other tenants reported whose names share this one's `hashtext`,
    /// and so its claim key and writers' lock (see `twins`).
    pub twins: Vec<String>,
    /// The transactions that hold the tenant's writers' lock: writers in
    /// flight (of the tenant, or of a twin).
    pub writers: Vec<Writer>,
}

/// A transaction that holds a tenant's writers' lock, as `status` names it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Writer {
    /// Its backend's pid; none for a prepared transaction.
    pub pid: Option<i32>,
    /// When its transaction began (UTC), and how long ago in ms; none when
    /// the server does not show it to this role.
    pub xact_start: Option<String>,
    pub open_ms: Option<i64>,
    /// A prepared transaction's `gid`, when it was prepared (UTC), and how
    /// long ago in ms.
    pub gid: Option<String>,
    pub prepared: Option<String>,
    pub prepared_ms: Option<i64>,
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

    /// Pending rows, lag and the blocking row of each tenant, one statement;
    /// then its twins and the writers that hold its writers' lock, one more.
    pub async fn tenant_status(&self, tenants: &[String]) -> Result<Vec<TenantStatus>, StoreError> {
        let mut statuses = self
            .query_all(
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
                        twins: Vec::new(),
                        writers: Vec::new(),
                    })
                },
            )
            .await?;
        let lock_key: &str = &self.lock_key;
        let holders = self
            .query_all(
                "the status query's writers",
                TENANT_WRITERS,
                &[(&lock_key, Type::TEXT), (&tenants, Type::TEXT_ARRAY)],
                |row| {
                    let writer = Writer {
                        pid: row.try_get("pid")?,
                        xact_start: row.try_get("xact_start")?,
                        open_ms: row.try_get("open_ms")?,
                        gid: row.try_get("gid")?,
                        prepared: row.try_get("prepared")?,
                        prepared_ms: row.try_get("prepared_ms")?,
                    };
                    Ok((
                        row.try_get::<_, i64>("n")?,
                        row.try_get::<_, Vec<String>>("twins")?,
                        row.try_get::<_, bool>("held")?.then_some(writer),
                    ))
                },
            )
            .await?;
        // Both statements answer one row per tenant given, in that order.
        for (n, twins, writer) in holders {
            if let Some(status) = usize::try_from(n - 1)
                .ok()
                .and_then(|i| statuses.get_mut(i))
            {
                status.twins = twins;
                status.writers.extend(writer);
            }
        }
        Ok(statuses)
    }
}
