//! Faults injected for real — replicas killed, backends terminated, broker and
//! database paths reset, stalled and refused through a proxy the test owns
//! (the broker's memory alarm is `flow`'s, on a node of its own) — and a
//! checker over what consumers received:
//!
//! - **L** every committed row was received at least once and is marked published;
//! - **O** per tenant, the first occurrences of ids are strictly increasing;
//! - **D** duplicates ≤ `batch_size` × injected faults, zero without faults;
//! - **H** the fault showed in `/readyz`, `/healthz` or `/metrics`;
//! - **R** after the fault clears, lag returns to zero within a stated bound.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::proxy::{Mode, Proxy};
use crate::support::{
    Broker, Outbox, by_tenant, check_history, config, eventually, http_get, metric, pg_client,
    relay_env, set_env, spawn_relay, start_relay,
};

const BROKER: &str = "127.0.0.1:5672";
const DATABASE: &str = "127.0.0.1:5432";

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn amqp_via(proxy: &Proxy) -> String {
    format!("amqp://guest:guest@{}/%2f", proxy.addr)
}

fn database_via(proxy: &Proxy) -> String {
    format!("postgres://postgres@{}/test", proxy.addr)
}

/// The sum of every series of `name` whose labels contain `needle`.
fn sum(metrics: &str, name: &str, needle: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Committed ids per tenant.
type Committed = BTreeMap<String, Vec<i64>>;

async fn write_rows(
    outbox: &Outbox,
    tenants: &[String],
    per_tenant: i64,
    committed: &mut Committed,
) {
    for tenant in tenants {
        committed
            .entry(tenant.clone())
            .or_default()
            .extend(outbox.insert_many(tenant, per_tenant).await);
    }
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i:02}")).collect()
}

/// 1. Three replicas, 20 tenants, rows written while relaying: L, O, no duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_twenty_tenants_concurrent_writes() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let tenants = names("t", 20);
    let refs: Vec<&str> = tenants.iter().map(String::as_str).collect();
    let mut env = relay_env(&outbox, &broker, &refs);
    set_env(&mut env, "OUTBOX_BATCH_SIZE", "32");
    set_env(&mut env, "OUTBOX_POLL_MS", "20");
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(spawn_relay(&env).await);
    }
    let mut committed = Committed::new();
    for _ in 0..10 {
        write_rows(&outbox, &tenants, 15, &mut committed).await;
    }
    let duplicates = check_history(&outbox, &broker, &committed, Duration::from_secs(60)).await;
    assert_eq!(duplicates, 0, "no fault, no duplicates");
    let mut by_replica = Vec::new();
    for (process, http) in &replicas {
        let (_, metrics) = http_get(*http, "/metrics").await;
        by_replica.push(sum(&metrics, "outbox_published_total", "tenant="));
        process.signal("TERM");
    }
    assert_eq!(by_replica.iter().sum::<f64>(), 3000.0, "{by_replica:?}");
    for (mut process, _) in replicas {
        assert_eq!(
            process.wait(Duration::from_secs(20)).await,
            Some(0),
            "{}",
            process.output()
        );
    }
}

