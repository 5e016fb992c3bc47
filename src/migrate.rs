//! Applies `migrations/` to the configured schema and table, each migration
//! once: what ran is recorded in `outbox_relay_migrations` (one per schema,
//! rows keyed by table). A table made before the record existed is upgraded
//! in place (0001 is idempotent). Safe when several replicas start with
//! `migrate = true` at once: they serialise on an advisory lock. `--print`
//! gives the same SQL as a script for psql ([`script`]).

mod check;
mod script;
mod split;
mod waits;

use std::collections::BTreeSet;
use std::time::Duration;

use deadpool_postgres::{ClientWrapper, Object};
use tokio_postgres::types::Type;

use crate::config::Config;
use crate::sql::{fill, qualified_table, quote_ident};
use crate::store::{Store, StoreError, within};

pub use check::{Missing, SchemaReport, TRIGGER, check_schema};
pub use script::{finish_script, script};
pub use split::{concurrent_index_name, statements};
pub use waits::{FinishError, OlderRelay, older_relays};
// Defined in `sql`; kept at these paths for the wake-up and the tests.
pub use crate::sql::{fnv1a, quote_literal, wakeup_channel};

/// One migration file.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Its number, recorded once applied.
    pub version: i32,
    /// The file name without `.sql`, as logged and recorded.
    pub name: &'static str,
    pub sql: &'static str,
    /// It changes only the trigger functions and the trigger, which keep
    /// order as they are meanwhile: a relay started with `migrate = true`
    /// relays while it waits for a lock to apply it (see [`relays_after`]).
    pub trigger_only: bool,
}

/// The first line of a migration whose statements run one by one outside a
/// transaction (`CREATE INDEX CONCURRENTLY`, which never blocks writers).
pub const NO_TRANSACTION: &str = "-- outbox-relay: no-transaction";

impl Migration {
    /// Whether it runs in one transaction (the default) or, marked with
    /// [`NO_TRANSACTION`], statement by statement.
    pub fn in_transaction(&self) -> bool {
        !self.sql.starts_with(NO_TRANSACTION)
    }

    /// Its SQL for `schema`.`table`.
    pub fn render(&self, schema: &str, table: &str) -> String {
        render_mode(self.sql, schema, table, writer_mode(self.version))
    }
}

/// The migrations, in order, embedded in the binary.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_outbox",
        sql: include_str!("../migrations/0001_outbox.sql"),
        trigger_only: false,
    },
    Migration {
        version: 2,
        name: "0002_commit_order",
        sql: include_str!("../migrations/0002_commit_order.sql"),
        trigger_only: false,
    },
    Migration {
        version: 3,
        name: "0003_parking",
        sql: include_str!("../migrations/0003_parking.sql"),
        trigger_only: false,
    },
    Migration {
        version: 4,
        name: "0004_pending_index",
        sql: include_str!("../migrations/0004_pending_index.sql"),
        trigger_only: false,
    },
    Migration {
        version: 5,
        name: "0005_writer_lock",
        sql: include_str!("../migrations/0005_writer_lock.sql"),
        trigger_only: true,
    },
    // Version 6 is the second step of 0005 ([`FINISH`]).
    Migration {
        version: 7,
        name: "0007_own_table",
        sql: include_str!("../migrations/0007_own_table.sql"),
        trigger_only: true,
    },
];

/// The second step of the writer lock (`outbox-relay migrate --finish`): the
/// trigger of 0005 re-created in the shared mode, in which writers never
/// wait for each other. Not in [`MIGRATIONS`]: older relays rely on the
/// exclusive mode, so it is taken only once none reads the table (or at once
/// for a table `migrate` creates: see [`run`]). 0005's function body is put
/// back with it, so 0007 follows, to make it act for its own table again.
pub const FINISH: Migration = Migration {
    version: 6,
    name: "0006_writers_shared",
    sql: concat!(
        include_str!("../migrations/0005_writer_lock.sql"),
        "\n",
        include_str!("../migrations/0007_own_table.sql")
    ),
    trigger_only: true,
};

