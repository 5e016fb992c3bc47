//! Commit order (the trigger of `migrations/0002_commit_order.sql`) and the
//! versioned migrations: interleaved writers with the consumer-side order
//! checked, several tenants in one transaction, the deadlock of opposite
//! orders, ids the application supplies, insert-only roles, bulk loads, the
//! upgrade of an existing table, `migrate --print` and the check at start.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_relay::config::Config;
use outbox_relay::migrate::{MIGRATIONS, Migration};
use outbox_relay::store::Store;
use tokio_postgres::Client;

use crate::support::{
    Broker, DATABASE_URL, Outbox, OwnedSchema, RelayProcess, by_tenant, check_history, config,
    eventually, http_get, lines_at, metric, pg_client, relay_command, relay_env, spawn_relay,
    start_relay, unique,
};

/// Committed ids per tenant.
type Committed = BTreeMap<String, Vec<i64>>;

fn insert_sql(outbox: &Outbox) -> String {
    format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'k', 's', '{{}}') RETURNING id",
        outbox.qualified()
    )
}

async fn insert(client: &Client, sql: &str, tenant: &str) -> Result<i64, tokio_postgres::Error> {
    Ok(client.query_one(sql, &[&tenant]).await?.get(0))
}

async fn backend_pid(client: &Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0)
}

/// A small deterministic generator (xorshift), one per writer.
fn generator(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move |below| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % below
    }
}

/// Eight connections write two tenants, each transaction held open 0–40 ms
/// after its insert: a tenant's writers commit in id order (writers of the
/// other tenant commit in between, lower ids after higher ones), and every
/// tenant's messages reach the consumer in ascending id, none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_writers_arrive_in_commit_order() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let relay = start_relay(config(&outbox, &broker, &["red", "blue"])).await;
    let sql = Arc::new(insert_sql(&outbox));
    let commits = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::new();
    for writer in 0..8u64 {
        let (sql, commits) = (sql.clone(), commits.clone());
        writers.push(tokio::spawn(async move {
            let mut client = pg_client().await;
            let mut random = generator(writer + 1);
            let mut written = Vec::new();
            for _ in 0..25 {
                let tenant = if random(2) == 0 { "red" } else { "blue" };
                let tx = client.transaction().await.expect("begin");
                let id: i64 = tx
                    .query_one(sql.as_str(), &[&tenant])
                    .await
                    .expect("insert")
                    .get(0);
                tokio::time::sleep(Duration::from_millis(random(41))).await;
                tx.commit().await.expect("commit");
                written.push((tenant, id, commits.fetch_add(1, Ordering::SeqCst)));
            }
            written
        }));
    }
    let mut written = Vec::new();
    for writer in writers {
        written.extend(writer.await.expect("writer"));
    }
    written.sort_by_key(|(_, _, commit)| *commit);
    // Which commit the server saw first cannot be read from the clients (a
    // writer's task may record its commit after the next writer's): the
    // consumer's side is the check. Each tenant's rows, in id order, must
    // arrive in that order, none lost.
    let mut committed = Committed::new();
    for (tenant, id, _) in &written {
        committed.entry(tenant.to_string()).or_default().push(*id);
    }
    for ids in committed.values_mut() {
        ids.sort_unstable();
    }
    assert!(
        written.windows(2).any(|w| w[0].1 > w[1].1),
        "some lower id (of the other tenant) committed after a higher one"
    );
    assert_eq!(
        check_history(&outbox, &broker, &committed, Duration::from_secs(60)).await,
        0,
        "no duplicates"
    );
    relay.stop().await;
}

