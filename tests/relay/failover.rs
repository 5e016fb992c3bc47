//! Several PostgreSQL hosts, failover, and a replica cut off mid-sweep.
//!
//! The failover test runs against two real servers: the machine's PostgreSQL
//! and a cluster of its own started from the machine's binaries (once per
//! test run, stopped and removed when the run ends). There is no
//! replication: the same outbox table exists on both, and "the primary" is
//! the server that takes writes; the other has `default_transaction_read_only`
//! on (set with ALTER SYSTEM on the private cluster only; the machine's
//! server is made to look gone by a proxy the test owns).

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use outbox_relay::config::Config;
use outbox_relay::store::Store;
use tokio_postgres::{Client, NoTls};

use crate::proxy::{Mode, Proxy};
use crate::support::{
    Broker, Outbox, PrivateServer, by_tenant, config, eventually, free_port, http_get,
    private_cluster, relay_command, relay_env, set_env, spawn_relay, standby_of, start_relay,
};

/// The private cluster (see [`PrivateServer`]), with a database `test`.
struct Cluster {
    port: u16,
    server: PrivateServer,
}

fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let server = private_cluster(
            "failover cluster",
            "outbox-relay-failover-",
            &["max_connections=60"],
        );
        Cluster {
            port: server.port,
            server,
        }
    })
}

impl Cluster {
    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/test", self.port)
    }

    async fn client(&self) -> Client {
        let (client, connection) = tokio_postgres::connect(&self.url(), NoTls)
            .await
            .expect("the failover cluster is reachable");
        tokio::spawn(connection);
        client
    }

    /// Makes the whole cluster take writes or not, every session at once
    /// (none of them has set the setting itself).
    async fn set_writable(&self, client: &Client, writable: bool) {
        let statement = if writable {
            "ALTER SYSTEM RESET default_transaction_read_only"
        } else {
            "ALTER SYSTEM SET default_transaction_read_only = on"
        };
        for statement in [statement, "SELECT pg_reload_conf()"] {
            client
                .batch_execute(statement)
                .await
                .expect("the cluster's settings change");
        }
        // The reload reaches each session a moment later.
        let wanted = if writable { "off" } else { "on" };
        eventually(
            "the cluster's sessions see the change",
            Duration::from_secs(10),
            || async {
                let shown = client
                    .query_one("SHOW default_transaction_read_only", &[])
                    .await;
                shown.is_ok_and(|row| row.get::<_, String>(0) == wanted)
            },
        )
        .await;
    }
}

/// Only one test at a time turns the private cluster read-only.
static CLUSTER_IN_USE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A port nothing listens on.
fn closed_port() -> u16 {
    free_port()
}

/// Inserts `n` rows of `tenant` into `table` through `client`; their ids.
async fn insert(client: &Client, table: &str, tenant: &str, n: i64) -> Vec<i64> {
    let sql = format!(
        "INSERT INTO {table} (tenant_id, kind, subject_id, payload)
         SELECT $1, 'thing.changed', 's-' || g, '{{\"n\":' || g || '}}'
         FROM generate_series(1, $2::bigint) g RETURNING id"
    );
    // A new transaction sees the server's read-only setting as it is now.
    let rows = client
        .query(&sql, &[&tenant, &n])
        .await
        .expect("rows inserted on the primary");
    let mut ids: Vec<i64> = rows.iter().map(|row| row.get(0)).collect();
    ids.sort_unstable();
    ids
}

async fn count(client: &Client, sql: &str) -> i64 {
    client
        .query_one(sql, &[])
        .await
        .map(|row| row.get(0))
        .unwrap_or(-1)
}

/// Waits until the consumer has received every row of `expected` at least
/// once (a row is marked before its message reaches the consumer).
async fn all_received(broker: &Broker, expected: &BTreeMap<String, Vec<i64>>) {
    let total: usize = expected.values().map(Vec::len).sum();
    eventually("every row received", Duration::from_secs(20), || async {
        let ids: std::collections::HashSet<i64> = broker.received().iter().map(|r| r.id).collect();
        ids.len() >= total
    })
    .await;
}

