//! The relay in this process: a configuration over the test's table and
//! exchange, started on a free port, stopped as SIGTERM would stop it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::Config;
use outbox_relay::relay::Relay;
use tokio::task::JoinHandle;

use super::{AMQP_URL, Broker, DATABASE_URL, Outbox, http_get};

/// A relay configuration for this test's table and exchange.
pub fn config(outbox: &Outbox, broker: &Broker, tenants: &[&str]) -> Config {
    let mut config = Config::with_tenants(tenants.iter().copied());
    config.database_url = DATABASE_URL.parse().expect("database url");
    config.listen_database_url = config.database_url.clone();
    config.amqp_url = AMQP_URL.parse().expect("amqp url");
    config.schema = outbox.schema.clone();
    config.table = outbox.table.clone();
    config.exchange = broker.exchange.clone();
    config.http_addr = "127.0.0.1:0".parse().unwrap();
    config.poll_ms = 50;
    config.confirm_timeout_ms = 5_000;
    config.shutdown_grace_ms = 5_000;
    config
}

/// A relay running in this process.
pub struct RelayHandle {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

pub async fn start_relay(config: Config) -> RelayHandle {
    // `TEST_LOG=debug cargo test …` shows the relays' logs.
    if let Ok(filter) = std::env::var("TEST_LOG") {
        outbox_relay::telemetry::init(outbox_relay::config::LogFormat::Text, &filter);
    }
    let listener = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let relay = Arc::new(Relay::from_config(Arc::new(config)).expect("relay builds"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(outbox_relay::serve(relay, listener, async move {
        let _ = stopped.await;
    }));
    RelayHandle {
        addr,
        stop: Some(stop),
        task,
    }
}

impl RelayHandle {
    pub async fn get(&self, path: &str) -> (u16, String) {
        http_get(self.addr, path).await
    }

    /// Stops the relay as SIGTERM would and waits for it to finish.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), &mut self.task)
            .await
            .expect("the relay stops within its grace period")
            .expect("the relay task does not panic");
    }
}
