//! Broker flow control: a broker that blocks publishers (a resource alarm,
//! `connection.blocked`) while the relay runs, on a RabbitMQ node of this
//! test run's own (`support::node`; never the machine's broker, which other
//! tests share).
//!
//! What an operator checks: the relay keeps its one connection (counted on
//! the node), `/readyz` stays 200 and `outbox_amqp_blocked` is 1 while
//! blocked, the sweeps caught by the block end `failed` with reason
//! `timeout` and blame no row, delivery resumes at the unblock with at most
//! one batch of duplicates per tenant being swept, and SIGTERM still stops
//! the relay within its grace.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::support::{
    Broker, BrokerNode, Outbox, check_history, eventually, http_get, metric, private_broker_node,
    relay_env, set_env, spawn_relay,
};

impl BrokerNode {
    /// Connections on the node that the relay opened (it names them).
    async fn relay_connections(&'static self) -> usize {
        tokio::task::spawn_blocking(|| {
            self.ctl(&[
                "list_connections",
                "--no-table-headers",
                "client_properties",
            ])
            .lines()
            .filter(|line| line.contains("outbox-relay"))
            .count()
        })
        .await
        .expect("rabbitmqctl")
    }

    /// Raises the memory alarm: the node blocks every connection that
    /// publishes, until the alarm is dropped.
    fn alarm(&'static self) -> Alarm {
        self.ctl(&["set_vm_memory_high_watermark", "0"]);
        Alarm(self)
    }
}

/// The node's memory alarm, cleared when dropped (even if the test fails).
struct Alarm(&'static BrokerNode);

impl Drop for Alarm {
    fn drop(&mut self) {
        let _ = self.0.try_ctl(&["set_vm_memory_high_watermark", "0.4"]);
    }
}

/// Committed ids per tenant.
type Committed = BTreeMap<String, Vec<i64>>;

async fn write_rows(outbox: &Outbox, tenants: &[&str], per_tenant: i64, committed: &mut Committed) {
    for tenant in tenants {
        committed
            .entry(tenant.to_string())
            .or_default()
            .extend(outbox.insert_many(tenant, per_tenant).await);
    }
}

/// The sum of every series of `name` whose labels contain `needle`.
fn sum(metrics: &str, name: &str, needle: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The relay binary on the private node for `tenants`, with a narrow
/// confirm timeout so that an alarm lasts many of them.
fn blocked_relay_env(
    node: &BrokerNode,
    outbox: &Outbox,
    broker: &Broker,
    tenants: &[&str],
) -> Vec<(String, String)> {
    let mut env = relay_env(outbox, broker, tenants);
    set_env(&mut env, "OUTBOX_AMQP_URL", node.url());
    set_env(&mut env, "OUTBOX_BATCH_SIZE", "100");
    set_env(&mut env, "OUTBOX_CONFIRM_TIMEOUT_MS", "1000");
    set_env(&mut env, "OUTBOX_MAX_BACKOFF_MS", "500");
    env
}

const BATCH: usize = 100;

/// An alarm many confirm timeouts long: the relay keeps its one connection,
/// stays ready, shows the block, blames no row, and once the alarm clears
/// delivers everything in order with at most one batch of duplicates per
/// tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_alarm_keeps_the_connection_and_resends_at_most_a_batch_per_tenant() {
    let node = private_broker_node().await;
    let _turn = node.turn().await;
    let outbox = Outbox::create().await;
    let broker = Broker::create_on(&node.url(), &["#"]).await;
    let tenants = ["flow_a", "flow_b"];
    let mut env = blocked_relay_env(node, &outbox, &broker, &tenants);
    // The alarm lasts many heartbeat intervals too: lapin sends no heartbeat
    // while blocked, and neither side may take the silence for a dead peer.
    set_env(
        &mut env,
        "OUTBOX_AMQP_URL",
        format!("{}?heartbeat=2", node.url()),
    );
    let (mut relay, http) = spawn_relay(&env).await;
    let mut committed = Committed::new();
    write_rows(&outbox, &tenants, 20, &mut committed).await;
    eventually("the first rows go out", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;
    assert_eq!(node.relay_connections().await, 1);

    let alarm = node.alarm();
    write_rows(&outbox, &tenants, 300, &mut committed).await;
    eventually(
        "outbox_amqp_blocked is 1 once the relay publishes into the alarm",
        Duration::from_secs(20),
        || async {
            metric(&http_get(http, "/metrics").await.1, "outbox_amqp_blocked") == Some(1.0)
        },
    )
    .await;
    // Hold the alarm for many confirm timeouts (1 s each), checking
    // throughout what an operator would.
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        let (ready, body) = http_get(http, "/readyz").await;
        assert_eq!(ready, 200, "ready while blocked: {body}");
        let metrics = http_get(http, "/metrics").await.1;
        assert_eq!(metric(&metrics, "outbox_amqp_blocked"), Some(1.0));
        assert_eq!(metric(&metrics, "outbox_amqp_connected"), Some(1.0));
        assert_eq!(
            sum(&metrics, "outbox_tenant_backoff_seconds", "tenant="),
            0.0,
            "no tenant backs off for the block:\n{metrics}"
        );
        assert!(
            node.relay_connections().await <= 1,
            "one relay connection on the broker:\n{}",
            relay.output()
        );
    }
    let held = started.elapsed();
    let metrics = http_get(http, "/metrics").await.1;
    let failed = sum(&metrics, "outbox_sweeps_total", "outcome=\"failed\"");
    let timeouts = sum(
        &metrics,
        "outbox_publish_failures_total",
        "reason=\"timeout\"",
    );
    let other = sum(&metrics, "outbox_publish_failures_total", "reason=") - timeouts;
    assert!(
        failed >= 1.0,
        "the sweeps caught by the block failed:\n{metrics}"
    );
    assert_eq!(failed, timeouts, "each failed as a timeout:\n{metrics}");
    assert_eq!(other, 0.0, "{metrics}");
    // Not a loop of sweeps or reconnects: a sweep caught by the block ends,
    // and no new one starts until the unblock.
    assert!(
        failed <= 2.0 * tenants.len() as f64,
        "sweeps do not retry into the block: {failed} failed"
    );
    for tenant in tenants {
        assert_eq!(
            outbox.blamed(tenant).await,
            0,
            "no row of {tenant} is blamed"
        );
    }
    let waiting = outbox.all_pending().await;
    assert!(waiting > 0, "the rows wait");

    drop(alarm);
    eventually(
        "delivery resumes at the unblock",
        Duration::from_secs(15),
        || async { outbox.all_pending().await < waiting },
    )
    .await;
    eventually(
        "outbox_amqp_blocked back to 0",
        Duration::from_secs(20),
        || async {
            metric(&http_get(http, "/metrics").await.1, "outbox_amqp_blocked") == Some(0.0)
        },
    )
    .await;
    let duplicates = check_history(&outbox, &broker, &committed, Duration::from_secs(40)).await;
    eprintln!("blocked {held:?}: {failed} sweeps failed, {duplicates} duplicates");
    assert!(
        duplicates <= BATCH * tenants.len(),
        "at most one batch per tenant is sent again: {duplicates}"
    );
    assert_eq!(
        node.relay_connections().await,
        1,
        "still the one connection"
    );
    let output = relay.output();
    assert!(
        !output.contains("reconnecting"),
        "the connection was never dropped:\n{output}"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));
}