/// This build's upgrade level: the number of the newest migration it knows.
/// Each relay's members' name ends with it (`:u<level>`, see `wakeup`), so
/// that an upgrade step older relays cannot follow sees them
/// ([`older_relays`]). It rises with every migration added.
pub const LEVEL: i32 = {
    let last = MIGRATIONS[MIGRATIONS.len() - 1].version;
    if FINISH.version > last {
        FINISH.version
    } else {
        last
    }
};

/// The migrations a relay started with `migrate = true` applies before it
/// relays (its reads need them), and the trigger-only ones that end the
/// list, which it applies while it relays.
pub fn relays_after() -> (&'static [Migration], &'static [Migration]) {
    let needed = MIGRATIONS
        .iter()
        .rposition(|migration| !migration.trigger_only)
        .map_or(0, |last| last + 1);
    MIGRATIONS.split_at(needed)
}

/// The writers' lock mode a migration installs: shared for [`FINISH`],
/// exclusive (as older relays need) for the rest.
fn writer_mode(version: i32) -> &'static str {
    if version == FINISH.version {
        "shared"
    } else {
        "exclusive"
    }
}

/// A migration in a transaction must not hold writers: its DDL queues
/// behind the writers in flight, and every new writer queues behind it
/// meanwhile. So it waits for a table lock only this long, and is tried
/// again (its whole transaction) while the table is busy, saying who holds
/// the lock (see [`apply_in_transaction`]).
const RETRY_LOCK_TIMEOUT: &str = "100ms";
/// How often a migration that waits for a lock says so.
const LOCK_WAIT_LOG_EVERY: Duration = Duration::from_secs(10);
/// lock_not_available: the lock_timeout ran out.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Creates the record of applied migrations (in the configured schema).
const RECORD_TABLE: &str = include_str!("migrate/record.sql");
const RECORDED: &str =
    "SELECT version FROM outbox_relay_migrations WHERE table_name = $1 AND version = $2";
const RECORDED_ALL: &str = "SELECT version FROM outbox_relay_migrations WHERE table_name = $1";
/// Forgets what was applied to a table that no longer exists (dropped
/// since): its migrations run again. $1 = the table's name, $2 = it quoted
/// and schema-qualified.
const FORGET_DROPPED: &str = "DELETE FROM outbox_relay_migrations \
                              WHERE table_name = $1 AND to_regclass($2) IS NULL";
const RECORD: &str = "INSERT INTO outbox_relay_migrations (table_name, version, name) \
                      VALUES ($1, $2, $3) ON CONFLICT DO NOTHING";
const INVALID_INDEX: &str = "SELECT 1 FROM pg_index i \
     JOIN pg_class c ON c.oid = i.indexrelid \
     JOIN pg_namespace n ON n.oid = c.relnamespace \
     WHERE n.nspname = $1 AND c.relname = $2 AND NOT i.indisvalid";
/// A row when `$1` ('"schema"."table"') is a partitioned table, on which
/// PostgreSQL cannot build or drop an index CONCURRENTLY.
const PARTITIONED: &str = "SELECT 1 FROM pg_class WHERE oid = to_regclass($1) AND relkind = 'p'";
/// The migrators' lock (the relay's claims take two int4 keys, the trigger
/// one bigint of another shape: no key is shared).
/// A DO block, so that psql prints no result row for it.
const LOCK: &str =
    "DO $lock$ BEGIN PERFORM pg_advisory_xact_lock(hashtext('outbox-relay migrate')); END $lock$";