/// 2. `kill -9` of a replica mid-batch, again and again, while the others run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_killed_mid_batch() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let tenants = names("k", 6);
    let refs: Vec<&str> = tenants.iter().map(String::as_str).collect();
    let batch_size = 200;
    let mut env = relay_env(&outbox, &broker, &refs);
    set_env(&mut env, "OUTBOX_BATCH_SIZE", batch_size.to_string());
    // One sweep at a time per replica: a kill interrupts at most one batch.
    set_env(&mut env, "OUTBOX_CONCURRENCY", "1");
    // A narrow window keeps each batch in flight long enough that the kills
    // land mid-run however fast the machine drains.
    set_env(&mut env, "OUTBOX_MAX_IN_FLIGHT", "16");
    let mut committed = Committed::new();
    write_rows(&outbox, &tenants, 3_000, &mut committed).await;
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(spawn_relay(&env).await);
    }
    let mut kills = 0;
    for round in 0..4 {
        // Progress as the table sees it: the test's consumer may trail the
        // relays by many seconds on a loaded machine.
        let pending = outbox.all_pending().await;
        eventually(
            "progress before the next kill",
            Duration::from_secs(30),
            || async { outbox.all_pending().await + 50 < pending },
        )
        .await;
        if outbox.all_pending().await == 0 {
            break;
        }
        let victim = round % replicas.len();
        let (mut process, _) = replicas.remove(victim);
        process.signal("KILL");
        process.wait(Duration::from_secs(10)).await;
        kills += 1;
        replicas.insert(victim, spawn_relay(&env).await);
    }
    assert!(kills >= 1, "at least one replica was killed mid-run");
    let duplicates = check_history(&outbox, &broker, &committed, Duration::from_secs(60)).await;
    assert!(
        duplicates <= batch_size * kills,
        "D: {duplicates} duplicates after {kills} kills"
    );
}

/// 3. The broker connection is reset in the middle of a batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_connection_reset_mid_batch() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    // A throttled path (small window, delayed bytes) keeps a batch in flight
    // when the reset comes.
    let proxy = Proxy::start(addr(BROKER), Mode::Delay(Duration::from_millis(5))).await;
    let batch_size = 300;
    let mut config = config(&outbox, &broker, &["reset"]);
    config.amqp_url = amqp_via(&proxy).parse().expect("amqp url");
    config.batch_size = batch_size;
    config.max_in_flight = 10;
    config.max_backoff_ms = 500;
    let mut committed = Committed::new();
    write_rows(&outbox, &["reset".to_string()], 3_000, &mut committed).await;
    let relay = start_relay(config).await;
    eventually("a batch is in flight", Duration::from_secs(30), || async {
        broker.count() > 10
    })
    .await;
    // H: the lost connection shows as a failed publish. A reset that lands
    // between two batches only forces a reconnect, so reset until one shows;
    // every reset counts as a fault.
    let failures = || async {
        let m = relay.get("/metrics").await.1;
        sum(&m, "outbox_publish_failures_total", "reason=\"connection\"")
            + sum(&m, "outbox_publish_failures_total", "reason=\"timeout\"")
    };
    let mut resets = 0;
    while failures().await < 1.0 {
        assert!(resets < 5, "H: five resets and no failed publish");
        proxy.reset();
        resets += 1;
        let deadline = Instant::now() + Duration::from_secs(5);
        while failures().await < 1.0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    proxy.set(Mode::Pass);
    // R: lag back to zero within 30 s.
    let duplicates = check_history(&outbox, &broker, &committed, Duration::from_secs(30)).await;
    assert!(
        duplicates <= batch_size * resets,
        "D: {duplicates} after {resets} resets"
    );
    let (_, health) = relay.get("/healthz").await;
    assert!(health.contains("\"status\":\"ok\""), "{health}");
    assert!(proxy.accepted() >= 2, "the relay reconnected");
    relay.stop().await;
}

/// Asserts that every row marked published has reached the consumer.
async fn marked_were_received(outbox: &Outbox, broker: &Broker) {
    let marked = outbox.published_ids().await;
    eventually(
        "every marked row reached the consumer",
        Duration::from_secs(10),
        || async {
            let received: HashSet<i64> = broker.received().iter().map(|r| r.id).collect();
            marked.iter().all(|id| received.contains(id))
        },
    )
    .await;
}

