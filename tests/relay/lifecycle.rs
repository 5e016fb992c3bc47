//! Parking and bringing rows back: a row refused for its own sake is parked
//! after `park_after_attempts` while its tenant goes on; the broker's trouble
//! parks nothing; `requeue`, `discard` and `replay` as an operator runs them,
//! checked on the consumer's side, in the table and in `/metrics`.

use std::net::SocketAddr;
use std::time::Duration;

use lapin::types::AMQPValue;
use serde_json::json;

use crate::proxy::{Mode, Proxy};
use crate::support::{
    Broker, Outbox, OwnedSchema, RelayProcess, by_tenant, config, eventually, lines_at, metric,
    pg_client, relay_command, relay_env, set_env, spawn_relay, start_relay,
};

/// Runs the binary with the test's table and exchange; exit code, stdout, stderr.
fn cli(outbox: &Outbox, broker: &Broker, args: &[&str]) -> (Option<i32>, String, String) {
    let mut command = relay_command();
    command.envs(relay_env(outbox, broker, &["any"]));
    let output = command.args(args).output().expect("the binary runs");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Whether row `id` is parked, and whether it is discarded.
async fn parked(outbox: &Outbox, id: i64) -> (bool, bool) {
    let row = outbox
        .client
        .query_one(
            &format!(
                "SELECT parked_at IS NOT NULL, discarded_at IS NOT NULL FROM {} WHERE id = $1",
                outbox.qualified()
            ),
            &[&id],
        )
        .await
        .expect("read the row");
    (row.get(0), row.get(1))
}

/// The tenant's rows neither published nor parked.
async fn pending(outbox: &Outbox, tenant: &str) -> i64 {
    outbox
        .client
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE tenant_id = $1 AND published_at IS NULL AND parked_at IS NULL",
                outbox.qualified()
            ),
            &[&tenant],
        )
        .await
        .expect("count pending rows")
        .get(0)
}

/// A row that no message can carry: its headers are not a JSON object.
async fn poison(outbox: &Outbox, tenant: &str) -> i64 {
    outbox
        .insert(
            tenant,
            "thing.changed",
            "p",
            Some("{}"),
            Some(json!([1, 2])),
        )
        .await
}

