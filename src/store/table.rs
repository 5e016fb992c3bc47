//! [`Store`]: the outbox table of one relay, its pool and its statements,
//! and what the store notes of the table (its columns, its id sequence).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use deadpool_postgres::{Object, Pool};
use tokio_postgres::types::{Kind, Type};

use super::connect::pool;
use super::sequence::{PositionSeen, SEQUENCE_UNKNOWN};
use super::statements::{COLUMNS, Statements};
use super::twins::Twins;
use super::{StoreError, columns};
use crate::config::Config;
use crate::domain::FailureReason;
use crate::sql::{qualified_table, quote_literal, wakeup_channel};

/// The outbox table of one relay: a pool and its statements.
#[derive(Clone)]
pub struct Store {
    pub(super) pool: Pool,
    /// With the columns of parking, and without them.
    pub(super) statements: Arc<[Statements; 2]>,
    /// Whether the table has `parked_at` and `discarded_at`, as last checked
    /// (see [`Store::check_columns`]); assumed until a check says not.
    pub(super) parking_columns: Arc<AtomicBool>,
    /// `park_after_attempts`, for the refusals that park (0: never).
    pub(super) park_after_attempts: i32,
    /// `'<schema>.<table>'`: the first advisory-lock key.
    pub(super) lock_key: Arc<str>,
    /// `idle_in_transaction_session_timeout` of a claim, in ms.
    pub(super) claim_idle_ms: Arc<str>,
    pub(super) batch_size: i64,
    pub(super) max_payload_bytes: i64,
    /// The id sequence's oid, as the last [`Store::check_sequence`] found it:
    /// 0 when the id column draws from none, [`SEQUENCE_UNKNOWN`] before a
    /// check said.
    pub(super) sequence: Arc<AtomicI64>,
    /// Where the checks of the id sequence found it.
    pub(super) sequence_seen: Arc<Mutex<PositionSeen>>,
    /// Tenants that share a claim key (see `twins`).
    pub(super) twins: Arc<Mutex<Twins>>,
    /// The highest id this relay has read from the table (`i64::MIN`:
    /// none): a sequence standing below it would number new rows with ids
    /// already sent (see [`Store::check_sequence`]).
    pub(super) highest_read: Arc<AtomicI64>,
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
        let pool = pool(config, application_name)?;
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
            sequence_seen: Arc::default(),
            twins: Arc::default(),
            highest_read: Arc::new(AtomicI64::new(i64::MIN)),
        })
    }

    /// The statements for the table as last checked.
    pub(super) fn statements(&self) -> &Statements {
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
    pub(super) fn parks_at(&self, reason: FailureReason) -> i32 {
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

    /// A pooled connection, within [`POOL_WAIT_TIMEOUT`](super::POOL_WAIT_TIMEOUT).
    pub async fn connection(&self) -> Result<Object, StoreError> {
        self.pool.get().await.map_err(StoreError::Pool)
    }

    /// Passes `result` on; when it says the server takes no writes, first
    /// drops every idle pooled connection (they are on that server too), so
    /// that the next ones go to the writable host.
    pub(super) fn dropping_idle_if_read_only<T>(
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

    /// Holds the table's columns, as the catalog has them, against what the
    /// relay reads, by the same check as every read's row description (see
    /// [`columns`]). `Ok(false)`: the table does not exist (yet), nothing
    /// was checked; an unfit or missing column is [`StoreError::Columns`].
    /// Notes whether the table has the columns of parking, which decides the
    /// statements the store runs from now on (see
    /// [`variant`](super::statements::variant)).
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
                let deterministic: bool = row.try_get(5)?;
                Ok((name.zip(ty), parking, deterministic))
            })
            .await?;
        let Some((_, parking, _)) = found.first() else {
            return Ok(false);
        };
        self.parking_columns.store(*parking, Ordering::Relaxed);
        if let Some((Some((_, ty)), _, _)) = found.iter().find(|(column, _, deterministic)| {
            !deterministic && column.as_ref().is_some_and(|(name, _)| name == "tenant_id")
        }) {
            return Err(StoreError::Columns(columns::Drift {
                table: table.to_string(),
                column: "tenant_id",
                found: Some(format!("{} with a nondeterministic collation", ty.name())),
            }));
        }
        let found: Vec<(String, Type)> = found.into_iter().filter_map(|(c, _, _)| c).collect();
        columns::check(
            table,
            found.iter().map(|(name, ty)| (name.as_str(), ty)),
            true,
        )?;
        Ok(true)
    }
}