/// 4. The broker path stalls (half-open): confirms never come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_path_stalls() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let proxy = Proxy::start(addr(BROKER), Mode::Delay(Duration::from_millis(5))).await;
    let mut config = config(&outbox, &broker, &["stall"]);
    config.amqp_url = amqp_via(&proxy).parse().expect("amqp url");
    config.batch_size = 200;
    config.max_in_flight = 10;
    config.confirm_timeout_ms = 1_000;
    config.max_backoff_ms = 500;
    let mut committed = Committed::new();
    write_rows(&outbox, &["stall".to_string()], 3_000, &mut committed).await;
    let relay = start_relay(config).await;
    eventually("publishing", Duration::from_secs(30), || async {
        broker.count() > 10
    })
    .await;
    proxy.set(Mode::Stall);
    let stalled_at = Instant::now();
    eventually(
        "H: the sweep fails by its confirm deadline",
        Duration::from_secs(20),
        || async {
            metric(
                &relay.get("/metrics").await.1,
                "outbox_publish_failures_total{reason=\"timeout\",tenant=\"stall\"}",
            )
            .unwrap_or(0.0)
                >= 1.0
        },
    )
    .await;
    assert!(
        stalled_at.elapsed() < Duration::from_secs(10),
        "failed by the deadline, not by luck"
    );
    eventually(
        "H: /readyz answers 503 while the path is stalled",
        Duration::from_secs(20),
        || async { relay.get("/readyz").await.0 == 503 },
    )
    .await;
    // Nothing the broker did not confirm was marked while stalled.
    let marked_during_stall = outbox.published_ids().await;
    marked_were_received(&outbox, &broker).await;
    assert!(
        marked_during_stall.len() < 2_000,
        "the stall held rows back"
    );
    let refused = outbox
        .row(committed["stall"][marked_during_stall.len()])
        .await;
    assert!(
        refused
            .last_error
            .unwrap_or_default()
            .starts_with("timeout"),
        "the row at the stall records why"
    );

    proxy.reset();
    proxy.set(Mode::Pass);
    // R: back to zero lag within 40 s (a reconnect attempt into the stall may need its 10 s deadline).
    let duplicates = check_history(&outbox, &broker, &committed, Duration::from_secs(40)).await;
    assert!(duplicates <= 200, "D: {duplicates}");
    relay.stop().await;
}

/// 6. The broker is down when the relay starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_at_start() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let proxy = Proxy::start(addr(BROKER), Mode::Refuse).await;
    let mut committed = Committed::new();
    write_rows(&outbox, &["early".to_string()], 50, &mut committed).await;
    let mut config = config(&outbox, &broker, &["early"]);
    config.amqp_url = amqp_via(&proxy).parse().expect("amqp url");
    let relay = start_relay(config).await;
    eventually("connection attempts", Duration::from_secs(10), || async {
        proxy.accepted() >= 2
    })
    .await;
    let (status, body) = relay.get("/readyz").await;
    assert_eq!(
        (status, body.contains("\"broker\":false")),
        (503, true),
        "{body}"
    );
    assert_eq!(relay.get("/livez").await.0, 200);
    assert_eq!(outbox.all_pending().await, 50);
    proxy.set(Mode::Pass);
    eventually(
        "ready once the broker appears",
        Duration::from_secs(20),
        || async { relay.get("/readyz").await.0 == 200 },
    )
    .await;
    assert_eq!(
        check_history(&outbox, &broker, &committed, Duration::from_secs(20)).await,
        0
    );
    relay.stop().await;
}

