//! The check at start: does the table have what the relay relies on? A
//! missing piece is said plainly, once, with what it costs and how to fix it.

use std::fmt;

use tokio_postgres::types::Type;

use crate::config::Config;
use crate::sql::{qualified_table, wakeup_channel};
use crate::store::{Store, StoreError};

const CHECK: &str = concat!(
    include_str!("check.sql"),
    include_str!("partitioned_by_id.sql")
);
/// Whether the table (`$1`) is partitioned by a key that includes `id`.
pub(super) const PARTITIONED_BY_ID: &str =
    concat!("SELECT\n", include_str!("partitioned_by_id.sql"));

/// The trigger `migrations/0002_commit_order.sql` installs.
pub const TRIGGER: &str = "outbox_relay_commit_order";

/// The columns the relay reads or writes.
const COLUMNS: [&str; 10] = [
    "id",
    "tenant_id",
    "kind",
    "subject_id",
    "payload",
    "headers",
    "occurred_at",
    "published_at",
    "attempts",
    "last_error",
];

/// The columns of parking (migration 0003).
const PARKING_COLUMNS: [&str; 2] = ["parked_at", "discarded_at"];

const FIX: &str = "run `outbox-relay migrate` or apply the SQL of `outbox-relay migrate --print`";

/// One thing the table lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    /// No such table.
    Table,
    /// Columns the relay reads or writes.
    Columns(Vec<String>),
    /// No `<table>_pending` index.
    PendingIndex,
    /// The index is INVALID (an interrupted concurrent build).
    InvalidPendingIndex,
    /// No `parked_at` and `discarded_at` (migration 0003 not applied).
    ParkingColumns(Vec<String>),
    /// The pending index still holds parked rows (migration 0004 not applied).
    PendingIndexWithParked,
    /// No commit-order trigger.
    Trigger,
    /// The trigger exists but does not fire for ordinary sessions.
    TriggerDisabled,
    /// The trigger's arguments name another table's lock key or channel.
    TriggerArguments,
    /// The table is partitioned (at some level) by a key that includes `id`:
    /// refused by `migrate`, an ERROR at start.
    PartitionedById,
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Missing::Table => write!(f, "the outbox table does not exist; {FIX}"),
            Missing::Columns(columns) => write!(
                f,
                "the outbox table has no column {}: its rows cannot be relayed; {FIX}",
                columns.join(", ")
            ),
            Missing::PendingIndex => write!(
                f,
                "the outbox table has no pending index: every poll and sweep scans the table; {FIX}"
            ),
            Missing::InvalidPendingIndex => write!(
                f,
                "the outbox table's pending index is INVALID (an interrupted build): every poll \
                 and sweep scans the table; drop it and {FIX}"
            ),
            Missing::ParkingColumns(columns) => write!(
                f,
                "the outbox table has no column {}: rows are never parked (park_after_attempts \
                 must stay 0), `requeue` and `discard` cannot run, and every poll checks the \
                 table's columns once more; {FIX}",
                columns.join(", ")
            ),
            Missing::PendingIndexWithParked => write!(
                f,
                "the outbox table's pending index still includes parked rows (its predicate \
                 lacks `parked_at IS NULL`): polls and sweeps step over every parked row; {FIX}"
            ),
            Missing::Trigger => write!(
                f,
                "the outbox table has no commit-order trigger ({TRIGGER}): a tenant's rows written \
                 by concurrent transactions may be relayed out of commit order, and no insert \
                 wakes the relay (it finds rows by polling); {FIX}"
            ),
            Missing::TriggerDisabled => write!(
                f,
                "the outbox table's commit-order trigger ({TRIGGER}) is disabled: a tenant's rows \
                 written by concurrent transactions may be relayed out of commit order, and no \
                 insert wakes the relay; enable it (ALTER TABLE … ENABLE TRIGGER {TRIGGER}) or {FIX}"
            ),
            Missing::TriggerArguments => write!(
                f,
                "the outbox table's commit-order trigger ({TRIGGER}) names another table's lock \
                 key or channel (a copied or renamed table): its writers do not serialise with \
                 this table's, and their inserts do not wake this relay; {FIX}"
            ),
            Missing::PartitionedById => write!(
                f,
                "the outbox table is partitioned by a key that includes `id`: the commit-order \
                 trigger draws a row's id after PostgreSQL routed the row by the id its default \
                 drew, so at partition boundaries the application's inserts fail (\"moving row \
                 to another partition during a BEFORE FOR EACH ROW trigger is not supported\"); \
                 partition it by `occurred_at` or `tenant_id` instead (docs/operations.md, \
                 \"Retention\")"
            ),
        }
    }
}

/// What the check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaReport {
    /// Everything missing, in the order the warnings name them.
    pub missing: Vec<Missing>,
    /// The commit-order trigger is in place, enabled, for this table: a
    /// tenant's ids follow commit order, and inserts notify the relay's
    /// channel (unless `outbox_relay.notify = off`).
    pub trigger: bool,
}

