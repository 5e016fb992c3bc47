//! A refused row stops its tenant only: unroutable, nacked, too large,
//! malformed headers, what the broker would reject. Its attempts and
//! last_error are recorded, the rows after it stay pending, every other tenant
//! flows — unblamed, each row once, the broker connection up — and once fixed
//! it drains in order.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;

use crate::support::{
    Broker, BrokerNode, Outbox, RelayHandle, RowState, by_tenant, config, eventually, http_get,
    metric, private_broker_node, relay_env, set_env, spawn_relay, start_relay,
};

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
    // A tenant's failure series appear with its first failure.
    assert_eq!(
        metric(
            &metrics,
            "outbox_publish_failures_total{reason=\"unroutable\",tenant=\"flowing\"}"
        ),
        None
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
        None
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
        || async { outbox.pending_of(&flowing).await == 0 },
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

async fn nacking(
    tenant: &str,
    rows: i64,
    capacity: i32,
    (batch_size, max_in_flight): (usize, usize),
) -> Nacking {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&[]).await;
    let capped = broker.capped_queue(&format!("{tenant}.#"), capacity).await;
    let ids = outbox.insert_many(tenant, rows).await;
    let mut config = config(&outbox, &broker, &[tenant]);
    config.batch_size = batch_size;
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
    } = nacking("full", 6, 3, (256, 1)).await;
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
            RowState {
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
    // A NULL the contract's table would not take, in a table that does.
    outbox
        .execute("ALTER TABLE {outbox} ALTER COLUMN subject_id DROP NOT NULL")
        .await;
    let null: i64 = outbox
        .client
        .query_one(
            &format!(
                "INSERT INTO {} (tenant_id, kind, subject_id, payload) \
                 VALUES ('null', 'thing.changed', NULL, '{{}}') RETURNING id",
                outbox.qualified()
            ),
            &[],
        )
        .await
        .expect("a row with no subject_id")
        .get(0);
    let fine = outbox.insert_many("fine", 20).await;
    let mut config = config(&outbox, &broker, &["big", "bad", "null", "fine"]);
    config.max_payload_bytes = 100;
    config.max_backoff_ms = 300;
    let relay = start_relay(config).await;

    eventually("the refusals recorded", Duration::from_secs(20), || async {
        outbox.row(big).await.attempts >= 1
            && outbox.row(bad).await.attempts >= 1
            && outbox.row(null).await.attempts >= 1
    })
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
        Some("invalid: headers must be a JSON object, found an array")
    );
    assert_eq!(
        outbox.row(null).await.last_error.as_deref(),
        Some("invalid: subject_id is NULL: the column allows it, the contract's table does not")
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
            "outbox_publish_failures_total{reason=\"invalid\",tenant=\"bad\"}"
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
    outbox
        .execute(&format!(
            "UPDATE {{outbox}} SET subject_id = 's-2' WHERE id = {null}"
        ))
        .await;
    eventually("repaired rows drain", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;
    eventually("all received", Duration::from_secs(10), || async {
        broker.count() == 24
    })
    .await;
    relay.stop().await;
    let received = by_tenant(&broker.received());
    assert_eq!(received["big"], vec![big, big_next]);
    assert_eq!(received["bad"], vec![bad]);
    assert_eq!(received["null"], vec![null]);
    assert_eq!(received["fine"], fine);
}

/// The rows before `ids[nacked]` are marked and no other; the nacked row
/// has the nack recorded, and no row after it was charged an attempt.
async fn exactly_the_prefix_is_marked(outbox: &Outbox, ids: &[i64], nacked: usize) {
    assert_eq!(
        outbox.published_ids().await,
        ids[..nacked].to_vec(),
        "exactly the confirmed prefix is marked"
    );
    let refused = outbox.row(ids[nacked]).await;
    assert!(
        refused.last_error.as_deref().unwrap().starts_with("nack: "),
        "{refused:?}"
    );
    for id in &ids[nacked + 1..] {
        assert_eq!(outbox.row(*id).await.attempts, 0, "row {id}");
    }
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
    } = nacking("deep", 300, 150, (256, 256)).await;
    relay.stop().await;
    exactly_the_prefix_is_marked(&outbox, &ids, 150).await;
    broker.purge(&capped).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_in_a_later_batch_of_one_window_marks_exactly_the_confirmed_prefix() {
    // Batches of 64 chained in one transaction, one window of 64 sliding
    // across them: the rows of the third batch go out while the second's
    // are confirmed, and the queue nacks from row 150 on, inside the third.
    // Rows of the fourth may be in flight when the nack comes back.
    let Nacking {
        outbox,
        broker,
        capped,
        ids,
        relay,
    } = nacking("window", 300, 150, (64, 64)).await;
    let metrics = relay.get("/metrics").await.1;
    relay.stop().await;
    exactly_the_prefix_is_marked(&outbox, &ids, 150).await;
    assert_eq!(
        metric(&metrics, "outbox_published_total{tenant=\"window\"}"),
        Some(150.0),
        "each confirmed row counted once:\n{metrics}"
    );
    broker.purge(&capped).await;
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
            if let Some(claim) = store
                .claim("ahead", 1 << 20, i64::MIN)
                .await
                .expect("claim")
            {
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
            RowState {
                published: false,
                attempts: 0,
                last_error: None
            }
        );
    }
}