/// 7. The PostgreSQL backend holding a tenant is terminated mid-batch; another replica takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claiming_backend_terminated() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let proxy = Proxy::start(addr(BROKER), Mode::Delay(Duration::from_millis(5))).await;
    let batch_size = 300;
    let mut config = config(&outbox, &broker, &["held"]);
    config.amqp_url = amqp_via(&proxy).parse().expect("amqp url");
    config.batch_size = batch_size;
    config.max_in_flight = 10;
    config.max_backoff_ms = 500;
    let mut committed = Committed::new();
    write_rows(&outbox, &["held".to_string()], 3_000, &mut committed).await;
    let first = start_relay(config.clone()).await;
    let second = start_relay(config).await;
    eventually("a batch is in flight", Duration::from_secs(30), || async {
        broker.count() > 10
    })
    .await;

    let admin = pg_client().await;
    let lock_key = format!("{}.{}", outbox.schema, outbox.table);
    let terminated = std::sync::atomic::AtomicUsize::new(0);
    eventually(
        "the claiming backend is terminated",
        Duration::from_secs(20),
        || async {
            let rows = admin
                .query(
                    "SELECT pg_terminate_backend(l.pid) FROM pg_locks l
                 WHERE l.locktype = 'advisory' AND l.granted
                   AND l.classid::bigint = (hashtext($1)::bigint + 4294967296) % 4294967296
                   AND l.objid::bigint = (hashtext($2)::bigint + 4294967296) % 4294967296",
                    &[&lock_key, &"held"],
                )
                .await
                .unwrap();
            let n = rows.iter().filter(|r| r.get::<_, bool>(0)).count();
            terminated.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n > 0
        },
    )
    .await;
    let terminated = terminated.into_inner();
    assert_eq!(terminated, 1, "one backend held the tenant");
    let duplicates = check_history(&outbox, &broker, &committed, Duration::from_secs(40)).await;
    assert!(duplicates <= batch_size, "D: {duplicates}");
    let failed = sum(
        &first.get("/metrics").await.1,
        "outbox_sweeps_total",
        "outcome=\"failed\"",
    ) + sum(
        &second.get("/metrics").await.1,
        "outbox_sweeps_total",
        "outcome=\"failed\"",
    );
    assert!(failed >= 1.0, "H: the interrupted sweep failed");
    first.stop().await;
    second.stop().await;
}

/// 8. The database path stalls, then resets: sweeps fail by their deadline and the pool recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_path_stalls_and_resets() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let proxy = Proxy::start(addr(DATABASE), Mode::Pass).await;
    let mut config = config(&outbox, &broker, &["db"]);
    config.database_url = database_via(&proxy).parse().expect("database url");
    config.max_backoff_ms = 500;
    let mut committed = Committed::new();
    write_rows(&outbox, &["db".to_string()], 20, &mut committed).await;
    let relay = start_relay(config).await;
    eventually("first rows out", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;

    proxy.set(Mode::Stall);
    write_rows(&outbox, &["db".to_string()], 20, &mut committed).await;
    eventually(
        "H: /readyz reports the database down",
        Duration::from_secs(30),
        || async {
            let (status, body) = relay.get("/readyz").await;
            status == 503 && body.contains("\"database\":false")
        },
    )
    .await;
    let (status, body) = relay.get("/healthz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("\"status\":\"error\""), "{body}");
    proxy.reset();
    proxy.set(Mode::Pass);
    // R: within 30 s of the path clearing.
    assert_eq!(
        check_history(&outbox, &broker, &committed, Duration::from_secs(30)).await,
        0
    );

    // A reset of every database connection mid-run: the pool replaces them.
    write_rows(&outbox, &["db".to_string()], 20, &mut committed).await;
    proxy.reset();
    write_rows(&outbox, &["db".to_string()], 20, &mut committed).await;
    check_history(&outbox, &broker, &committed, Duration::from_secs(30)).await;
    eventually("ready again", Duration::from_secs(10), || async {
        relay.get("/readyz").await.0 == 200
    })
    .await;
    relay.stop().await;
}