async fn gauge(addr: SocketAddr, tenant: &str) -> Option<f64> {
    let (_, text) = crate::support::http_get(addr, "/metrics").await;
    metric(&text, &format!("outbox_parked_rows{{tenant=\"{tenant}\"}}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_row_is_parked_after_n_attempts_and_its_tenant_goes_on() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let mut ids = outbox.insert_many("poisoned", 2).await;
    let bad = poison(&outbox, "poisoned").await;
    ids.extend(outbox.insert_many("poisoned", 3).await);
    let others = outbox.insert_many("other", 10).await;
    let mut config = config(&outbox, &broker, &["poisoned", "other"]);
    config.park_after_attempts = 3;
    config.max_backoff_ms = 100;
    let relay = start_relay(config.clone()).await;

    eventually(
        "the tenant goes on past its parked row",
        Duration::from_secs(20),
        || async { pending(&outbox, "poisoned").await == 0 },
    )
    .await;
    let row = outbox.row(bad).await;
    assert!(!row.published, "a parked row is never marked published");
    assert_eq!(
        row.attempts, 3,
        "parked when its attempts reached 3, not before"
    );
    assert!(
        row.last_error
            .as_deref()
            .unwrap_or_default()
            .starts_with("invalid: headers must be a JSON object"),
        "{row:?}"
    );
    assert_eq!(parked(&outbox, bad).await, (true, false));
    eventually("every row arrives", Duration::from_secs(20), || async {
        broker.count() == ids.len() + others.len()
    })
    .await;
    let received = by_tenant(&broker.received());
    assert_eq!(received["poisoned"], ids, "its later rows, in order, once");
    assert_eq!(received["other"], others, "the other tenant untouched");
    assert_eq!(outbox.row(others[0]).await.attempts, 0);
    eventually("the gauge counts it", Duration::from_secs(10), || async {
        gauge(relay.addr, "poisoned").await == Some(1.0)
    })
    .await;
    // Series carry information only: none, or 0.
    assert_eq!(gauge(relay.addr, "other").await.unwrap_or(0.0), 0.0);
    let (_, text) = relay.get("/metrics").await;
    assert_eq!(
        metric(
            &text,
            "outbox_publish_failures_total{reason=\"invalid\",tenant=\"poisoned\"}"
        ),
        Some(3.0)
    );
    relay.stop().await;

    // `status` shows it; the tenant is not blocked nor lagging.
    let (code, out, err) = cli(
        &outbox,
        &broker,
        &["status", "--json", "--tenants", "poisoned,other"],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(report["tenants"][0]["parked"], 1, "{out}");
    assert_eq!(report["tenants"][0]["pending"], 0, "{out}");
    assert_eq!(
        report["tenants"][0]["oldest_id"],
        serde_json::Value::Null,
        "{out}"
    );
    assert_eq!(report["tenants"][1]["parked"], 0, "{out}");
    let (_, table, _) = cli(&outbox, &broker, &["status", "--tenants", "poisoned"]);
    assert!(table.contains("1 parked row(s)"), "{table}");
    // With discovered tenants, a tenant whose only rows are parked is shown.
    let (code, out, err) = cli(&outbox, &broker, &["status", "--json", "--tenants", "*"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("json");
    let tenants = report["tenants"].as_array().expect("tenants");
    assert_eq!(tenants.len(), 1, "{out}");
    assert_eq!(tenants[0]["tenant"], "poisoned", "{out}");
    assert_eq!(tenants[0]["parked"], 1, "{out}");

    // The gauge comes from the database: a fresh relay reports it too.
    let relay = start_relay(config).await;
    eventually(
        "a restarted relay reports the parked row",
        Duration::from_secs(10),
        || async { gauge(relay.addr, "poisoned").await == Some(1.0) },
    )
    .await;
    assert_eq!(
        broker.count(),
        ids.len() + others.len(),
        "nothing sent again"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_brokers_trouble_parks_nothing_even_at_one_attempt() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let proxy = Proxy::start(
        "127.0.0.1:5672".parse().unwrap(),
        Mode::Delay(Duration::from_millis(1)),
    )
    .await;
    let mut config = config(&outbox, &broker, &["nacked"]);
    config.amqp_url = format!("amqp://guest:guest@{}/%2f", proxy.addr)
        .parse()
        .expect("amqp url");
    config.park_after_attempts = 1;
    config.max_backoff_ms = 100;
    config.confirm_timeout_ms = 500;
    let capped = broker.capped_queue("nacked.#", 1).await;
    let ids = outbox.insert_many("nacked", 5).await;
    let relay = start_relay(config).await;

    // Nacks: counted as attempts, never a reason to park.
    eventually("nacks are counted", Duration::from_secs(20), || async {
        outbox.row(ids[1]).await.attempts >= 2
    })
    .await;
    assert_eq!(parked(&outbox, ids[1]).await, (false, false));
    // The path stalls: confirms time out, the connection is lost.
    proxy.set(Mode::Stall);
    eventually("confirms time out", Duration::from_secs(20), || async {
        let (_, text) = relay.get("/metrics").await;
        metric(
            &text,
            "outbox_publish_failures_total{reason=\"timeout\",tenant=\"nacked\"}",
        )
        .unwrap_or(0.0)
            >= 1.0
    })
    .await;
    proxy.set(Mode::Refuse);
    proxy.reset();
    eventually("the broker is down", Duration::from_secs(10), || async {
        relay.get("/readyz").await.0 == 503
    })
    .await;
    assert_eq!(gauge(relay.addr, "nacked").await.unwrap_or(0.0), 0.0);
    for id in &ids {
        assert_eq!(parked(&outbox, *id).await, (false, false), "row {id}");
    }
    // The broker back and the queue emptied: everything goes, in order.
    proxy.set(Mode::Pass);
    broker.purge(&capped).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while outbox.pending("nacked").await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the tenant drains");
        broker.purge(&capped).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let received: Vec<i64> = by_tenant(&broker.received())["nacked"]
        .iter()
        .copied()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(received, ids, "every row, none parked");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_discard_and_replay_as_an_operator_runs_them() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let a1 = outbox.insert_many("t", 1).await[0];
    let fixed = poison(&outbox, "t").await;
    let a2 = outbox.insert_many("t", 1).await[0];
    let dropped = poison(&outbox, "t").await;
    let a3 = outbox.insert_many("t", 1).await[0];
    let mut config = config(&outbox, &broker, &["t"]);
    config.park_after_attempts = 1;
    let relay = start_relay(config).await;
    eventually(
        "both poison rows parked",
        Duration::from_secs(20),
        || async { pending(&outbox, "t").await == 0 },
    )
    .await;
    eventually("the rest arrives", Duration::from_secs(10), || async {
        broker.count() == 3
    })
    .await;
    assert_eq!(by_tenant(&broker.received())["t"], [a1, a2, a3]);

    // Bad arguments exit 2; nothing matched exits 1.
    assert_eq!(cli(&outbox, &broker, &["requeue"]).0, Some(2));
    let both = ["requeue", "--id", "1", "--tenant", "t"];
    assert_eq!(cli(&outbox, &broker, &both).0, Some(2));
    let (code, _, err) = cli(&outbox, &broker, &["discard", "--id", &a1.to_string()]);
    assert_eq!(code, Some(1), "a published row is not parked: {err}");
    assert!(err.contains("no parked row matched"), "{err}");
    assert_eq!(
        cli(&outbox, &broker, &["requeue", "--tenant", "nobody"]).0,
        Some(1)
    );

    // The operator fixes a row and requeues it: it goes out next.
    outbox
        .execute(&format!(
            "UPDATE {{outbox}} SET headers = NULL WHERE id = {fixed}"
        ))
        .await;
    let (code, out, err) = cli(&outbox, &broker, &["requeue", "--id", &fixed.to_string()]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains(&format!("id {fixed} (tenant \"t\")")), "{out}");
    eventually(
        "the requeued row arrives",
        Duration::from_secs(20),
        || async { broker.count() == 4 },
    )
    .await;
    assert_eq!(by_tenant(&broker.received())["t"], [a1, a2, a3, fixed]);
    // A row reaches the queue before the relay's mark of it commits.
    eventually(
        "the requeued row is marked published",
        Duration::from_secs(10),
        || async { outbox.row(fixed).await.published },
    )
    .await;

    // The other is discarded: recorded, never sent, no longer counted.
    let (code, out, err) = cli(&outbox, &broker, &["discard", "--id", &dropped.to_string()]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains(&format!("id {dropped}")), "{out}");
    assert_eq!(parked(&outbox, dropped).await, (true, true));
    assert!(!outbox.row(dropped).await.published);
    let (code, _, _) = cli(&outbox, &broker, &["requeue", "--id", &dropped.to_string()]);
    assert_eq!(code, Some(1), "a discarded row is not requeued");
    eventually("the gauge drops to 0", Duration::from_secs(10), || async {
        gauge(relay.addr, "t").await == Some(0.0)
    })
    .await;
    relay.stop().await;

    // Replay: the published rows again, in id order, marked, the discarded
    // one skipped; the table untouched.
    let before = outbox.published_ids().await;
    let to = ["--to-id", "0"];
    let (code, _, err) = cli(
        &outbox,
        &broker,
        &[&["replay", "--tenant", "t", "--from-id", "5"][..], &to[..]].concat(),
    );
    assert_eq!(code, Some(2), "--to-id below --from-id: {err}");
    let (code, _, _) = cli(
        &outbox,
        &broker,
        &["replay", "--tenant", "nobody", "--from-id", "1"],
    );
    assert_eq!(code, Some(1), "nothing matched");
    let (code, out, err) = cli(
        &outbox,
        &broker,
        &["replay", "--tenant", "t", "--from-id", &a1.to_string()],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("replayed 4 rows"), "{out}");
    assert!(out.contains("deduplicate on message_id"), "{out}");
    eventually(
        "the replayed rows arrive",
        Duration::from_secs(10),
        || async { broker.count() == 8 },
    )
    .await;
    let replayed: Vec<_> = broker.received().into_iter().skip(4).collect();
    let ids: Vec<i64> = replayed.iter().map(|m| m.id).collect();
    assert_eq!(
        ids,
        [a1, fixed, a2, a3],
        "in id order, the discarded row skipped"
    );
    for message in &replayed {
        assert_eq!(
            message.header("outbox-replay"),
            Some(&AMQPValue::Boolean(true))
        );
        assert_eq!(
            message
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.as_str().to_string()),
            Some(message.id.to_string())
        );
        assert_eq!(
            message.header("outbox-id"),
            Some(&AMQPValue::LongLongInt(message.id))
        );
    }
    let (code, out, _) = cli(
        &outbox,
        &broker,
        &[
            "replay",
            "--tenant",
            "t",
            "--from-id",
            &a2.to_string(),
            "--to-id",
            &a2.to_string(),
        ],
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("replayed 1 row of"), "{out}");
    assert_eq!(outbox.published_ids().await, before, "replay marks nothing");
    assert!(!outbox.row(dropped).await.published);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_the_parking_columns_relays_and_refuses_to_park() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    outbox
        .execute(
            "ALTER TABLE {outbox} DROP COLUMN parked_at, DROP COLUMN discarded_at; \
             CREATE INDEX outbox_message_pending ON {outbox} (tenant_id, id) \
             WHERE published_at IS NULL",
        )
        .await;
    let ids = outbox.insert_many("old", 5).await;
    // park_after_attempts = 0: relays as before.
    let relay = start_relay(config(&outbox, &broker, &["old"])).await;
    eventually("the rows arrive", Duration::from_secs(20), || async {
        broker.count() == 5
    })
    .await;
    assert_eq!(by_tenant(&broker.received())["old"], ids);
    relay.stop().await;
    let (code, _, err) = cli(&outbox, &broker, &["requeue", "--tenant", "old"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("no columns parked_at and discarded_at"),
        "{err}"
    );
    // park_after_attempts set: the relay stops at start, saying how to fix it.
    let mut command = relay_command();
    command.envs(relay_env(&outbox, &broker, &["old"]));
    command.env("OUTBOX_PARK_AFTER_ATTEMPTS", "3");
    let output = command.output().expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("park_after_attempts = 3"), "{stderr}");
    assert!(stderr.contains("outbox-relay migrate"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_upgrades_a_partitioned_table_with_rows() {
    let client = crate::support::pg_client().await;
    let schema = crate::support::unique("part");
    let _owned = OwnedSchema::new(crate::support::DATABASE_URL, &schema);
    client
        .batch_execute(&format!(
            "CREATE SCHEMA \"{schema}\";
             CREATE TABLE \"{schema}\".outbox_message (
                 id BIGINT GENERATED BY DEFAULT AS IDENTITY, tenant_id TEXT NOT NULL,
                 kind TEXT NOT NULL, subject_id TEXT NOT NULL, payload TEXT, headers JSONB,
                 occurred_at TIMESTAMPTZ NOT NULL DEFAULT now(), published_at TIMESTAMPTZ,
                 attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT,
                 PRIMARY KEY (tenant_id, id)) PARTITION BY LIST (tenant_id);
             CREATE TABLE \"{schema}\".outbox_a PARTITION OF \"{schema}\".outbox_message FOR VALUES IN ('a');
             CREATE TABLE \"{schema}\".outbox_rest PARTITION OF \"{schema}\".outbox_message DEFAULT;
             INSERT INTO \"{schema}\".outbox_message (tenant_id, kind, subject_id) VALUES ('a', 'k', 's'), ('b', 'k', 's');"
        ))
        .await
        .expect("a partitioned outbox table");
    let mut command = relay_command();
    command.envs([
        ("OUTBOX_TENANTS", "a"),
        ("OUTBOX_DATABASE_URL", crate::support::DATABASE_URL),
        ("OUTBOX_SCHEMA", schema.as_str()),
    ]);
    let output = command.arg("migrate").output().expect("the binary runs");
    let log = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{log}");
    assert!(log.contains("partitioned"), "{log}");
    let index: String = client
        .query_one(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'outbox_message_pending'",
            &[&schema],
        )
        .await
        .expect("the pending index")
        .get(0);
    assert!(
        index.contains("WHERE ((published_at IS NULL) AND (parked_at IS NULL))"),
        "{index}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeued_row_goes_out_at_once_not_at_the_next_poll() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let poisoned = poison(&outbox, "t").await;
    let mut config = config(&outbox, &broker, &["t"]);
    config.park_after_attempts = 1;
    // After the first poll (at start, which parks the row), none during the test.
    config.poll_ms = 60_000;
    let relay = start_relay(config).await;
    eventually("the row parked", Duration::from_secs(20), || async {
        pending(&outbox, "t").await == 0
    })
    .await;
    eventually(
        "the relay LISTENs for wake-ups",
        Duration::from_secs(10),
        || async {
            let (_, text) = relay.get("/metrics").await;
            metric(&text, "outbox_wakeup_connected") == Some(1.0)
        },
    )
    .await;
    outbox
        .execute(&format!(
            "UPDATE {{outbox}} SET headers = NULL WHERE id = {poisoned}"
        ))
        .await;
    let (code, out, err) = cli(
        &outbox,
        &broker,
        &["requeue", "--id", &poisoned.to_string()],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    eventually(
        "the requeued row arrives, woken by the requeue's notification",
        Duration::from_secs(20),
        || async { broker.count() == 1 },
    )
    .await;
    relay.stop().await;
    assert_eq!(by_tenant(&broker.received())["t"], [poisoned]);
}

/// `tail` and `replay` against a broker that accepts the connection and never
/// answers: each ends within the connect deadline (10 s), exit 1, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_and_replay_end_rather_than_hang_on_a_silent_broker() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let silent = Proxy::start("127.0.0.1:5672".parse().unwrap(), Mode::Stall).await;
    let url = format!("amqp://guest:guest@{}/%2f", silent.addr);
    let runs = [
        vec!["tail"],
        vec!["replay", "--tenant", "t", "--from-id", "1"],
    ]
    .map(|args| {
        let mut command = relay_command();
        command
            .envs(relay_env(&outbox, &broker, &["any"]))
            .env("OUTBOX_AMQP_URL", &url)
            .args(args);
        tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let output = command.output().expect("the binary runs");
            (output, started.elapsed())
        })
    });
    for run in runs {
        let (output, took) = run.await.expect("the command");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("did not answer within 10 s"), "{stderr}");
        assert!(took < Duration::from_secs(15), "took {took:?}: {stderr}");
    }
}

/// An outbox table dropped after `migrate` ran keeps its record of applied
/// migrations; `migrate` then finds the table gone, forgets that record and
/// creates the table again, with its trigger, rather than calling it up to
/// date.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_creates_a_dropped_table_again() {
    let outbox = Outbox::create().await;
    outbox.execute("DROP TABLE {outbox}").await;
    let mut command = relay_command();
    command.envs([
        ("OUTBOX_TENANTS", "a"),
        ("OUTBOX_DATABASE_URL", crate::support::DATABASE_URL),
        ("OUTBOX_SCHEMA", outbox.schema.as_str()),
        ("OUTBOX_TABLE", outbox.table.as_str()),
    ]);
    let output = command.arg("migrate").output().expect("the binary runs");
    let log = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{log}");
    assert!(log.contains("dropped since its migrations ran"), "{log}");
    assert!(!log.contains("up to date"), "{log}");
    let triggers: i64 = outbox
        .client
        .query_one(
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass($1) AND NOT tgisinternal",
            &[&outbox.qualified()],
        )
        .await
        .expect("the table's triggers")
        .get(0);
    assert!(triggers >= 1, "the commit-order trigger is back");
    assert_eq!(outbox.insert_many("a", 2).await.len(), 2);
}

/// A broker that stops answering with rows pending: at the stop a sweep's
/// confirms never come (the drain ends at the grace period), and the
/// connection's close, which would wait for an answer, gets only what is
/// left of it (at least 0.5 s): the relay stops within about the grace
/// period, not 3 s past it. Nothing is marked that the broker did not
/// confirm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_a_silent_broker_ends_within_the_grace_period() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap(), Mode::Pass).await;
    let mut config = config(&outbox, &broker, &["silent"]);
    config.amqp_url = format!("amqp://guest:guest@{}/%2f", proxy.addr)
        .parse()
        .expect("amqp url");
    config.shutdown_grace_ms = 1_000;
    config.confirm_timeout_ms = 60_000;
    let relay = start_relay(config).await;
    outbox.insert_many("silent", 1).await;
    eventually("the broker has a row", Duration::from_secs(20), || async {
        broker.count() == 1
    })
    .await;
    proxy.set(Mode::Stall);
    let ids = outbox.insert_many("silent", 50).await;
    let started = std::time::Instant::now();
    relay.stop().await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(2_500),
        "stopped {took:?} after the signal, with a grace period of 1 s"
    );
    assert_eq!(
        outbox.pending("silent").await,
        ids.len() as i64,
        "nothing marked without a confirm"
    );
}

/// A sweep running when the relay is told to stop settles the batches it
/// has read and takes no other, however long its tenant's backlog: here its
/// confirms are held back (the broker's path pauses) until the relay is
/// draining, and then at most its first batch and the one read ahead of it
/// (2 × 50 rows) are marked, not the 16 batches a claim may chain. Every row
/// marked reached the consumer; the rest stay pending for the next relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_running_at_shutdown_takes_no_further_batch() {
    let Proxied {
        outbox,
        broker,
        proxy,
        mut relay,
    } = relay_through_a_proxy(
        "long",
        &[("OUTBOX_BATCH_SIZE", "50"), ("OUTBOX_MAX_IN_FLIGHT", "50")],
    )
    .await;
    proxy.set(Mode::Hold);
    let rows = outbox.insert_many("long", 2_000).await.len() as i64;
    // The claim is taken once the tenant's lock is held: its first batch is
    // read, and goes out into the stalled path.
    until_claimed(&outbox, "long").await;
    relay.signal("TERM");
    eventually("the relay drains", Duration::from_secs(20), || {
        let draining = relay.output().contains("draining running sweeps");
        async move { draining }
    })
    .await;
    proxy.set(Mode::Pass);
    assert_eq!(
        relay.wait(Duration::from_secs(30)).await,
        Some(0),
        "{}",
        relay.output()
    );
    let marked = rows - outbox.pending("long").await;
    assert!(
        (1..=100).contains(&marked),
        "marked {marked} rows: the sweep settles what it sent, and only its first batch \
         and the one read ahead; output:\n{}",
        relay.output()
    );
    eventually(
        "every row marked reached the consumer",
        Duration::from_secs(10),
        || async { broker.count() == 1 + marked as usize },
    )
    .await;
}

/// A broker connection lost and regained is told once, in the relay's own
/// words: one WARN with the reason, one INFO on reconnecting, and no line
/// of the AMQP client's (lapin would add ERROR lines of its own, a debug
/// dump of the frame among them, for a loss the relay rides through). Lost
/// with a sweep in flight, the sweep's WARN names the connection, not a
/// refused row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_broker_connection_is_told_once_in_the_relays_words() {
    let Proxied {
        outbox,
        broker,
        proxy,
        mut relay,
    } = relay_through_a_proxy("a", &[]).await;
    proxy.reset();
    relay.until_said("INFO", "connected to the broker", 2).await;
    outbox.insert_many("a", 1).await;
    eventually(
        "the next row is relayed",
        Duration::from_secs(20),
        || async { broker.count() == 2 && outbox.pending("a").await == 0 },
    )
    .await;
    let output = relay.output();
    assert_eq!(lines_at(&output, "ERROR"), Vec::<&str>::new(), "{output}");
    let warnings = lines_at(&output, "WARN");
    assert_eq!(warnings.len(), 1, "{output}");
    assert!(
        warnings[0].contains("broker connection lost; reconnecting"),
        "{output}"
    );

    // Lost again with a sweep in flight: the sweep's failure is said to be
    // the connection's, and its rows go again.
    proxy.set(Mode::Hold);
    let ids = outbox.insert_many("a", 10).await;
    until_claimed(&outbox, "a").await;
    proxy.reset();
    proxy.set(Mode::Pass);
    eventually("the rows go again", Duration::from_secs(30), || async {
        outbox.pending("a").await == 0 && broker.count() >= 2 + ids.len()
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(30)).await, Some(0));
    let output = relay.output();
    assert_eq!(lines_at(&output, "ERROR"), Vec::<&str>::new(), "{output}");
    assert_eq!(relay.said("WARN", "broker connection lost"), 2, "{output}");
    assert_eq!(
        relay.said(
            "WARN",
            "sweep failed: the channel to the broker closed or went silent with this row in flight"
        ),
        1,
        "{output}"
    );
    assert_eq!(relay.said("WARN", "row refused"), 0, "{output}");
}