/// A transaction open with rows of two tenants holds back only the rows of
/// those tenants with higher ids: a later writer of one of them inserts and
/// commits at once (writers never wait for each other), its row waits
/// pending while the relay sweeps what is committed below it and another
/// tenant's rows, and once the open transaction commits everything arrives
/// in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_writing_two_tenants_blocks_no_writer_and_holds_back_only_later_ids() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let relay = start_relay(config(&outbox, &broker, &["a", "b", "c"])).await;
    let sql = insert_sql(&outbox);
    let mut committed = Committed::new();
    let a0 = outbox.insert("a", "k", "s", Some("{}"), None).await;
    committed.entry("a".into()).or_default().push(a0);
    eventually(
        "a's first row goes out",
        Duration::from_secs(20),
        || async { outbox.row(a0).await.published },
    )
    .await;

    let mut both = pg_client().await;
    let tx = both.transaction().await.unwrap();
    let ta: i64 = tx.query_one(&sql, &[&"a"]).await.unwrap().get(0);
    let tb: i64 = tx.query_one(&sql, &[&"b"]).await.unwrap().get(0);

    // Another writer of a: its INSERT and its COMMIT both return while the
    // first transaction is still open.
    let mut later_client = pg_client().await;
    let later = tokio::time::timeout(Duration::from_secs(10), async {
        let later_tx = later_client.transaction().await.unwrap();
        let id: i64 = later_tx.query_one(&sql, &[&"a"]).await.unwrap().get(0);
        later_tx.commit().await.unwrap();
        id
    })
    .await
    .expect("a writer of the same tenant inserts and commits without waiting");
    assert!(later > tb, "ids are drawn in order");
    for _ in 0..5 {
        let id = outbox.insert("c", "k", "s", Some("{}"), None).await;
        committed.entry("c".into()).or_default().push(id);
    }
    eventually(
        "c's rows go out while the transaction is open",
        Duration::from_secs(20),
        || async { outbox.pending("c").await == 0 },
    )
    .await;
    assert!(
        !outbox.row(later).await.published,
        "the later row of a waits for the open transaction's lower id"
    );
    tx.commit().await.unwrap();
    committed.get_mut("a").unwrap().extend([ta, later]);
    committed.insert("b".into(), vec![tb]);
    assert_eq!(
        check_history(&outbox, &broker, &committed, Duration::from_secs(30)).await,
        0
    );
    relay.stop().await;
}

/// Transaction A inserts its outbox row and then updates a business row;
/// transaction B updates that business row and then inserts its outbox row
/// for the same tenant. As on a table without the relay's trigger, B's
/// insert simply proceeds and both commit (no deadlock): A's update waits
/// for B's row lock, which is the application's own. The consumer gets A's
/// row, then B's, although B committed first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_orders_with_a_business_row_both_commit() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let relay = start_relay(config(&outbox, &broker, &["x", "z"])).await;
    let sql = Arc::new(insert_sql(&outbox));
    let business = format!("{}.business", outbox.schema);
    outbox
        .client
        .batch_execute(&format!(
            "CREATE TABLE {business} (id int PRIMARY KEY, n int); INSERT INTO {business} VALUES (1, 0)"
        ))
        .await
        .unwrap();
    let update = Arc::new(format!("UPDATE {business} SET n = n + 1 WHERE id = 1"));
    let first = Arc::new(pg_client().await);
    let second = Arc::new(pg_client().await);
    let first_pid = backend_pid(&first).await;
    first.batch_execute("BEGIN").await.unwrap();
    second.batch_execute("BEGIN").await.unwrap();
    let first_x = insert(&first, &sql, "x").await.unwrap();
    second.batch_execute(&update).await.unwrap();
    let first_update = tokio::spawn({
        let (client, update) = (first.clone(), update.clone());
        async move { client.batch_execute(&update).await }
    });
    let observer = pg_client().await;
    eventually(
        "A's update waits for B's row lock",
        Duration::from_secs(10),
        || async {
            observer
                .query_opt(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
                    &[&first_pid],
                )
                .await
                .expect("pg_stat_activity")
                .is_some()
        },
    )
    .await;
    let second_x = tokio::time::timeout(Duration::from_secs(10), insert(&second, &sql, "x"))
        .await
        .expect("B's insert does not wait")
        .expect("B's insert is not a deadlock");
    second.batch_execute("COMMIT").await.expect("B commits");
    first_update
        .await
        .unwrap()
        .expect("A's update goes on once B committed: no deadlock");
    // B's row (the higher id) is committed, A's is not: it waits.
    let after = outbox.insert("z", "k", "s", Some("{}"), None).await;
    eventually(
        "another tenant goes on",
        Duration::from_secs(20),
        || async { outbox.row(after).await.published },
    )
    .await;
    assert!(
        !outbox.row(second_x).await.published,
        "B's row waits for A's lower id"
    );
    first.batch_execute("COMMIT").await.expect("A commits");
    let mut committed = Committed::new();
    committed.insert("x".into(), vec![first_x, second_x]);
    committed.insert("z".into(), vec![after]);
    assert_eq!(
        check_history(&outbox, &broker, &committed, Duration::from_secs(30)).await,
        0
    );
    relay.stop().await;
}