/// The lock a migration outside a transaction holds for its session, one per
/// table (two int4 keys, as the claims take, with the first never a table's):
/// not the migrators' lock, which migrations in a transaction wait for inside
/// it — with a snapshot that a concurrent index build would wait for in turn.
/// `$1` = '<schema>.<table>'.
const TRY_TABLE_LOCK: &str =
    "SELECT pg_try_advisory_lock(hashtext('outbox-relay migrate'), hashtext($1))";
const TABLE_UNLOCK: &str =
    "SELECT pg_advisory_unlock(hashtext('outbox-relay migrate'), hashtext($1))";
/// How often a migrator asks for the migrators' lock while another holds it.
const LOCK_RETRY: Duration = Duration::from_millis(100);

/// How long one migration may take on the client's clock, lock wait included.
pub const MIGRATION_TIMEOUT: Duration = Duration::from_secs(60);
/// Server-side bounds of a migration in a transaction: its DDL waits at most
/// `LOCK_TIMEOUT` for a table lock, so writers never queue behind it longer.
const LOCK_TIMEOUT: &str = "30s";
const STATEMENT_TIMEOUT: &str = "50s";
/// A statement outside a transaction builds an index without blocking
/// writers, and may take long on a big table.
const NO_TRANSACTION_STATEMENT_TIMEOUT: &str = "15min";
const NO_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(16 * 60);

/// The statements of one migration for `schema`.`table`: the files name the
/// default table `outbox_message` (and its indexes `outbox_message_pending`,
/// `outbox_message_pending_unparked` while it is rebuilt, and
/// `outbox_message_parked`),
/// and take the names as string literals where they build SQL themselves
/// (`{table_literal}`, `{channel_literal}`), never inside a dollar-quoted
/// body. One pass: what is substituted is never read again, so a name
/// holding a placeholder's text stays as it is.
pub fn render(sql: &str, schema: &str, table: &str) -> String {
    render_mode(sql, schema, table, "exclusive")
}

/// As [`render`], with `{writer_mode_literal}` the writers' lock mode.
fn render_mode(sql: &str, schema: &str, table: &str, writer_mode: &str) -> String {
    let replacements = [
        (
            "outbox_message_pending_unparked",
            quote_ident(&format!("{table}_pending_unparked")),
        ),
        (
            "outbox_message_parked",
            quote_ident(&format!("{table}_parked")),
        ),
        (
            "outbox_message_pending",
            quote_ident(&format!("{table}_pending")),
        ),
        ("outbox_message", quote_ident(table)),
        ("{table_literal}", quote_literal(table)),
        (
            "{channel_literal}",
            quote_literal(&wakeup_channel(schema, table)),
        ),
        ("{writer_mode_literal}", quote_literal(writer_mode)),
    ];
    fill(sql, &replacements)
}

/// A migration transaction's bounds, its quiet (the "already exists,
/// skipping" notices of idempotent DDL say nothing), and the migrators' lock.
fn bounds() -> String {
    format!(
        "SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';\n\
         SET LOCAL statement_timeout = '{STATEMENT_TIMEOUT}';\n\
         SET LOCAL client_min_messages = warning;\n\
         {LOCK};\n"
    )
}

/// The statements that open a migration's transaction: its bounds, the
/// migrators' lock, the schema.
fn transaction_header(schema: &str) -> String {
    format!(
        "{}\
         SET LOCAL search_path TO {};\n",
        bounds(),
        quote_ident(schema)
    )
}

/// Applies every migration not yet recorded for the configured table, each in
/// its own transaction (or statement by statement when marked), and records
/// it. Logs what ran, or that the table was up to date.
/// A table whose commit-order trigger this run created (0002 applied now, so
/// no writer ever took the exclusive lock and no older relay can rely on it)
/// is finished at once: its writers take the shared lock from the start.
pub async fn run(store: &Store, config: &Config) -> Result<(), StoreError> {
    let applied = apply(store, config, MIGRATIONS).await?;
    if applied.contains(&2) {
        apply(store, config, &[FINISH]).await?;
    }
    Ok(())
}