/// Checks on the consumer's side that each tenant's first deliveries are
/// exactly `expected` (every row, in the order written), duplicates aside.
fn assert_received_in_order(broker: &Broker, expected: &BTreeMap<String, Vec<i64>>) {
    let received = by_tenant(&broker.received());
    for (tenant, ids) in expected {
        let mut seen = std::collections::HashSet::new();
        let firsts: Vec<i64> = received
            .get(tenant)
            .map(|got| got.iter().copied().filter(|id| seen.insert(*id)).collect())
            .unwrap_or_default();
        assert_eq!(&firsts, ids, "{tenant}: every row, in order, nothing lost");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_or_silent_host_first_in_the_list_is_passed_over_in_both_forms() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    // A host that refuses at once, and one that accepts and never answers
    // (a blackholed address looks the same to the relay: no answer).
    let silent = Proxy::start("127.0.0.1:5432".parse().unwrap(), Mode::Stall).await;
    let (closed, silent_port) = (closed_port(), silent.addr.port());
    let url = format!(
        "postgres://postgres@127.0.0.1:{closed},127.0.0.1:{silent_port},127.0.0.1:5432/test\
         ?connect_timeout=1&target_session_attrs=read-write"
    );
    let key_value = format!(
        "host=127.0.0.1,127.0.0.1,127.0.0.1 port={closed},{silent_port},5432 dbname=test \
         user=postgres connect_timeout=1 target_session_attrs=read-write"
    );
    let mut relays = Vec::new();
    for (tenant, url) in [("url", &url), ("pairs", &key_value)] {
        let mut config = config(&outbox, &broker, &[tenant]);
        config.database_url = url.parse().expect("several hosts parse");
        config.listen_database_url = config.database_url.clone();
        relays.push(start_relay(config).await);
    }
    let mut expected = BTreeMap::new();
    for tenant in ["url", "pairs"] {
        expected.insert(tenant.to_string(), outbox.insert_many(tenant, 20).await);
    }
    eventually(
        "every row relayed past the dead hosts",
        Duration::from_secs(30),
        || async { outbox.all_pending().await == 0 },
    )
    .await;
    all_received(&broker, &expected).await;
    assert_received_in_order(&broker, &expected);
    assert!(
        silent.accepted() > 0,
        "the silent host was tried (the test would prove nothing otherwise)"
    );
    for relay in relays {
        relay.stop().await;
    }
}

/// Without `target_session_attrs`, several hosts mean "a writable one": a
/// read-only server first in the list (a standby, or one with
/// `default_transaction_read_only`) is passed over, in both forms.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_hosts_without_target_session_attrs_pass_over_a_read_only_first_host() {
    let _cluster = CLUSTER_IN_USE.lock().await;
    let read_only = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let admin = read_only.client().await;
    read_only.set_writable(&admin, false).await;
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let port = read_only.port;
    let url = format!("postgres://postgres@127.0.0.1:{port},127.0.0.1:5432/test?connect_timeout=2");
    let key_value = format!(
        "host=127.0.0.1,127.0.0.1 port={port},5432 dbname=test user=postgres connect_timeout=2"
    );
    let mut relays = Vec::new();
    for (tenant, url) in [("url", &url), ("pairs", &key_value)] {
        let mut config = config(&outbox, &broker, &[tenant]);
        config.database_url = url.parse().expect("several hosts parse");
        config.listen_database_url = config.database_url.clone();
        relays.push(start_relay(config).await);
    }
    let mut expected = BTreeMap::new();
    for tenant in ["url", "pairs"] {
        expected.insert(tenant.to_string(), outbox.insert_many(tenant, 20).await);
    }
    eventually(
        "every row relayed from the writable host",
        Duration::from_secs(30),
        || async { outbox.all_pending().await == 0 },
    )
    .await;
    all_received(&broker, &expected).await;
    assert_received_in_order(&broker, &expected);
    let on_read_only = "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name LIKE 'outbox-relay%' AND datname = 'test'";
    // Each new connection tries it first and leaves it at once.
    eventually(
        "no relay session stays on the read-only host",
        Duration::from_secs(10),
        || async { count(&admin, on_read_only).await == 0 },
    )
    .await;
    for relay in relays {
        relay.stop().await;
    }
    read_only.set_writable(&admin, true).await;
}

