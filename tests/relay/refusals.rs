//! A refused row stops its tenant only: unroutable, nacked, too large,
//! malformed headers. Its attempts and last_error are recorded, the rows after
//! it stay pending, every other tenant flows, and once fixed it drains in order.

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable, LongString};
use serde_json::json;

use crate::support::{
    Broker, Outbox, RelayHandle, by_tenant, config, eventually, metric, start_relay,
};

/// A queue bound to `key` that holds `length` messages and then rejects
/// publishes, which the broker nacks. Returns its name.
async fn capped_queue(broker: &Broker, key: &str, length: i32) -> String {
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongInt(length));
    arguments.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from("reject-publish")),
    );
    broker.side_queue(key, arguments).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_row_stops_only_its_tenant_and_goes_out_once_a_queue_is_bound() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["flowing.#"]).await;
    let flowing = outbox.insert_many("flowing", 30).await;
    let stuck = outbox.insert_many("stuck", 5).await;
    let mut config = config(&outbox, &broker, &["flowing", "stuck"]);
    config.max_backoff_ms = 300;
    let relay = start_relay(config).await;

    eventually(
        "the other tenant drains",
        Duration::from_secs(20),
        || async { outbox.pending("flowing").await == 0 },
    )
    .await;
    eventually(
        "the refusal is recorded",
        Duration::from_secs(20),
        || async { outbox.row(stuck[0]).await.attempts >= 2 },
    )
    .await;
    let first = outbox.row(stuck[0]).await;
    assert!(!first.published);
    let error = first.last_error.unwrap();
    assert!(error.starts_with("unroutable: "), "{error}");
    assert!(error.contains("stuck.thing.changed"), "{error}");
    for id in &stuck[1..] {
        let row = outbox.row(*id).await;
        assert!(!row.published, "nothing after the refused row is marked");
        assert_eq!(row.attempts, 0, "only the refused row counts attempts");
    }
    let (status, metrics) = relay.get("/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metric(
            &metrics,
            "outbox_publish_failures_total{reason=\"unroutable\",tenant=\"stuck\"}"
        )
        .unwrap()
            >= 2.0
    );
    assert_eq!(
        metric(
            &metrics,
            "outbox_publish_failures_total{reason=\"unroutable\",tenant=\"flowing\"}"
        ),
        Some(0.0)
    );
    assert!(
        metric(
            &metrics,
            "outbox_sweeps_total{outcome=\"failed\",tenant=\"stuck\"}"
        )
        .unwrap()
            >= 2.0
    );
    let backoff = metric(&metrics, "outbox_tenant_backoff_seconds{tenant=\"stuck\"}").unwrap();
    assert!(
        (0.1..=0.3).contains(&backoff),
        "backing off, capped at max_backoff_ms: {backoff}"
    );
    assert_eq!(
        metric(
            &metrics,
            "outbox_tenant_backoff_seconds{tenant=\"flowing\"}"
        ),
        Some(0.0)
    );

    broker.bind("stuck.#").await;
    eventually(
        "the stuck tenant drains",
        Duration::from_secs(20),
        || async { outbox.pending("stuck").await == 0 },
    )
    .await;
    eventually("all received", Duration::from_secs(10), || async {
        broker.count() == 35
    })
    .await;
    relay.stop().await;
    let received = by_tenant(&broker.received());
    assert_eq!(received["flowing"], flowing);
    assert_eq!(
        received["stuck"], stuck,
        "each once, in order, after the fix"
    );
    broker.delete().await;
    outbox.drop_schema().await;
}

/// A relay's sweeps share one channel, and lapin may hand a returned message
/// to another sweep's confirm (even a later one's, with a multiple-ack). Many
/// returns interleaved with other tenants' acks: each must reach its own row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_reach_their_own_rows_when_tenants_share_a_channel() {
    let outbox = Outbox::create().await;
    let flowing = ["flow1", "flow2", "flow3", "flow4"];
    let lost = ["lost1", "lost2", "lost3", "lost4"];
    let bindings = flowing.map(|t| format!("{t}.#"));
    let bindings: Vec<&str> = bindings.iter().map(String::as_str).collect();
    let broker = Broker::create(&bindings).await;
    let mut expected = std::collections::BTreeMap::new();
    for round in 0..2 {
        for (flow, lost) in flowing.iter().zip(&lost) {
            let ids = outbox.insert_many(flow, 150).await;
            expected
                .entry(flow.to_string())
                .or_insert_with(Vec::new)
                .extend(ids);
            if round == 0 {
                outbox.insert_many(lost, 150).await;
            }
        }
    }
    let tenants: Vec<&str> = flowing.iter().chain(&lost).copied().collect();
    let mut config = config(&outbox, &broker, &tenants);
    config.concurrency = 8;
    config.batch_size = 100;
    config.max_in_flight = 100;
    config.max_backoff_ms = 100;
    let relay = start_relay(config).await;

    eventually(
        "the flowing tenants drain",
        Duration::from_secs(30),
        || async {
            let mut pending = 0;
            for tenant in flowing {
                pending += outbox.pending(tenant).await;
            }
            pending == 0
        },
    )
    .await;
    eventually(
        "every lost tenant's refusals are recorded",
        Duration::from_secs(30),
        || async {
            let mut refused = true;
            for tenant in lost {
                refused &= outbox
                    .first_pending(tenant)
                    .await
                    .is_some_and(|r| r.attempts >= 3);
            }
            refused
        },
    )
    .await;
    eventually("all received", Duration::from_secs(10), || async {
        broker.count() >= 1_200
    })
    .await;
    relay.stop().await;

    for tenant in lost {
        assert_eq!(
            outbox.pending(tenant).await,
            150,
            "no row of {tenant} is marked published: every return reached its row"
        );
        let first = outbox.first_pending(tenant).await.unwrap();
        let error = first.last_error.unwrap();
        assert!(error.starts_with("unroutable: "), "{error}");
        assert!(
            error.contains(&format!("{tenant}.thing.changed")),
            "{error}"
        );
    }
    let received = by_tenant(&broker.received());
    for tenant in flowing {
        assert_eq!(
            received[tenant], expected[tenant],
            "{tenant}: each row once, in order (none refused by another's return)"
        );
        assert_eq!(
            outbox.attempts(tenant).await,
            0,
            "{tenant}: nothing refused"
        );
    }
    broker.delete().await;
    outbox.drop_schema().await;
}

