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
//! Statements go out unnamed (`query_typed`: parse, bind and execute in one
//! message sequence, with its parameters' types given here), never as a
//! prepared statement kept on the session: through PgBouncer in transaction
//! pooling, a connection's next transaction may run on another server
//! connection, where a name prepared before means nothing, or means another
//! client's statement. The one exception lives and dies inside a claim's
//! transaction: a claim that reads ahead prepares its read and mark once for
//! all its batches (SQL `PREPARE`), and deallocates them before its commit
//! (see `Statements::prepare`). Nothing else is kept in the session either: the
//! claim's settings are transaction-local (but for the server's TCP
//! keepalives, see [`connect`](fn@connect)).
//!
//! Several hosts: each connection tries them in turn (see [`connect`](fn@connect)). A
//! server that stops taking writes (a primary demoted in a failover) is
//! noticed by the claim and the poll, and on the marks (SQLSTATE 25006): its
//! connections are discarded, every idle one with them, so new ones go to
//! the writable host. That is an outage, never a tenant's failure.
//!
//! The store's parts: `table` (the [`Store`] and what it notes of the
//! table), `connect` (hosts, TLS, the pool), `statements` (every SQL
//! text), `query` (deadlines, one-statement round trips), `read` (a
//! batch's read and its rows' decoding), `claim` (the claim, its marks and
//! reads sent ahead, its settlement), `poll`, `lag`, `sequence` (the
//! claim's fence), `twins` (tenants that share a claim key), `lifecycle`
//! (`requeue`, `discard`, `replay`), `columns`, and `error`.

mod claim;
mod columns;
mod connect;
mod error;
mod lag;
mod lifecycle;
mod poll;
mod query;
mod read;
mod sequence;
mod statements;
mod table;
mod twins;

pub use claim::{Claim, KeptPending, Parked, Settled};
pub use columns::Drift;
pub use connect::{CONNECT_TIMEOUT, POOL_WAIT_TIMEOUT};
pub(crate) use connect::{TlsStream, connect, session_keepalives};
pub use error::StoreError;
pub(crate) use error::describe;
pub use lag::{TenantLag, TenantStatus, Writer};
pub use lifecycle::{Changed, LifecycleError};
pub use poll::{Page, PendingTenant, Polled};
pub use query::QUERY_TIMEOUT;
pub(crate) use query::within;
pub use read::FIELD_LIMIT;
pub use sequence::{Holder, Watched, Writers};
pub use table::Store;

// Defined in `sql`; kept at these paths for the wake-up.
pub use crate::sql::{qualified_table, quote_ident};