/// `outbox-relay migrate --finish`: every migration, then [`FINISH`], which
/// moves the table's writers to the shared lock. Refused while a relay older
/// than this build reads the table ([`older_relays`]), unless `force`
/// (then with a WARN naming each one).
pub async fn finish(store: &Store, config: &Config, force: bool) -> Result<(), FinishError> {
    apply(store, config, MIGRATIONS).await?;
    let older = older_relays(store, config).await?;
    if !older.is_empty() {
        if !force {
            return Err(FinishError::OlderRelays(older));
        }
        for relay in &older {
            tracing::warn!(
                schema = %config.schema, table = %config.table,
                "--force: taking the second step while a relay older than this one reads the \
                 table; it may publish a tenant's rows out of order until it stops: {}",
                relay.listed()
            );
        }
    }
    apply(store, config, &[FINISH]).await?;
    Ok(())
}

/// As [`run`], for any list of migrations (tests give their own). Returns the
/// versions this call applied. A migration that waits for a lock gives up
/// after [`MIGRATION_TIMEOUT`], naming the lock and its holders.
pub async fn apply(
    store: &Store,
    config: &Config,
    migrations: &[Migration],
) -> Result<Vec<i32>, StoreError> {
    apply_with(store, config, migrations, Some(MIGRATION_TIMEOUT), &|| {}).await
}

/// As [`apply`], for the relay: a migration waits for a lock for as long as
/// it is held, saying every [`LOCK_WAIT_LOG_EVERY`] who holds it, and
/// calling `waiting` (the database answers meanwhile).
pub async fn apply_patiently(
    store: &Store,
    config: &Config,
    migrations: &[Migration],
    waiting: &(dyn Fn() + Sync),
) -> Result<Vec<i32>, StoreError> {
    apply_with(store, config, migrations, None, waiting).await
}

async fn apply_with(
    store: &Store,
    config: &Config,
    migrations: &[Migration],
    patience: Option<Duration>,
    waiting: &(dyn Fn() + Sync),
) -> Result<Vec<i32>, StoreError> {
    // A connection of its own, closed when done: nothing a migration sets in
    // the session, nor its session lock, goes back to the pool.
    let mut client = Object::take(store.connection().await?);
    let recorded = within(
        "a migration",
        MIGRATION_TIMEOUT,
        prepare(&mut client, config),
    )
    .await?;
    let mut applied = Vec::new();
    for migration in migrations {
        if recorded.contains(&migration.version) {
            continue;
        }
        let ran = if migration.in_transaction() {
            apply_in_transaction(&mut client, config, migration, patience, waiting).await?
        } else {
            within(
                "a migration",
                NO_TRANSACTION_TIMEOUT,
                apply_outside_transaction(&client, config, migration),
            )
            .await?
        };
        if ran {
            applied.push(migration.version);
            tracing::info!(schema = %config.schema, table = %config.table, "applied {}", migration.name);
        }
    }
    // Not said by a relay's first part while trigger-only ones remain.
    let to_the_end = migrations.last().map(|m| m.version) == MIGRATIONS.last().map(|m| m.version);
    if applied.is_empty() && to_the_end {
        tracing::info!(schema = %config.schema, table = %config.table, "migrations up to date");
    }
    Ok(applied)
}

/// Takes the table's migrators' lock for the session (see
/// [`TRY_TABLE_LOCK`]). It is asked for again and again rather than waited for:
/// a session waiting in a statement holds a snapshot, which the holder's
/// `CREATE INDEX CONCURRENTLY` would wait for (a deadlock).
async fn take_table_lock(client: &ClientWrapper, table: &str) -> Result<(), StoreError> {
    loop {
        let taken: bool = client
            .query_typed_one(TRY_TABLE_LOCK, &[(&table, Type::TEXT)])
            .await?
            .try_get(0)?;
        if taken {
            return Ok(());
        }
        tokio::time::sleep(LOCK_RETRY).await;
    }
}