/// 8b. The database path is cut for a while, then restored. Sweeps that met
/// the outage are no tenant's failure: no tenant backs off for it, and once
/// the path is back every tenant resumes within about one poll, not after a
/// back-off grown through the outage (with the old rule, 7 s of outage left
/// tenants waiting some 6 s more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tenant_resumes_within_a_poll_after_a_database_outage() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let proxy = Proxy::start(addr(DATABASE), Mode::Delay(Duration::from_millis(2))).await;
    let tenants = names("r", 4);
    let refs: Vec<&str> = tenants.iter().map(String::as_str).collect();
    let mut config = config(&outbox, &broker, &refs);
    config.database_url = database_via(&proxy).parse().expect("database url");
    config.batch_size = 10;
    config.max_backoff_ms = 60_000;
    let mut committed = Committed::new();
    write_rows(&outbox, &tenants, 2_000, &mut committed).await;
    let relay = start_relay(config).await;
    eventually(
        "every tenant is being relayed",
        Duration::from_secs(30),
        || async {
            let received = by_tenant(&broker.received());
            tenants.iter().all(|t| received.contains_key(t))
        },
    )
    .await;

    proxy.set(Mode::Refuse);
    proxy.reset();
    eventually(
        "H: /readyz reports the database down",
        Duration::from_secs(15),
        || async {
            let (status, body) = relay.get("/readyz").await;
            status == 503 && body.contains("\"database\":false")
        },
    )
    .await;
    eventually("sweeps met the outage", Duration::from_secs(15), || async {
        sum(
            &relay.get("/metrics").await.1,
            "outbox_sweeps_total",
            "outcome=\"failed\"",
        ) >= 1.0
    })
    .await;
    // The outage lasts a while: long enough for a back-off grown by it to
    // reach seconds.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let metrics = relay.get("/metrics").await.1;
    assert_eq!(
        sum(&metrics, "outbox_tenant_backoff_seconds", "tenant="),
        0.0,
        "no tenant backs off for an outage:\n{metrics}"
    );
    let mut before = Vec::new();
    for tenant in &tenants {
        before.push(outbox.pending(tenant).await);
    }
    assert!(before.iter().all(|&n| n > 0), "rows left: {before:?}");

    proxy.set(Mode::Pass);
    let restored = Instant::now();
    // Waited for well past the bound, so that a miss says by how much and
    // what the relay reported then.
    eventually(
        "every tenant resumes after the path's return",
        Duration::from_secs(30),
        || async {
            for (tenant, before) in tenants.iter().zip(&before) {
                if outbox.pending(tenant).await >= *before {
                    return false;
                }
            }
            true
        },
    )
    .await;
    let resumed = restored.elapsed();
    let metrics = relay.get("/metrics").await.1;
    let reported: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            [
                "outbox_database_up",
                "outbox_sweeps_total",
                "outbox_tenant_backoff",
            ]
            .iter()
            .any(|name| l.starts_with(name))
        })
        .collect();
    assert!(
        resumed < Duration::from_secs(2),
        "every tenant resumes within about one poll of the path's return, not {resumed:?}:\n{}",
        reported.join("\n")
    );
    let duplicates = check_history(&outbox, &broker, &committed, Duration::from_secs(60)).await;
    // What the outage cut off goes out again: at most one transaction per
    // tenant, its chained batches (confirmed, their marks not committed)
    // and the one read ahead, of `batch_size` (10) each.
    let bound = tenants.len() * (outbox_relay::relay::CHAINED_BATCHES + 1) * 10;
    assert!(duplicates <= bound, "D: {duplicates} > {bound}");
    println!("every tenant resumed {resumed:?} after the path returned");
    relay.stop().await;
}

/// 9. SIGTERM in the middle of a slow batch: exit 0 within the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_slow_batch() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let proxy = Proxy::start(addr(BROKER), Mode::Delay(Duration::from_millis(50))).await;
    let mut committed = Committed::new();
    write_rows(&outbox, &["slow".to_string()], 2_000, &mut committed).await;
    let grace = Duration::from_millis(1_500);
    let mut env = relay_env(&outbox, &broker, &["slow"]);
    set_env(&mut env, "OUTBOX_AMQP_URL", amqp_via(&proxy));
    set_env(&mut env, "OUTBOX_BATCH_SIZE", "2000");
    set_env(&mut env, "OUTBOX_MAX_IN_FLIGHT", "32");
    set_env(
        &mut env,
        "OUTBOX_SHUTDOWN_GRACE_MS",
        grace.as_millis().to_string(),
    );
    let (mut process, _) = spawn_relay(&env).await;
    eventually(
        "the slow batch is under way",
        Duration::from_secs(30),
        || async { broker.count() > 0 },
    )
    .await;
    let signalled = Instant::now();
    process.signal("TERM");
    let code = process.wait(grace + Duration::from_secs(5)).await;
    let took = signalled.elapsed();
    let output = process.output();
    assert_eq!(code, Some(0), "{output}");
    assert!(
        took < grace + Duration::from_secs(3),
        "exited {took:?} after SIGTERM, grace {grace:?}"
    );
    assert!(
        output.contains("abandoning sweeps"),
        "the batch could not finish in time:\n{output}"
    );
    assert!(
        outbox.all_pending().await > 0,
        "the abandoned batch was rolled back"
    );
    marked_were_received(&outbox, &broker).await;

    proxy.set(Mode::Pass);
    let relay = start_relay(config(&outbox, &broker, &["slow"])).await;
    let duplicates = check_history(&outbox, &broker, &committed, Duration::from_secs(40)).await;
    assert!(duplicates <= 2_000, "D: {duplicates}");
    relay.stop().await;
}

