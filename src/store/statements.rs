//! Every statement the store runs, loaded from the `.sql` files beside this
//! one, and [`Statements`]: those that name the table, with the configured
//! table substituted, in the variant for the table's columns.

use std::fmt::Write;

use crate::sql::fill;

/// Opens a sweep's transaction. Its commit does not wait for the WAL flush: if
/// PostgreSQL crashed right after, the marks of the last moments could be lost,
/// and those rows would be published again — a duplicate, never a loss, which
/// at-least-once allows. It takes the disk flush out of every batch's path.
pub(super) const BEGIN: &str = "BEGIN; SET LOCAL synchronous_commit = off";
/// Runs the read a claim prepared (see [`Statements::prepare`]) with the
/// parameters of `read_batch.sql`, written into the statement: a utility
/// statement such as `EXECUTE` takes no bound parameters.
pub(super) fn execute_read(tenant: &str, numbers: [i64; 5]) -> String {
    let [batch_size, max_payload_bytes, budget, field_limit, after] = numbers;
    format!(
        "EXECUTE outbox_relay_read({}, {batch_size}, {max_payload_bytes}, {budget}, {field_limit}, {after})",
        literal(tenant)
    )
}

/// Runs the mark a claim prepared, its ids written into the statement.
pub(super) fn execute_mark(ids: &[i64]) -> String {
    let mut sql = String::with_capacity(32 + ids.len() * 8);
    sql.push_str("EXECUTE outbox_relay_mark('{");
    for (n, id) in ids.iter().enumerate() {
        if n > 0 {
            sql.push(',');
        }
        let _ = write!(sql, "{id}");
    }
    sql.push_str("}')");
    sql
}

/// `text` as a string literal that reads the same whatever the server's
/// `standard_conforming_strings`: `E'…'`, each backslash and quote doubled.
fn literal(text: &str) -> String {
    let mut quoted = String::with_capacity(text.len() + 3);
    quoted.push_str("E'");
    for c in text.chars() {
        if c == '\'' || c == '\\' {
            quoted.push(c);
        }
        quoted.push(c);
    }
    quoted.push('\'');
    quoted
}

/// Drops what [`Statements::prepare`] prepared, before the claim's
/// transaction ends (a prepared statement is not undone by a commit or a
/// rollback).
pub(super) const DEALLOCATE: &str = "DEALLOCATE outbox_relay_read; DEALLOCATE outbox_relay_mark";
pub(super) const CLAIM: &str = include_str!("claim.sql");
pub(super) const CLAIM_TURN: &str = include_str!("claim_turn.sql");
pub(super) const TWINS: &str = include_str!("twins.sql");
pub(super) const TENANT_WRITERS: &str = include_str!("tenant_writers.sql");
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
const STILL_PENDING: &str = include_str!("still_pending.sql");
const TWINS_PENDING: &str = include_str!("twins_pending.sql");
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
    /// Prepares `read_batch.sql` and `mark_published.sql` in a claim's
    /// session, with generic plans for the rest of its transaction: a claim
    /// that reads ahead sends it with its first read ahead, so that each of
    /// its later reads and marks is parsed and planned once for all its
    /// batches instead of for each ([`execute_read`], [`execute_mark`]). It
    /// sends [`DEALLOCATE`] before its commit: nothing outlives the
    /// transaction on a server connection that a pooler by transaction
    /// hands to another client next. The generic plans use the pending
    /// index as the custom ones do: `read_batch.sql` is written so that only
    /// that index yields its order, and a mark finds its rows by the primary
    /// key (the test of plans checks both).
    pub(super) prepare: String,
    pub(super) read_payload: String,
    pub(super) mark_published: String,
    pub(super) unmark_published: String,
    pub(super) still_pending: String,
    pub(super) twins_pending: String,
    /// `sequence.sql` with the table's highest id beside it (a step down the
    /// primary key), for a table known to exist.
    pub(super) sequence_highest: String,
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
            fill(
                &variant(text, parking),
                &[("{table}", table), ("{channel}", channel)],
            )
        };
        let (read_batch, mark_published) = (sql(READ_BATCH), sql(MARK_PUBLISHED));
        Statements {
            prepare: format!(
                "SET LOCAL plan_cache_mode = force_generic_plan;\n\
                 PREPARE outbox_relay_read (text, bigint, bigint, bigint, bigint, bigint) AS\n\
                 {read_batch};\n\
                 PREPARE outbox_relay_mark (bigint[]) AS\n{mark_published}"
            ),
            read_batch,
            read_payload: sql(READ_PAYLOAD),
            mark_published,
            unmark_published: sql(UNMARK_PUBLISHED),
            still_pending: sql(STILL_PENDING),
            twins_pending: sql(TWINS_PENDING),
            sequence_highest: format!(
                "SELECT s.*, (SELECT max(id) FROM {table}) AS highest\nFROM (\n{SEQUENCE}) s"
            ),
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
    fn a_prepared_read_and_mark_are_run_with_their_values_written_in() {
        assert_eq!(
            execute_read("acme", [256, 1, 2, 3, -9_223_372_036_854_775_808]),
            "EXECUTE outbox_relay_read(E'acme', 256, 1, 2, 3, -9223372036854775808)"
        );
        assert_eq!(
            execute_mark(&[1, 22, -3]),
            "EXECUTE outbox_relay_mark('{1,22,-3}')"
        );
        assert_eq!(execute_mark(&[7]), "EXECUTE outbox_relay_mark('{7}')");
    }

    #[test]
    fn a_tenant_written_into_a_statement_stays_one_literal() {
        assert_eq!(literal("plain"), "E'plain'");
        assert_eq!(literal("o'brien"), "E'o''brien'");
        assert_eq!(literal(r"back\slash"), r"E'back\\slash'");
        assert_eq!(
            literal(r"\'); DROP TABLE t; --"),
            r"E'\\''); DROP TABLE t; --'"
        );
        assert_eq!(literal("tenant ✓"), "E'tenant ✓'");
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