/// Creates the schema (when missing) and the record table; returns the
/// versions recorded for the table.
async fn prepare(client: &mut ClientWrapper, config: &Config) -> Result<BTreeSet<i32>, StoreError> {
    let tx = client.transaction().await?;
    tx.batch_execute(&bounds()).await?;
    // Checked first: CREATE SCHEMA IF NOT EXISTS needs the database's CREATE
    // privilege even when the schema exists.
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
        "SET LOCAL search_path TO {};\n{RECORD_TABLE}",
        quote_ident(&config.schema)
    ))
    .await?;
    let qualified = qualified_table(&config.schema, &config.table);
    let forgotten = tx
        .execute_typed(
            FORGET_DROPPED,
            &[(&config.table, Type::TEXT), (&qualified, Type::TEXT)],
        )
        .await?;
    if forgotten > 0 {
        tracing::info!(
            schema = %config.schema,
            table = %config.table,
            forgotten,
            "the table was dropped since its migrations ran; they run again"
        );
    }
    let partitioned_by_id: bool = tx
        .query_typed_one(check::PARTITIONED_BY_ID, &[(&qualified, Type::TEXT)])
        .await?
        .try_get(0)?;
    if partitioned_by_id {
        return Err(StoreError::Refused(Missing::PartitionedById.to_string()));
    }
    let versions = tx
        .query_typed(RECORDED_ALL, &[(&config.table, Type::TEXT)])
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
    tx.commit().await?;
    Ok(versions)
}

/// Applies and records `migration` in one transaction, unless another
/// migrator recorded it first. Returns whether it ran. It waits for table
/// locks only briefly ([`RETRY_LOCK_TIMEOUT`]) and is tried again, logging
/// the lock and who holds it (a pid, or a prepared transaction's gid), until
/// `patience` runs out (none: for as long as the lock is held), calling
/// `waiting` after each try.
async fn apply_in_transaction(
    client: &mut ClientWrapper,
    config: &Config,
    migration: &Migration,
    patience: Option<Duration>,
    waiting: &(dyn Fn() + Sync),
) -> Result<bool, StoreError> {
    let started = tokio::time::Instant::now();
    let mut said: Option<tokio::time::Instant> = None;
    let mut attempts: u64 = 0;
    loop {
        let attempt = within(
            "a migration",
            MIGRATION_TIMEOUT,
            try_in_transaction(client, config, migration),
        )
        .await;
        match attempt {
            Err(error) if error.sqlstate() == Some(LOCK_NOT_AVAILABLE) => {
                attempts += 1;
                waiting();
                let wait = waits::lock_wait(&**client, config, migration).await?;
                if patience.is_some_and(|patience| started.elapsed() >= patience) {
                    return Err(StoreError::LockWait(wait));
                }
                if said.is_none_or(|at| at.elapsed() >= LOCK_WAIT_LOG_EVERY) {
                    tracing::warn!(
                        schema = %config.schema, table = %config.table, attempts,
                        "{wait}; trying again every {RETRY_LOCK_TIMEOUT}"
                    );
                    said = Some(tokio::time::Instant::now());
                }
                tokio::time::sleep(LOCK_RETRY).await;
            }
            result => return result,
        }
    }
}

async fn try_in_transaction(
    client: &mut ClientWrapper,
    config: &Config,
    migration: &Migration,
) -> Result<bool, StoreError> {
    let tx = client.transaction().await?;
    tx.batch_execute(&transaction_header(&config.schema))
        .await?;
    if is_recorded(&*tx, config, migration).await? {
        tx.rollback().await?;
        return Ok(false);
    }
    tx.batch_execute(&format!("SET LOCAL lock_timeout = '{RETRY_LOCK_TIMEOUT}'"))
        .await?;
    tx.batch_execute(&migration.render(&config.schema, &config.table))
        .await?;
    record(&*tx, config, migration).await?;
    tx.commit().await?;
    Ok(true)
}