#[test]
fn several_hosts_are_shown_without_their_password() {
    for (url, shown) in [
        (
            "postgres://app:s3cret@h1:5432,h2:5433/db?target_session_attrs=read-write",
            "postgres://app:***@h1:5432,h2:5433/db?target_session_attrs=read-write",
        ),
        (
            "host=h1,h2 port=5432,5433 user=app password='s3 cret' dbname=db target_session_attrs=read-write",
            "host=h1,h2 port=5432,5433 user=app password=*** dbname=db target_session_attrs=read-write",
        ),
    ] {
        let output = relay_command()
            .env("OUTBOX_TENANTS", "a")
            .env("OUTBOX_DATABASE_URL", url)
            .arg("check-config")
            .output()
            .expect("check-config runs");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(0), "{stderr}");
        assert!(!stdout.contains("s3"), "{stdout}");
        assert!(stdout.contains(shown), "{stdout}");
    }
    // A malformed host list is refused, naming the key, quoting nothing.
    let output = relay_command()
        .env("OUTBOX_TENANTS", "a")
        .env(
            "OUTBOX_DATABASE_URL",
            "postgres://app:s3cret@h1,[::1/db?target_session_attrs=read-write",
        )
        .arg("check-config")
        .output()
        .expect("check-config runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("database_url"), "{stderr}");
    assert!(!stderr.contains("s3cret"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_failover_the_pool_and_the_listen_connection_move_to_the_new_primary() {
    let _cluster = CLUSTER_IN_USE.lock().await;
    let second = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let table = outbox.qualified();
    // The same table on the second server, its ids far above the first's.
    let mut on_second = Config::with_tenants(["migrate"]);
    on_second.database_url = second.url().parse().expect("url");
    on_second.schema = outbox.schema.clone();
    on_second.table = outbox.table.clone();
    outbox_relay::migrate::run(&Store::new(&on_second).expect("store"), &on_second)
        .await
        .expect("migrations apply on the second server");
    let standby = second.client().await;
    standby
        .batch_execute(&format!(
            "SELECT setval(pg_get_serial_sequence('{table}', 'id'), 1000000000)"
        ))
        .await
        .expect("ids apart");
    second.set_writable(&standby, false).await;

    // The machine's server, behind a proxy that can make it look gone.
    let first = Proxy::start("127.0.0.1:5432".parse().unwrap(), Mode::Pass).await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}/test\
         ?target_session_attrs=read-write&connect_timeout=2",
        closed_port(),
        first.addr.port(),
        second.port
    );
    let mut config = config(&outbox, &broker, &["a", "b"]);
    config.database_url = url.parse().expect("several hosts parse");
    config.listen_database_url = config.database_url.clone();
    config.poll_ms = 200;
    let relay = start_relay(config).await;
    let listening_on_second = "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name LIKE 'outbox-relay:%' AND datname = 'test'";
    let pending_on_second = format!("SELECT count(*) FROM {table} WHERE published_at IS NULL");

    // 1. The first server is the primary.
    let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for tenant in ["a", "b"] {
        expected.insert(tenant.into(), outbox.insert_many(tenant, 30).await);
    }
    eventually(
        "rows on the first primary relayed",
        Duration::from_secs(30),
        || async { outbox.all_pending().await == 0 },
    )
    .await;
    assert_eq!(count(&standby, listening_on_second).await, 0);

    // 2. Failover: the first server goes away, the second takes writes.
    first.set(Mode::Refuse);
    first.reset();
    second.set_writable(&standby, true).await;
    let promoted = Instant::now();
    for tenant in ["a", "b"] {
        let ids = insert(&standby, &table, tenant, 30).await;
        expected.get_mut(tenant).unwrap().extend(ids);
    }
    eventually(
        "rows on the new primary relayed",
        Duration::from_secs(30),
        || async { count(&standby, &pending_on_second).await == 0 },
    )
    .await;
    let moved_in = promoted.elapsed();
    eventually(
        "the LISTEN connection on the new primary",
        Duration::from_secs(20),
        || async { count(&standby, listening_on_second).await == 1 },
    )
    .await;

    // 3. Back: the second server is demoted but stays up (its sessions stay
    // open, now read-only), the first takes writes again, its sequence set
    // past the ids the second gave (or the relay would send none of its
    // rows: see the test below).
    outbox
        .execute(&format!(
            "SELECT setval(pg_get_serial_sequence('{table}', 'id'), 2000000000)"
        ))
        .await;
    first.set(Mode::Pass);
    second.set_writable(&standby, false).await;
    let demoted = Instant::now();
    eventually(
        "the LISTEN connection leaves the demoted primary",
        Duration::from_secs(20),
        || async { count(&standby, listening_on_second).await == 0 },
    )
    .await;
    for tenant in ["a", "b"] {
        let ids = outbox.insert_many(tenant, 30).await;
        expected.get_mut(tenant).unwrap().extend(ids);
    }
    eventually(
        "rows on the first server relayed again",
        Duration::from_secs(30),
        || async { outbox.all_pending().await == 0 },
    )
    .await;
    let moved_back_in = demoted.elapsed();
    all_received(&broker, &expected).await;
    assert_received_in_order(&broker, &expected);
    // An outage is no tenant's failure: no row was blamed.
    let blamed = format!("SELECT count(*) FROM {table} WHERE attempts > 0");
    assert_eq!(count(&standby, &blamed).await, 0);
    assert_eq!(count(&outbox.client, &blamed).await, 0);
    eprintln!("moved to the new primary in {moved_in:?}, back in {moved_back_in:?}");

    relay.stop().await;
    second.set_writable(&standby, true).await;
    standby
        .batch_execute(&format!("DROP SCHEMA \"{}\" CASCADE", outbox.schema))
        .await
        .expect("schema dropped");
}

/// A standby promoted while behind (asynchronous replication, its stream
/// cut): its id sequence stands below ids the relay has already read and
/// sent from the old primary, so its new rows are numbered among them. The
/// relay publishes none of them, says so in one ERROR naming the `setval`
/// that fixes it, turns `/healthz` 503 once they wait past `max_lag_ms`, and
/// resumes by itself once the sequence has passed them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_standby_promoted_behind_the_ids_sent_reuses_none_in_silence() {
    let _cluster = CLUSTER_IN_USE.lock().await;
    let primary = tokio::task::spawn_blocking(cluster).await.expect("cluster");
    let schema = crate::support::unique("behind");
    let mut migrate = Config::with_tenants(["migrate"]);
    migrate.database_url = primary.url().parse().expect("url");
    migrate.schema = schema.clone();
    outbox_relay::migrate::run(&Store::new(&migrate).expect("store"), &migrate)
        .await
        .expect("migrations apply on the primary");
    let outbox = Outbox::adopt_in(
        &primary.url(),
        schema,
        "outbox_message".into(),
        primary.client().await,
    );
    let table = outbox.qualified();
    let standby = tokio::task::spawn_blocking(|| {
        standby_of(
            &primary.server,
            "standby",
            "outbox-relay-standby-",
            &["max_connections=60"],
        )
    })
    .await
    .expect("standby");
    let replica = crate::support::db::pg_client_to(&format!(
        "postgres://postgres@127.0.0.1:{}/test",
        standby.port
    ))
    .await;
    let broker = Broker::create(&["#"]).await;
    let first = Proxy::start(
        format!("127.0.0.1:{}", primary.port).parse().unwrap(),
        Mode::Pass,
    )
    .await;
    let mut env = relay_env(&outbox, &broker, &["a"]);
    set_env(
        &mut env,
        "OUTBOX_DATABASE_URL",
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/test\
             ?target_session_attrs=read-write&connect_timeout=2",
            first.addr.port(),
            standby.port
        ),
    );
    set_env(&mut env, "OUTBOX_POLL_MS", "200");
    set_env(&mut env, "OUTBOX_MAX_LAG_MS", "1000");
    let (relay, addr) = spawn_relay(&env).await;

    // 1. Ten rows sent from the primary, and replayed by the standby.
    let mut sent = outbox.insert_many("a", 10).await;
    let replayed = format!("SELECT count(*) FROM {table} WHERE published_at IS NOT NULL");
    eventually(
        "sent, and replayed marked",
        Duration::from_secs(30),
        || async { outbox.all_pending().await == 0 && count(&replica, &replayed).await == 10 },
    )
    .await;
    // 2. The standby's stream cut: 40 more rows sent that it never gets
    // (more than the 32 values a sequence logs ahead).
    for statement in [
        "ALTER SYSTEM SET primary_conninfo = ''",
        "SELECT pg_reload_conf()",
    ] {
        replica.batch_execute(statement).await.expect("stream cut");
    }
    eventually("the stream is cut", Duration::from_secs(20), || async {
        count(&replica, "SELECT count(*) FROM pg_stat_wal_receiver").await == 0
    })
    .await;
    sent.extend(outbox.insert_many("a", 40).await);
    eventually("sent from the primary", Duration::from_secs(30), || async {
        outbox.all_pending().await == 0
    })
    .await;
    let highest = *sent.last().unwrap();

    // 3. Failover: the primary gone, the standby promoted. Its new rows are
    // numbered among ids already sent.
    first.set(Mode::Refuse);
    first.reset();
    replica
        .batch_execute("SELECT pg_promote()")
        .await
        .expect("promoted");
    let reused = insert(&replica, &table, "a", 5).await;
    assert!(reused.iter().all(|id| *id < highest), "{reused:?}");
    let fix = format!(
        "fix: SELECT setval('{}.outbox_message_id_seq', GREATEST({highest}, (SELECT max(id) FROM \\\"{}\\\".\\\"{}\\\")))",
        outbox.schema, outbox.schema, outbox.table
    );
    relay.until_said("ERROR", &fix, 1).await;
    eventually(
        "/healthz turns 503 past max_lag_ms",
        Duration::from_secs(20),
        || async { http_get(addr, "/healthz").await.0 == 503 },
    )
    .await;
    let published = format!(
        "SELECT count(*) FROM {table} WHERE published_at IS NOT NULL AND id >= {}",
        reused[0]
    );
    assert_eq!(count(&replica, &published).await, 0, "none of them marked");
    assert_eq!(broker.count(), sent.len(), "none of them sent");

    // 4. The sequence set past the ids sent: relaying resumes by itself.
    let sequence = format!("pg_get_serial_sequence('{table}', 'id')");
    replica
        .batch_execute(&format!(
            "SELECT setval({sequence}, GREATEST({highest}, (SELECT max(id) FROM {table})))"
        ))
        .await
        .expect("the fix");
    let later = insert(&replica, &table, "a", 5).await;
    assert!(later[0] > highest, "{later:?}");
    let pending = format!("SELECT count(*) FROM {table} WHERE published_at IS NULL");
    eventually(
        "the new primary's rows relayed",
        Duration::from_secs(30),
        || async { count(&replica, &pending).await == 0 },
    )
    .await;
    eventually("/healthz 200 again", Duration::from_secs(20), || async {
        http_get(addr, "/healthz").await.0 == 200
    })
    .await;
    eventually("every row received", Duration::from_secs(20), || async {
        broker.count() >= sent.len() + reused.len() + later.len()
    })
    .await;
    let expected: Vec<i64> = sent.iter().chain(&reused).chain(&later).copied().collect();
    assert_eq!(by_tenant(&broker.received())["a"], expected, "in order");
    assert_eq!(
        relay.said("ERROR", &fix),
        1,
        "said once: {}",
        relay.output()
    );
    assert_eq!(
        relay.said("INFO", "relaying resumes"),
        1,
        "{}",
        relay.output()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_cut_off_mid_sweep_loses_its_claim_to_another_within_the_bound() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    // Relay A reaches the database through a path the test cuts as a
    // partition does (nothing forwarded, no close passed on) the moment A
    // sends its commit: its claim is open on the server, its rows confirmed
    // by the broker and not marked.
    let path = Proxy::start("127.0.0.1:5432".parse().unwrap(), Mode::Pass).await;
    let mut config_a = config(&outbox, &broker, &["t"]);
    config_a.database_url = format!("postgres://postgres@127.0.0.1:{}/test", path.addr.port())
        .parse()
        .unwrap();
    config_a.listen_database_url = config_a.database_url.clone();
    config_a.confirm_timeout_ms = 500;
    let bound = config_a.claim_idle_timeout();
    let relay_a = start_relay(config_a).await;
    eventually("relay A ready", Duration::from_secs(20), || async {
        relay_a.get("/readyz").await.0 == 200
    })
    .await;
    path.set(Mode::PartitionOn(b"COMMIT"));
    let mut expected = BTreeMap::new();
    expected.insert("t".to_string(), outbox.insert_many("t", 10).await);
    eventually(
        "relay A published the batch",
        Duration::from_secs(20),
        || async { broker.count() >= 10 },
    )
    .await;
    eventually(
        "the path cut at A's commit",
        Duration::from_secs(10),
        || async { outbox.pending("t").await == 10 },
    )
    .await;
    let cut = Instant::now();

    // Relay B, direct, takes the tenant once the server has ended A's
    // transaction: the claim's idle-in-transaction timeout.
    let mut config_b = config(&outbox, &broker, &["t"]);
    config_b.confirm_timeout_ms = 500;
    let relay_b = start_relay(config_b).await;
    eventually(
        "relay B takes the tenant over",
        bound + Duration::from_secs(15),
        || async { outbox.pending("t").await == 0 },
    )
    .await;
    let taken_in = cut.elapsed();
    expected
        .get_mut("t")
        .unwrap()
        .extend(outbox.insert_many("t", 5).await);
    eventually(
        "later rows relayed by B",
        Duration::from_secs(20),
        || async { outbox.pending("t").await == 0 },
    )
    .await;
    all_received(&broker, &expected).await;
    assert_received_in_order(&broker, &expected);
    assert!(
        taken_in >= bound.saturating_sub(Duration::from_secs(2)),
        "B took the tenant after {taken_in:?}, before A's transaction could have ended ({bound:?})"
    );
    eprintln!("claim bound {bound:?}; taken over {taken_in:?} after the cut");

    relay_b.stop().await;
    drop(path);
    relay_a.stop().await;
}