/// An id the application supplies is replaced by one drawn from the sequence
/// under the tenant's lock, and the message carries the drawn id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_supplied_id_is_overwritten() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let sql = format!(
        "INSERT INTO {} (id, tenant_id, kind, subject_id, payload) VALUES (424242, 'own', 'k', 's', '{{}}') RETURNING id",
        outbox.qualified()
    );
    let id: i64 = outbox.client.query_one(&sql, &[]).await.unwrap().get(0);
    assert_ne!(id, 424242, "the supplied id is overwritten");
    let relay = start_relay(config(&outbox, &broker, &["own"])).await;
    let committed = Committed::from([("own".to_string(), vec![id])]);
    assert_eq!(
        check_history(&outbox, &broker, &committed, Duration::from_secs(20)).await,
        0
    );
    relay.stop().await;
}

/// A role that may only INSERT into the table (and use its schema) writes
/// through the trigger: the lock and the sequence are used with the owner's
/// rights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_may_only_insert_writes_through_the_trigger() {
    let outbox = Outbox::create().await;
    let role = unique("insert_only");
    outbox
        .execute(&format!(
            "CREATE ROLE \"{role}\" NOLOGIN; \
             GRANT USAGE ON SCHEMA \"{schema}\" TO \"{role}\"; \
             GRANT INSERT ON {{outbox}} TO \"{role}\"",
            schema = outbox.schema
        ))
        .await;
    let writer = pg_client().await;
    let written = writer
        .batch_execute(&format!(
            "SET ROLE \"{role}\"; \
             INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ('limited', 'k', 's', '{{}}'); \
             RESET ROLE",
            outbox.qualified()
        ))
        .await;
    let ids: Vec<i64> = outbox
        .client
        .query(
            &format!(
                "SELECT id FROM {} WHERE tenant_id = 'limited'",
                outbox.qualified()
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    outbox
        .execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await;
    written.expect("the insert-only role inserts");
    assert_eq!(ids.len(), 1, "one row written");
}

/// How many advisory locks the current transaction of `client` holds.
async fn advisory_locks_held(client: &tokio_postgres::Transaction<'_>) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// One transaction writing 2,000 tenants takes 2,000 locks and works; a bulk
/// load of 20,000 tenants that holds writers out itself (`LOCK TABLE … IN
/// EXCLUSIVE MODE`) and sets `outbox_relay.commit_order = off` takes none and
/// works. (Past the shared lock table, about max_locks_per_transaction ×
/// max_connections, an insert fails with SQLSTATE 53200: not tested here,
/// since the lock table is shared with every other test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_inserts_over_many_tenants_and_the_escape_hatch() {
    let mut outbox = Outbox::create().await;
    let bulk = |tenants: i64| {
        format!(
            "INSERT INTO {} (tenant_id, kind, subject_id, payload) \
             SELECT 'bulk-' || g, 'k', 's', '{{}}' FROM generate_series(1, {tenants}) g",
            format_args!("\"{}\".\"{}\"", outbox.schema, outbox.table)
        )
    };
    let (two_thousand, twenty_thousand) = (bulk(2_000), bulk(20_000));
    let tx = outbox.client.transaction().await.unwrap();
    assert_eq!(tx.execute(&two_thousand, &[]).await.unwrap(), 2_000);
    assert_eq!(advisory_locks_held(&tx).await, 2_000, "one lock per tenant");
    tx.commit().await.unwrap();

    let tx = outbox.client.transaction().await.unwrap();
    tx.batch_execute(&format!(
        "LOCK TABLE \"{}\".\"{}\" IN EXCLUSIVE MODE; SET LOCAL outbox_relay.commit_order = off",
        outbox.schema, outbox.table
    ))
    .await
    .unwrap();
    assert_eq!(tx.execute(&twenty_thousand, &[]).await.unwrap(), 20_000);
    assert_eq!(advisory_locks_held(&tx).await, 0, "no lock per tenant");
    tx.commit().await.unwrap();
    assert_eq!(outbox.all_pending().await, 22_000);
}

/// A configuration of the migrations for `schema`.
fn migrate_config(schema: &str) -> Config {
    let mut config = Config::with_tenants(["migrate"]);
    config.database_url = DATABASE_URL.parse().expect("database url");
    config.schema = schema.to_string();
    config
}

/// `outbox-relay migrate` for `schema`: exit code and output.
async fn migrate_binary(schema: &str, print: bool) -> (Option<i32>, String) {
    let mut command = relay_command();
    command.arg("migrate");
    if print {
        command.arg("--print");
    }
    command.envs([
        ("OUTBOX_TENANTS", "migrate"),
        ("OUTBOX_DATABASE_URL", DATABASE_URL),
        ("OUTBOX_SCHEMA", schema),
        ("OUTBOX_LOG_FORMAT", "json"),
    ]);
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .expect("the binary runs");
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.code(), text)
}