/// Runs `migration`'s statements one by one outside a transaction, holding
/// the migrators' lock for the session, then records it. An INVALID index
/// that an interrupted concurrent build left is dropped and built again.
async fn apply_outside_transaction(
    client: &ClientWrapper,
    config: &Config,
    migration: &Migration,
) -> Result<bool, StoreError> {
    client
        .batch_execute(&format!(
            "SET lock_timeout = '{LOCK_TIMEOUT}'; \
             SET statement_timeout = '{NO_TRANSACTION_STATEMENT_TIMEOUT}'; \
             SET client_min_messages = warning; \
             SET search_path TO {};",
            quote_ident(&config.schema)
        ))
        .await?;
    if is_recorded(&**client, config, migration).await? {
        return Ok(false);
    }
    let lock_key = format!("{}.{}", config.schema, config.table);
    take_table_lock(client, &lock_key).await?;
    let unlock = async {
        client
            .query_typed(TABLE_UNLOCK, &[(&lock_key, Type::TEXT)])
            .await
            .map(drop)
    };
    if is_recorded(&**client, config, migration).await? {
        unlock.await?;
        return Ok(false);
    }
    let table = qualified_table(&config.schema, &config.table);
    let partitioned = client
        .query_typed_opt(PARTITIONED, &[(&table, Type::TEXT)])
        .await?
        .is_some();
    if partitioned {
        tracing::warn!(
            schema = %config.schema, table = %config.table,
            "the table is partitioned: {} builds its indexes without CONCURRENTLY, holding writers out while they are built",
            migration.name
        );
    }
    // A table without rows (a new one) has its indexes built at once: a
    // concurrent build would wait for every transaction of the database.
    let empty = client
        .query_one(&format!("SELECT NOT EXISTS (SELECT 1 FROM {table})"), &[])
        .await?
        .try_get::<_, bool>(0)?;
    let at_once = partitioned || empty;
    for statement in statements(&migration.render(&config.schema, &config.table)) {
        if let Some(index) = concurrent_index_name(&statement) {
            drop_invalid_index(client, &config.schema, &index).await?;
        }
        let statement = if at_once {
            without_concurrently(&statement)
        } else {
            statement
        };
        client.batch_execute(&statement).await?;
    }
    record(&**client, config, migration).await?;
    unlock.await?;
    Ok(true)
}

/// `statement` with its `CONCURRENTLY` keyword taken out, for a partitioned
/// table (the migrations write it, in capitals, only as `CREATE INDEX
/// CONCURRENTLY` and `DROP INDEX CONCURRENTLY`).
fn without_concurrently(statement: &str) -> String {
    statement.replacen("INDEX CONCURRENTLY", "INDEX", 1)
}

async fn drop_invalid_index(
    client: &ClientWrapper,
    schema: &str,
    index: &str,
) -> Result<(), StoreError> {
    let invalid = client
        .query_typed_opt(
            INVALID_INDEX,
            &[(&schema, Type::TEXT), (&index, Type::TEXT)],
        )
        .await?
        .is_some();
    if invalid {
        tracing::warn!(%schema, %index, "dropping an INVALID index left by an interrupted build, to build it again");
        client
            .batch_execute(&format!(
                "DROP INDEX CONCURRENTLY IF EXISTS {}.{}",
                quote_ident(schema),
                quote_ident(index)
            ))
            .await?;
    }
    Ok(())
}

async fn is_recorded(
    client: &impl tokio_postgres::GenericClient,
    config: &Config,
    migration: &Migration,
) -> Result<bool, StoreError> {
    Ok(client
        .query_typed_opt(
            RECORDED,
            &[
                (&config.table, Type::TEXT),
                (&migration.version, Type::INT4),
            ],
        )
        .await?
        .is_some())
}

