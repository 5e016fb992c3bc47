//! The rolling upgrade of the writers' lock, with the real relay of the
//! commit before it (built once per test run from this repository's history
//! into `target/old-relay`), side by side with this build: `migrate` is safe
//! while the old relay runs (writers stay on the exclusive lock it relies
//! on), and `migrate --finish`, once it is gone, moves writers to the shared
//! lock. Each tenant's rows reach the consumer in id order throughout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use tokio_postgres::Client;

use crate::support::{
    Broker, DATABASE_URL, Outbox, binary_command, check_history, config, eventually, pg_client,
    relay_command, relay_env, spawn_relay_of, start_relay, unique,
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

    // Step 2, once the old relay is gone.
    old_relay.signal("TERM");
    assert_eq!(old_relay.wait(Duration::from_secs(30)).await, Some(0));
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