/// The table made by the first migration alone, with no record: what
/// `migrate` made before migrations were versioned.
async fn old_table(client: &Client, schema: &str) {
    let sql = outbox_relay::migrate::render(MIGRATIONS[0].sql, schema, "outbox_message");
    client
        .batch_execute(&format!(
            "CREATE SCHEMA \"{schema}\"; SET search_path TO \"{schema}\"; {sql} RESET search_path"
        ))
        .await
        .expect("the old table");
}

async fn recorded(client: &Client, schema: &str) -> Vec<(String, i32, String)> {
    client
        .query(
            &format!(
                "SELECT table_name, version, name FROM \"{schema}\".outbox_relay_migrations ORDER BY 1, 2"
            ),
            &[],
        )
        .await
        .expect("the record")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// The table's storage (its `relfilenode`) and its row count.
async fn storage(client: &Client, table: &str) -> (i64, i64) {
    let row = client
        .query_one(
            &format!(
                "SELECT c.relfilenode::bigint, (SELECT count(*) FROM {table}) \
                 FROM pg_class c WHERE c.oid = to_regclass($1::text)"
            ),
            &[&table],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// Whether the index `kind_once` of `schema` is valid.
async fn kind_once_valid(client: &Client, schema: &str) -> bool {
    client
        .query_one(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = 'kind_once'",
            &[&schema],
        )
        .await
        .unwrap()
        .get(0)
}

/// A table made by the old `migrate` (0001 only, no record) is upgraded in
/// place: same storage (`relfilenode`), rows kept, the trigger added; a
/// second run changes nothing and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_table_is_upgraded_in_place_and_a_second_migrate_is_up_to_date() {
    let client = pg_client().await;
    let schema = unique("old");
    let _owned = OwnedSchema::new(DATABASE_URL, &schema);
    old_table(&client, &schema).await;
    let table = format!("\"{schema}\".outbox_message");
    client
        .batch_execute(&format!(
            "INSERT INTO {table} (tenant_id, kind, subject_id) SELECT 't', 'k', 's' FROM generate_series(1, 100)"
        ))
        .await
        .unwrap();
    let before = storage(&client, &table).await;

    let (code, output) = migrate_binary(&schema, false).await;
    assert_eq!(code, Some(0), "{output}");
    assert!(output.contains("applied 0001_outbox"), "{output}");
    assert!(output.contains("applied 0002_commit_order"), "{output}");
    assert_eq!(
        storage(&client, &table).await,
        before,
        "same storage, rows kept"
    );
    let inserted: i64 = client
        .query_one(
            &format!("INSERT INTO {table} (id, tenant_id, kind, subject_id) VALUES (1, 't', 'k', 's') RETURNING id"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(inserted > 100, "the trigger draws the id: {inserted}");
    let names: Vec<i32> = recorded(&client, &schema)
        .await
        .iter()
        .map(|r| r.1)
        .collect();
    // The trigger is new (0002 applied now): the writers take the shared
    // lock at once (0006).
    assert_eq!(names, vec![1, 2, 3, 4, 5, 6, 7]);

    let (code, output) = migrate_binary(&schema, false).await;
    assert_eq!(code, Some(0), "{output}");
    assert!(output.contains("migrations up to date"), "{output}");
    assert!(!output.contains("applied"), "{output}");
}

/// Four migrators at once (replicas started together): every one succeeds,
/// each migration is applied by exactly one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrators_apply_each_migration_once() {
    let client = pg_client().await;
    let schema = unique("race");
    let _owned = OwnedSchema::new(DATABASE_URL, &schema);
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let schema = schema.clone();
            tokio::spawn(async move { migrate_binary(&schema, false).await })
        })
        .collect();
    let mut outputs = String::new();
    for run in runs {
        let (code, output) = run.await.unwrap();
        assert_eq!(code, Some(0), "{output}");
        outputs += &output;
    }
    for migration in MIGRATIONS.iter().chain([&outbox_relay::migrate::FINISH]) {
        assert_eq!(
            outputs
                .matches(&format!("applied {}", migration.name))
                .count(),
            1,
            "{outputs}"
        );
    }
    assert_eq!(
        recorded(&client, &schema).await.len(),
        MIGRATIONS.len() + 1,
        "a new table is finished at once"
    );
}

/// What a schema holds, with its name replaced by `S`: columns, indexes,
/// constraints, triggers, functions and the record.
async fn catalog(client: &Client, schema: &str) -> Vec<String> {
    let sql = format!(
        "SELECT 'column ' || c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                || ' ' || a.attnotnull || ' ' || a.attidentity::text || ' ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
           FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
           LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
          WHERE n.nspname = $1 AND a.attnum > 0 AND NOT a.attisdropped AND c.relkind = 'r'
         UNION ALL
         SELECT 'index ' || pg_get_indexdef(i.indexrelid) || ' ' || i.indisvalid
           FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = $1
         UNION ALL
         SELECT 'constraint ' || conname || ' ' || pg_get_constraintdef(co.oid)
           FROM pg_constraint co JOIN pg_namespace n ON n.oid = co.connamespace WHERE n.nspname = $1
         UNION ALL
         SELECT 'trigger ' || pg_get_triggerdef(t.oid) || ' ' || t.tgenabled::text
           FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = $1 AND NOT t.tgisinternal
         UNION ALL
         SELECT 'function ' || p.proname || ' ' || p.prosecdef || ' '
                || coalesce(array_to_string(p.proconfig, ','), '') || ' ' || md5(regexp_replace(replace(p.prosrc, $1, 'S'), '\\d+::pg_catalog\\.oid', 'oid', 'g'))
                || ' ' || coalesce(array_to_string(p.proacl, ','), '')
           FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1
         UNION ALL
         SELECT 'recorded ' || table_name || ' ' || version || ' ' || name FROM \"{schema}\".outbox_relay_migrations
         ORDER BY 1"
    );
    client
        .query(&sql, &[&schema])
        .await
        .expect("the catalog")
        .iter()
        .map(|r| r.get::<_, String>(0).replace(schema, "S"))
        .collect()
}

/// The writers' lock mode the commit-order trigger of `schema` was made with.
async fn writer_mode(client: &Client, schema: &str) -> String {
    let row = client
        .query_one(
            "SELECT pg_get_triggerdef(t.oid) FROM pg_trigger t
               JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND t.tgname = 'outbox_relay_commit_order'",
            &[&schema],
        )
        .await
        .expect("the trigger");
    let definition: String = row.get(0);
    if definition.contains("'shared'") {
        "shared".into()
    } else if definition.contains("'exclusive'") {
        "exclusive".into()
    } else {
        panic!("no mode in {definition}")
    }
}

/// The script `outbox-relay migrate [--finish] --print` prints for `schema`
/// (connecting to nothing), applied with `psql -v ON_ERROR_STOP=1`.
fn print_and_apply(schema: &str, finish: bool) {
    let mut printed = relay_command();
    printed.args(["migrate", "--print"]).envs([
        ("OUTBOX_TENANTS", "migrate"),
        // Nothing listens there: --print must not connect.
        ("OUTBOX_DATABASE_URL", "postgres://nobody@127.0.0.1:1/none"),
        ("OUTBOX_SCHEMA", schema),
    ]);
    if finish {
        printed.arg("--finish");
    }
    let output = printed.output().expect("the binary runs");
    assert_eq!(output.status.code(), Some(0));
    let script = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(script.path(), &output.stdout).unwrap();
    let psql = std::process::Command::new("psql")
        .args([DATABASE_URL, "-q", "-v", "ON_ERROR_STOP=1", "-f"])
        .arg(script.path())
        .output()
        .expect("psql runs");
    assert!(
        psql.status.success(),
        "psql applied the script: {}",
        String::from_utf8_lossy(&psql.stderr)
    );
}

/// `migrate --print` connects to nothing, and its script applied with
/// `psql -v ON_ERROR_STOP=1` (twice: it is idempotent) leaves the catalog as
/// `migrate` does for a new table: its writers in the shared mode from the
/// start. A table whose trigger was installed before (in the exclusive mode,
/// which older relays rely on) keeps that mode through the script until
/// `migrate --finish --print`, and keeps the shared mode through the script
/// afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_print_applied_by_psql_equals_migrate() {
    let client = pg_client().await;
    let (by_migrate, by_psql) = (unique("mig"), unique("psq"));
    let _owned = [&by_migrate, &by_psql].map(|schema| OwnedSchema::new(DATABASE_URL, schema));
    let config = migrate_config(&by_migrate);
    outbox_relay::migrate::run(&Store::new(&config).unwrap(), &config)
        .await
        .expect("migrate");
    let mut refused = relay_command();
    refused.args(["migrate", "--print"]).envs([
        ("OUTBOX_TENANTS", "migrate"),
        ("OUTBOX_SCHEMA", by_psql.as_str()),
        ("OUTBOX_POLL_MS", "0"),
    ]);
    let refused = refused.output().expect("the binary runs");
    assert_eq!(refused.status.code(), Some(2), "bad configuration exits 2");
    assert!(refused.stdout.is_empty(), "and prints no script");
    for _ in 0..2 {
        print_and_apply(&by_psql, false);
    }
    let expected = catalog(&client, &by_migrate).await;
    assert!(
        expected
            .iter()
            .any(|e| e.starts_with("trigger CREATE TRIGGER outbox_relay_commit_order"))
    );
    assert_eq!(writer_mode(&client, &by_migrate).await, "shared");
    assert_eq!(catalog(&client, &by_psql).await, expected);

    // A table whose trigger an earlier run installed, and left exclusive.
    client
        .batch_execute(&format!(
            "DELETE FROM \"{by_psql}\".outbox_relay_migrations WHERE version = 6"
        ))
        .await
        .expect("forget the second step");
    print_and_apply(&by_psql, false);
    assert_eq!(writer_mode(&client, &by_psql).await, "exclusive");
    print_and_apply(&by_psql, true);
    assert_eq!(writer_mode(&client, &by_psql).await, "shared");
    print_and_apply(&by_psql, false);
    assert_eq!(writer_mode(&client, &by_psql).await, "shared");
    assert_eq!(catalog(&client, &by_psql).await, expected);
}

