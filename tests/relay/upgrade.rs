//! The rolling upgrade of the writers' lock, with the real relay of the
//! commit before it (built once per test run from this repository's history
//! into `target/old-relay`), side by side with this build: `migrate` is safe
//! while the old relay runs (writers stay on the exclusive lock it relies
//! on), and `migrate --finish`, once it is gone, moves writers to the shared
//! lock. Each tenant's rows reach the consumer in id order throughout.
//! `migrate --finish` refuses beside a relay older than this build (told by
//! the upgrade level its members' name ends with); a relay started with
//! `migrate = true` relays while a trigger-only migration waits for a lock,
//! and names the lock's holder.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use outbox_relay::config::Config;
use outbox_relay::migrate::{LEVEL, MIGRATIONS};
use outbox_relay::store::Store;
use tokio_postgres::Client;

use crate::support::{
    Broker, DATABASE_URL, Outbox, binary_command, by_tenant, check_history, config, eventually,
    http_get, lines_at, metric, pg_client, relay_command, relay_env, set_env, spawn_relay,
    spawn_relay_of, start_relay, unique,
};

/// The last commit before the shared writers' lock: its relay reads without
/// a fence and relies on the exclusive lock.
const OLD_COMMIT: &str = "ce86eac";

/// The old relay's binary, built once per test run (a debug build of
/// `OLD_COMMIT`, from `git archive`, in a target directory of its own).
fn old_relay() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let root = Path::new(env!("CARGO_MANIFEST_DIR"));
            let dir = root.join("target").join("old-relay");
            let source = dir.join(format!("src-{OLD_COMMIT}"));
            if !source.join("Cargo.toml").exists() {
                std::fs::create_dir_all(&source).expect("the old relay's source folder");
                let mut archive = Command::new("git")
                    .arg("-C")
                    .arg(root)
                    .args(["archive", "--format=tar", OLD_COMMIT])
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("git runs");
                let unpacked = Command::new("tar")
                    .arg("-x")
                    .arg("-C")
                    .arg(&source)
                    .stdin(archive.stdout.take().expect("git's output"))
                    .status()
                    .expect("tar runs");
                let archived = archive.wait().expect("git archive");
                assert!(
                    archived.success() && unpacked.success(),
                    "the old relay's source ({OLD_COMMIT}) comes from this repository's history"
                );
            }
            // At the lowest priority: the build takes every core for a
            // minute or more, and the tests running beside it wait on
            // deadlines measured in polls.
            let built = Command::new("nice")
                .args(["-n", "19", env!("CARGO")])
                .args(["build", "--quiet", "--locked", "--bin", "outbox-relay"])
                .arg("--manifest-path")
                .arg(source.join("Cargo.toml"))
                .arg("--target-dir")
                .arg(dir.join("target"))
                .status()
                .expect("cargo runs");
            assert!(built.success(), "the old relay ({OLD_COMMIT}) builds");
            dir.join("target").join("debug").join("outbox-relay")
        })
        .clone()
}

/// Writers of `tenants`, interleaved: four connections, each transaction held
/// 0–20 ms after its insert. Returns the committed ids per tenant.
async fn interleaved(outbox: &Outbox, tenants: &[&'static str]) -> BTreeMap<String, Vec<i64>> {
    let sql = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'k', 's', '{{}}') RETURNING id",
        outbox.qualified()
    );
    let writers = (0..4u64).map(|writer| {
        let (sql, tenants) = (sql.clone(), tenants.to_vec());
        tokio::spawn(async move {
            let mut client = pg_client().await;
            let mut written = Vec::new();
            for n in 0..12u64 {
                let tenant = tenants[((writer + n) % tenants.len() as u64) as usize];
                let tx = client.transaction().await.expect("begin");
                let id: i64 = tx.query_one(&sql, &[&tenant]).await.expect("insert").get(0);
                tokio::time::sleep(Duration::from_millis((writer * 7 + n * 3) % 21)).await;
                tx.commit().await.expect("commit");
                written.push((tenant.to_string(), id));
            }
            written
        })
    });
    let mut committed = BTreeMap::<String, Vec<i64>>::new();
    for writer in writers.collect::<Vec<_>>() {
        for (tenant, id) in writer.await.expect("writer") {
            committed.entry(tenant).or_default().push(id);
        }
    }
    committed
}

