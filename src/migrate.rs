//! Applies `migrations/` to the configured schema and table. Idempotent, and
//! safe when several replicas start with `migrate = true` at once (they
//! serialise on an advisory lock).

use std::time::Duration;

use tokio_postgres::types::Type;

use crate::config::Config;
use crate::store::{Store, StoreError, quote_ident};

/// The migrations, in order, embedded in the binary.
pub const MIGRATIONS: &[(&str, &str)] = &[
    (
        "0001_outbox.sql",
        include_str!("../migrations/0001_outbox.sql"),
    ),
    (
        "0002_commit_order.sql",
        include_str!("../migrations/0002_commit_order.sql"),
    ),
];

/// The statements of one migration for `schema`.`table`: the files name the
/// default table `outbox_message` (and its index `outbox_message_pending`),
/// and take the names as string literals where they build SQL themselves
/// (`{schema_literal}`, `{table_literal}`, `{lock_key_literal}`,
/// `{channel_literal}`).
pub fn render(sql: &str, schema: &str, table: &str) -> String {
    const NAME: &str = "outbox_message";
    const INDEX_SUFFIX: &str = "_pending";
    let mut out = String::with_capacity(sql.len());
    let mut rest = sql;
    while let Some(at) = rest.find(NAME) {
        out.push_str(&rest[..at]);
        rest = &rest[at + NAME.len()..];
        if let Some(after) = rest.strip_prefix(INDEX_SUFFIX) {
            out.push_str(&quote_ident(&format!("{table}{INDEX_SUFFIX}")));
            rest = after;
        } else {
            out.push_str(&quote_ident(table));
        }
    }
    out.push_str(rest);
    // The literals last: a name inside them is not a token to replace.
    out.replace("{schema_literal}", &quote_literal(schema))
        .replace("{table_literal}", &quote_literal(table))
        .replace(
            "{lock_key_literal}",
            &quote_literal(&format!("{schema}.{table}")),
        )
        .replace(
            "{channel_literal}",
            &quote_literal(&wakeup_channel(schema, table)),
        )
}

/// A string literal for `text` (standard_conforming_strings, as on every
/// supported server).
pub fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The channel the commit-order trigger notifies and the relay listens on:
/// `outbox.<schema>.<table>` when that fits PostgreSQL's 63 bytes, else
/// `outbox.` and a 64-bit FNV-1a hash of `<schema>.<table>` in hex.
pub fn wakeup_channel(schema: &str, table: &str) -> String {
    let readable = format!("outbox.{schema}.{table}");
    if readable.len() <= 63 {
        return readable;
    }
    let hash = fnv1a(format!("{schema}.{table}").as_bytes());
    format!("outbox.{hash:016x}")
}

/// The 64-bit FNV-1a hash: the same on every replica and every build.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// How long the migrations may take, lock wait included.
pub const MIGRATION_TIMEOUT: Duration = Duration::from_secs(60);

/// Applies every migration in one transaction, within [`MIGRATION_TIMEOUT`].
pub async fn run(store: &Store, config: &Config) -> Result<(), StoreError> {
    match tokio::time::timeout(MIGRATION_TIMEOUT, apply(store, config)).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::Timeout("the migrations", MIGRATION_TIMEOUT)),
    }
}

async fn apply(store: &Store, config: &Config) -> Result<(), StoreError> {
    let mut conn = store.connection().await?;
    let tx = conn.transaction().await?;
    // Server-side bounds too, so an abandoned attempt does not linger holding locks.
    tx.batch_execute("SET LOCAL lock_timeout = '30s'; SET LOCAL statement_timeout = '50s'")
        .await?;
    // Unnamed statements only (as in the store), so that migrations run
    // through PgBouncer in transaction pooling too.
    tx.execute_typed(
        "SELECT pg_advisory_xact_lock(hashtext('outbox-relay migrate'))",
        &[],
    )
    .await?;
    let exists = tx
        .query_typed_opt(
            "SELECT 1 FROM pg_namespace WHERE nspname = $1",
            &[(&config.schema, Type::TEXT)],
        )
        .await?
        .is_some();
    if !exists {
        tx.batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS {}",
            quote_ident(&config.schema)
        ))
        .await?;
    }
    tx.batch_execute(&format!(
        "SET LOCAL search_path TO {}",
        quote_ident(&config.schema)
    ))
    .await?;
    for (name, sql) in MIGRATIONS {
        tx.batch_execute(&render(sql, &config.schema, &config.table))
            .await?;
        tracing::info!(migration = name, schema = %config.schema, table = %config.table, "migration applied");
    }
    tx.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_configured_table_and_its_index() {
        let sql = render(MIGRATIONS[0].1, "public", "orders_outbox");
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"orders_outbox\" ("));
        assert!(sql.contains("CREATE INDEX IF NOT EXISTS \"orders_outbox_pending\""));
        assert!(sql.contains("ON \"orders_outbox\" (tenant_id, id) WHERE published_at IS NULL"));
        assert!(!sql.contains("outbox_message"));
        let odd = render(MIGRATIONS[0].1, "public", "we\"ird");
        assert!(
            odd.contains("CREATE INDEX IF NOT EXISTS \"we\"\"ird_pending\""),
            "{odd}"
        );
    }

    #[test]
    fn the_trigger_takes_its_names_as_literals() {
        let sql = render(MIGRATIONS[1].1, "app's", "out\"box");
        assert!(
            sql.contains("format('%I.%I', 'app''s', 'out\"box')"),
            "{sql}"
        );
        assert!(
            sql.contains("'app''s.out\"box', id_sequence, 'outbox.app''s.out\"box'"),
            "{sql}"
        );
        assert!(!sql.contains('{'), "every placeholder filled: {sql}");
    }

    #[test]
    fn the_channel_fits_postgresqls_identifiers() {
        assert_eq!(
            wakeup_channel("public", "outbox_message"),
            "outbox.public.outbox_message"
        );
        let long = wakeup_channel(&"s".repeat(63), &"t".repeat(55));
        assert_eq!(long.len(), "outbox.".len() + 16);
        assert_ne!(long, wakeup_channel(&"s".repeat(63), &"u".repeat(55)));
    }
}