/// 11. Two writers of one tenant commit out of id order: the second inserts
/// and commits while the first (the lower id) is still open, without waiting
/// for it; its row waits pending until the first commits, and the consumer
/// receives the two in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_committed_out_of_id_order() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let relay = start_relay(config(&outbox, &broker, &["late"])).await;
    let mut first_writer = pg_client().await;
    let second_writer = pg_client().await;
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ('late', 'k', $1, '{{}}') RETURNING id",
        outbox.qualified()
    );
    let slow = first_writer.transaction().await.unwrap();
    let first: i64 = slow.query_one(&insert, &[&"first"]).await.unwrap().get(0);
    let second: i64 = tokio::time::timeout(
        Duration::from_secs(10),
        second_writer.query_one(&insert, &[&"second"]),
    )
    .await
    .expect("the second writer does not wait for the first")
    .unwrap()
    .get(0);
    assert!(first < second, "ids are drawn in order");
    let stays = outbox.row(second).await;
    assert!(!stays.published, "the committed higher id waits");
    // The relay has swept the tenant meanwhile (it is woken by the commit),
    // and the higher id is still held back.
    eventually(
        "the relay has looked at the tenant",
        Duration::from_secs(10),
        || async {
            let (_, text) = relay.get("/metrics").await;
            text.lines().any(|line| {
                line.starts_with("outbox_sweeps_total{") && line.contains("tenant=\"late\"")
            })
        },
    )
    .await;
    assert!(!outbox.row(second).await.published, "still held back");
    slow.commit().await.unwrap();
    let committed = Committed::from([("late".to_string(), vec![first, second])]);
    assert_eq!(
        check_history(&outbox, &broker, &committed, Duration::from_secs(20)).await,
        0
    );
    relay.stop().await;
}

/// 12. Pool pressure: 200 tenants, concurrency 4, the smallest pool allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_pressure_two_hundred_tenants() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let tenants = names("p", 200);
    let refs: Vec<&str> = tenants.iter().map(String::as_str).collect();
    let mut config = config(&outbox, &broker, &refs);
    config.concurrency = 4;
    config.pool_size = 5;
    config.poll_ms = 20;
    let mut committed = Committed::new();
    write_rows(&outbox, &tenants, 5, &mut committed).await;
    let relay = start_relay(config).await;
    assert_eq!(
        check_history(&outbox, &broker, &committed, Duration::from_secs(60)).await,
        0
    );
    let metrics = relay.get("/metrics").await.1;
    assert_eq!(
        sum(&metrics, "outbox_sweeps_total", "outcome=\"failed\""),
        0.0,
        "no pool-timeout storm"
    );
    assert_eq!(metric(&metrics, "outbox_database_up"), Some(1.0));
    relay.stop().await;
}