/// Whether a second writer of `tenant` waits while a first one's transaction
/// with a row of it is open (the exclusive lock), or inserts and commits at
/// once (the shared lock). Both transactions commit either way.
async fn writers_wait(outbox: &Outbox, tenant: &str) -> bool {
    let sql = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'k', 's', '{{}}')",
        outbox.qualified()
    );
    let mut first = pg_client().await;
    let open = first.transaction().await.expect("begin");
    open.execute(&sql, &[&tenant]).await.expect("insert");
    let second = pg_client().await;
    let quick =
        tokio::time::timeout(Duration::from_secs(2), second.execute(&sql, &[&tenant])).await;
    let waited = quick.is_err();
    open.commit().await.expect("commit");
    if waited {
        // The second insert goes on once the first committed.
        second.execute(&sql, &[&tenant]).await.expect("insert");
    }
    waited
}

async fn recorded(client: &Client, schema: &str) -> Vec<i32> {
    client
        .query(
            &format!("SELECT version FROM \"{schema}\".outbox_relay_migrations ORDER BY version"),
            &[],
        )
        .await
        .expect("the record")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// `migrate` (with `args`) of a relay build for the `schema`'s table; it
/// must succeed.
fn migrate(mut command: Command, args: &[&str], schema: &str) {
    let output = command
        .arg("migrate")
        .args(args)
        .envs([
            ("OUTBOX_TENANTS", "red"),
            ("OUTBOX_DATABASE_URL", DATABASE_URL),
            ("OUTBOX_SCHEMA", schema),
        ])
        .output()
        .expect("the relay binary runs");
    assert!(
        output.status.success(),
        "migrate {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The test's table, with a connection of its own.
async fn outbox_of(schema: &str) -> Outbox {
    Outbox::adopt(
        schema.to_string(),
        "outbox_message".into(),
        pg_client().await,
    )
}

fn merge(into: &mut BTreeMap<String, Vec<i64>>, more: BTreeMap<String, Vec<i64>>) {
    for (tenant, ids) in more {
        into.entry(tenant).or_default().extend(ids);
    }
    for ids in into.values_mut() {
        ids.sort_unstable();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_relay_beside_a_new_one_keeps_order_through_both_steps_of_the_upgrade() {
    let old = tokio::task::spawn_blocking(old_relay).await.expect("built");
    let schema = unique("up");
    migrate(binary_command(&old), &[], &schema);
    let outbox = outbox_of(&schema).await;
    assert_eq!(recorded(&outbox.client, &schema).await, [1, 2, 3, 4]);
    let broker = Broker::create(&["#"]).await;
    let tenants = ["red", "blue"];
    let (mut old_relay, _) =
        spawn_relay_of(binary_command(&old), &relay_env(&outbox, &broker, &tenants)).await;
    let new_relay = start_relay(config(&outbox, &broker, &tenants)).await;
    let mut committed = interleaved(&outbox, &tenants).await;

    // Step 1, while the old relay runs and writers write: the new trigger,
    // still the exclusive lock the old relay relies on.
    let writing = tokio::spawn({
        let outbox = outbox.sharing(pg_client().await);
        async move { interleaved(&outbox, &["red", "blue"]).await }
    });
    migrate(relay_command(), &[], &schema);
    merge(&mut committed, writing.await.expect("writers"));
    assert_eq!(recorded(&outbox.client, &schema).await, [1, 2, 3, 4, 5, 7]);
    assert!(
        writers_wait(&outbox, "red").await,
        "after step 1 a tenant's writers still take the exclusive lock"
    );
    merge(&mut committed, interleaved(&outbox, &tenants).await);
    eventually(
        "the old and the new relay relayed every row so far",
        Duration::from_secs(30),
        || async { outbox.all_pending().await == 0 },
    )
    .await;
    assert!(
        old_relay
            .output()
            .contains("\"message\":\"outbox-relay started\""),
        "the old relay ran throughout"
    );

    // Step 2 is refused while the old relay runs (its LISTEN connection's
    // name has no upgrade level), and taken once it is gone.
    let (code, said) = migrate_output(&["--finish"], &schema);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("migrate --finish refused: 1 session(s) of relays older than this one"),
        "{said}"
    );
    assert_eq!(recorded(&outbox.client, &schema).await, [1, 2, 3, 4, 5]);
    old_relay.signal("TERM");
    assert_eq!(old_relay.wait(Duration::from_secs(30)).await, Some(0));
    let prefix = outbox_relay::sql::relays_prefix(&schema, "outbox_message");
    eventually(
        "the old relay's sessions are gone",
        Duration::from_secs(10),
        || async {
            outbox
                .client
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE starts_with(application_name, $1) AND application_name !~ ':u[0-9]+$'",
                    &[&prefix],
                )
                .await
                .expect("pg_stat_activity")
                .get::<_, i64>(0)
                == 0
        },
    )
    .await;
    migrate(relay_command(), &["--finish"], &schema);
    assert_eq!(
        recorded(&outbox.client, &schema).await,
        [1, 2, 3, 4, 5, 6, 7]
    );
    assert!(
        !writers_wait(&outbox, "blue").await,
        "after step 2 a tenant's writers never wait for each other"
    );
    merge(&mut committed, interleaved(&outbox, &tenants).await);
    // writers_wait's own rows belong to the history too.
    let all: Vec<(String, i64)> = outbox
        .client
        .query(
            &format!(
                "SELECT tenant_id, id FROM {} ORDER BY id",
                outbox.qualified()
            ),
            &[],
        )
        .await
        .expect("the table")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut history = BTreeMap::<String, Vec<i64>>::new();
    for (tenant, id) in all {
        history.entry(tenant).or_default().push(id);
    }
    for (tenant, ids) in &committed {
        assert!(
            ids.iter().all(|id| history[tenant].contains(id)),
            "every row the writers committed is in the table"
        );
    }
    check_history(&outbox, &broker, &history, Duration::from_secs(60)).await;
    new_relay.stop().await;
}

/// `migrate` (with `args`) of this build for the `schema`'s table, as it
/// ended: its exit code, and its stdout (the log) and stderr together.
fn migrate_output(args: &[&str], schema: &str) -> (Option<i32>, String) {
    let output = relay_command()
        .arg("migrate")
        .args(args)
        .envs([
            ("OUTBOX_TENANTS", "red"),
            ("OUTBOX_DATABASE_URL", DATABASE_URL),
            ("OUTBOX_SCHEMA", schema),
            ("OUTBOX_LOG_FORMAT", "json"),
        ])
        .output()
        .expect("the relay binary runs");
    let said = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.code(), said)
}

/// A session of the test database named `name`, and its backend's pid.
async fn session_named(name: &str) -> (Client, i32) {
    let mut config: tokio_postgres::Config = DATABASE_URL.parse().expect("url");
    let (client, connection) = config
        .application_name(name)
        .connect(tokio_postgres::NoTls)
        .await
        .expect("connects");
    tokio::spawn(connection);
    let pid = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    (client, pid)
}

/// The table at migration `version` (0004: as a relay of `OLD_COMMIT` left
/// it).
async fn table_at(database_url: &str, schema: &str, version: usize) {
    let mut config = Config::with_tenants(["migrate"]);
    config.database_url = database_url.parse().expect("url");
    config.schema = schema.to_string();
    let store = Store::new(&config).expect("store");
    outbox_relay::migrate::apply(&store, &config, &MIGRATIONS[..version])
        .await
        .expect("the migrations apply");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finish_refuses_while_an_older_relay_reads_the_table_and_force_overrides_it() {
    let schema = unique("guard");
    table_at(DATABASE_URL, &schema, 4).await;
    let outbox = outbox_of(&schema).await;
    migrate(relay_command(), &[], &schema);
    // Relays' members' names: one of a build before upgrade levels, one of
    // a lower level, one of this build (not older), and an older relay of
    // another table (not this table's).
    let prefix = outbox_relay::sql::relays_prefix(&schema, "outbox_message");
    let (_unlevelled, unlevelled) =
        session_named(&format!("{prefix}0badc0de:00000000feedface")).await;
    let (_lower, lower) = session_named(&format!("{prefix}0badc0de:00000000deadbeef:u5")).await;
    let current = format!("{prefix}0badc0de:0000000012345678:u{LEVEL}");
    let (_current, current_pid) = session_named(&current).await;
    let other = outbox_relay::sql::relays_prefix(&schema, "another_outbox");
    let (_other, other_pid) = session_named(&format!("{other}0badc0de:00000000cafecafe")).await;
    const { assert!(LEVEL > 5, "this build's level is above the relays of 0005") };

    let (code, said) = migrate_output(&["--finish"], &schema);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("migrate --finish refused: 2 session(s) of relays older"),
        "{said}"
    );
    for pid in [unlevelled, lower] {
        assert!(
            said.contains(&format!("pid {pid}, client_addr 127.0.0.1, backend_start ")),
            "{said}"
        );
    }
    for pid in [current_pid, other_pid] {
        assert!(
            !said.contains(&format!("pid {pid},")),
            "not older, or not this table's: {said}"
        );
    }
    assert!(
        said.contains(&format!(
            "application_name {prefix}0badc0de:00000000deadbeef:u5"
        )),
        "{said}"
    );
    assert!(
        said.contains("run `outbox-relay migrate --finish` again; `--force` takes the step anyway"),
        "{said}"
    );
    assert!(said.contains("PgBouncer"), "{said}");
    assert_eq!(
        recorded(&outbox.client, &schema).await,
        [1, 2, 3, 4, 5],
        "nothing taken"
    );

    let (code, said) = migrate_output(&["--finish", "--force"], &schema);
    assert_eq!(code, Some(0), "{said}");
    let warned = lines_at(&said, "WARN");
    assert_eq!(warned.len(), 2, "one WARN per older relay: {said}");
    assert!(
        warned
            .iter()
            .any(|line| line.contains(&format!("pid {lower},"))),
        "{said}"
    );
    assert_eq!(recorded(&outbox.client, &schema).await, [1, 2, 3, 4, 5, 6]);
    assert!(!writers_wait(&outbox, "red").await, "the step was taken");

    // The runbook's undo before a rollback: the record of 0005 and later
    // forgotten, `migrate` puts the exclusive mode back.
    outbox
        .execute(&format!(
            "DELETE FROM \"{schema}\".outbox_relay_migrations \
             WHERE table_name = 'outbox_message' AND version >= 5"
        ))
        .await;
    migrate(relay_command(), &[], &schema);
    assert_eq!(recorded(&outbox.client, &schema).await, [1, 2, 3, 4, 5]);
    assert!(
        writers_wait(&outbox, "red").await,
        "the exclusive mode is back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_relays_while_its_trigger_only_migration_waits_for_a_prepared_transaction() {
    let _cluster = crate::twophase::CLUSTER_IN_USE.lock().await;
    let cluster = tokio::task::spawn_blocking(crate::twophase::cluster)
        .await
        .expect("cluster");
    let schema = unique("uplock");
    table_at(&cluster.url("postgres"), &schema, 4).await;
    let outbox = Outbox::adopt_in(
        &cluster.url("postgres"),
        schema.clone(),
        "outbox_message".into(),
        cluster.client("postgres").await,
    );
    outbox
        .execute(&format!(
            "GRANT USAGE ON SCHEMA \"{schema}\" TO preparer; GRANT INSERT, SELECT ON {{outbox}} TO preparer"
        ))
        .await;
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'k', 's', '{{}}') RETURNING id",
        outbox.qualified()
    );
    // A prepared transaction that wrote to the table holds a lock that
    // DROP/CREATE TRIGGER (migration 0005) waits for.
    let gid = unique("held");
    let preparer = cluster.client("preparer").await;
    preparer.batch_execute("BEGIN").await.unwrap();
    let held: i64 = preparer
        .query_one(&insert, &[&"held"])
        .await
        .unwrap()
        .get(0);
    preparer
        .batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .await
        .expect("prepares");

    let broker = Broker::create(&["#"]).await;
    let mut env = relay_env(&outbox, &broker, &["a", "held"]);
    set_env(&mut env, "OUTBOX_DATABASE_URL", cluster.url("postgres"));
    set_env(&mut env, "OUTBOX_MIGRATE", "true");
    let (relay, addr) = spawn_relay(&env).await;
    relay
        .until_said(
            "WARN",
            &format!(
                "0005_writer_lock waits for a lock on \\\"{schema}\\\".\\\"outbox_message\\\""
            ),
            1,
        )
        .await;
    assert_eq!(
        relay.said(
            "WARN",
            &format!("held by the prepared transaction '{gid}' (RowExclusiveLock")
        ),
        1,
        "the holder is named by its gid:\n{}",
        relay.output()
    );
    // Meanwhile the relay relays, and answers as any running relay does.
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(
            outbox
                .client
                .query_one(&insert, &[&"a"])
                .await
                .unwrap()
                .get::<_, i64>(0),
        );
    }
    eventually(
        "tenant a's rows arrive",
        Duration::from_secs(20),
        || async { by_tenant(&broker.received()).get("a") == Some(&ids) },
    )
    .await;
    assert_eq!(
        recorded(&outbox.client, &schema).await,
        [1, 2, 3, 4],
        "0005 still waits"
    );
    for path in ["/livez", "/readyz"] {
        assert_eq!(http_get(addr, path).await.0, 200, "{path}");
    }

    outbox.execute(&format!("COMMIT PREPARED '{gid}'")).await;
    eventually(
        "0005 applies once the lock is free",
        Duration::from_secs(20),
        // 0007 (trigger-only too) follows it within milliseconds.
        || async {
            recorded(&outbox.client, &schema)
                .await
                .starts_with(&[1, 2, 3, 4, 5])
        },
    )
    .await;
    eventually(
        "the prepared row arrives",
        Duration::from_secs(20),
        || async { by_tenant(&broker.received()).get("held") == Some(&vec![held]) },
    )
    .await;
    assert_eq!(relay.said("INFO", "applied 0005_writer_lock"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_the_reads_need_holds_the_relay_and_names_the_transaction_it_waits_for() {
    let schema = unique("upneed");
    table_at(DATABASE_URL, &schema, 2).await;
    let outbox = outbox_of(&schema).await;
    let committed = outbox.insert("a", "k", "s", Some("{}"), None).await;
    // A transaction left open after writing to the table holds a lock that
    // ALTER TABLE (migration 0003, whose columns the reads need) waits for.
    let mut open = pg_client().await;
    let open_pid: i32 = open
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let tx = open.transaction().await.unwrap();
    tx.execute(
        &format!(
            "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ('b', 'k', 's', '{{}}')",
            outbox.qualified()
        ),
        &[],
    )
    .await
    .unwrap();

    let broker = Broker::create(&["#"]).await;
    let mut env = relay_env(&outbox, &broker, &["a", "b"]);
    set_env(&mut env, "OUTBOX_MIGRATE", "true");
    let (relay, addr) = spawn_relay(&env).await;
    relay
        .until_said(
            "WARN",
            &format!("0003_parking waits for a lock on \\\"{schema}\\\".\\\"outbox_message\\\" (ACCESS EXCLUSIVE, to change the table) held by pid {open_pid} (RowExclusiveLock, its transaction open since "),
            1,
        )
        .await;
    assert_eq!(
        http_get(addr, "/livez").await.0,
        200,
        "alive while it waits"
    );
    let (_, metrics) = http_get(addr, "/metrics").await;
    assert_eq!(
        metric(&metrics, "outbox_database_up"),
        Some(1.0),
        "a lock wait is no database outage"
    );
    assert_eq!(
        broker.count(),
        0,
        "nothing relayed before the reads' migrations"
    );
    assert!(!outbox.row(committed).await.published);

    tx.commit().await.unwrap();
    eventually(
        "the row arrives once the migrations apply",
        Duration::from_secs(30),
        || async { outbox.all_pending().await == 0 && broker.count() == 2 },
    )
    .await;
    eventually(
        "0005 applies while the relay relays",
        Duration::from_secs(20),
        || async { recorded(&outbox.client, &schema).await == [1, 2, 3, 4, 5] },
    )
    .await;
}
