//! `outbox-relay migrate --print`: the migrations as a psql script, each
//! in its transaction (or statement by statement when marked) and recorded
//! as [`run`](super::run) records it.

use super::check::PARTITIONED_BY_ID;
use super::{
    FINISH, LOCK_TIMEOUT, MIGRATIONS, Migration, Missing, NO_TRANSACTION_STATEMENT_TIMEOUT,
    PARTITIONED, RECORD_TABLE, RECORDED, bounds, statements, transaction_header,
    without_concurrently,
};
use crate::sql::{qualified_table, quote_ident, quote_literal};

/// The psql variable the printed script sets when the table is partitioned
/// (see [`PARTITIONED`]).
const PARTITIONED_VAR: &str = "outbox_relay_partitioned";

/// `outbox-relay migrate --print`: every migration as a psql script for
/// `schema`.`table`, each in its transaction (or statement by statement when
/// marked) and recorded as `migrate` records it. Every migration is
/// idempotent, so the script may run again.
///
/// As [`run`](super::run) does, a table whose commit-order trigger the
/// script installs (0002 not recorded when it starts) is finished at its end
/// ([`FINISH`]), and so is a table finished already (0006 recorded), which the script's 0005
/// would otherwise put back in the exclusive mode: psql's `\if` on what the
/// script found at its start.
pub fn script(schema: &str, table: &str) -> String {
    let recorded = |version: i32| {
        RECORDED
            .replace(
                "FROM outbox_relay_migrations",
                &format!("FROM {}.outbox_relay_migrations", quote_ident(schema)),
            )
            .replace("$1", &quote_literal(table))
            .replace("$2", &version.to_string())
    };
    let mut out = preamble(schema, table);
    out += &refusal(schema, table);
    out += &format!(
        "\n-- Whether the table takes the second step at the end: this script installs \
         the commit-order trigger (0002 not recorded yet, so no writer ever took the \
         exclusive lock), or the table took it already.\n\
         SELECT NOT EXISTS ({}) OR EXISTS ({}) AS {SHARED_VAR} \\gset\n",
        recorded(2),
        recorded(FINISH.version),
    );
    for migration in MIGRATIONS {
        out += &block(migration, schema, table);
    }
    out += &format!("\n\\if :{SHARED_VAR}");
    out += &block(&FINISH, schema, table);
    out += "\\endif\n";
    out
}

/// A table partitioned by a key that includes `id` is refused, as `migrate`
/// refuses it: psql (`ON_ERROR_STOP`) stops before the first migration.
fn refusal(schema: &str, table: &str) -> String {
    let table = quote_literal(&qualified_table(schema, table));
    format!(
        "\n{}\\gset outbox_relay_\n\\if :outbox_relay_partitioned_by_id\n\
         DO $refused$ BEGIN RAISE EXCEPTION '%', {}; END $refused$;\n\\endif\n",
        PARTITIONED_BY_ID.replace("$1", &table),
        quote_literal(&Missing::PartitionedById.to_string())
    )
}

/// The psql variable the printed script sets when the table is to end in
/// the shared mode.
const SHARED_VAR: &str = "outbox_relay_writers_shared";

/// `outbox-relay migrate --finish --print`: the second step alone (see
/// [`FINISH`]), for a table the script of [`script`] upgraded.
pub fn finish_script(schema: &str, table: &str) -> String {
    script_of(&[FINISH], schema, table)
}

fn script_of(migrations: &[Migration], schema: &str, table: &str) -> String {
    let mut out = preamble(schema, table);
    for migration in migrations {
        out += &block(migration, schema, table);
    }
    out
}

/// A printed script's start: its title, the schema, the record table.
fn preamble(schema: &str, table: &str) -> String {
    let mut out = format!(
        "-- outbox-relay {}: the migrations of {}.{}\n\
         -- Apply with: psql -v ON_ERROR_STOP=1 -f <this file>\n\n\
         BEGIN;\n",
        env!("CARGO_PKG_VERSION"),
        quote_ident(schema),
        quote_ident(table)
    );
    out += &format!(
        "{}CREATE SCHEMA IF NOT EXISTS {schema_ident};\n\
         SET LOCAL search_path TO {schema_ident};\n\
         {RECORD_TABLE}COMMIT;\n",
        bounds(),
        schema_ident = quote_ident(schema)
    );
    out
}