/// Waits until a relay holds `tenant`'s claim (its advisory lock).
async fn until_claimed(outbox: &Outbox, tenant: &str) {
    let client = pg_client().await;
    let held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                AND objsubid = 2 \
                AND classid::bigint = (hashtext($1)::bigint & 4294967295) \
                AND objid::bigint = (hashtext($2)::bigint & 4294967295)";
    let key = format!("{}.{}", outbox.schema, outbox.table);
    eventually(
        "the relay claims the tenant",
        Duration::from_secs(20),
        || {
            let (client, key) = (&client, &key);
            async move {
                let held: i64 = client
                    .query_one(held, &[key, &tenant])
                    .await
                    .expect("locks")
                    .get(0);
                held == 1
            }
        },
    )
    .await;
}

/// A relay binary of tenant `tenant` (with `env` besides the test's own)
/// whose broker connection goes through a proxy, once it has relayed a first
/// row: its publishing channel is open.
struct Proxied {
    outbox: Outbox,
    broker: Broker,
    proxy: Proxy,
    relay: RelayProcess,
}

async fn relay_through_a_proxy(tenant: &str, env: &[(&str, &str)]) -> Proxied {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap(), Mode::Pass).await;
    let mut vars = relay_env(&outbox, &broker, &[tenant]);
    set_env(
        &mut vars,
        "OUTBOX_AMQP_URL",
        format!("amqp://guest:guest@{}/%2f", proxy.addr),
    );
    for (key, value) in env {
        set_env(&mut vars, key, *value);
    }
    let (relay, _) = spawn_relay(&vars).await;
    outbox.insert_many(tenant, 1).await;
    eventually(
        "the first row is relayed",
        Duration::from_secs(20),
        || async { broker.count() == 1 && outbox.pending(tenant).await == 0 },
    )
    .await;
    Proxied {
        outbox,
        broker,
        proxy,
        relay,
    }
}
