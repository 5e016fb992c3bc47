//! Two-phase commit writers, on a private cluster with
//! `max_prepared_transactions` > 0 (the machine's server has 0), started once
//! per test run like the TLS and failover clusters: with the one documented
//! setting for their role (`outbox_relay.notify = off`) they prepare and
//! commit through the trigger; a prepared transaction left open holds its
//! tenant's later rows back (shown by `outbox_writer_wait_seconds`), and
//! once committed everything arrives in id order.

use std::sync::OnceLock;
use std::time::Duration;

use outbox_relay::config::Config;
use outbox_relay::store::Store;
use tokio_postgres::{Client, NoTls};

use crate::proxy::{Mode, Proxy};
use crate::support::{
    Broker, Outbox, PrivateServer, RelayHandle, by_tenant, config, eventually, metric,
    private_cluster, relay_command, standby_of, start_relay, unique,
};

/// The private cluster, with a database `test` and a role `preparer` that
/// may insert into any outbox table the tests make and notifies never.
pub(crate) struct Cluster {
    port: u16,
    server: PrivateServer,
}

pub(crate) fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let server = private_cluster(
            "two-phase cluster",
            "outbox-relay-twophase-",
            &["max_prepared_transactions=10", "max_connections=40"],
        );
        server.psql(
            "test",
            "CREATE ROLE preparer LOGIN; ALTER ROLE preparer SET outbox_relay.notify = off",
        );
        Cluster {
            port: server.port,
            server,
        }
    })
}

/// Only one test at a time uses the cluster: one restarts it.
pub(crate) static CLUSTER_IN_USE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl Cluster {
    pub(crate) fn url(&self, user: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/test", self.port)
    }

    pub(crate) async fn client(&self, user: &str) -> Client {
        let (client, connection) = tokio_postgres::connect(&self.url(user), NoTls)
            .await
            .expect("the two-phase cluster is reachable");
        tokio::spawn(connection);
        client
    }
}

/// A migrated outbox table on the cluster, in a schema of its own named
/// after `prefix`, that `preparer` may write into.
async fn preparers_outbox(cluster: &Cluster, prefix: &str) -> Outbox {
    let schema = unique(prefix);
    let mut migrate = Config::with_tenants(["migrate"]);
    migrate.database_url = cluster.url("postgres").parse().expect("url");
    migrate.schema = schema.clone();
    outbox_relay::migrate::run(&Store::new(&migrate).expect("store"), &migrate)
        .await
        .expect("migrations apply");
    let outbox = Outbox::adopt_in(
        &cluster.url("postgres"),
        schema.clone(),
        "outbox_message".into(),
        cluster.client("postgres").await,
    );
    outbox
        .client
        .batch_execute(&format!(
            "GRANT USAGE ON SCHEMA \"{schema}\" TO preparer; GRANT INSERT, SELECT ON {} TO preparer",
            outbox.qualified()
        ))
        .await
        .expect("grants");
    outbox
}

/// A migrated outbox table on the cluster that `preparer` may write into, a
/// broker, and a relay of tenants `a` and `b` on `database_url`; the
/// statement that inserts a row of tenant `$1` and returns its id.
async fn relayed(cluster: &Cluster, database_url: &str) -> (Outbox, Broker, RelayHandle, String) {
    let outbox = preparers_outbox(cluster, "twophase").await;
    let broker = Broker::create(&["#"]).await;
    let mut relayed = config(&outbox, &broker, &["a", "b"]);
    relayed.database_url = database_url.parse().expect("url");
    relayed.listen_database_url = relayed.database_url.clone();
    let relay = start_relay(relayed).await;
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'k', $2, '{{}}') RETURNING id",
        outbox.qualified()
    );
    (outbox, broker, relay, insert)
}

/// Inserts a row of `tenant` through `client` (`insert`, from [`relayed`]): its id.
async fn insert_row(client: &Client, insert: &str, tenant: &str) -> i64 {
    client
        .query_one(insert, &[&tenant, &"s"])
        .await
        .expect("row inserted")
        .get(0)
}