/// A relay publishing `rows` rows of `tenant`, `max_in_flight` at a time, to
/// no queue but one that takes `capacity` messages and nacks the rest; returns
/// once the first nacked row (index `capacity`) has its attempt recorded.
struct Nacking {
    outbox: Outbox,
    broker: Broker,
    capped: String,
    ids: Vec<i64>,
    relay: RelayHandle,
}

async fn nacking(tenant: &str, rows: i64, capacity: i32, max_in_flight: usize) -> Nacking {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&[]).await;
    let capped = capped_queue(&broker, &format!("{tenant}.#"), capacity).await;
    let ids = outbox.insert_many(tenant, rows).await;
    let mut config = config(&outbox, &broker, &[tenant]);
    config.batch_size = 256;
    config.max_in_flight = max_in_flight;
    config.max_backoff_ms = 300;
    let relay = start_relay(config).await;
    eventually("the nack is recorded", Duration::from_secs(20), || async {
        outbox.row(ids[capacity as usize]).await.attempts >= 1
    })
    .await;
    Nacking {
        outbox,
        broker,
        capped,
        ids,
        relay,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacked_row_marks_only_the_confirmed_prefix() {
    // No consumer queue for this tenant: only a queue that holds three
    // messages and then rejects publishes, which the broker nacks.
    let Nacking {
        outbox,
        broker,
        capped,
        ids,
        relay,
    } = nacking("full", 6, 3, 1).await;
    for id in &ids[..3] {
        assert!(
            outbox.row(*id).await.published,
            "the confirmed prefix is marked"
        );
    }
    let refused = outbox.row(ids[3]).await;
    assert!(!refused.published);
    assert!(
        refused.last_error.as_deref().unwrap().starts_with("nack: "),
        "{refused:?}"
    );
    for id in &ids[4..] {
        assert_eq!(
            outbox.row(*id).await,
            crate::support::RowState {
                published: false,
                attempts: 0,
                last_error: None
            }
        );
    }
    let metrics = relay.get("/metrics").await.1;
    assert!(
        metric(
            &metrics,
            "outbox_publish_failures_total{reason=\"nack\",tenant=\"full\"}"
        )
        .unwrap()
            >= 1.0
    );
    assert_eq!(
        metric(&metrics, "outbox_published_total{tenant=\"full\"}"),
        Some(3.0)
    );

    // Make room: the rest goes out.
    broker.purge(&capped).await;
    eventually(
        "the rest drains after the fix",
        Duration::from_secs(20),
        || async {
            outbox.pending("full").await == 0 || {
                broker.purge(&capped).await;
                false
            }
        },
    )
    .await;
    relay.stop().await;
    broker.delete().await;
    outbox.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_too_large_payload_and_malformed_headers_are_refused_without_being_sent() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let big = outbox
        .insert("big", "blob.stored", "b-1", Some(&"x".repeat(200)), None)
        .await;
    let big_next = outbox
        .insert("big", "blob.stored", "b-2", Some("{}"), None)
        .await;
    let bad = outbox
        .insert(
            "bad",
            "thing.changed",
            "s-1",
            Some("{}"),
            Some(json!(["not", "an", "object"])),
        )
        .await;
    let fine = outbox.insert_many("fine", 20).await;
    let mut config = config(&outbox, &broker, &["big", "bad", "fine"]);
    config.max_payload_bytes = 100;
    config.max_backoff_ms = 300;
    let relay = start_relay(config).await;

    eventually(
        "both refusals recorded",
        Duration::from_secs(20),
        || async { outbox.row(big).await.attempts >= 1 && outbox.row(bad).await.attempts >= 1 },
    )
    .await;
    eventually(
        "the healthy tenant drains",
        Duration::from_secs(20),
        || async { outbox.pending("fine").await == 0 },
    )
    .await;
    let big_row = outbox.row(big).await;
    assert_eq!(
        big_row.last_error.as_deref(),
        Some("too_large: payload is 200 bytes, over max_payload_bytes (100)")
    );
    assert!(
        !outbox.row(big_next).await.published,
        "the tenant stopped at its refused row"
    );
    let bad_row = outbox.row(bad).await;
    assert_eq!(
        bad_row.last_error.as_deref(),
        Some("other: headers must be a JSON object, found an array")
    );
    assert!(
        broker.received().iter().all(|r| r.tenant() == "fine"),
        "nothing of the refused tenants was sent"
    );
    let (_, metrics) = relay.get("/metrics").await;
    assert!(
        metric(
            &metrics,
            "outbox_publish_failures_total{reason=\"too_large\",tenant=\"big\"}"
        )
        .unwrap()
            >= 1.0
    );
    assert!(
        metric(
            &metrics,
            "outbox_publish_failures_total{reason=\"other\",tenant=\"bad\"}"
        )
        .unwrap()
            >= 1.0
    );

    // Repair the rows: both tenants drain.
    outbox
        .execute(&format!(
            "UPDATE {{outbox}} SET payload = '{{}}' WHERE id = {big}"
        ))
        .await;
    outbox
        .execute(&format!(
            "UPDATE {{outbox}} SET headers = '{{\"k\": \"v\"}}' WHERE id = {bad}"
        ))
        .await;
    eventually("repaired rows drain", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;
    eventually("all received", Duration::from_secs(10), || async {
        broker.count() == 23
    })
    .await;
    relay.stop().await;
    let received = by_tenant(&broker.received());
    assert_eq!(received["big"], vec![big, big_next]);
    assert_eq!(received["bad"], vec![bad]);
    assert_eq!(received["fine"], fine);
    broker.delete().await;
    outbox.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_deep_in_a_batch_marks_exactly_the_confirmed_prefix() {
    // A batch of 256 is marked ahead in steps while it is confirmed; the
    // queue takes 150 and nacks the rest, so the steps marked ahead and the
    // refusal meet inside the batch.
    let Nacking {
        outbox,
        broker,
        capped,
        ids,
        relay,
    } = nacking("deep", 300, 150, 256).await;
    relay.stop().await;
    assert_eq!(
        outbox.published_ids().await,
        ids[..150].to_vec(),
        "exactly the confirmed prefix is marked"
    );
    let refused = outbox.row(ids[150]).await;
    assert!(
        refused.last_error.as_deref().unwrap().starts_with("nack: "),
        "{refused:?}"
    );
    for id in &ids[151..] {
        assert_eq!(outbox.row(*id).await.attempts, 0, "row {id}");
    }
    broker.purge(&capped).await;
    broker.delete().await;
    outbox.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_sent_ahead_are_invisible_until_the_commit_and_undone_past_a_late_refusal() {
    use outbox_relay::domain::{BatchReport, FailureReason, Refusal};
    use outbox_relay::store::Store;

    let outbox = Outbox::create().await;
    let ids = outbox.insert_many("ahead", 10).await;
    let mut config = outbox_relay::config::Config::with_tenants(["ahead"]);
    config.database_url = crate::support::DATABASE_URL.parse().expect("url");
    config.schema = outbox.schema.clone();
    config.table = outbox.table.clone();
    let store = Store::new(&config).expect("store");
    // The previous claim's lock goes when its backend notices the closed
    // connection: retry a skipped claim until then.
    let claim = || async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(claim) = store.claim("ahead", 1 << 20).await.expect("claim") {
                return claim;
            }
            assert!(tokio::time::Instant::now() < deadline, "never claimed");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    };

    // Marked ahead, then the claim is abandoned: nothing was ever visible.
    let abandoned = claim().await;
    assert_eq!(abandoned.rows().len(), 10);
    abandoned.mark_ahead(5);
    assert_eq!(abandoned.marks_ahead_done().await.expect("mark"), 5);
    assert_eq!(
        outbox.pending("ahead").await,
        10,
        "invisible before the commit"
    );
    drop(abandoned);
    assert_eq!(outbox.pending("ahead").await, 10);

    // Marked ahead past the row a refusal later turned out to stop at: the
    // commit keeps the prefix only, and records the refusal.
    let claim = claim().await;
    claim.mark_ahead(8);
    assert_eq!(claim.marks_ahead_done().await.expect("mark"), 8);
    let confirmed = std::time::SystemTime::now();
    claim
        .settle(&BatchReport {
            confirmed_at: vec![confirmed; 5],
            refusal: Some((
                5,
                Refusal::new(FailureReason::Nack, "the broker nacked the message"),
            )),
        })
        .await
        .expect("commit");
    assert_eq!(outbox.published_ids().await, ids[..5].to_vec());
    let refused = outbox.row(ids[5]).await;
    assert_eq!((refused.published, refused.attempts), (false, 1));
    for id in &ids[6..] {
        assert_eq!(
            outbox.row(*id).await,
            crate::support::RowState {
                published: false,
                attempts: 0,
                last_error: None
            }
        );
    }
    outbox.drop_schema().await;
}
