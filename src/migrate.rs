//! Applies `migrations/` to the configured schema and table. Idempotent, and
//! safe when several replicas start with `migrate = true` at once (they
//! serialise on an advisory lock).

use std::time::Duration;

use tokio_postgres::types::Type;

use crate::config::Config;
use crate::store::{Store, StoreError, quote_ident};

/// The migrations, in order, embedded in the binary.
pub const MIGRATIONS: &[(&str, &str)] = &[(
    "0001_outbox.sql",
    include_str!("../migrations/0001_outbox.sql"),
)];

/// The statements of one migration for `schema`.`table`: the files name the
/// default table `outbox_message` (and its index `outbox_message_pending`).
pub fn render(sql: &str, table: &str) -> String {
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
    out
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
        tx.batch_execute(&render(sql, &config.table)).await?;
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
        let sql = render(MIGRATIONS[0].1, "orders_outbox");
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"orders_outbox\" ("));
        assert!(sql.contains("CREATE INDEX IF NOT EXISTS \"orders_outbox_pending\""));
        assert!(sql.contains("ON \"orders_outbox\" (tenant_id, id) WHERE published_at IS NULL"));
        assert!(!sql.contains("outbox_message"));
        let odd = render(MIGRATIONS[0].1, "we\"ird");
        assert!(
            odd.contains("CREATE INDEX IF NOT EXISTS \"we\"\"ird_pending\""),
            "{odd}"
        );
    }
}