/// A migration marked to run outside a transaction builds its index
/// concurrently, after dropping the INVALID index an interrupted build left
/// (which `IF NOT EXISTS` alone would keep).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_no_transaction_migration_rebuilds_an_invalid_index() {
    let outbox = Outbox::create().await;
    outbox.insert("t", "dup", "s", None, None).await;
    outbox.insert("t", "dup", "s", None, None).await;
    let failed = outbox
        .client
        .batch_execute(&format!(
            "CREATE UNIQUE INDEX CONCURRENTLY kind_once ON {} (kind)",
            outbox.qualified()
        ))
        .await;
    assert!(failed.is_err(), "the duplicate fails the build");
    assert!(
        !kind_once_valid(&outbox.client, &outbox.schema).await,
        "left INVALID"
    );
    outbox
        .execute("DELETE FROM {outbox} WHERE id = (SELECT max(id) FROM {outbox})")
        .await;
    let marked = Migration {
        version: 100,
        name: "0100_kind_once",
        sql: "-- outbox-relay: no-transaction\n\
              CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS kind_once ON outbox_message (kind);\n",
        trigger_only: false,
    };
    let config = migrate_config(&outbox.schema);
    outbox_relay::migrate::apply(&Store::new(&config).unwrap(), &config, &[marked])
        .await
        .expect("the marked migration applies");
    assert!(
        kind_once_valid(&outbox.client, &outbox.schema).await,
        "rebuilt valid"
    );
    assert!(
        recorded(&outbox.client, &outbox.schema)
            .await
            .iter()
            .any(|r| r.1 == 100),
        "recorded"
    );
}

