//! The byte budget (`max_bytes_in_flight`): a batch stops at the sweep's share
//! of it and the tenant goes on at once; a row larger than a share is read on
//! its own once the budget holds it, and goes out whole, in order; a payload
//! over `max_payload_bytes` is refused without being read. The relay binary
//! with its defaults relays the heaviest rows it accepts within the memory
//! the manifests give it (peak RSS read from `/proc`).

use std::collections::HashSet;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};

use crate::support::{
    Broker, Outbox, by_tenant, config, eventually, metric, relay_command, relay_env, spawn_relay,
    start_relay,
};

const KIB: usize = 1024;

/// A budget of 1 MiB shares (over 4 sweeps). Below what configuration
/// allows (that must hold a row with the longest headers, which these rows
/// have none of), so that rows of at most 1 MiB can be larger than a share.
const SMALL_BUDGET: usize = 4096 * KIB;

/// A payload of `bytes` that says which row it is at its start.
fn payload(tenant: &str, n: usize, bytes: usize) -> String {
    let head = format!("{tenant}-{n}:");
    head.clone() + &"x".repeat(bytes - head.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_stop_at_the_budget_and_rows_larger_than_a_share_go_out_whole_in_order() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let mut config = config(&outbox, &broker, &["large", "many", "huge"]);
    config.max_payload_bytes = 1024 * KIB;
    config.max_bytes_in_flight = SMALL_BUDGET;
    config.concurrency = 4;
    config.pool_size = 6;
    // Only the first poll finds the tenants: a batch cut short by the budget
    // must be followed at once, not wait for the next poll.
    config.poll_ms = 60_000;
    config.max_backoff_ms = 60_000;

    // Each costs about 2.7 MiB, over a sweep's share (1 MiB).
    let mut large = Vec::new();
    for n in 0..4 {
        let body = payload("large", n, 900 * KIB);
        large.push((
            outbox.insert("large", "k", "s", Some(&body), None).await,
            body,
        ));
    }
    // About 121 KiB each: 8 to a share, so 200 take many batches.
    let mut many = Vec::new();
    for n in 0..200 {
        let body = payload("many", n, 40 * KIB);
        many.push((
            outbox.insert("many", "k", "s", Some(&body), None).await,
            body,
        ));
    }
    let huge = outbox
        .insert(
            "huge",
            "k",
            "s",
            Some(&payload("huge", 0, 2048 * KIB)),
            None,
        )
        .await;

    let relay = start_relay(config).await;
    eventually(
        "every row within limits arrives",
        Duration::from_secs(30),
        || async {
            let ids: HashSet<i64> = broker.received().iter().map(|r| r.id).collect();
            large.iter().chain(&many).all(|(id, _)| ids.contains(id))
        },
    )
    .await;
    eventually(
        "the huge row is refused",
        Duration::from_secs(10),
        || async { outbox.row(huge).await.attempts >= 1 },
    )
    .await;

    let received = broker.received();
    let order = by_tenant(&received);
    for (tenant, rows) in [("large", &large), ("many", &many)] {
        let expected: Vec<i64> = rows.iter().map(|(id, _)| *id).collect();
        assert_eq!(order[tenant], expected, "{tenant}: once each, in order");
        for (id, body) in rows.iter() {
            let message = received.iter().find(|r| r.id == *id).unwrap();
            assert!(
                message.body == body.as_bytes(),
                "{tenant} row {id} arrives whole"
            );
        }
    }
    assert!(
        !order.contains_key("huge"),
        "a payload over max_payload_bytes is never sent"
    );
    let refused = outbox.row(huge).await;
    assert_eq!(
        refused.last_error.as_deref(),
        Some("too_large: payload is 2097152 bytes, over max_payload_bytes (1048576)")
    );

    // Cut short by the budget, not by batch_size (256): many sweeps, each a
    // full one, none waiting for the next poll.
    let metrics = relay.get("/metrics").await.1;
    let full = metric(
        &metrics,
        "outbox_sweeps_total{outcome=\"published\",tenant=\"many\"}",
    )
    .unwrap_or_default();
    assert!(
        full >= 15.0,
        "200 rows of 81 KiB in 1 MiB shares: {full} full sweeps"
    );
    relay.stop().await;
}

/// Full batches of one tenant follow each other in one transaction, each read
/// while the one before is confirmed; a row larger than a share at the start
/// of the batch read ahead ends the chain there and is read on its own by the
/// next sweep. Every row arrives once, whole, in order, with no second poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_row_at_the_head_of_the_batch_read_ahead_goes_out_whole_in_order() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let mut config = config(&outbox, &broker, &["mixed"]);
    config.max_payload_bytes = 1024 * KIB;
    config.max_bytes_in_flight = SMALL_BUDGET;
    config.batch_size = 10;
    config.max_in_flight = 10;
    config.poll_ms = 60_000;
    // Small rows fill batches of 10 within a share (1 MiB); the large one
    // (about 2.7 MiB to hold) heads the third batch.
    let mut rows = Vec::new();
    for n in 0..35 {
        let bytes = if n == 20 { 900 * KIB } else { KIB };
        let body = payload("mixed", n, bytes);
        rows.push((
            outbox.insert("mixed", "k", "s", Some(&body), None).await,
            body,
        ));
    }
    let relay = start_relay(config).await;
    eventually(
        "every row arrives without a second poll",
        Duration::from_secs(20),
        || async { outbox.pending("mixed").await == 0 && broker.count() >= rows.len() },
    )
    .await;
    let metrics = relay.get("/metrics").await.1;
    relay.stop().await;
    let received = broker.received();
    let expected: Vec<i64> = rows.iter().map(|(id, _)| *id).collect();
    assert_eq!(
        by_tenant(&received)["mixed"],
        expected,
        "once each, in order"
    );
    for (id, body) in &rows {
        let message = received.iter().find(|r| r.id == *id).unwrap();
        assert!(message.body == body.as_bytes(), "row {id} arrives whole");
    }
    assert_eq!(
        metric(&metrics, "outbox_published_total{tenant=\"mixed\"}"),
        Some(rows.len() as f64),
        "each row counted once:\n{metrics}"
    );
}

