//! Every statement the store runs, loaded from the `.sql` files beside this
//! one, and [`Statements`]: those that name the table, with the configured
//! table substituted, in the variant for the table's columns.

/// Opens a sweep's transaction. Its commit does not wait for the WAL flush: if
/// PostgreSQL crashed right after, the marks of the last moments could be lost,
/// and those rows would be published again — a duplicate, never a loss, which
/// at-least-once allows. It takes the disk flush out of every batch's path.
pub(super) const BEGIN: &str = "BEGIN; SET LOCAL synchronous_commit = off";
/// Sent once a claim prepares its read and mark (see `claim::ahead::Prepared`),
/// so that each is planned once for the rest of the transaction instead of
/// for every batch. The generic plans use the pending index as the custom
/// ones do: `read_batch.sql` is written so that only that index yields its
/// order, and the marks find their rows by the primary key (both checked by
/// the test of plans).
pub(super) const GENERIC_PLANS: &str = "SET LOCAL plan_cache_mode = force_generic_plan";
pub(super) const CLAIM: &str = include_str!("claim.sql");
pub(super) const COLUMNS: &str = include_str!("columns.sql");
pub(super) const SEQUENCE: &str = include_str!("sequence.sql");
pub(super) const WRITERS: &str = include_str!("writers.sql");
pub(super) const WRITERS_FREE: &str = include_str!("writers_free.sql");
/// Where the id sequence stands, alone: the watch's read between moves.
pub(super) const POSITION: &str = include_str!("position.sql");

// The statements that name the table (`{table}`), made into `Statements`.
const READ_BATCH: &str = include_str!("read_batch.sql");
const READ_PAYLOAD: &str = include_str!("read_payload.sql");
const MARK_PUBLISHED: &str = include_str!("mark_published.sql");
const RECORD_REFUSAL: &str = include_str!("record_refusal.sql");
const UNMARK_PUBLISHED: &str = include_str!("unmark_published.sql");
const PENDING_TENANTS: &str = include_str!("pending_tenants.sql");
const TENANT_LAG: &str = include_str!("tenant_lag.sql");
const TENANT_STATUS: &str = include_str!("tenant_status.sql");
const REQUEUE: &str = include_str!("requeue.sql");
const REQUEUE_TENANT: &str = include_str!("requeue_tenant.sql");
const DISCARD: &str = include_str!("discard.sql");
const REPLAY_BATCH: &str = include_str!("replay_batch.sql");
/// Where the id sequence stands, and the tenants of its newest rows (see
/// [`Store::watch`](super::Store::watch)).
const WATCH: &str = include_str!("watch.sql");

/// The statements with the configured table substituted, in one of two
/// variants: for a table with the columns of parking, or without them.
#[derive(Debug)]
pub(super) struct Statements {
    pub(super) read_batch: String,
    pub(super) read_payload: String,
    pub(super) mark_published: String,
    pub(super) unmark_published: String,
    pub(super) record_refusal: String,
    pub(super) pending_tenants: String,
    pub(super) watch: String,
    pub(super) tenant_lag: String,
    pub(super) tenant_status: String,
    pub(super) requeue: String,
    pub(super) requeue_tenant: String,
    pub(super) discard: String,
    pub(super) replay_batch: String,
    /// `"schema"."table"`, for the column checks.
    pub(super) table: String,
}

impl Statements {
    /// The statements for `table`; with `parking` false, for a table without
    /// `parked_at` and `discarded_at` (see [`variant`]).
    /// `table` quoted, `channel` the wake-up channel as a quoted literal.
    pub(super) fn new(table: &str, channel: &str, parking: bool) -> Statements {
        let sql = |text: &str| {
            variant(text, parking)
                .replace("{table}", table)
                .replace("{channel}", channel)
        };
        Statements {
            read_batch: sql(READ_BATCH),
            read_payload: sql(READ_PAYLOAD),
            mark_published: sql(MARK_PUBLISHED),
            unmark_published: sql(UNMARK_PUBLISHED),
            record_refusal: sql(RECORD_REFUSAL),
            pending_tenants: sql(PENDING_TENANTS),
            watch: sql(WATCH),
            tenant_lag: sql(TENANT_LAG),
            tenant_status: sql(TENANT_STATUS),
            requeue: sql(REQUEUE),
            requeue_tenant: sql(REQUEUE_TENANT),
            discard: sql(DISCARD),
            replay_batch: sql(REPLAY_BATCH),
            table: table.to_string(),
        }
    }
}

/// A statement for a table with the columns of parking (`parking`) or
/// without them: a line with the comment `-- lifecycle` is kept only with
/// them, a line with `-- legacy` only without.
pub(super) fn variant(sql: &str, parking: bool) -> String {
    sql.lines()
        .filter(|line| {
            if line.contains("-- lifecycle") {
                parking
            } else if line.contains("-- legacy") {
                !parking
            } else {
                true
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variant_keeps_the_lines_of_its_columns() {
        let sql = "SELECT id\nFROM t\nWHERE parked_at IS NULL -- lifecycle\n  AND true -- legacy\nORDER BY id";
        assert_eq!(
            variant(sql, true),
            "SELECT id\nFROM t\nWHERE parked_at IS NULL -- lifecycle\nORDER BY id"
        );
        assert_eq!(
            variant(sql, false),
            "SELECT id\nFROM t\n  AND true -- legacy\nORDER BY id"
        );
    }

    #[test]
    fn every_statement_names_the_configured_table_and_fills_its_placeholders() {
        let statements = Statements::new("\"s\".\"t\"", "'outbox.s.t'", true);
        for sql in [
            &statements.read_batch,
            &statements.mark_published,
            &statements.pending_tenants,
            &statements.replay_batch,
        ] {
            assert!(sql.contains("\"s\".\"t\""), "{sql}");
            assert!(
                !sql.contains("{table}") && !sql.contains("{channel}"),
                "{sql}"
            );
        }
        let legacy = Statements::new("\"s\".\"t\"", "'outbox.s.t'", false);
        assert!(statements.read_batch.contains("-- lifecycle"));
        assert!(!legacy.read_batch.contains("-- lifecycle"));
    }
}