/// Polls `/readyz` and `outbox_amqp_connected` every 20 ms while a test runs:
/// one row's refusal must make neither flap.
struct Steadiness {
    stop: Arc<AtomicBool>,
    /// Taken by [`Steadiness::assert_steady`]; aborted if the test fails
    /// first (its relay's endpoints are going away).
    task: Option<tokio::task::JoinHandle<(usize, Vec<String>)>>,
}

impl Drop for Steadiness {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Steadiness {
    /// Starts watching a relay that is ready.
    async fn watch(addr: SocketAddr) -> Steadiness {
        eventually("the relay is ready", Duration::from_secs(20), || async {
            http_get(addr, "/readyz").await.0 == 200
        })
        .await;
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let (mut samples, mut flaps) = (0, Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    let (status, body) = http_get(addr, "/readyz").await;
                    if status != 200 {
                        flaps.push(format!("/readyz answered {status}: {body}"));
                    }
                    let metrics = http_get(addr, "/metrics").await.1;
                    let connected = metric(&metrics, "outbox_amqp_connected");
                    if connected != Some(1.0) {
                        flaps.push(format!("outbox_amqp_connected = {connected:?}"));
                    }
                    samples += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                (samples, flaps)
            }
        });
        Steadiness {
            stop,
            task: Some(task),
        }
    }

    async fn assert_steady(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let task = self.task.take().expect("watched once");
        let (samples, flaps) = task.await.expect("the watch does not panic");
        assert!(samples >= 10, "watched long enough: {samples} samples");
        assert!(
            flaps.is_empty(),
            "readiness and the connection held for one row's refusal ({} of {samples} samples): {:?}",
            flaps.len(),
            &flaps[..flaps.len().min(5)]
        );
    }
}

/// The tenants beside the guilty one, written to while its row is retried.
const CALM: [&str; 4] = ["calm0", "calm1", "calm2", "calm3"];

/// `batch_size` and `max_in_flight` beside a guilty row: a calm tenant's
/// batch takes many round trips, so that its rows are in flight on the shared
/// channel nearly all the time, and a window re-sent is small and known.
const BATCH: usize = 200;
const IN_FLIGHT: usize = 4;

/// One row the broker would reject, among good rows of its tenant (`before`,
/// `after`), while four other tenants are written to.
struct Beside {
    outbox: Outbox,
    relay: RelayHandle,
    steady: Steadiness,
    /// Each calm tenant's committed ids.
    calm: BTreeMap<String, Vec<i64>>,
    before: Vec<i64>,
    guilty: i64,
    after: Vec<i64>,
}