/// A relay over a table without the trigger says so once, plainly, and
/// relays all the same; over a migrated table it says nothing of the kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_warns_once_about_a_missing_trigger() {
    let client = pg_client().await;
    let schema = unique("bare");
    old_table(&client, &schema).await;
    let outbox = Outbox::adopt(schema.clone(), "outbox_message".into(), client);
    let broker = Broker::create(&["#"]).await;
    let env = relay_env(&outbox, &broker, &["w"]);
    let (relay, _) = spawn_relay(&env).await;
    outbox.insert("w", "k", "s", Some("{}"), None).await;
    eventually("the row is relayed", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;
    eventually("the warning", Duration::from_secs(10), || async {
        relay.output().contains("no commit-order trigger")
    })
    .await;
    let output = relay.output();
    let warnings: Vec<&str> = output
        .lines()
        .filter(|l| l.contains("no commit-order trigger"))
        .collect();
    assert_eq!(warnings.len(), 1, "{output}");
    assert!(warnings[0].contains("\"WARN\""), "{}", warnings[0]);
    assert!(
        warnings[0].contains("out of commit order"),
        "{}",
        warnings[0]
    );
    assert!(
        warnings[0].contains("outbox-relay migrate --print"),
        "{}",
        warnings[0]
    );
    drop(relay);

    let config = migrate_config(&schema);
    outbox_relay::migrate::run(&Store::new(&config).unwrap(), &config)
        .await
        .unwrap();
    let (relay, _) = spawn_relay(&env).await;
    outbox.insert("w", "k", "s", Some("{}"), None).await;
    eventually(
        "the next row is relayed",
        Duration::from_secs(20),
        || async { outbox.all_pending().await == 0 },
    )
    .await;
    // A row is marked once the broker confirmed it, which may be before the
    // test's consumer has it.
    eventually("both rows arrive", Duration::from_secs(10), || async {
        broker.count() >= 2
    })
    .await;
    let received = by_tenant(&broker.received());
    assert_eq!(received["w"].len(), 2);
    assert!(!relay.output().contains("\"WARN\""), "{}", relay.output());
}