/// One migration of a printed script, recorded as `migrate` records it.
fn block(migration: &Migration, schema: &str, table: &str) -> String {
    let mut out = String::new();
    let sql = migration.render(schema, table);
    let record = format!(
        "INSERT INTO outbox_relay_migrations (table_name, version, name)\n    \
             VALUES ({}, {}, {}) ON CONFLICT DO NOTHING;\n",
        quote_literal(table),
        migration.version,
        quote_literal(migration.name)
    );
    out += &format!("\n-- {}\n", migration.name);
    if migration.in_transaction() {
        out += &format!(
            "BEGIN;\n{}{}\n{record}COMMIT;\n",
            transaction_header(schema),
            sql.trim_end()
        );
    } else {
        out += &format!(
            "-- Outside a transaction. If a concurrent index build is interrupted, \
                 DROP INDEX CONCURRENTLY the INVALID index it left before running this again.\n\
                 SET lock_timeout = '{LOCK_TIMEOUT}';\n\
                 SET statement_timeout = '{NO_TRANSACTION_STATEMENT_TIMEOUT}';\n\
                 SET search_path TO {};\n",
            quote_ident(schema)
        );
        let statements = statements(&sql);
        if statements.iter().any(|s| s.contains("INDEX CONCURRENTLY")) {
            out += &format!(
                "-- A partitioned table cannot build an index CONCURRENTLY: there the \
                     indexes are built without it (writers wait while they are built).\n\
                     SELECT EXISTS ({}) AS {PARTITIONED_VAR} \\gset\n\\if :{PARTITIONED_VAR}\n",
                PARTITIONED.replace("$1", &quote_literal(&qualified_table(schema, table)))
            );
            for statement in &statements {
                out += &format!("{};\n", without_concurrently(statement));
            }
            out += "\\else\n";
            for statement in &statements {
                out += &format!("{statement};\n");
            }
            out += "\\endif\n";
        } else {
            for statement in statements {
                out += &format!("{statement};\n");
            }
        }
        out += &record;
        out += "RESET lock_timeout;\nRESET statement_timeout;\nRESET search_path;\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_runs_each_migration_in_its_transaction_and_records_it() {
        let script = script("app", "orders_outbox");
        // The second step too, under psql's `\if`.
        let in_transaction = MIGRATIONS.iter().filter(|m| m.in_transaction()).count() + 1;
        assert_eq!(script.matches("BEGIN;").count(), 1 + in_transaction);
        assert_eq!(script.matches("COMMIT;").count(), 1 + in_transaction);
        let finish = script.find("\\if :outbox_relay_writers_shared\n-- 0006_writers_shared");
        let finish = finish.expect("the second step, under its condition");
        assert!(script[finish..].trim_end().ends_with("\\endif"));
        assert!(script[..finish].contains("AS outbox_relay_writers_shared \\gset"));
        assert!(script.contains("CREATE TABLE IF NOT EXISTS outbox_relay_migrations"));
        assert!(script.contains("VALUES ('orders_outbox', 2, '0002_commit_order')"));
        assert!(script.contains("SET LOCAL search_path TO \"app\";"));
        // A comment reads on a line of its own, not after a keyword.
        assert!(!script.contains("SELECT       --"), "{script}");
    }

    #[test]
    fn a_no_transaction_migration_is_printed_statement_by_statement() {
        let marked = Migration {
            version: 3,
            name: "0003_index",
            sql: "-- outbox-relay: no-transaction\n\
                  DROP INDEX CONCURRENTLY IF EXISTS outbox_message_pending;\n\
                  CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_message_pending\n    \
                  ON outbox_message (tenant_id, id) WHERE published_at IS NULL;\n",
            trigger_only: false,
        };
        assert!(!marked.in_transaction());
        let script = script_of(&[marked], "app", "t");
        let part = &script[script.find("-- 0003_index").unwrap()..];
        assert!(!part.contains("BEGIN;"), "{part}");
        assert!(
            part.contains("DROP INDEX CONCURRENTLY IF EXISTS \"t_pending\";\n"),
            "{part}"
        );
        assert!(
            part.contains("CREATE INDEX CONCURRENTLY IF NOT EXISTS \"t_pending\"\n    ON \"t\""),
            "{part}"
        );
        assert!(part.contains("VALUES ('t', 3, '0003_index')"), "{part}");
    }

    #[test]
    fn a_partitioned_table_gets_its_indexes_without_concurrently() {
        let script = script("app", "t");
        let part = &script[script.find("-- 0004_pending_index").unwrap()..];
        assert!(
            part.contains("AS outbox_relay_partitioned \\gset\n\\if :outbox_relay_partitioned\n"),
            "{part}"
        );
        let branches = part
            .split_once("\\if :outbox_relay_partitioned\n")
            .unwrap()
            .1;
        let (partitioned, plain) = branches.split_once("\\else\n").unwrap();
        assert!(!partitioned.contains("INDEX CONCURRENTLY"), "{partitioned}");
        assert!(
            partitioned.contains("CREATE INDEX IF NOT EXISTS \"t_pending_unparked\""),
            "{partitioned}"
        );
        assert!(
            plain.contains("CREATE INDEX CONCURRENTLY IF NOT EXISTS \"t_pending_unparked\""),
            "{plain}"
        );
        assert!(
            plain.contains("ALTER INDEX \"t_pending_unparked\" RENAME TO \"t_pending\""),
            "{plain}"
        );
        assert_eq!(
            without_concurrently("DROP INDEX CONCURRENTLY IF EXISTS \"t_pending\""),
            "DROP INDEX IF EXISTS \"t_pending\""
        );
    }
}
