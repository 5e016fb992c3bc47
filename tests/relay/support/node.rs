//! A RabbitMQ node of this test run's own, for tests that change what is
//! the whole node's (its memory alarm: `flow`; its `max_message_size`:
//! `refusals`), so that no other process on the machine's broker (a second
//! suite, the benchmark) meets the change or undoes it.

use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{free_port, unique};

/// A RabbitMQ node of this test run's own, started once (10–20 s) from the
/// machine's installation, as the `rabbitmq` user, with its own node name,
/// AMQP and distribution ports, configuration, data and logs under a
/// directory of its own. Its shell parent stops it and removes the directory
/// when this process exits and its stdin closes.
pub struct BrokerNode {
    name: String,
    port: u16,
    _stdin: Mutex<ChildStdin>,
    _child: Mutex<Child>,
}

/// The node, started once for this run (on a blocking thread) and shared by
/// every test that needs it.
pub async fn private_broker_node() -> &'static BrokerNode {
    static NODE: OnceLock<BrokerNode> = OnceLock::new();
    tokio::task::spawn_blocking(|| NODE.get_or_init(BrokerNode::start))
        .await
        .expect("the private node starts")
}

impl BrokerNode {
    /// What a test changes is the whole node's: tests take turns.
    pub async fn turn(&self) -> tokio::sync::MutexGuard<'static, ()> {
        static TURNS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        TURNS.lock().await
    }

    fn start() -> BrokerNode {
        let dir = std::env::temp_dir().join(unique("outbox-relay-rabbit"));
        std::fs::create_dir_all(dir.join("mnesia")).expect("node dir");
        std::fs::create_dir_all(dir.join("log")).expect("node dir");
        let port = free_port();
        let dist_port = free_port();
        let name = format!("{}@localhost", unique("outbox-relay-node"));
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n"),
        )
        .expect("rabbitmq.conf");
        std::fs::write(dir.join("enabled_plugins"), "[].\n").expect("enabled_plugins");
        // Empty: the machine's rabbitmq-env.conf names the machine's node.
        std::fs::write(dir.join("rabbitmq-env.conf"), "").expect("rabbitmq-env.conf");
        let status = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&dir)
            .status()
            .expect("chown");
        assert!(status.success());
        let dir_text = dir.display().to_string();
        let script = r#"
            dir=$1
            /usr/lib/rabbitmq/bin/rabbitmq-server >"$dir/log/stdout" 2>&1 &
            pid=$!
            cat >/dev/null
            kill -TERM "$pid"
            wait "$pid"
            rm -rf "$dir"
        "#;
        let env = [
            ("RABBITMQ_NODENAME", name.clone()),
            ("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1".to_string()),
            ("RABBITMQ_NODE_PORT", port.to_string()),
            ("RABBITMQ_DIST_PORT", dist_port.to_string()),
            ("RABBITMQ_CONFIG_FILE", format!("{dir_text}/rabbitmq.conf")),
            (
                "RABBITMQ_CONF_ENV_FILE",
                format!("{dir_text}/rabbitmq-env.conf"),
            ),
            ("RABBITMQ_MNESIA_BASE", format!("{dir_text}/mnesia")),
            ("RABBITMQ_LOG_BASE", format!("{dir_text}/log")),
            (
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                format!("{dir_text}/enabled_plugins"),
            ),
            ("RABBITMQ_PLUGINS_EXPAND_DIR", format!("{dir_text}/plugins")),
            ("RABBITMQ_PID_FILE", format!("{dir_text}/pid")),
            // The machine's Erlang cookie, which `rabbitmqctl` uses too.
            ("HOME", "/var/lib/rabbitmq".to_string()),
            ("ERL_EPMD_ADDRESS", "127.0.0.1".to_string()),
            (
                "ERL_FLAGS",
                "-kernel inet_dist_use_interface {127,0,0,1}".to_string(),
            ),
        ];
        let mut child = Command::new("runuser")
            .args(["-u", "rabbitmq", "--", "sh", "-c", script, "sh", &dir_text])
            .envs(env)
            .current_dir("/var/lib/rabbitmq")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("rabbitmq-server starts");
        let stdin = child.stdin.take().expect("stdin");
        let node = BrokerNode {
            name,
            port,
            _stdin: Mutex::new(stdin),
            _child: Mutex::new(child),
        };
        let deadline = Instant::now() + Duration::from_secs(90);
        while !node.try_ctl(&["await_startup", "--timeout", "10"]).0 {
            assert!(
                Instant::now() < deadline,
                "the private RabbitMQ node did not start within 90 s: {}",
                std::fs::read_to_string(dir.join("log/stdout")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        node
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// `rabbitmqctl` against this node: whether it succeeded, and its output.
    pub fn try_ctl(&self, args: &[&str]) -> (bool, String) {
        let output = Command::new("rabbitmqctl")
            .args(["-q", "-n", &self.name])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("rabbitmqctl runs");
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    }

    pub fn ctl(&self, args: &[&str]) -> String {
        let (ok, output) = self.try_ctl(args);
        assert!(ok, "rabbitmqctl {args:?} failed: {output}");
        output
    }
}
