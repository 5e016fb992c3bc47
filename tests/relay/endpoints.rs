//! `amqp_url` with several endpoints: a dead first endpoint is passed over,
//! the connected endpoint dying mid-flow moves the relay to the next one and
//! re-sends only what was unconfirmed, in order, and neither the logs nor a
//! configuration error show a password (one with a comma in it included).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::proxy::{Mode, Proxy};
use crate::support::{
    Broker, Outbox, check_history, config, eventually, http_get, metric, relay_command, relay_env,
    set_env, spawn_relay, start_relay,
};

const BROKER: &str = "127.0.0.1:5672";

/// A password with a comma in it, for an endpoint that is never reached.
const COMMA_PASSWORD: &str = "se,cr3t";

fn broker_addr() -> SocketAddr {
    BROKER.parse().unwrap()
}

fn amqp_at(addr: SocketAddr) -> String {
    format!("amqp://guest:guest@{addr}/%2f")
}

/// A loopback port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

fn endpoint_gauge(metrics: &str, endpoint: &str) -> Option<f64> {
    metric(
        metrics,
        &format!("outbox_amqp_endpoint{{endpoint=\"{endpoint}\"}}"),
    )
}

/// The first endpoint is dead (a closed port, behind a password with a
/// comma): the relay publishes through the second, says so in its log and
/// its gauge, and never shows the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_first_endpoint_is_passed_over() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let dead = format!("127.0.0.1:{}", closed_port());
    let mut env = relay_env(&outbox, &broker, &["first"]);
    set_env(
        &mut env,
        "OUTBOX_AMQP_URL",
        format!(
            "amqp://guest:{COMMA_PASSWORD}@{dead}/%2f, {}",
            amqp_at(broker_addr())
        ),
    );
    let mut committed = BTreeMap::new();
    committed.insert("first".to_string(), outbox.insert_many("first", 50).await);
    let (mut relay, http) = spawn_relay(&env).await;
    let duplicates = check_history(&outbox, &broker, &committed, Duration::from_secs(30)).await;
    assert_eq!(duplicates, 0);
    let metrics = http_get(http, "/metrics").await.1;
    assert_eq!(endpoint_gauge(&metrics, BROKER), Some(1.0), "{metrics}");
    assert_eq!(endpoint_gauge(&metrics, &dead), Some(0.0), "{metrics}");
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));
    let log = relay.output();
    let said = |message: &str, endpoint: &str| {
        log.lines().any(|line| {
            let entry: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
            entry["message"] == message && entry["endpoint"] == endpoint
        })
    };
    assert!(said("cannot connect to the broker", &dead), "{log}");
    assert!(said("connected to the broker", BROKER), "{log}");
    assert!(!log.contains("cr3t"), "the password is shown:\n{log}");
}

/// The endpoint connected to dies while a backlog drains (proxy A, the list
/// being A then B, both to the machine's broker): the relay moves to B;
/// consumers get every row, in order per tenant, and at most the
/// unconfirmed window of each interrupted batch again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connected_endpoint_dying_mid_flow_moves_to_the_next() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    // A throttled path keeps batches in flight when A dies.
    let a = Proxy::start(broker_addr(), Mode::Delay(Duration::from_millis(5))).await;
    let b = Proxy::start(broker_addr(), Mode::Pass).await;
    let tenants = ["fo-1", "fo-2"];
    let max_in_flight = 10;
    let mut config = config(&outbox, &broker, &tenants);
    config.amqp_url = format!("{},{}", amqp_at(a.addr), amqp_at(b.addr))
        .parse()
        .expect("amqp url");
    config.batch_size = 300;
    config.max_in_flight = max_in_flight;
    config.max_backoff_ms = 500;
    let mut committed = BTreeMap::new();
    for tenant in tenants {
        committed.insert(tenant.to_string(), outbox.insert_many(tenant, 2_000).await);
    }
    let relay = start_relay(config).await;
    let names = [a.addr.to_string(), b.addr.to_string()];
    let in_use = |metrics: &str| {
        names
            .iter()
            .position(|name| endpoint_gauge(metrics, name) == Some(1.0))
    };
    eventually(
        "publishing, through the endpoint the gauge names",
        Duration::from_secs(30),
        || async { broker.count() > 100 && in_use(&relay.get("/metrics").await.1).is_some() },
    )
    .await;
    // A, unless a confirm timeout on a loaded machine already moved the
    // relay on: the node it is connected to dies, whichever it is.
    let dying = in_use(&relay.get("/metrics").await.1).expect("connected");
    let (node, next) = ([&a, &b][dying], 1 - dying);
    node.kill();
    assert!(
        outbox.all_pending().await > 0,
        "the node died with rows still to relay"
    );
    eventually(
        "the relay moved to the other endpoint, as the gauge says",
        Duration::from_secs(20),
        || async {
            let metrics = relay.get("/metrics").await.1;
            in_use(&metrics) == Some(next) && endpoint_gauge(&metrics, &names[dying]) == Some(0.0)
        },
    )
    .await;
    let duplicates = check_history(&outbox, &broker, &committed, Duration::from_secs(60)).await;
    // Each batch the lost connection interrupted (a failure, `connection` or
    // `timeout`) sends its unconfirmed window again, no more.
    let metrics = relay.get("/metrics").await.1;
    let interrupted: f64 = tenants
        .iter()
        .flat_map(|tenant| {
            ["connection", "timeout"].map(|reason| {
                metric(
                    &metrics,
                    &format!(
                        "outbox_publish_failures_total{{reason=\"{reason}\",tenant=\"{tenant}\"}}"
                    ),
                )
                .unwrap_or(0.0)
            })
        })
        .sum();
    assert!(
        duplicates <= max_in_flight * interrupted as usize,
        "{duplicates} duplicates for {interrupted} interrupted batches: more than the unconfirmed window was sent again"
    );
    assert!([&a, &b][next].accepted() >= 1);
    relay.stop().await;
}

/// A bad endpoint in the list exits 2 naming the key, its source and the
/// endpoint's position, without showing any of the list.
#[test]
fn a_bad_endpoint_exits_2_naming_its_position_and_showing_no_password() {
    let list = format!(
        "amqp://guest:{COMMA_PASSWORD}@mq-0:5672/%2f,amqp://guest:{COMMA_PASSWORD}@mq-1:port/%2f"
    );
    let output = relay_command()
        .env("OUTBOX_TENANTS", "a")
        .env("OUTBOX_AMQP_URL", &list)
        .arg("check-config")
        .output()
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    for says in ["amqp_url", "OUTBOX_AMQP_URL", "endpoint 2 of 2"] {
        assert!(stderr.contains(says), "missing {says:?}: {stderr}");
    }
    assert!(
        !stderr.contains("cr3t") && !stdout.contains("cr3t"),
        "{stderr}{stdout}"
    );
}
