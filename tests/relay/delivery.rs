//! What a user checks first: rows arrive, once, in order, as the envelope says,
//! and are marked published; batches chain; replicas take turns; health.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use lapin::types::AMQPValue;
use serde_json::json;

use crate::support::{Broker, Outbox, by_tenant, config, eventually, metric, start_relay};

fn long_string(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => panic!("expected a string header, found {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_three_tenants_arrive_once_in_order_with_every_envelope_field() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let tenants = ["acme", "globex", "initech"];
    let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for round in 0..40 {
        for tenant in tenants {
            let id = outbox
                .insert(
                    tenant,
                    "order.created",
                    &format!("o-{round}"),
                    Some(&format!("{{\"round\":{round}}}")),
                    Some(json!({"traceparent": format!("00-{round}-01"), "attempt": round, "replay": false, "outbox-id": "forged"})),
                )
                .await;
            expected.entry(tenant.to_string()).or_default().push(id);
        }
    }
    let tombstone = outbox
        .insert("acme", "order.deleted", "o-0", None, None)
        .await;
    expected.get_mut("acme").unwrap().push(tombstone);

    let relay = start_relay(config(&outbox, &broker, &tenants)).await;
    eventually(
        "every row marked published",
        Duration::from_secs(30),
        || async { outbox.all_pending().await == 0 },
    )
    .await;
    eventually("every row received", Duration::from_secs(10), || async {
        broker.count() >= 121
    })
    .await;
    relay.stop().await;

    let received = broker.received();
    assert_eq!(received.len(), 121, "each row exactly once");
    assert_eq!(by_tenant(&received), expected, "per-tenant outbox order");

    let published: HashSet<i64> = outbox.published_ids().await.into_iter().collect();
    for message in &received {
        assert!(
            published.contains(&message.id),
            "row {} is marked published",
            message.id
        );
        assert!(!message.redelivered, "no fault, no redelivery");
        let p = &message.properties;
        let tenant = message.tenant();
        assert_eq!(
            p.message_id().as_ref().unwrap().as_str(),
            message.id.to_string()
        );
        assert_eq!(*p.delivery_mode(), Some(2), "persistent");
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(p.app_id().as_ref().unwrap().as_str(), "outbox-relay");
        assert!(
            p.timestamp().unwrap() > 1_700_000_000,
            "occurred_at in Unix seconds"
        );
        assert_eq!(
            message.header("outbox-id"),
            Some(&AMQPValue::LongLongInt(message.id)),
            "row headers never override"
        );
        let occurred = long_string(message.header("outbox-occurred-at").unwrap());
        assert!(
            occurred.ends_with('Z') && occurred.contains('T'),
            "RFC 3339 UTC: {occurred}"
        );
        let parsed =
            time::OffsetDateTime::parse(&occurred, &time::format_description::well_known::Rfc3339)
                .unwrap();
        assert_eq!(parsed.unix_timestamp() as u64, p.timestamp().unwrap());
        if message.id == tombstone {
            assert!(message.body.is_empty(), "a tombstone has an empty body");
            assert_eq!(
                message.header("outbox-tombstone"),
                Some(&AMQPValue::Boolean(true))
            );
            assert_eq!(p.kind().as_ref().unwrap().as_str(), "order.deleted");
            assert_eq!(message.routing_key, "acme.order.deleted");
            assert_eq!(
                long_string(message.header("outbox-subject-id").unwrap()),
                "o-0"
            );
            continue;
        }
        let body: serde_json::Value = serde_json::from_slice(&message.body).unwrap();
        let round = body["round"].as_i64().unwrap();
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "order.created");
        assert_eq!(message.routing_key, format!("{tenant}.order.created"));
        assert_eq!(
            long_string(message.header("outbox-subject-id").unwrap()),
            format!("o-{round}")
        );
        assert_eq!(
            long_string(message.header("traceparent").unwrap()),
            format!("00-{round}-01")
        );
        assert_eq!(
            message.header("attempt"),
            Some(&AMQPValue::LongLongInt(round))
        );
        assert_eq!(message.header("replay"), Some(&AMQPValue::Boolean(false)));
        assert_eq!(message.header("outbox-tombstone"), None);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_is_followed_at_once_by_the_next() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let ids = outbox.insert_many("busy", 95).await;
    let mut config = config(&outbox, &broker, &["busy"]);
    config.batch_size = 10;
    config.max_in_flight = 10;
    // One poll at start, the next a minute away: only chaining full batches
    // can drain 95 rows before then.
    config.poll_ms = 60_000;
    let relay = start_relay(config).await;
    eventually(
        "95 rows published without a second poll",
        Duration::from_secs(20),
        || async { outbox.pending("busy").await == 0 },
    )
    .await;
    let (_, metrics) = relay.get("/metrics").await;
    relay.stop().await;
    assert_eq!(
        metric(&metrics, "outbox_published_total{tenant=\"busy\"}"),
        Some(95.0),
        "every row counted once:\n{metrics}"
    );
    assert_eq!(
        metric(&metrics, "outbox_published_total{tenant=\"busy\"}"),
        Some(95.0),
        "{metrics}"
    );
    eventually("all received", Duration::from_secs(10), || async {
        broker.count() == 95
    })
    .await;
    assert_eq!(by_tenant(&broker.received())["busy"], ids);
}

/// While a tenant is alone, a full batch's successor is read ahead and sent
/// in the same transaction: consecutive batches still arrive in order, each
/// row once, and a refused row in the second batch stops the tenant there,
/// with the first batch marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consecutive_full_batches_arrive_in_order_once_and_stop_at_a_refused_row() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["busy.thing.#"]).await;
    let mut ids = outbox.insert_many("busy", 14).await;
    // The fifth row of the second batch routes nowhere: refused.
    let stray = outbox
        .insert("busy", "stray", "s-stray", Some("{}"), None)
        .await;
    ids.push(stray);
    ids.extend(outbox.insert_many("busy", 45).await);
    let mut config = config(&outbox, &broker, &["busy"]);
    config.batch_size = 10;
    // One in flight: no row behind the refused one reaches the queue first
    // (see docs/guarantees.md), so each arrives exactly once.
    config.max_in_flight = 1;
    config.max_backoff_ms = 300;
    let relay = start_relay(config).await;

    eventually(
        "the refusal is recorded",
        Duration::from_secs(20),
        || async { outbox.row(stray).await.attempts >= 1 },
    )
    .await;
    for id in &ids[..14] {
        assert!(outbox.row(*id).await.published, "the prefix is marked");
    }
    for id in &ids[15..] {
        assert!(
            !outbox.row(*id).await.published,
            "nothing after the refused row is marked"
        );
    }
    broker.bind("busy.#").await;
    eventually("the tenant drains", Duration::from_secs(20), || async {
        outbox.pending("busy").await == 0
    })
    .await;
    eventually("all received", Duration::from_secs(10), || async {
        broker.count() == ids.len()
    })
    .await;
    let (_, metrics) = relay.get("/metrics").await;
    relay.stop().await;
    assert_eq!(
        by_tenant(&broker.received())["busy"],
        ids,
        "each once, in order"
    );
    assert_eq!(
        metric(&metrics, "outbox_published_total{tenant=\"busy\"}"),
        Some(ids.len() as f64),
        "every row counted once:\n{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_over_one_table_never_publish_a_row_twice() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let tenants: Vec<String> = (0..8).map(|i| format!("tenant-{i}")).collect();
    let names: Vec<&str> = tenants.iter().map(String::as_str).collect();
    let mut config = config(&outbox, &broker, &names);
    config.batch_size = 16;
    config.max_in_flight = 16;
    config.poll_ms = 10;
    let first = start_relay(config.clone()).await;
    let second = start_relay(config).await;

    // Rows are written while both relays run.
    let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for _ in 0..10 {
        for tenant in &names {
            expected
                .entry(tenant.to_string())
                .or_default()
                .extend(outbox.insert_many(tenant, 25).await);
        }
    }
    eventually("every row published", Duration::from_secs(60), || async {
        outbox.all_pending().await == 0
    })
    .await;
    eventually("every row received", Duration::from_secs(10), || async {
        broker.count() >= 2000
    })
    .await;
    let (_, first_metrics) = first.get("/metrics").await;
    let (_, second_metrics) = second.get("/metrics").await;
    first.stop().await;
    second.stop().await;

    let received = broker.received();
    let unique: HashSet<i64> = received.iter().map(|r| r.id).collect();
    assert_eq!(received.len(), unique.len(), "no row was published twice");
    assert_eq!(
        by_tenant(&received),
        expected,
        "each tenant in order, all rows"
    );
    let published_by = |metrics: &str| -> u64 {
        metrics
            .lines()
            .filter(|l| l.starts_with("outbox_published_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    assert_eq!(
        published_by(&first_metrics) + published_by(&second_metrics),
        2000
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_turns_503_past_max_lag_and_200_once_published() {
    let outbox = Outbox::create().await;
    // Nothing is bound for `late` yet: its rows cannot leave.
    let broker = Broker::create(&["ontime.#"]).await;
    let mut config = config(&outbox, &broker, &["ontime", "late"]);
    config.max_lag_ms = 300;
    config.max_backoff_ms = 200;
    let relay = start_relay(config).await;

    let (status, body) = relay.get("/healthz").await;
    assert_eq!(status, 200, "{body}");
    let health: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(health["status"], "ok");
    assert_eq!(health["max_lag_ms"], 300);
    assert_eq!(health["error"], serde_json::Value::Null);
    assert_eq!(
        health["tenants"],
        json!([{"tenant": "ontime", "lag_ms": 0, "pending": false}, {"tenant": "late", "lag_ms": 0, "pending": false}])
    );
    // Connected first: a relay still connecting holds every tenant up alike,
    // which is not what this test is about.
    eventually("/readyz answers 200", Duration::from_secs(15), || async {
        relay.get("/readyz").await.0 == 200
    })
    .await;

    outbox
        .insert("late", "thing.changed", "s", Some("{}"), None)
        .await;
    outbox
        .insert("ontime", "thing.changed", "s", Some("{}"), None)
        .await;
    // The other tenant goes out while `late` is stuck (however slow the
    // machine: what matters is that it is not held up behind `late`).
    eventually("ontime goes out", Duration::from_secs(15), || async {
        outbox.pending("ontime").await == 0
    })
    .await;
    eventually(
        "/healthz answers 503 lagging",
        Duration::from_secs(15),
        || async {
            let (status, body) = relay.get("/healthz").await;
            status == 503 && body.contains("\"status\":\"lagging\"")
        },
    )
    .await;
    let (_, body) = relay.get("/healthz").await;
    let health: serde_json::Value = serde_json::from_str(&body).unwrap();
    let late = &health["tenants"][1];
    assert_eq!(late["tenant"], "late");
    assert_eq!(late["pending"], true);
    assert!(late["lag_ms"].as_i64().unwrap() > 300, "{body}");
    assert_eq!(
        health["tenants"][0]["pending"], false,
        "the other tenant was not held up: {body}"
    );
    // The gauge is the poll's, up to a poll older than /healthz's answer.
    eventually(
        "the lag gauge passes max_lag_ms too",
        Duration::from_secs(15),
        || async {
            let (_, metrics) = relay.get("/metrics").await;
            metric(&metrics, "outbox_lag_seconds{tenant=\"late\"}").is_some_and(|lag| lag > 0.3)
        },
    )
    .await;

    broker.bind("late.#").await;
    eventually(
        "/healthz answers 200 again",
        Duration::from_secs(15),
        || async { relay.get("/healthz").await.0 == 200 },
    )
    .await;
    // Marked once confirmed: a row may be seen before its mark commits.
    eventually("every row marked", Duration::from_secs(10), || async {
        outbox.all_pending().await == 0
    })
    .await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_livez_and_readyz_answer() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    outbox.insert_many("a", 3).await;
    let relay = start_relay(config(&outbox, &broker, &["a"])).await;
    eventually("ready", Duration::from_secs(15), || async {
        relay.get("/readyz").await.0 == 200
    })
    .await;
    let (_, ready) = relay.get("/readyz").await;
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&ready).unwrap(),
        json!({"ready": true, "database": true, "broker": true})
    );
    assert_eq!(relay.get("/livez").await.0, 200);
    eventually("published", Duration::from_secs(15), || async {
        outbox.pending("a").await == 0
    })
    .await;
    let (status, metrics) = relay.get("/metrics").await;
    assert_eq!(status, 200);
    let expected: &[(&str, Option<f64>)] = &[
        ("outbox_published_total{tenant=\"a\"}", Some(3.0)),
        (
            "outbox_publish_failures_total{tenant=\"a\",reason=\"nack\"}",
            None,
        ),
        // Failure and back-off series appear with a first failure.
        (
            "outbox_publish_failures_total{reason=\"nack\",tenant=\"a\"}",
            None,
        ),
        ("outbox_sweeps_total{outcome=\"failed\",tenant=\"a\"}", None),
        ("outbox_delivery_delay_seconds_count", Some(3.0)),
        ("outbox_tenant_backoff_seconds{tenant=\"a\"}", None),
        ("outbox_amqp_connected", Some(1.0)),
        ("outbox_database_up", Some(1.0)),
        (
            concat!(
                "outbox_build_info{version=\"",
                env!("CARGO_PKG_VERSION"),
                "\"}"
            ),
            Some(1.0),
        ),
    ];
    for (series, value) in expected {
        assert_eq!(metric(&metrics, series), *value, "{series} in\n{metrics}");
    }
    for described in [
        "# TYPE outbox_publish_failures_total counter",
        "# TYPE outbox_tenant_backoff_seconds gauge",
    ] {
        assert!(metrics.contains(described), "{described} in\n{metrics}");
    }
    assert!(
        metric(
            &metrics,
            "outbox_sweeps_total{outcome=\"idle\",tenant=\"a\"}"
        )
        .unwrap()
            >= 1.0
    );
    assert!(metric(&metrics, "outbox_lag_seconds{tenant=\"a\"}").is_some());
    assert!(
        metric(
            &metrics,
            "outbox_sweep_duration_seconds_count{outcome=\"idle\"}"
        )
        .unwrap()
            >= 1.0
    );
    for name in [
        "outbox_sweeps_total",
        "outbox_sweep_duration_seconds",
        "outbox_delivery_delay_seconds",
        "outbox_lag_seconds",
    ] {
        assert!(metrics.contains(&format!("# TYPE {name} ")), "{name}");
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_is_not_fatal_and_not_ready() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    outbox.insert_many("a", 2).await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut config = config(&outbox, &broker, &["a"]);
    config.amqp_url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
        .parse()
        .expect("amqp url");
    let relay = start_relay(config).await;
    eventually("database seen up", Duration::from_secs(10), || async {
        metric(&relay.get("/metrics").await.1, "outbox_database_up") == Some(1.0)
    })
    .await;
    let (status, body) = relay.get("/readyz").await;
    assert_eq!(status, 503);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap(),
        json!({"ready": false, "database": true, "broker": false})
    );
    assert_eq!(relay.get("/livez").await.0, 200, "alive while retrying");
    assert_eq!(
        metric(&relay.get("/metrics").await.1, "outbox_amqp_connected"),
        Some(0.0)
    );
    assert_eq!(
        outbox.pending("a").await,
        2,
        "nothing claimed or marked while the broker is down"
    );
    relay.stop().await;
}

/// The plan of `sql` prepared (as the relay's statements are) and executed
/// with `params`.
async fn plan_of(client: &tokio_postgres::Client, sql: &str, params: &str) -> String {
    client
        .batch_execute(&format!("DEALLOCATE ALL; PREPARE planned AS {sql}"))
        .await
        .unwrap();
    let plan: Vec<String> = client
        .query(&format!("EXPLAIN EXECUTE planned{params}"), &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    plan.join("\n")
}

/// The trap measured on this kind of machine: many published rows, fresh statistics, the
/// default `random_page_cost`, and the planner walks the primary key and
/// filters. The relay's statements must use the partial index regardless,
/// even with costs that favour anything else and with generic plans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_reads_use_the_partial_index_whatever_the_costs() {
    let outbox = Outbox::create().await;
    let table = outbox.qualified();
    outbox
        .execute(
            // The plans are the point, not the trigger: a bulk load skips it.
            "SET session_replication_role = replica;
             INSERT INTO {outbox} (tenant_id, kind, subject_id, payload, published_at)
             SELECT 'bulk', 'k', 's', repeat('x', 64), now() FROM generate_series(1, 200000);
             INSERT INTO {outbox} (tenant_id, kind, subject_id, payload)
             SELECT 'bulk', 'k', 's', repeat('x', 64) FROM generate_series(1, 200000);
             RESET session_replication_role;
             ANALYZE {outbox};",
        )
        .await;
    let statements = [
        include_str!("../../src/store/read_batch.sql").replace("{table}", &table),
        // The parked count is checked below, under sane costs.
        include_str!("../../src/store/pending_tenants.sql")
            .lines()
            .filter(|line| !line.contains("(parked count)"))
            .collect::<Vec<_>>()
            .join("\n")
            .replace("{table}", &table),
        include_str!("../../src/store/tenant_lag.sql").replace("{table}", &table),
    ];
    let client = &outbox.client;
    for settings in [
        "RESET ALL",
        "SET random_page_cost = 100; SET seq_page_cost = 0.01; SET cpu_tuple_cost = 0",
        "SET plan_cache_mode = force_generic_plan",
    ] {
        client.batch_execute("RESET ALL").await.unwrap();
        client.batch_execute(settings).await.unwrap();
        // The claim's fence, as the batch read meets it (claim.sql).
        client
            .batch_execute("SET outbox_relay.fence = '9223372036854775807'")
            .await
            .unwrap();
        for (n, sql) in statements.iter().enumerate() {
            let params = match n {
                0 => "('bulk', 256, 16777216, 67108864, 1048576, -9223372036854775808)",
                1 => "('outbox-relay:0:%', '', true, 10000)",
                _ => "(ARRAY['bulk', 'other'])",
            };
            let plan = plan_of(client, sql, params).await;
            assert!(
                plan.contains("outbox_message_pending"),
                "{settings}: statement {n} ignores the partial index:\n{plan}"
            );
            assert!(
                !plan.contains("outbox_message_pkey"),
                "{settings}: statement {n} walks the primary key:\n{plan}"
            );
            assert!(
                !plan.contains("Seq Scan"),
                "{settings}: statement {n} scans the table:\n{plan}"
            );
        }
    }
    // The poll's count of parked rows reads the small index of parked rows
    // (with the server's own costs, and as a generic plan).
    let poll = include_str!("../../src/store/pending_tenants.sql").replace("{table}", &table);
    for settings in ["RESET ALL", "SET plan_cache_mode = force_generic_plan"] {
        client.batch_execute("RESET ALL").await.unwrap();
        client.batch_execute(settings).await.unwrap();
        let plan = plan_of(client, &poll, "('outbox-relay:0:%', '', true, 10000)").await;
        assert!(
            plan.contains("outbox_message_parked") && !plan.contains("Seq Scan"),
            "{settings}: the parked count scans the table:\n{plan}"
        );
    }
    // Marking (and undoing a mark) finds its rows by the primary key, also on
    // a table whose statistics are not gathered yet (a fresh table, or before
    // autovacuum): a scan of the whole partial index for each mark of a large
    // backlog made the marks of one batch outlast their deadline on a loaded
    // machine.
    let fresh = format!("\"{}\".fresh", outbox.schema);
    outbox
        .execute(&format!(
            "CREATE TABLE {fresh} (LIKE {{outbox}} INCLUDING ALL);
             INSERT INTO {fresh} (tenant_id, kind, subject_id, payload)
             SELECT 'bulk', 'k', 's', '{{}}' FROM generate_series(1, 30000);"
        ))
        .await;
    for settings in ["RESET ALL", "SET plan_cache_mode = force_generic_plan"] {
        client.batch_execute("RESET ALL").await.unwrap();
        client.batch_execute(settings).await.unwrap();
        for (n, sql) in [
            include_str!("../../src/store/mark_published.sql"),
            include_str!("../../src/store/unmark_published.sql"),
        ]
        .iter()
        .enumerate()
        {
            let sql = sql.replace("{table}", &fresh);
            let plan = plan_of(client, &sql, "(ARRAY[1, 2, 3]::bigint[])").await;
            assert!(
                plan.contains("fresh_pkey"),
                "{settings}: marking statement {n} does not find its rows by id:\n{plan}"
            );
        }
    }
}