/// Starts a relay over the calm tenants; once it has published their first
/// rows, commits in one transaction a full batch for each calm tenant and the
/// guilty tenant's rows (its guilty row with the SQL expressions `payload`
/// and `headers`), so that the next poll starts all their sweeps together and
/// the guilty row meets the calm tenants' batches in flight. Keeps writing to
/// the calm tenants until the guilty row has `attempts`, and returns once
/// every calm row is published.
async fn beside_a_guilty_row(
    broker: &Broker,
    payload: &str,
    headers: &str,
    attempts: i32,
) -> Beside {
    let outbox = Outbox::create().await;
    let calm = Mutex::new(BTreeMap::new());
    for tenant in CALM {
        let ids = outbox.insert_many(tenant, 100).await;
        calm.lock().unwrap().insert(tenant.to_string(), ids);
    }
    let tenants: Vec<&str> = std::iter::once("guilty").chain(CALM).collect();
    let mut config = config(&outbox, broker, &tenants);
    config.amqp_url = broker.url().parse().expect("amqp url");
    config.batch_size = BATCH;
    config.max_in_flight = IN_FLIGHT;
    config.concurrency = 5;
    config.max_backoff_ms = 200;
    let relay = start_relay(config).await;
    let steady = Steadiness::watch(relay.addr).await;
    eventually("the calm tenants flow", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;
    let calm_names = CALM.map(|t| format!("'{t}'")).join(", ");
    let written_before: i64 = outbox
        .client
        .query_one(
            &format!("SELECT coalesce(max(id), 0) FROM {}", outbox.qualified()),
            &[],
        )
        .await
        .expect("the last id")
        .get(0);
    outbox
        .execute(&format!(
            "BEGIN;
             INSERT INTO {{outbox}} (tenant_id, kind, subject_id, payload)
             SELECT t, 'thing.changed', 's-' || g, '{{\"n\":' || g || '}}'
             FROM unnest(ARRAY[{calm_names}]) t, generate_series(1, {BATCH}) g ORDER BY g;
             INSERT INTO {{outbox}} (tenant_id, kind, subject_id, payload)
             SELECT 'guilty', 'thing.changed', 'b-' || g, '{{}}' FROM generate_series(1, 3) g;
             INSERT INTO {{outbox}} (tenant_id, kind, subject_id, payload, headers)
             VALUES ('guilty', 'thing.changed', 's-g', {payload}, {headers});
             INSERT INTO {{outbox}} (tenant_id, kind, subject_id, payload)
             SELECT 'guilty', 'thing.changed', 'a-' || g, '{{}}' FROM generate_series(1, 3) g;
             COMMIT;"
        ))
        .await;
    let pending = outbox
        .client
        .query(
            &format!(
                // Not only the pending ones: the relay may have published
                // some already.
                "SELECT tenant_id, id FROM {} WHERE id > $1 ORDER BY id",
                outbox.qualified()
            ),
            &[&written_before],
        )
        .await
        .expect("the rows just written");
    let mut guilty_ids = Vec::new();
    for row in pending {
        let (tenant, id): (String, i64) = (row.get(0), row.get(1));
        match calm.lock().unwrap().get_mut(&tenant) {
            Some(ids) => ids.push(id),
            None => guilty_ids.push(id),
        }
    }
    assert_eq!(
        guilty_ids.len(),
        7,
        "the guilty tenant's rows: {guilty_ids:?}"
    );
    let (before, guilty, after) = (
        guilty_ids[..3].to_vec(),
        guilty_ids[3],
        guilty_ids[4..].to_vec(),
    );

    eventually(
        "the guilty row is retried while the calm tenants are written to",
        Duration::from_secs(40),
        || async {
            for tenant in CALM {
                let ids = outbox.insert_many(tenant, 10).await;
                calm.lock().unwrap().get_mut(tenant).unwrap().extend(ids);
            }
            outbox.row(guilty).await.attempts >= attempts
        },
    )
    .await;
    let calm = calm.into_inner().unwrap();
    let total: usize = calm.values().map(Vec::len).sum();
    eventually(
        "every calm row is published",
        Duration::from_secs(30),
        || async { outbox.pending_of(&CALM).await == 0 },
    )
    .await;
    eventually(
        "every calm row is received",
        Duration::from_secs(20),
        || async {
            let ids: HashSet<i64> = broker
                .received()
                .iter()
                .filter(|r| r.tenant() != "guilty")
                .map(|r| r.id)
                .collect();
            ids.len() >= total
        },
    )
    .await;
    Beside {
        outbox,
        relay,
        steady,
        calm,
        before,
        guilty,
        after,
    }
}

impl Beside {
    /// The guilty row holds its tenant: what is before it is published, it
    /// and what follows are not; only it carries blame, and it says why.
    async fn assert_guilty_row_stops_its_tenant(&self, last_error: &str) {
        for id in &self.before {
            assert!(self.outbox.row(*id).await.published, "row {id} before it");
        }
        let guilty = self.outbox.row(self.guilty).await;
        assert!(!guilty.published);
        let error = guilty.last_error.unwrap_or_default();
        assert!(error.starts_with(last_error), "{error}");
        assert!(error.len() < 400, "a short last_error: {error}");
        for id in &self.after {
            assert_eq!(
                self.outbox.row(*id).await,
                RowState {
                    published: false,
                    attempts: 0,
                    last_error: None
                },
                "row {id} after it"
            );
        }
    }

    /// No calm row carries blame or was counted as a failure of its own.
    async fn assert_calm_unblamed(&self, metrics: &str) {
        for tenant in CALM {
            let blamed = self.outbox.blamed(tenant).await;
            if blamed > 0 {
                let rows = self
                    .outbox
                    .client
                    .query(
                        &format!(
                            "SELECT id, attempts, last_error FROM {} WHERE tenant_id = $1 \
                             AND (attempts > 0 OR last_error IS NOT NULL)",
                            self.outbox.qualified()
                        ),
                        &[&tenant],
                    )
                    .await
                    .expect("blamed rows");
                let rows: Vec<(i64, i32, Option<String>)> = rows
                    .iter()
                    .map(|r| (r.get(0), r.get(1), r.get(2)))
                    .collect();
                panic!("{tenant}: {blamed} rows blamed: {rows:?}");
            }
            for reason in ["nack", "unroutable", "too_large", "invalid", "other"] {
                assert_eq!(
                    metric(
                        metrics,
                        &format!(
                            "outbox_publish_failures_total{{reason=\"{reason}\",tenant=\"{tenant}\"}}"
                        )
                    )
                    .unwrap_or(0.0),
                    0.0,
                    "{tenant}: no {reason} failure"
                );
            }
        }
    }

    /// The guilty row repaired by `repair` (an UPDATE of `{outbox}`), its
    /// tenant drains in order.
    async fn repair_and_drain(self, broker: &Broker, repair: &str) -> Vec<i64> {
        self.outbox
            .execute(&format!("{repair} WHERE id = {}", self.guilty))
            .await;
        eventually(
            "the repaired tenant drains",
            Duration::from_secs(20),
            || async { self.outbox.pending("guilty").await == 0 },
        )
        .await;
        let expected: Vec<i64> = self
            .before
            .iter()
            .chain([&self.guilty])
            .chain(&self.after)
            .copied()
            .collect();
        eventually("its rows are received", Duration::from_secs(10), || async {
            let ids: HashSet<i64> = broker
                .received()
                .iter()
                .filter(|r| r.tenant() == "guilty")
                .map(|r| r.id)
                .collect();
            ids.len() == expected.len()
        })
        .await;
        self.steady.assert_steady().await;
        self.relay.stop().await;
        let mut seen = HashSet::new();
        let firsts: Vec<i64> = by_tenant(&broker.received())["guilty"]
            .iter()
            .copied()
            .filter(|id| seen.insert(*id))
            .collect();
        assert_eq!(firsts, expected, "the repaired tenant's rows, in order");
        by_tenant(&broker.received())["guilty"].clone()
    }
}

/// A row header `CC` (RabbitMQ routes on it and closes the channel, 406, for
/// anything but an array of strings) is refused as `invalid` before it is
/// sent: the calm tenants see each row once, nothing blamed, and the broker
/// connection never drops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cc_header_is_refused_before_sending_and_no_other_tenant_feels_it() {
    let broker = Broker::create(&["#"]).await;
    let beside = beside_a_guilty_row(&broker, "'{}'", "'{\"CC\": \"audit.all\"}'", 3).await;
    beside
        .assert_guilty_row_stops_its_tenant(
            "invalid: header \"CC\" is reserved by RabbitMQ for sender-selected routing",
        )
        .await;
    assert!(
        !beside
            .outbox
            .row(beside.guilty)
            .await
            .last_error
            .unwrap()
            .contains("audit.all"),
        "no header value in last_error"
    );
    let metrics = beside.relay.get("/metrics").await.1;
    beside.assert_calm_unblamed(&metrics).await;
    assert_calm_received_once_in_order(&broker, &beside.calm, &metrics);
    assert_eq!(
        by_tenant(&broker.received())["guilty"],
        beside.before,
        "the guilty row was never sent, nor anything after it"
    );
    let guilty = beside
        .repair_and_drain(
            &broker,
            "UPDATE {outbox} SET headers = '{\"cc\": \"audit.all\"}'",
        )
        .await;
    assert_eq!(guilty.len(), 7, "each of its rows once");
}

