//! The test harness: a private outbox table (`db`), a private exchange and
//! queue with a recording consumer (`broker`), the relay in-process
//! (`in_process`) or as the real binary (`process`), its endpoints probed
//! (`http`), histories checked (`history`), servers of the run's own
//! (`services`, and a RabbitMQ node: `node`), cleanup when a test's resources go out of scope
//! (`fixture`), and polling with deadlines (here).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub mod broker;
pub mod db;
pub mod fixture;
pub mod history;
pub mod http;
pub mod in_process;
pub mod node;
pub mod process;
pub mod services;

pub use broker::{AMQP_URL, Broker, Received, by_tenant};
pub use db::{DATABASE_URL, Outbox, RowState, pg_client};
pub use fixture::{OwnedRole, OwnedSchema};
pub use history::check_history;
pub use http::{http_get, metric};
pub use in_process::{RelayHandle, config, start_relay};
pub use node::{BrokerNode, private_broker_node};
pub use process::{
    RelayProcess, binary_command, lines_at, relay_command, relay_env, set_env, spawn_relay,
    spawn_relay_of,
};
pub use services::{PrivateServer, free_port, initdb, private_cluster, standby_of};

/// A name no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    format!(
        "{prefix}_{}_{}_{nanos:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Polls `check` every 25 ms until it holds; panics naming `what` after `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