/// SIGTERM while the broker blocks: the sweep waiting for its confirms is
/// abandoned at the grace (its rows stay pending, unblamed), the blocked
/// connection is dropped without a close it could not send, and the relay
/// exits 0 within its grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_the_broker_blocks_stops_within_the_grace() {
    let node = private_broker_node().await;
    let _turn = node.turn().await;
    let outbox = Outbox::create().await;
    let broker = Broker::create_on(&node.url(), &["#"]).await;
    let tenants = ["flow_stop"];
    let mut env = blocked_relay_env(node, &outbox, &broker, &tenants);
    // The confirms in flight would outlast the grace.
    set_env(&mut env, "OUTBOX_CONFIRM_TIMEOUT_MS", "30000");
    set_env(&mut env, "OUTBOX_SHUTDOWN_GRACE_MS", "2000");
    let (mut relay, http) = spawn_relay(&env).await;
    let mut committed = Committed::new();
    write_rows(&outbox, &tenants, 5, &mut committed).await;
    eventually("the first rows go out", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;

    let alarm = node.alarm();
    write_rows(&outbox, &tenants, 300, &mut committed).await;
    eventually("the relay is blocked", Duration::from_secs(20), || async {
        metric(&http_get(http, "/metrics").await.1, "outbox_amqp_blocked") == Some(1.0)
    })
    .await;
    assert_eq!(http_get(http, "/readyz").await.0, 200);
    relay.signal("TERM");
    let asked = Instant::now();
    assert_eq!(
        relay.wait(Duration::from_secs(10)).await,
        Some(0),
        "{}",
        relay.output()
    );
    let took = asked.elapsed();
    eprintln!("stopped {took:?} after SIGTERM while blocked");
    assert!(
        took < Duration::from_millis(2_000 + 1_500),
        "stopped {took:?} after SIGTERM, grace 2 s:\n{}",
        relay.output()
    );
    assert_eq!(outbox.blamed("flow_stop").await, 0);
    assert!(outbox.pending("flow_stop").await > 0);
    drop(alarm);
}

/// `replay` against a broker that blocks publishers ends at the first row
/// not taken or not confirmed within `confirm_timeout_ms`, exit 1, naming
/// it; it does not wait for the unblock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_while_the_broker_blocks_ends_at_the_row_it_reached() {
    let node = private_broker_node().await;
    let _turn = node.turn().await;
    let outbox = Outbox::create().await;
    let broker = Broker::create_on(&node.url(), &["#"]).await;
    let tenants = ["flow_replay"];
    let env = blocked_relay_env(node, &outbox, &broker, &tenants);
    let (mut relay, _) = spawn_relay(&env).await;
    let mut committed = Committed::new();
    write_rows(&outbox, &tenants, 20, &mut committed).await;
    eventually("the rows go out", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));

    let alarm = node.alarm();
    let first = committed["flow_replay"][0].to_string();
    let mut command = crate::support::relay_command();
    command
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .args(["replay", "--tenant", "flow_replay", "--from-id", &first]);
    let asked = Instant::now();
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("replay runs");
    // Killed past 20 s, rather than left waiting for the unblock.
    let mut code = None;
    while asked.elapsed() < Duration::from_secs(20) {
        if let Some(status) = child.try_wait().expect("replay's status") {
            code = status.code();
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = child.kill();
    let took = asked.elapsed();
    let output = child.wait_with_output().expect("replay's output");
    drop(alarm);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(code, Some(1), "replay ended within 20 s, exit 1: {stderr}");
    assert!(stderr.contains("replay stopped at row"), "{stderr}");
    // Connect, then one publish or confirm deadline of 1 s, well before the
    // connect deadline of 10 s.
    assert!(
        took < Duration::from_secs(8),
        "replay took {took:?}: {stderr}"
    );
}