/// Each calm tenant received exactly its committed rows, once each, in
/// order, and its sweeps never failed over the shared channel.
fn assert_calm_received_once_in_order(
    broker: &Broker,
    calm: &BTreeMap<String, Vec<i64>>,
    metrics: &str,
) {
    let received = by_tenant(&broker.received());
    for tenant in CALM {
        assert_eq!(
            received[tenant], calm[tenant],
            "{tenant}: each row once, in order"
        );
        assert_eq!(
            metric(
                metrics,
                &format!(
                    "outbox_publish_failures_total{{reason=\"connection\",tenant=\"{tenant}\"}}"
                )
            )
            .unwrap_or(0.0),
            0.0,
            "{tenant}: its in-flight rows never failed with another's"
        );
    }
}

/// A 200 kB header value cannot fit the broker's frame (`frame_max`, 131072
/// by default), and RabbitMQ would close the whole connection: refused as
/// `invalid` before it is sent, naming the header, not its value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_header_is_refused_before_sending_and_the_connection_stays_up() {
    let broker = Broker::create(&["#"]).await;
    let headers = "jsonb_build_object('trace', 't-1', 'blob', repeat('v', 200000))";
    let beside = beside_a_guilty_row(&broker, "'{}'", headers, 3).await;
    beside
        .assert_guilty_row_stops_its_tenant("invalid: properties and headers take 200")
        .await;
    let error = beside.outbox.row(beside.guilty).await.last_error.unwrap();
    assert!(
        error.contains("over the broker's frame_max (131072)")
            && error.ends_with("; 6 headers, the largest \"blob\" (200000 bytes)"),
        "{error}"
    );
    let metrics = beside.relay.get("/metrics").await.1;
    beside.assert_calm_unblamed(&metrics).await;
    assert_calm_received_once_in_order(&broker, &beside.calm, &metrics);
    assert!(
        metric(
            &metrics,
            "outbox_publish_failures_total{reason=\"invalid\",tenant=\"guilty\"}"
        )
        .unwrap()
            >= 3.0
    );
    assert_eq!(
        by_tenant(&broker.received())["guilty"],
        beside.before,
        "the guilty row was never sent, nor anything after it"
    );
    let guilty = beside
        .repair_and_drain(
            &broker,
            "UPDATE {outbox} SET headers = '{\"trace\": \"t-1\"}'",
        )
        .await;
    assert_eq!(guilty.len(), 7, "each of its rows once");
}