/// 13. Bad rows: an empty-string tenant in the table and a payload over the
/// limit. Each is refused plainly; nothing is lost; the others flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_are_refused_plainly() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let nameless = outbox.insert("", "k", "s", Some("{}"), None).await;
    let huge = outbox
        .insert("huge", "k", "s", Some(&"x".repeat(17 * 1024 * 1024)), None)
        .await;
    let mut committed = Committed::new();
    write_rows(&outbox, &["fine".to_string()], 30, &mut committed).await;
    let env = relay_env(&outbox, &broker, &["huge", "fine"]);
    let (mut process, http) = spawn_relay(&env).await;
    eventually(
        "the healthy tenant drains",
        Duration::from_secs(30),
        || async { outbox.pending("fine").await == 0 },
    )
    .await;
    eventually(
        "the huge row is refused",
        Duration::from_secs(30),
        || async { outbox.row(huge).await.attempts >= 1 },
    )
    .await;
    let row = outbox.row(huge).await;
    assert_eq!(
        row.last_error.as_deref(),
        Some("too_large: payload is 17825792 bytes, over max_payload_bytes (16777216)")
    );
    eventually(
        "the unconfigured tenant is reported",
        Duration::from_secs(10),
        || async {
            process
                .output()
                .contains("rows are pending for a tenant this relay is not configured for")
        },
    )
    .await;
    assert!(
        !outbox.row(nameless).await.published,
        "nothing lost: the nameless row stays pending"
    );
    eventually(
        "the refusal is logged with its reason",
        Duration::from_secs(10),
        || async { process.output().contains("\"reason\":\"too_large\"") },
    )
    .await;
    assert!(
        !process.output().contains("xxxxxxxx"),
        "no payload in the logs"
    );
    let (_, metrics) = http_get(http, "/metrics").await;
    assert!(
        metric(
            &metrics,
            "outbox_publish_failures_total{reason=\"too_large\",tenant=\"huge\"}"
        )
        .unwrap()
            >= 1.0
    );
    process.signal("TERM");
    assert_eq!(process.wait(Duration::from_secs(20)).await, Some(0));
    // Confirmed by the broker is not yet delivered to this test's consumer.
    eventually(
        "the healthy tenant's rows are received",
        Duration::from_secs(20),
        || async { by_tenant(&broker.received()).get("fine") == committed.get("fine") },
    )
    .await;
}

/// 10. Unroutable rows for one tenant, an oversized payload for another: only
/// those two stop, with attempts and last_error; the rest flow; once fixed
/// (a queue bound, the row repaired) they drain in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_tenants_stop_alone_and_drain_once_fixed() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["big.#", "f00.#", "f01.#", "f02.#"]).await;
    let mut committed = Committed::new();
    let big_first = outbox
        .insert("big", "k", "s", Some(&"x".repeat(4_096)), None)
        .await;
    committed.insert("big".into(), vec![big_first]);
    write_rows(
        &outbox,
        &["unroutable".to_string(), "big".to_string()],
        10,
        &mut committed,
    )
    .await;
    let flowing = names("f", 3);
    write_rows(&outbox, &flowing, 40, &mut committed).await;
    let mut config = config(
        &outbox,
        &broker,
        &["unroutable", "big", "f00", "f01", "f02"],
    );
    config.max_payload_bytes = 1_024;
    config.max_backoff_ms = 300;
    let relay = start_relay(config).await;
    for tenant in &flowing {
        eventually(
            "the other tenants flow",
            Duration::from_secs(20),
            || async { outbox.pending(tenant).await == 0 },
        )
        .await;
    }
    let unroutable_first = committed["unroutable"][0];
    eventually(
        "both refusals recorded",
        Duration::from_secs(20),
        || async {
            outbox.row(unroutable_first).await.attempts >= 1
                && outbox.row(big_first).await.attempts >= 1
        },
    )
    .await;
    assert!(
        outbox
            .row(unroutable_first)
            .await
            .last_error
            .unwrap()
            .starts_with("unroutable: ")
    );
    assert!(
        outbox
            .row(big_first)
            .await
            .last_error
            .unwrap()
            .starts_with("too_large: ")
    );
    assert_eq!(outbox.pending("unroutable").await, 10);
    assert_eq!(outbox.pending("big").await, 11);
    let (status, body) = relay.get("/healthz").await;
    assert_eq!(status, 200, "lag is still within max_lag_ms: {body}");
    assert!(
        body.contains("{\"tenant\":\"big\",\"lag_ms\":") && body.contains("\"pending\":true"),
        "{body}"
    );

    broker.bind("unroutable.#").await;
    outbox
        .execute(&format!(
            "UPDATE {{outbox}} SET payload = 'small' WHERE id = {big_first}"
        ))
        .await;
    assert_eq!(
        check_history(&outbox, &broker, &committed, Duration::from_secs(30)).await,
        0
    );
    relay.stop().await;
}

