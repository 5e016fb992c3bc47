//! The scheduler's poll: which tenants have pending rows (a page of them),
//! which have parked rows, who listens for wake-ups, and whether the server
//! takes writes, in one statement.

use tokio_postgres::types::Type;

use super::{Store, StoreError};

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

/// One row of the poll's statement.
enum Found {
    Pending(PendingTenant),
    Parked(String, i64),
    Listener(String),
    /// Whether the server takes writes.
    Writable(bool),
}

impl Store {
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
}