/// The keepalive timer of the server's side of each established connection
/// from `client_ports`, as `ss` shows it (`timer:(keepalive,14sec,0)`).
fn server_keepalive_timers(client_ports: &[i32]) -> Vec<String> {
    let output = std::process::Command::new("ss")
        .args(["-tnoH", "state", "established", "( sport = :5432 )"])
        .output()
        .expect("ss runs");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| {
            client_ports
                .iter()
                .any(|port| line.contains(&format!("127.0.0.1:{port} ")))
        })
        .filter_map(|line| {
            let timer = line.split("timer:(").nth(1)?;
            Some(timer.split(')').next()?.to_string())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_servers_side_of_every_relay_connection_has_short_keepalives() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let name = crate::support::unique("keepalives");
    let mut config = config(&outbox, &broker, &["k"]);
    config.database_url =
        format!("postgres://postgres@127.0.0.1:5432/test?application_name={name}")
            .parse()
            .unwrap();
    config.listen_database_url = config.database_url.clone();
    let relay = start_relay(config).await;
    outbox.insert_many("k", 5).await;
    eventually("rows relayed", Duration::from_secs(20), || async {
        outbox.pending("k").await == 0
    })
    .await;
    let ports: Vec<i32> = outbox
        .client
        .query(
            "SELECT client_port FROM pg_stat_activity WHERE application_name = $1",
            &[&name],
        )
        .await
        .expect("the relay's sessions")
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert!(
        !ports.is_empty(),
        "the relay's pooled sessions are named {name}"
    );
    // Without the relay's settings the kernel's default shows: 119min. A
    // connection with data in flight shows its retransmit timer ("on")
    // instead: read again until each is between statements.
    let mut timers = Vec::new();
    eventually(
        "every session's timer is its keepalive",
        Duration::from_secs(10),
        || {
            timers = server_keepalive_timers(&ports);
            let idle = timers.len() == ports.len()
                && timers.iter().all(|timer| timer.starts_with("keepalive,"));
            async move { idle }
        },
    )
    .await;
    for timer in &timers {
        let left = timer
            .strip_prefix("keepalive,")
            .and_then(|rest| rest.split(',').next())
            .unwrap_or_else(|| panic!("a keepalive timer, not {timer}"));
        let seconds: u64 = if left.ends_with("ms") {
            0
        } else {
            left.strip_suffix("sec")
                .and_then(|secs| secs.parse().ok())
                .unwrap_or_else(|| panic!("a keepalive timer of seconds, not {timer}"))
        };
        assert!(seconds <= 15, "{timer}");
    }
    relay.stop().await;
}