async fn record(
    client: &impl tokio_postgres::GenericClient,
    config: &Config,
    migration: &Migration,
) -> Result<(), StoreError> {
    client
        .execute_typed(
            RECORD,
            &[
                (&config.table, Type::TEXT),
                (&migration.version, Type::INT4),
                (&migration.name, Type::TEXT),
            ],
        )
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_configured_table_and_its_index() {
        let sql = render(MIGRATIONS[0].sql, "public", "orders_outbox");
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"orders_outbox\" ("));
        assert!(sql.contains("CREATE INDEX IF NOT EXISTS \"orders_outbox_pending\""));
        assert!(sql.contains("ON \"orders_outbox\" (tenant_id, id) WHERE published_at IS NULL"));
        assert!(!sql.contains("outbox_message"));
        let odd = render(MIGRATIONS[0].sql, "public", "we\"ird");
        assert!(
            odd.contains("CREATE INDEX IF NOT EXISTS \"we\"\"ird_pending\""),
            "{odd}"
        );
    }

    #[test]
    fn the_trigger_takes_its_names_as_literals() {
        let sql = render(MIGRATIONS[1].sql, "app's", "out\"box");
        assert!(
            sql.contains("SET LOCAL outbox_relay.migrate_table = 'out\"box';"),
            "{sql}"
        );
        assert!(
            sql.contains("SET LOCAL outbox_relay.migrate_channel = 'outbox.app''s.out\"box';"),
            "{sql}"
        );
        assert!(!sql.contains('{'), "every placeholder filled: {sql}");
    }

    #[test]
    fn no_name_is_written_inside_a_dollar_quoted_body() {
        for migration in MIGRATIONS.iter().chain([&FINISH]) {
            let sql = migration.render("x$outbox_relay$y", "t$outbox_relay$");
            let mut inside = false;
            for line in sql.lines() {
                if line.ends_with(" $outbox_relay$") || line == "$outbox_relay$;" {
                    inside = line != "$outbox_relay$;";
                } else if inside {
                    assert!(
                        !line.contains("$outbox_relay$"),
                        "{}: {line}",
                        migration.name
                    );
                }
            }
            assert!(!inside, "{}", migration.name);
        }
    }

    #[test]
    fn a_name_holding_a_placeholder_is_not_substituted_again() {
        let sql = render(
            "{table_literal} {channel_literal} outbox_message",
            "s{table_literal}",
            "t{channel_literal}outbox_message",
        );
        assert_eq!(
            sql,
            "'t{channel_literal}outbox_message' 'outbox.s{table_literal}.t{channel_literal}outbox_message' \"t{channel_literal}outbox_message\""
        );
    }

    #[test]
    fn the_upgrade_level_is_the_newest_migration_known() {
        let newest = MIGRATIONS.iter().chain([&FINISH]).map(|m| m.version).max();
        assert_eq!(Some(LEVEL), newest);
    }

    #[test]
    fn a_relay_relays_once_only_trigger_only_migrations_are_left() {
        let (needed, rest) = relays_after();
        assert_eq!(needed.len() + rest.len(), MIGRATIONS.len());
        assert!(rest.iter().all(|m| m.trigger_only));
        assert!(needed.last().is_none_or(|m| !m.trigger_only));
        assert!(!rest.is_empty(), "0005 re-creates the trigger alone");
    }

    #[test]
    fn the_versions_are_the_file_numbers_in_order() {
        let mut versions: Vec<i32> = MIGRATIONS.iter().map(|m| m.version).collect();
        versions.push(FINISH.version);
        versions.sort_unstable();
        assert_eq!(versions, (1..=7).collect::<Vec<_>>());
        for migration in MIGRATIONS {
            assert!(
                migration
                    .name
                    .starts_with(&format!("{:04}_", migration.version))
            );
        }
        assert!(MIGRATIONS.windows(2).all(|w| w[0].version < w[1].version));
    }
}