/// The check names each missing piece: a migrated table has none; without
/// its pending index and with its trigger disabled it has those two, and
/// NOTIFYs are not to be expected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schema_check_names_each_missing_piece() {
    use outbox_relay::migrate::{Missing, check_schema};
    let outbox = Outbox::create().await;
    let config = migrate_config(&outbox.schema);
    let store = Store::new(&config).unwrap();
    let report = check_schema(&store, &config).await.unwrap();
    assert_eq!((report.missing, report.trigger), (vec![], true));

    outbox
        .execute(&format!(
            "DROP INDEX \"{}\".outbox_message_pending; \
             ALTER TABLE {{outbox}} DISABLE TRIGGER outbox_relay_commit_order",
            outbox.schema
        ))
        .await;
    let report = check_schema(&store, &config).await.unwrap();
    assert_eq!(
        report.missing,
        vec![Missing::PendingIndex, Missing::TriggerDisabled]
    );
    assert!(!report.trigger);

    let mut elsewhere = config.clone();
    elsewhere.table = "no_such_table".into();
    let report = check_schema(&store, &elsewhere).await.unwrap();
    assert_eq!(report.missing, vec![Missing::Table]);
}

/// The id sequence's settings are checked while the relay runs: one altered
/// to `CACHE 20` under it (a draw would show the end of its session's cached
/// range to everyone, so the relay's bound would not hold) stops relaying
/// with one ERROR naming the sequence and the fix, within the check's 10 s.
/// It is held as an outage, not as the tenant's failure: no sweep fails and
/// no back-off grows while the row found pending waits, and it goes out
/// once the sequence is fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_altered_to_cache_rows_under_the_relay_stops_it_until_fixed() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let env = relay_env(&outbox, &broker, &["seq"]);
    let (relay, addr) = crate::support::spawn_relay(&env).await;
    let first = outbox.insert("seq", "k", "s", Some("{}"), None).await;
    eventually("the first row arrives", Duration::from_secs(20), || async {
        broker.count() >= 1
    })
    .await;
    let sequence = format!("\"{}\".outbox_message_id_seq", outbox.schema);
    outbox
        .execute(&format!("ALTER SEQUENCE {sequence} CACHE 20"))
        .await;
    eventually(
        "the relay names the sequence and the fix",
        Duration::from_secs(30),
        || {
            let said =
                relay.output().contains("ALTER SEQUENCE") && relay.output().contains("CACHE 1");
            async move { said }
        },
    )
    .await;
    let second = outbox.insert("seq", "k", "s", Some("{}"), None).await;
    eventually(
        "a poll finds the row pending",
        Duration::from_secs(20),
        || async {
            let metrics = http_get(addr, "/metrics").await.1;
            metric(&metrics, "outbox_lag_seconds{tenant=\"seq\"}").is_some_and(|lag| lag > 0.0)
        },
    )
    .await;
    let metrics = http_get(addr, "/metrics").await.1;
    assert_eq!(
        metric(&metrics, "outbox_tenant_backoff_seconds{tenant=\"seq\"}").unwrap_or(0.0),
        0.0,
        "no back-off grows: {metrics}"
    );
    outbox
        .execute(&format!("ALTER SEQUENCE {sequence} CACHE 1"))
        .await;
    let committed = Committed::from([("seq".to_string(), vec![first, second])]);
    assert_eq!(
        check_history(&outbox, &broker, &committed, Duration::from_secs(40)).await,
        0
    );
    let metrics = http_get(addr, "/metrics").await.1;
    assert_eq!(
        metric(
            &metrics,
            "outbox_sweeps_total{outcome=\"failed\",tenant=\"seq\"}"
        )
        .unwrap_or(0.0),
        0.0,
        "no sweep failed: {metrics}"
    );
    let output = relay.output();
    let errors = lines_at(&output, "ERROR");
    assert_eq!(errors.len(), 1, "said once: {errors:?}");
    assert!(output.contains("the id sequence fits again"), "{output}");
}

