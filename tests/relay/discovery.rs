//! Discovered tenants (`tenants = "*"`): a tenant that first writes while the
//! relay runs is relayed without a restart, checked on the consumer's side;
//! `/healthz`, `status` and the lag gauge cover it; past `max_tenants` its
//! series go under the overflow label and its rows still go out.

use std::process::Command;
use std::time::Duration;

use outbox_relay::config::Config;
use outbox_relay::metrics::OVERFLOW;
use outbox_relay::scheduler::POLL_PAGE;
use outbox_relay::store::{Page, Polled, Store};

use crate::support::{
    Broker, DATABASE_URL, Outbox, by_tenant, config, eventually, metric, relay_command, start_relay,
};

/// `outbox-relay status --json` over this outbox with `tenants = "*"`.
fn status_json(outbox: &Outbox) -> serde_json::Value {
    let mut command: Command = relay_command();
    command
        .env("OUTBOX_TENANTS", "*")
        .env("OUTBOX_DATABASE_URL", DATABASE_URL)
        .env("OUTBOX_SCHEMA", &outbox.schema)
        .env("OUTBOX_TABLE", &outbox.table)
        .env("OUTBOX_LOG_FORMAT", "json")
        .args(["status", "--json"]);
    let output = command.output().expect("the binary runs");
    serde_json::from_str(&String::from_utf8_lossy(&output.stdout)).unwrap_or_else(|e| {
        panic!(
            "status prints JSON ({e}): {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_that_first_writes_mid_run_is_relayed_and_reported() {
    let outbox = Outbox::create().await;
    // Only early.* and late.* are routed: the stuck tenant's rows are
    // refused (unroutable) and stay pending, for the lag checks.
    let broker = Broker::create(&["early.#", "late.#"]).await;
    let early = outbox.insert_many("early", 3).await;
    let relay = start_relay(config(&outbox, &broker, &["*"])).await;
    eventually(
        "the tenant pending at start is relayed",
        Duration::from_secs(20),
        || async { by_tenant(&broker.received()).get("early") == Some(&early) },
    )
    .await;

    // A tenant nobody configured writes for the first time, mid-run.
    let late = outbox.insert_many("late", 4).await;
    eventually(
        "the tenant that first wrote mid-run is relayed, in order",
        Duration::from_secs(20),
        || async { by_tenant(&broker.received()).get("late") == Some(&late) },
    )
    .await;
    // Marked once confirmed: a row may arrive before its mark commits.
    eventually(
        "both tenants' rows marked",
        Duration::from_secs(10),
        || async { outbox.pending_of(&["early", "late"]).await == 0 },
    )
    .await;

    let stuck = outbox.insert("stuck", "k", "s", Some("{}"), None).await;
    eventually(
        "the discovered tenant's lag gauge is exposed",
        Duration::from_secs(20),
        || async {
            let (_, text) = relay.get("/metrics").await;
            metric(&text, "outbox_lag_seconds{tenant=\"stuck\"}").is_some()
                && metric(&text, "outbox_published_total{tenant=\"late\"}") == Some(4.0)
        },
    )
    .await;
    let (code, body) = relay.get("/healthz").await;
    assert_eq!(code, 200, "within max_lag_ms: {body}");
    let health: serde_json::Value = serde_json::from_str(&body).unwrap();
    let tenants = health["tenants"].as_array().unwrap();
    let listed: Vec<&str> = tenants
        .iter()
        .map(|t| t["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ["stuck"], "the pending tenant: {body}");
    assert_eq!(tenants[0]["pending"], true);

    let report = status_json(&outbox);
    let lines = report["tenants"].as_array().unwrap();
    assert_eq!(lines.len(), 1, "{report}");
    assert_eq!(lines[0]["tenant"], "stuck");
    assert_eq!(lines[0]["oldest_id"], stuck);
    assert_eq!(lines[0]["pending"], 1);

    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_past_max_tenants_share_the_overflow_label_and_their_rows_go_out() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let mut config = config(&outbox, &broker, &["*"]);
    config.max_tenants = 2;
    let tenants = ["t1", "t2", "t3", "t4", "t5"];
    let mut committed = std::collections::BTreeMap::new();
    for tenant in tenants {
        committed.insert(tenant.to_string(), outbox.insert_many(tenant, 3).await);
    }
    let relay = start_relay(config).await;
    eventually(
        "every tenant's rows arrive, in order",
        Duration::from_secs(20),
        || async { by_tenant(&broker.received()) == committed },
    )
    .await;
    // The consumer can see a batch before its marks commit.
    eventually(
        "every row marked published",
        Duration::from_secs(10),
        || async { outbox.all_pending().await == 0 },
    )
    .await;

    let (_, text) = relay.get("/metrics").await;
    let own: Vec<&str> = tenants
        .iter()
        .copied()
        .filter(|t| metric(&text, &format!("outbox_published_total{{tenant=\"{t}\"}}")).is_some())
        .collect();
    assert_eq!(own.len(), 2, "max_tenants tenants have their own: {own:?}");
    assert_eq!(
        metric(
            &text,
            &format!("outbox_published_total{{tenant=\"{OVERFLOW}\"}}")
        ),
        Some(9.0),
        "the other three tenants' 9 rows are counted under {OVERFLOW}:\n{text}"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_poll_reads_pending_tenants_a_page_at_a_time() {
    let outbox = Outbox::create().await;
    for tenant in ["", "a", "b", "c", "d"] {
        outbox.insert_many(tenant, 2).await;
    }
    // "c" has nothing pending: skipped, not counted in a page.
    outbox
        .execute("UPDATE {outbox} SET published_at = now() WHERE tenant_id = 'c'")
        .await;
    let mut config = Config::with_tenants(["*"]);
    config.database_url = DATABASE_URL.parse().expect("database url");
    config.schema = outbox.schema.clone();
    config.table = outbox.table.clone();
    let store = Store::new(&config).expect("store");
    let page = |after: Option<&str>| Page {
        after: after.map(str::to_string),
        limit: 2,
    };
    let names =
        |polled: Polled| -> Vec<String> { polled.pending.into_iter().map(|p| p.tenant).collect() };
    let first = names(store.pending_tenants("", &page(None)).await.unwrap());
    assert_eq!(first, ["", "a"], "from the first, the empty name included");
    let second = names(store.pending_tenants("", &page(Some("a"))).await.unwrap());
    assert_eq!(second, ["b", "d"], "after the last page's last tenant");
    let third = names(store.pending_tenants("", &page(Some("d"))).await.unwrap());
    assert!(third.is_empty(), "{third:?}");
    let all = names(store.pending_tenants("", &Page::all()).await.unwrap());
    assert_eq!(all, ["", "a", "b", "d"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_pending_tenants_than_a_poll_reads_are_all_relayed() {
    // More than one page of the poll (`POLL_PAGE`): two pages, one row each.
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let count = i64::try_from(POLL_PAGE + 500).unwrap();
    // One bulk load, before any relay runs: without the trigger's lock per
    // tenant (the escape hatch for bulk loads), which would take 10,500.
    outbox
        .client
        .batch_execute(&format!(
            "BEGIN;
             SET LOCAL outbox_relay.commit_order = off;
             SET LOCAL outbox_relay.notify = off;
             INSERT INTO {} (tenant_id, kind, subject_id, payload)
             SELECT 'p' || lpad(g::text, 6, '0'), 'k', 's', '{{}}' FROM generate_series(1, {count}) g;
             COMMIT;",
            outbox.qualified()
        ))
        .await
        .expect("rows");
    let config = config(&outbox, &broker, &["*"]);
    let relay = start_relay(config).await;
    eventually(
        "every tenant's row arrives",
        Duration::from_secs(120),
        || async { broker.count() >= count as usize },
    )
    .await;
    // The consumer can see a batch before its marks commit.
    eventually(
        "every row marked published",
        Duration::from_secs(10),
        || async { outbox.all_pending().await == 0 },
    )
    .await;
    let received = by_tenant(&broker.received());
    assert_eq!(received.len(), count as usize, "each tenant once");
    eventually(
        "the lag of every emptied tenant drops to 0 and /healthz is 200",
        Duration::from_secs(20),
        || async { relay.get("/healthz").await.0 == 200 },
    )
    .await;
    relay.stop().await;
}