/// What the release binary with the default configuration may peak at
/// (VmHWM: allocator retention included): the manifests allow 128 MiB.
const PEAK_RSS_LIMIT_MIB: u64 = 120;

/// The peak RSS (VmHWM) of a running process, in MiB.
fn peak_rss_mib(pid: u32) -> u64 {
    peak_rss_mib_if_running(pid).expect("VmHWM in /proc status")
}

/// [`peak_rss_mib`], `None` once the process is gone.
fn peak_rss_mib_if_running(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())?;
    Some(kib / 1024)
}

/// The relay binary, with nothing but its defaults (and the test's table,
/// exchange and port), relays rows as heavy as it accepts, across tenants at
/// once, within the memory the manifests give it: per tenant, header-heavy
/// rows (4,000 small keys, about 80 KB of JSON), rows with the densest
/// header table that fits RabbitMQ's default frame_max (15,500 keys of about
/// 9 bytes each on the wire), and rows of 15.9 MiB, interleaved. Every row
/// arrives, none is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_with_defaults_relays_the_heaviest_rows_within_its_memory_limit() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&[]).await;
    // The messages are dropped as they arrive (the broker still confirms
    // them): neither this test nor the broker holds 250 MiB of bodies.
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongInt(1));
    broker.side_queue("#", arguments).await;
    let tenants = ["m0", "m1", "m2", "m3"];
    for tenant in tenants {
        outbox
            .execute(&format!(
                "INSERT INTO {{outbox}} (tenant_id, kind, subject_id, payload, headers)
                 SELECT '{tenant}', 'k', 's' || g, p, h
                 FROM generate_series(1, 2) r, generate_series(1, 15) g,
                      LATERAL (SELECT CASE WHEN g % 5 = 0
                          THEN (SELECT jsonb_object_agg('h' || k, true)
                                FROM generate_series(1, 15500) k)
                          ELSE (SELECT jsonb_object_agg('key' || lpad(k::text, 5, '0'), 'v' || k)
                                FROM generate_series(1, 4000) k) END AS h,
                          CASE WHEN g = 15 THEN repeat('y', 16672358) ELSE '{{}}' END AS p) c
                 ORDER BY r, g"
            ))
            .await;
    }
    let rows: i64 = tenants.len() as i64 * 30;

    let (mut relay, _) = spawn_relay(&relay_env(&outbox, &broker, &tenants)).await;
    eventually(
        "every row is published",
        Duration::from_secs(240),
        || async { outbox.pending_of(&tenants).await == 0 },
    )
    .await;
    let peak = peak_rss_mib(relay.child.id());
    eprintln!("peak RSS of the relay binary: {peak} MiB");
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(30)).await, Some(0));
    for tenant in tenants {
        assert_eq!(outbox.blamed(tenant).await, 0, "{tenant}: no row refused");
    }
    assert_eq!(
        outbox.published_ids().await.len() as i64,
        rows,
        "every row published"
    );
    assert!(
        peak <= PEAK_RSS_LIMIT_MIB,
        "peak RSS {peak} MiB, over {PEAK_RSS_LIMIT_MIB} MiB"
    );

    // `replay` of the same rows, as an operator runs it beside the relay
    // (`kubectl exec` into its container): within the same limit. Its
    // VmHWM is read until it exits (the last row is one of 15.9 MiB, whose
    // confirm and the close follow it).
    let mut replay = relay_command();
    replay
        .envs(relay_env(&outbox, &broker, &tenants))
        .args(["replay", "--tenant", "m0", "--from-id", "0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut replay = replay.spawn().expect("replay runs");
    let mut replay_peak = 0;
    let status = loop {
        if let Some(status) = replay.try_wait().expect("replay's status") {
            break status;
        }
        if let Some(peak) = peak_rss_mib_if_running(replay.id()) {
            replay_peak = replay_peak.max(peak);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    assert!(status.success(), "replay: {status:?}");
    eprintln!("peak RSS of replay: {replay_peak} MiB");
    assert!(
        replay_peak <= PEAK_RSS_LIMIT_MIB,
        "replay's peak RSS {replay_peak} MiB, over {PEAK_RSS_LIMIT_MIB} MiB"
    );
}
