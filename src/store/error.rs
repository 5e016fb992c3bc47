//! [`StoreError`]: what failed when talking to PostgreSQL, and how the
//! relay tells an outage (unreachable, read-only) from a failure of what was
//! asked.

use std::time::Duration;

use deadpool_postgres::{BuildError, PoolError};

use super::Drift;

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
    /// row description, or by [`Store::check_columns`](super::Store::check_columns). Nothing of the
    /// table is read until it is fixed.
    #[error(transparent)]
    Columns(#[from] Drift),
    /// The id sequence cannot give a safe bound for commit order (see
    /// [`Store::check_sequence`](super::Store::check_sequence)).
    #[error("{0}")]
    Sequence(String),
    /// A migration waited for a table lock past its patience: the lock and
    /// who holds it.
    #[error("{0}")]
    LockWait(String),
    /// The table has a shape the relay refuses (`migrate` applies nothing
    /// to it), with the reason.
    #[error("{0}")]
    Refused(String),
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
            StoreError::Columns(_)
            | StoreError::Sequence(_)
            | StoreError::LockWait(_)
            | StoreError::Refused(_) => false,
        }
    }

    /// What makes the id sequence unfit, when that is what failed.
    pub fn unfit_sequence(&self) -> Option<&str> {
        match self {
            StoreError::Sequence(unfit) => Some(unfit),
            _ => None,
        }
    }

    /// The unfit column, when that is what failed.
    pub fn drift(&self) -> Option<&Drift> {
        match self {
            StoreError::Columns(drift) => Some(drift),
            _ => None,
        }
    }

    /// Whether the server failed inside (SQLSTATE XX000), as it does when
    /// a statement names a relation by an oid that is gone.
    pub fn is_internal(&self) -> bool {
        self.sqlstate() == Some(INTERNAL_ERROR)
    }

    /// Whether the server turned out to take no writes.
    pub fn is_read_only(&self) -> bool {
        matches!(self, StoreError::ReadOnly) || self.sqlstate() == Some(READ_ONLY_SQL_TRANSACTION)
    }
}

/// SQLSTATE of a failure inside the server.
const INTERNAL_ERROR: &str = "XX000";

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