/// 13. A sidecar's probes: with the database and the broker black-holed from
/// the start (they accept TCP and never answer), and a check at start that
/// would wait for the database longer than a start-up probe's 30 s, `/livez`
/// answers 200 well within those 30 s and stays 200 past its own margin
/// (5 × `poll_ms` + 30 s without a scheduler turn); `/readyz` says 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn livez_answers_at_once_and_through_an_outage_past_its_margin() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let database = Proxy::start(addr(DATABASE), Mode::Stall).await;
    let amqp = Proxy::start(addr(BROKER), Mode::Stall).await;
    let mut env = relay_env(&outbox, &broker, &["a"]);
    let slow_connect = format!("{}?connect_timeout=40", database_via(&database));
    set_env(&mut env, "OUTBOX_DATABASE_URL", slow_connect);
    set_env(&mut env, "OUTBOX_AMQP_URL", amqp_via(&amqp));
    set_env(&mut env, "OUTBOX_PARK_AFTER_ATTEMPTS", "3");
    let spawned = Instant::now();
    let (mut process, http) = spawn_relay(&env).await;
    eventually("/livez answers 200", Duration::from_secs(30), || async {
        http_get(http, "/livez").await.0 == 200
    })
    .await;
    let alive_after = spawned.elapsed();
    assert!(
        alive_after < Duration::from_secs(20),
        "/livez 200 only {alive_after:?} after start"
    );
    // Past the margin counted from the relay's start, as from any turn.
    while spawned.elapsed() < Duration::from_secs(36) {
        let (status, body) = http_get(http, "/livez").await;
        assert_eq!(
            status,
            200,
            "{:?} into the outage: {body}",
            spawned.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (status, body) = http_get(http, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(database.accepted() > 0 && amqp.accepted() > 0);
    process.signal("TERM");
    let code = process.wait(Duration::from_secs(10)).await;
    assert_eq!(code, Some(0), "{}", process.output());
}

/// 14. The database ends the relay's idle pool connections (as a restart
/// does): the rows after it go out, and the log has none of the pool
/// library's own `Connection could not be recycled` lines, which say nothing
/// an operator can act on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_connections_ended_by_the_server_are_replaced_without_library_noise() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let name = format!("faults-recycle-{}", outbox.table);
    let mut env = relay_env(&outbox, &broker, &["a"]);
    let url = format!("postgres://postgres@{DATABASE}/test?application_name={name}");
    set_env(&mut env, "OUTBOX_DATABASE_URL", url);
    let (relay, _) = spawn_relay(&env).await;
    outbox.insert_many("a", 5).await;
    eventually("the first rows", Duration::from_secs(20), || async {
        broker.count() == 5
    })
    .await;
    let admin = pg_client().await;
    let terminated = admin
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&name],
        )
        .await
        .expect("terminate the relay's sessions");
    assert!(!terminated.is_empty(), "the relay's pool had sessions");
    outbox.insert_many("a", 5).await;
    eventually("the rows after it", Duration::from_secs(20), || async {
        broker.count() == 10
    })
    .await;
    let output = relay.output();
    assert!(
        !output.contains("could not be recycled"),
        "the pool's own lines:\n{output}"
    );
}