/// Whether the relay shows tenant `a` waiting for its writers in flight.
async fn a_waits(relay: &RelayHandle) -> bool {
    let (_, text) = relay.get("/metrics").await;
    metric(&text, "outbox_writer_wait_seconds{tenant=\"a\"}").is_some_and(|s| s > 0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_transactions_commit_through_the_trigger_and_hold_back_only_later_rows() {
    let _cluster = CLUSTER_IN_USE.lock().await;
    let cluster = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let (outbox, broker, relay, insert) = relayed(cluster, &cluster.url("postgres")).await;
    // The relay waits for notifications (the table is quiet): a writer
    // without the setting notifies, and cannot prepare.
    let plain = cluster.client("postgres").await;
    eventually(
        "the relay holds the wake-up lock",
        Duration::from_secs(10),
        || async {
            plain
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 \
                     AND classid::bigint = (hashtext('outbox-relay wakeup')::bigint & 4294967295)",
                    &[],
                )
                .await
                .expect("pg_locks")
                .get::<_, i64>(0)
                == 1
        },
    )
    .await;
    plain.batch_execute("BEGIN").await.unwrap();
    plain.query_one(&insert, &[&"b", &"plain"]).await.unwrap();
    let refused = plain
        .batch_execute("PREPARE TRANSACTION 'notified'")
        .await
        .expect_err("a transaction that notified cannot be prepared");
    assert!(
        refused.to_string().contains("NOTIFY") || format!("{refused:?}").contains("NOTIFY"),
        "{refused:?}"
    );
    plain.batch_execute("ROLLBACK").await.ok();

    // With `outbox_relay.notify = off` for their role, writers prepare.
    let preparer = cluster.client("preparer").await;
    preparer.batch_execute("BEGIN").await.unwrap();
    let prepared: i64 = preparer
        .query_one(&insert, &[&"a", &"prepared"])
        .await
        .unwrap()
        .get(0);
    preparer
        .batch_execute("PREPARE TRANSACTION 'outbox_twophase'")
        .await
        .expect("a writer with outbox_relay.notify = off prepares");
    // A later row of the same tenant, and one of another tenant.
    let later: i64 = outbox
        .client
        .query_one(&insert, &[&"a", &"later"])
        .await
        .unwrap()
        .get(0);
    let other: i64 = outbox
        .client
        .query_one(&insert, &[&"b", &"other"])
        .await
        .unwrap()
        .get(0);
    assert!(prepared < later);
    eventually(
        "the other tenant goes on",
        Duration::from_secs(20),
        || async { outbox.row(other).await.published },
    )
    .await;
    eventually(
        "the tenant's wait for the prepared transaction shows",
        Duration::from_secs(20),
        || a_waits(&relay),
    )
    .await;
    assert!(
        !outbox.row(later).await.published,
        "the later row waits for the prepared transaction's lower id"
    );
    outbox
        .client
        .batch_execute("COMMIT PREPARED 'outbox_twophase'")
        .await
        .expect("commit prepared");
    eventually(
        "both rows of the tenant arrive",
        Duration::from_secs(20),
        || async { outbox.all_pending().await == 0 && broker.count() >= 3 },
    )
    .await;
    let received = by_tenant(&broker.received());
    assert_eq!(received["a"], [prepared, later], "in id order");
    assert_eq!(received["b"], [other]);
    eventually("the wait is over", Duration::from_secs(20), || async {
        let (_, text) = relay.get("/metrics").await;
        metric(&text, "outbox_writer_wait_seconds{tenant=\"a\"}") == Some(0.0)
    })
    .await;
    relay.stop().await;
}

/// Prepares a transaction (`gid`) that wrote a row of tenant `a`, commits a
/// later row of `a`, and waits until the relay shows `a` waiting: the two
/// rows' ids.
async fn prepared_then_later(
    cluster: &Cluster,
    outbox: &Outbox,
    relay: &RelayHandle,
    insert: &str,
    gid: &str,
) -> (i64, i64) {
    let preparer = cluster.client("preparer").await;
    preparer.batch_execute("BEGIN").await.unwrap();
    let prepared = insert_row(&preparer, insert, "a").await;
    preparer
        .batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .await
        .expect("prepared");
    let before = insert_row(&outbox.client, insert, "a").await;
    eventually(
        "the tenant waits for the prepared transaction",
        Duration::from_secs(20),
        || a_waits(relay),
    )
    .await;
    (prepared, before)
}

/// On a new server instance (`outbox`'s client on it), after
/// [`prepared_then_later`]: a later row of `a` and one of `b`; `b` goes on,
/// `a`'s later rows stay behind the prepared one for two seconds after that,
/// and once `gid` is committed every row of `a` arrives in id order.
async fn held_until_committed(
    outbox: &Outbox,
    broker: &Broker,
    relay: &RelayHandle,
    insert: &str,
    gid: &str,
    [prepared, before]: [i64; 2],
) {
    let after = insert_row(&outbox.client, insert, "a").await;
    let other = insert_row(&outbox.client, insert, "b").await;
    eventually(
        "the other tenant goes on on the new server",
        Duration::from_secs(30),
        || async { outbox.row(other).await.published },
    )
    .await;
    // The relay has swept and checked the tenant's writers since: for two
    // seconds more, its later rows stay behind the prepared one.
    let watched = tokio::time::Instant::now();
    while watched.elapsed() < Duration::from_secs(2) {
        for id in [before, after] {
            assert!(
                !outbox.row(id).await.published,
                "row {id} waits for the prepared transaction's lower id {prepared}"
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(a_waits(relay).await, "the wait shows");
    outbox
        .client
        .batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await
        .expect("commit prepared");
    eventually(
        "the tenant's rows arrive",
        Duration::from_secs(30),
        || async { outbox.all_pending().await == 0 && broker.count() >= 4 },
    )
    .await;
    let received = by_tenant(&broker.received());
    assert_eq!(received["a"], [prepared, before, after], "in id order");
}

/// A prepared transaction survives a restart of the server (recovered at
/// start-up, with a new virtual transaction id): the relay still counts it
/// as a writer of its tenant in flight, so the tenant's later rows, committed
/// before and after the restart, wait until it is committed, and then
/// everything arrives in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_transaction_holds_its_tenant_across_a_restart() {
    let _cluster = CLUSTER_IN_USE.lock().await;
    let cluster = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let (outbox, broker, relay, insert) = relayed(cluster, &cluster.url("postgres")).await;
    let gid = unique("restart");
    let (prepared, before) = prepared_then_later(cluster, &outbox, &relay, &insert, &gid).await;

    tokio::task::spawn_blocking(|| cluster.server.restart())
        .await
        .expect("restarted");
    let outbox = outbox.sharing(cluster.client("postgres").await);
    held_until_committed(&outbox, &broker, &relay, &insert, &gid, [prepared, before]).await;
    relay.stop().await;
}

/// `outbox-relay status` (`--json` when `json`) over `outbox` on the
/// two-phase cluster, for `tenants`.
fn status_of(cluster: &Cluster, outbox: &Outbox, tenants: &str, json: bool) -> String {
    let mut command = relay_command();
    command
        .env("OUTBOX_TENANTS", tenants)
        .env("OUTBOX_DATABASE_URL", cluster.url("postgres"))
        .env("OUTBOX_SCHEMA", &outbox.schema)
        .env("OUTBOX_TABLE", &outbox.table)
        .env("OUTBOX_LOG_FORMAT", "json")
        .arg("status");
    if json {
        command.arg("--json");
    }
    let output = command.output().expect("the binary runs");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The runbook's query for who holds a tenant's writers' lock, for this
/// table and `tenant`.
fn runbook_holders_query(outbox: &Outbox, tenant: &str) -> String {
    let runbook = include_str!("../../docs/runbook.md");
    let start = runbook
        .find("-- Who holds the tenant's writers' lock")
        .expect("the runbook's query");
    let end = start + runbook[start..].find("```").expect("its block ends");
    runbook[start..end]
        .replace(
            "'outbox.outbox_message'",
            &format!("'{}.{}'", outbox.schema, outbox.table),
        )
        .replace("'acme'", &format!("'{tenant}'"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_the_open_and_prepared_writers_that_hold_a_tenant_and_a_twins_writer() {
    let _cluster = CLUSTER_IN_USE.lock().await;
    let cluster = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let outbox = preparers_outbox(cluster, "twophase_status").await;
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'k', $2, '{{}}') RETURNING id",
        outbox.qualified()
    );
    let pid_of = async |client: &Client| -> i32 {
        client
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("pid")
            .get(0)
    };
    // Tenant `held`: a prepared writer and an open one, then a committed row.
    let gid = unique("status_gid");
    let preparer = cluster.client("preparer").await;
    preparer.batch_execute("BEGIN").await.unwrap();
    preparer
        .query_one(&insert, &[&"held", &"prepared"])
        .await
        .unwrap();
    preparer
        .batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .await
        .expect("prepare");
    let open = cluster.client("preparer").await;
    let open_pid = pid_of(&open).await;
    open.batch_execute("BEGIN").await.unwrap();
    open.query_one(&insert, &[&"held", &"open"]).await.unwrap();
    // A subtransaction's xid beside the transaction's: still one writer.
    open.batch_execute("SAVEPOINT nested").await.unwrap();
    open.query_one(&insert, &[&"held", &"nested"])
        .await
        .unwrap();
    // The twins: tenant-109170's writer stays open; tenant-134154 committed.
    let twin_writer = cluster.client("preparer").await;
    let twin_pid = pid_of(&twin_writer).await;
    twin_writer.batch_execute("BEGIN").await.unwrap();
    twin_writer
        .query_one(&insert, &[&"tenant-109170", &"open"])
        .await
        .unwrap();
    for tenant in ["held", "tenant-134154", "free"] {
        outbox
            .client
            .query_one(&insert, &[&tenant, &"committed"])
            .await
            .unwrap();
    }

    let tenants = "held,tenant-109170,tenant-134154,free";
    let json = status_of(cluster, &outbox, tenants, true);
    let text = status_of(cluster, &outbox, tenants, false);
    let runbook: Vec<(Option<i32>, Option<String>)> = outbox
        .client
        .query(&runbook_holders_query(&outbox, "held"), &[])
        .await
        .expect("the runbook's query runs")
        .iter()
        .map(|row| (row.get("pid"), row.get("gid")))
        .collect();
    outbox
        .client
        .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
        .await
        .expect("rollback prepared");
    open.batch_execute("ROLLBACK").await.unwrap();
    twin_writer.batch_execute("ROLLBACK").await.unwrap();

    let report: serde_json::Value =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("status --json ({e}): {json}"));
    let [held, backlogged, twin, free] = [0, 1, 2, 3].map(|i| &report["tenants"][i]);
    assert_eq!(held["waits_for_writers"], true, "{json}");
    assert!(
        held["oldest_id"].is_null() && held["attempts"].is_null() && held["last_error"].is_null(),
        "no blocking row: {json}"
    );
    let writers = held["writers"].as_array().expect("writers");
    assert_eq!(writers.len(), 2, "{json}");
    let prepared = writers
        .iter()
        .find(|w| w["gid"] == gid.as_str())
        .expect("the gid");
    assert!(
        prepared["pid"].is_null() && prepared["prepared"].is_string(),
        "{json}"
    );
    let session = writers
        .iter()
        .find(|w| w["pid"] == open_pid)
        .expect("the pid");
    assert!(session["xact_start"].is_string() && session["open_ms"].as_i64() >= Some(0));
    assert_eq!(twin["waits_for_writers"], true, "{json}");
    assert_eq!(twin["twins"], serde_json::json!(["tenant-109170"]));
    assert_eq!(twin["writers"][0]["pid"], twin_pid, "{json}");
    assert_eq!(
        backlogged["waits_for_writers"], false,
        "nothing of its own pending"
    );
    assert_eq!(free["waits_for_writers"], false);
    assert!(free["oldest_id"].is_i64(), "its blocking row stays: {json}");

    assert!(text.contains("held waits for writers in flight:"), "{text}");
    assert!(
        text.contains(&format!("prepared transaction '{gid}', prepared ")),
        "{text}"
    );
    assert!(
        text.contains(&format!("pid {open_pid}, transaction open for ")),
        "{text}"
    );
    assert!(
        text.contains(&format!("pid {twin_pid}, transaction open for "))
            && text.contains("or of its colliding tenant tenant-109170"),
        "{text}"
    );

    assert!(
        runbook.contains(&(None, Some(gid.clone()))),
        "the runbook's query names the prepared transaction's gid: {runbook:?}"
    );
    assert!(
        runbook.iter().any(|(pid, _)| *pid == Some(open_pid)),
        "{runbook:?}"
    );
}

/// A prepared transaction survives a failover too: a streaming standby that
/// had replayed the `PREPARE` is promoted (the old primary gone for the
/// relay), and recovers the transaction with a new virtual transaction id.
/// The tenant's later rows, committed before and after, wait until it is
/// committed on the new primary, then everything arrives in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_transaction_holds_its_tenant_across_a_promotion() {
    let _cluster = CLUSTER_IN_USE.lock().await;
    let cluster = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let standby = tokio::task::spawn_blocking(|| {
        standby_of(
            &cluster.server,
            "two-phase standby",
            "outbox-relay-twophase-standby-",
            &["max_prepared_transactions=10", "max_connections=40"],
        )
    })
    .await
    .expect("standby");
    let first = Proxy::start(
        format!("127.0.0.1:{}", cluster.port).parse().unwrap(),
        Mode::Pass,
    )
    .await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/test\
         ?target_session_attrs=read-write&connect_timeout=2",
        first.addr.port(),
        standby.port
    );
    let (outbox, broker, relay, insert) = relayed(cluster, &url).await;
    let gid = unique("promotion");
    let (prepared, before) = prepared_then_later(cluster, &outbox, &relay, &insert, &gid).await;
    let promoted = crate::support::db::pg_client_to(&format!(
        "postgres://postgres@127.0.0.1:{}/test",
        standby.port
    ))
    .await;
    // The later row's commit comes after the PREPARE in the WAL (a standby
    // lists no prepared transaction before it is promoted).
    let replayed = format!(
        "SELECT count(*) FROM {} WHERE id = {before}",
        outbox.qualified()
    );
    eventually(
        "the standby replayed the later row",
        Duration::from_secs(20),
        || async {
            promoted
                .query_one(&replayed, &[])
                .await
                .is_ok_and(|row| row.get::<_, i64>(0) == 1)
        },
    )
    .await;

    first.set(Mode::Refuse);
    first.reset();
    promoted
        .batch_execute("SELECT pg_promote()")
        .await
        .expect("promoted");
    let on_new = outbox.sharing(promoted);
    held_until_committed(&on_new, &broker, &relay, &insert, &gid, [prepared, before]).await;
    relay.stop().await;
    // The old primary still has it: gone with it.
    outbox
        .client
        .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
        .await
        .expect("rolled back on the old primary");
}