/// A sequence set back (by `setval`, a restore) would otherwise strand
/// pending rows above its position without a word, and number new rows with
/// ids already sent as `message_id`. The relay says so once at WARN, with
/// the position, the id already given and the fix, at start when the table
/// holds an id above the position; once the sequence passes the row again,
/// it goes out. Set back (here restarted) under the relay below ids it has
/// read and sent, it would number new rows with those ids: nothing goes out,
/// one ERROR says so with the fix, and relaying resumes once it passes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_behind_an_id_it_gave_is_said_with_the_fix() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let first = outbox.insert("seq", "k", "s", Some("{}"), None).await;
    let second = outbox.insert("seq", "k", "s", Some("{}"), None).await;
    let sequence = format!("'\"{}\".outbox_message_id_seq'", outbox.schema);
    outbox
        .execute(&format!("SELECT setval({sequence}, {first})"))
        .await;
    let env = relay_env(&outbox, &broker, &["seq"]);
    let (relay, _) = spawn_relay(&env).await;
    said(&relay, second, 1).await;
    let output = relay.output();
    assert!(
        output.contains(&format!("stands at {first}, below id {second}")),
        "{output}"
    );
    assert!(
        output.contains(&format!(
            "fix: SELECT setval('{}.outbox_message_id_seq', GREATEST({second}, (SELECT max(id) FROM \\\"{}\\\".\\\"{}\\\")))",
            outbox.schema, outbox.schema, outbox.table
        )),
        "{output}"
    );
    // Delivery and mark land in either order: wait for both.
    eventually(
        "the row below the position goes out",
        Duration::from_secs(20),
        || async { broker.count() >= 1 && outbox.published_ids().await == vec![first] },
    )
    .await;
    assert_eq!(broker.count(), 1, "only the row below the position is sent");
    assert_eq!(
        outbox.pending("seq").await,
        1,
        "the row above the position waits"
    );

    outbox
        .execute(&format!("SELECT setval({sequence}, {second})"))
        .await;
    eventually(
        "the row goes out once the sequence passes it",
        Duration::from_secs(30),
        || async { outbox.pending("seq").await == 0 },
    )
    .await;
    eventually(
        "the relay sees the sequence past its ids again",
        Duration::from_secs(30),
        || {
            let caught = relay
                .output()
                .contains("stands past every id it had given again");
            async move { caught }
        },
    )
    .await;
    // Restarted under an idle relay, below ids the relay has sent: the next
    // row would reuse one as its message_id. It waits, said once at ERROR
    // with the fix, and goes out once the sequence passes them.
    outbox.execute("TRUNCATE {outbox} RESTART IDENTITY").await;
    outbox.insert("seq", "k", "s", Some("{}"), None).await;
    let fix = format!("below id {second}, which this relay has already read and sent");
    relay.until_said("ERROR", &fix, 1).await;
    assert_eq!(outbox.pending("seq").await, 1, "the new row waits");
    outbox
        .execute(&format!("SELECT setval({sequence}, {second})"))
        .await;
    eventually("the new row goes out", Duration::from_secs(20), || async {
        outbox.pending("seq").await == 0
    })
    .await;
    assert_eq!(relay.said("ERROR", &fix), 1, "{}", relay.output());
    assert_eq!(relay.said("WARN", ", below id"), 1, "{}", relay.output());
}

/// Waits until `relay` has said `times` at WARN that the id sequence stands
/// below `given`, an id it had already given.
async fn said(relay: &RelayProcess, given: i64, times: usize) {
    let said = format!(", below id {given} that it had already given");
    relay.until_said("WARN", &said, times).await;
    assert_eq!(relay.said("WARN", &said), times, "{}", relay.output());
}