/// Checks the configured table's columns, pending index and commit-order
/// trigger, in one query of the catalog.
pub async fn check_schema(store: &Store, config: &Config) -> Result<SchemaReport, StoreError> {
    let table = qualified_table(&config.schema, &config.table);
    let index = format!("{}_pending", config.table);
    let conn = store.connection().await?;
    let row = tokio::time::timeout(
        crate::store::QUERY_TIMEOUT,
        conn.query_typed_one(CHECK, &[(&table, Type::TEXT), (&index, Type::TEXT)]),
    )
    .await
    .map_err(|_| StoreError::Timeout("the schema check", crate::store::QUERY_TIMEOUT))??;
    if !row.try_get::<_, bool>("table_exists")? {
        return Ok(SchemaReport {
            missing: vec![Missing::Table],
            trigger: false,
        });
    }
    let columns: Vec<String> = row.try_get("columns")?;
    let index_valid: Option<bool> = row.try_get("index_valid")?;
    let index_predicate: Option<String> = row.try_get("index_predicate")?;
    let enabled: Option<String> = row.try_get("trigger_enabled")?;
    let arguments: Option<Vec<u8>> = row.try_get("trigger_args")?;
    let mut missing = Vec::new();
    if row.try_get("partitioned_by_id")? {
        missing.push(Missing::PartitionedById);
    }
    let absent: Vec<String> = COLUMNS
        .iter()
        .filter(|name| !columns.iter().any(|c| c == *name))
        .map(|name| name.to_string())
        .collect();
    if !absent.is_empty() {
        missing.push(Missing::Columns(absent));
    }
    match index_valid {
        None => missing.push(Missing::PendingIndex),
        Some(false) => missing.push(Missing::InvalidPendingIndex),
        Some(true) => {}
    }
    let no_parking: Vec<String> = PARKING_COLUMNS
        .iter()
        .filter(|name| !columns.iter().any(|c| c == *name))
        .map(|name| name.to_string())
        .collect();
    if !no_parking.is_empty() {
        missing.push(Missing::ParkingColumns(no_parking));
    } else if index_valid.is_some() && !excludes_parked(index_predicate.as_deref()) {
        missing.push(Missing::PendingIndexWithParked);
    }
    if let Some(trigger) = trigger_fault(enabled.as_deref(), arguments.as_deref(), config) {
        missing.push(trigger);
    }
    let trigger = !missing.iter().any(|m| {
        matches!(
            m,
            Missing::Trigger | Missing::TriggerDisabled | Missing::TriggerArguments
        )
    });
    Ok(SchemaReport { missing, trigger })
}

/// Whether the pending index's predicate (as `pg_get_expr` gives it) leaves
/// parked rows out.
fn excludes_parked(predicate: Option<&str>) -> bool {
    predicate.is_some_and(|p| p.contains("parked_at IS NULL"))
}

/// What is wrong with the trigger, from its `tgenabled` and `tgargs`.
fn trigger_fault(
    enabled: Option<&str>,
    arguments: Option<&[u8]>,
    config: &Config,
) -> Option<Missing> {
    let (Some(enabled), Some(arguments)) = (enabled, arguments) else {
        return Some(Missing::Trigger);
    };
    // 'O' fires in ordinary sessions, 'A' always; 'D' never, 'R' on replicas only.
    if !matches!(enabled, "O" | "A") {
        return Some(Missing::TriggerDisabled);
    }
    // tgargs: each argument followed by a NUL byte.
    let arguments: Vec<&[u8]> = arguments.split(|b| *b == 0).collect();
    let lock_key = format!("{}.{}", config.schema, config.table);
    let channel = wakeup_channel(&config.schema, &config.table);
    let fits = arguments.first() == Some(&lock_key.as_bytes())
        && arguments.get(2) == Some(&channel.as_bytes());
    (!fits).then_some(Missing::TriggerArguments)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        let mut config = Config::with_tenants(["a"]);
        config.schema = "app".into();
        config.table = "outbox".into();
        config
    }

    #[test]
    fn the_trigger_must_fire_and_name_this_tables_key_and_channel() {
        let config = config();
        let right = b"app.outbox\0app.outbox_id_seq\0outbox.app.outbox\0";
        assert_eq!(trigger_fault(Some("O"), Some(right), &config), None);
        assert_eq!(trigger_fault(Some("A"), Some(right), &config), None);
        assert_eq!(trigger_fault(None, None, &config), Some(Missing::Trigger));
        assert_eq!(
            trigger_fault(Some("D"), Some(right), &config),
            Some(Missing::TriggerDisabled)
        );
        assert_eq!(
            trigger_fault(Some("R"), Some(right), &config),
            Some(Missing::TriggerDisabled)
        );
        let copied = b"app.old\0app.outbox_id_seq\0outbox.app.old\0";
        assert_eq!(
            trigger_fault(Some("O"), Some(copied), &config),
            Some(Missing::TriggerArguments)
        );
    }

    #[test]
    fn the_pending_index_must_leave_parked_rows_out() {
        assert!(excludes_parked(Some(
            "((published_at IS NULL) AND (parked_at IS NULL))"
        )));
        assert!(!excludes_parked(Some("(published_at IS NULL)")));
        assert!(!excludes_parked(None));
        let text = Missing::PendingIndexWithParked.to_string();
        assert!(text.contains("parked rows"), "{text}");
    }

    #[test]
    fn the_missing_trigger_is_said_with_its_cost_and_its_fix() {
        let text = Missing::Trigger.to_string();
        assert!(text.contains("out of commit order"), "{text}");
        assert!(text.contains("outbox-relay migrate --print"), "{text}");
    }
}