/// With `declare_exchange = false`, a deleted exchange is a configuration
/// problem: an ERROR naming the exchange and `declare_exchange`, no row
/// blamed, the connection and readiness steady; once the exchange is back,
/// everything drains once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_exchange_is_a_configuration_problem_blamed_on_no_row() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let mut committed: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for tenant in ["a", "b"] {
        committed.insert(tenant.into(), outbox.insert_many(tenant, 5).await);
    }
    let mut env = relay_env(&outbox, &broker, &["a", "b"]);
    set_env(&mut env, "OUTBOX_DECLARE_EXCHANGE", "false");
    set_env(&mut env, "OUTBOX_MAX_BACKOFF_MS", "300");
    let (process, addr) = spawn_relay(&env).await;
    eventually("the first rows go out", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;
    let steady = Steadiness::watch(addr).await;

    broker.delete_exchange().await;
    for tenant in ["a", "b"] {
        let ids = outbox.insert_many(tenant, 5).await;
        committed.get_mut(tenant).unwrap().extend(ids);
    }
    eventually(
        "the configuration problem is logged as an ERROR naming the exchange",
        Duration::from_secs(20),
        || async {
            process.output().lines().any(|line| {
                line.contains("\"level\":\"ERROR\"")
                    && line.contains("the broker refuses publishing to the exchange")
                    && line.contains(&format!("\"exchange\":\"{}\"", broker.exchange))
                    && line.contains("\"declare_exchange\":false")
            })
        },
    )
    .await;
    eventually(
        "both tenants keep failing, as `other`",
        Duration::from_secs(20),
        || async {
            let metrics = http_get(addr, "/metrics").await.1;
            ["a", "b"].iter().all(|tenant| {
                metric(
                    &metrics,
                    &format!(
                        "outbox_publish_failures_total{{reason=\"other\",tenant=\"{tenant}\"}}"
                    ),
                )
                .unwrap_or(0.0)
                    >= 3.0
            })
        },
    )
    .await;
    for tenant in ["a", "b"] {
        assert_eq!(outbox.pending(tenant).await, 5);
        assert_eq!(outbox.blamed(tenant).await, 0, "{tenant}: no row blamed");
    }

    broker.declare_exchange().await;
    broker.bind("#").await;
    eventually("everything drains", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;
    eventually(
        "everything is received",
        Duration::from_secs(10),
        || async { broker.count() == 20 },
    )
    .await;
    steady.assert_steady().await;
    let received = by_tenant(&broker.received());
    assert_eq!(received, committed, "each row once, in order");
}

/// Sets the broker's `max_message_size` (a global setting, read when a
/// channel opens) and restores the default when dropped, even if the test
/// panics. Only with the broker held exclusively.
struct MaxMessageSize(&'static BrokerNode);

impl MaxMessageSize {
    const DEFAULT: usize = 134_217_728;

    fn set(node: &'static BrokerNode, bytes: usize) -> MaxMessageSize {
        Self::eval(node, bytes);
        MaxMessageSize(node)
    }

    fn eval(node: &BrokerNode, bytes: usize) {
        node.ctl(&[
            "eval",
            &format!("application:set_env(rabbit, max_message_size, {bytes})."),
        ]);
    }
}

impl Drop for MaxMessageSize {
    fn drop(&mut self) {
        Self::eval(self.0, Self::DEFAULT);
    }
}

/// A body over the broker's `max_message_size`, which AMQP does not
/// announce, cannot be refused before it is first sent: the broker closes the
/// shared channel (406) with other tenants' rows in flight. Nobody is blamed
/// for that; the rows in flight are sent again alone, once, the guilty row
/// is found and refused as `too_large` at every retry after, alone, so the
/// incident happens once, not at every retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_brokers_max_message_size_is_found_alone_after_one_incident() {
    // The limit is the whole node's: on the run's own node, in turn, so
    // that no other process on the machine's broker meets it or resets it.
    let node = private_broker_node().await;
    let _turn = node.turn().await;
    let broker = Broker::create_on(&node.url(), &["#"]).await;
    let limit = MaxMessageSize::set(node, 1_048_576);
    let beside = beside_a_guilty_row(&broker, "repeat('x', 2097152)", "NULL", 4).await;
    beside
        .assert_guilty_row_stops_its_tenant(
            "too_large: refused by the broker: 406 PRECONDITION_FAILED - message size 2097152 is larger than configured max size 1048576",
        )
        .await;
    let metrics = beside.relay.get("/metrics").await.1;
    beside.assert_calm_unblamed(&metrics).await;
    let incidents = metric(
        &metrics,
        "outbox_publish_failures_total{reason=\"connection\",tenant=\"guilty\"}",
    );
    assert_eq!(
        incidents,
        Some(1.0),
        "the shared channel failed over the guilty row once; its retries went alone"
    );
    assert!(
        metric(
            &metrics,
            "outbox_publish_failures_total{reason=\"too_large\",tenant=\"guilty\"}"
        )
        .unwrap()
            >= 3.0
    );
    // At most the window in flight at the incident was sent again: each
    // calm tenant's first occurrences are its rows in order, and its
    // duplicates are at most its window in flight, once.
    let received = by_tenant(&broker.received());
    let mut duplicates = 0;
    for tenant in CALM {
        let mut seen = HashSet::new();
        let firsts: Vec<i64> = received[tenant]
            .iter()
            .copied()
            .filter(|id| seen.insert(*id))
            .collect();
        assert_eq!(firsts, beside.calm[tenant], "{tenant}: in order");
        let again = received[tenant].len() - firsts.len();
        assert!(
            again <= IN_FLIGHT,
            "{tenant}: {again} duplicates, over one window in flight ({IN_FLIGHT})"
        );
        duplicates += again;
    }
    let hit: f64 = CALM
        .iter()
        .filter_map(|tenant| {
            metric(
                &metrics,
                &format!(
                    "outbox_publish_failures_total{{reason=\"connection\",tenant=\"{tenant}\"}}"
                ),
            )
        })
        .sum();
    eprintln!(
        "max_message_size incident: {hit} calm sweeps were in flight on the closed channel; \
         {duplicates} duplicate deliveries across the calm tenants"
    );
    assert!(hit >= 1.0, "the incident met other tenants' rows in flight");
    assert!(
        !by_tenant(&broker.received())["guilty"].contains(&beside.guilty),
        "the broker never took the guilty row"
    );
    beside
        .repair_and_drain(&broker, "UPDATE {outbox} SET payload = '{}'")
        .await;
    drop(limit);
}

/// A full queue (`reject-publish`) nacks a row; another queue bound to the
/// same key takes every message. The nacked row is retried alone, so the
/// rows that were in flight behind it reach the other queue once, not once
/// per retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacked_row_is_retried_alone_so_no_window_is_sent_again_per_retry() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["nacked.#"]).await;
    broker.capped_queue("nacked.#", 3).await;
    let ids = outbox.insert_many("nacked", 300).await;
    let mut config = config(&outbox, &broker, &["nacked"]);
    config.batch_size = 256;
    config.max_in_flight = 64;
    config.max_backoff_ms = 100;
    let relay = start_relay(config).await;
    eventually(
        "five retries of the nacked row",
        Duration::from_secs(30),
        || async { outbox.row(ids[3]).await.attempts >= 5 },
    )
    .await;
    let refused = outbox.row(ids[3]).await;
    assert!(refused.last_error.unwrap_or_default().starts_with("nack: "));
    let received = broker.received();
    let mut times = BTreeMap::<i64, usize>::new();
    for message in &received {
        *times.entry(message.id).or_default() += 1;
    }
    let again: Vec<(i64, usize)> = times
        .iter()
        .filter(|(id, n)| **id != ids[3] && **n > 1)
        .map(|(id, n)| (*id, *n))
        .collect();
    assert!(
        again.is_empty(),
        "rows behind the nacked one sent again on retries: {again:?}"
    );
    assert!(
        times.get(&ids[3]).copied().unwrap_or_default() <= refused.attempts as usize + 1,
        "the nacked row alone is retried"
    );
    relay.stop().await;
}
