//! The built relay binary as a process of its own: its command with a clean
//! environment, the environment over the test's table and exchange, started
//! once it serves HTTP, its log, signals, and its exit; killed when its
//! handle goes out of scope.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{AMQP_URL, Broker, DATABASE_URL, Outbox, eventually, unique};

/// The relay binary, with a clean environment of relay variables.
pub fn relay_command() -> Command {
    binary_command(Path::new(env!("CARGO_BIN_EXE_outbox-relay")))
}

/// `binary` (a relay build) with none of the test process's relay
/// variables.
pub fn binary_command(binary: &Path) -> Command {
    let mut command = Command::new(binary);
    for (name, _) in std::env::vars() {
        if name.starts_with("OUTBOX_")
            || name.starts_with("OTEL_")
            || name == "DATABASE_URL"
            || name == "AMQP_URL"
            || name == "RUST_LOG"
        {
            command.env_remove(name);
        }
    }
    command.stdin(Stdio::null());
    command
}

/// A spawned relay process whose output goes to a file (read on failure).
pub struct RelayProcess {
    pub child: Child,
    pub log: PathBuf,
}

/// Environment for a relay binary over this test's table and exchange.
pub fn relay_env(outbox: &Outbox, broker: &Broker, tenants: &[&str]) -> Vec<(String, String)> {
    [
        ("OUTBOX_TENANTS", tenants.join(",")),
        ("OUTBOX_DATABASE_URL", DATABASE_URL.to_string()),
        ("OUTBOX_AMQP_URL", AMQP_URL.to_string()),
        ("OUTBOX_SCHEMA", outbox.schema.clone()),
        ("OUTBOX_TABLE", outbox.table.clone()),
        ("OUTBOX_EXCHANGE", broker.exchange.clone()),
        ("OUTBOX_HTTP_ADDR", "127.0.0.1:0".to_string()),
        ("OUTBOX_POLL_MS", "50".to_string()),
        ("OUTBOX_LOG_FORMAT", "json".to_string()),
        ("OUTBOX_LOG", "info".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The lines of a relay's JSON log output at `level` (e.g. `"ERROR"`).
pub fn lines_at<'a>(output: &'a str, level: &str) -> Vec<&'a str> {
    let level = format!("\"level\":\"{level}\"");
    output
        .lines()
        .filter(|line| line.contains(&level))
        .collect()
}

/// Sets `key` in an environment list, replacing an earlier value.
pub fn set_env(env: &mut Vec<(String, String)>, key: &str, value: impl Into<String>) {
    env.retain(|(k, _)| k != key);
    env.push((key.to_string(), value.into()));
}

/// A relay binary started with `env`, once it serves HTTP.
pub async fn spawn_relay(env: &[(String, String)]) -> (RelayProcess, SocketAddr) {
    spawn_relay_of(relay_command(), env).await
}

/// `command` (a relay binary, this build's or another's) started with `env`,
/// once it serves HTTP.
pub async fn spawn_relay_of(
    mut command: Command,
    env: &[(String, String)],
) -> (RelayProcess, SocketAddr) {
    command.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let mut process = RelayProcess::spawn(command);
    let mut addr = None;
    eventually(
        "the relay binary serves HTTP",
        Duration::from_secs(20),
        || {
            let found = process.started_addr();
            let exited = process.child.try_wait().ok().flatten();
            assert!(
                exited.is_none(),
                "the relay exited early ({exited:?}):\n{}",
                process.output()
            );
            addr = found;
            async move { found.is_some() }
        },
    )
    .await;
    (process, addr.expect("address found"))
}

impl RelayProcess {
    /// The HTTP address the relay logged at start.
    fn started_addr(&self) -> Option<SocketAddr> {
        self.output().lines().find_map(|line| {
            let entry: serde_json::Value = serde_json::from_str(line).ok()?;
            if entry["message"] != "outbox-relay started" {
                return None;
            }
            entry["addr"].as_str()?.parse().ok()
        })
    }

    pub fn spawn(mut command: Command) -> RelayProcess {
        let log = std::env::temp_dir().join(format!("{}.log", unique("relay")));
        let file = std::fs::File::create(&log).expect("log file");
        command
            .stdout(file.try_clone().expect("log file"))
            .stderr(file);
        let child = command.spawn().expect("the relay binary starts");
        RelayProcess { child, log }
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// How many of its log lines at `level` contain `text`.
    pub fn said(&self, level: &str, text: &str) -> usize {
        lines_at(&self.output(), level)
            .into_iter()
            .filter(|line| line.contains(text))
            .count()
    }

    /// Waits until at least `times` of its log lines at `level` contain
    /// `text`.
    pub async fn until_said(&self, level: &str, text: &str, times: usize) {
        let what = format!("{times} line(s) at {level} saying {text}");
        eventually(&what, Duration::from_secs(30), || {
            let said = self.said(level, text);
            async move { said >= times }
        })
        .await
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Waits for exit within `limit`; returns the exit code.
    pub async fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.code();
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!(
                    "the relay did not exit within {limit:?}; output:\n{}",
                    self.output()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}
