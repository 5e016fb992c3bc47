//! Servers of the test run's own beside the machine's: a private PostgreSQL
//! cluster made with the machine's `initdb`, started on a free port and
//! stopped when the test process exits, and commands run as `postgres`.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

/// A TCP port free on the loopback now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The newest PostgreSQL binaries on this machine.
pub fn postgres_bin() -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL binaries in /usr/lib/postgresql")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    versions.sort();
    versions.pop().expect("a PostgreSQL version").join("bin")
}

/// Creates a cluster's data directory `data` with the machine's `initdb`,
/// as user postgres, trust authentication (for the tests' own clusters).
pub fn initdb(data: &str) {
    let initdb = postgres_bin().join("initdb").display().to_string();
    let output = as_postgres(&[
        &initdb,
        "-D",
        data,
        "-U",
        "postgres",
        "-A",
        "trust",
        "--no-sync",
    ])
    .output()
    .expect("initdb runs");
    assert!(
        output.status.success(),
        "initdb: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A private cluster in a temporary folder of its own (`prefix…`), made by
/// [`initdb`] and started with `settings` (`name=value`), with a database
/// `test`: the failover and two-phase tests' servers.
pub fn private_cluster(what: &str, prefix: &str, settings: &[&str]) -> PrivateServer {
    let base = postgres_dir(prefix);
    let data = format!("{base}/data");
    initdb(&data);
    let server = PrivateServer::start(what, &data, &base, &base, &arguments(settings));
    server.psql("postgres", "CREATE DATABASE test");
    server
}

/// A streaming standby of `primary`, in a temporary folder of its own
/// (`prefix…`): a base backup (`pg_basebackup -R`) started with `settings`.
/// It replays the primary's WAL until promoted (`pg_promote()`).
pub fn standby_of(
    primary: &PrivateServer,
    what: &str,
    prefix: &str,
    settings: &[&str],
) -> PrivateServer {
    let base = postgres_dir(prefix);
    let data = format!("{base}/data");
    let pg_basebackup = postgres_bin().join("pg_basebackup").display().to_string();
    let port = primary.port.to_string();
    let output = as_postgres(&[
        &pg_basebackup,
        "-D",
        &data,
        "-R",
        "-h",
        &primary.socket_dir,
        "-p",
        &port,
        "-U",
        "postgres",
        "--checkpoint=fast",
        "--no-sync",
    ])
    .output()
    .expect("pg_basebackup runs");
    assert!(
        output.status.success(),
        "pg_basebackup: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    PrivateServer::start(what, &data, &base, &base, &arguments(settings))
}

/// A temporary folder (`prefix…`) owned by postgres, kept: the server's
/// shell parent removes it.
fn postgres_dir(prefix: &str) -> String {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("cluster dir")
        .keep();
    let status = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(&dir)
        .status()
        .expect("chown");
    assert!(status.success());
    dir.display().to_string()
}

/// `name=value` settings as `postgres` arguments.
fn arguments(settings: &[&str]) -> Vec<String> {
    settings
        .iter()
        .flat_map(|setting| ["-c".to_string(), setting.to_string()])
        .collect()
}

/// A PostgreSQL server of this test run's own (a second primary, a TLS
/// listener), started once from the machine's binaries on `data` (made by
/// [`initdb`]). Its shell parent stops it, and removes its directory, when
/// this process exits and its stdin closes.
pub struct PrivateServer {
    what: String,
    pub port: u16,
    /// Its Unix socket's directory, where its log is too.
    pub socket_dir: String,
    /// Its shell parent's stdin (a line restarts the server) and stdout
    /// (the answer).
    control: Mutex<(ChildStdin, BufReader<ChildStdout>)>,
    _child: Mutex<Child>,
}

impl PrivateServer {
    /// Starts the server on a free port, with `settings` (`-c name=value`
    /// pairs, as separate arguments) and waits until it accepts
    /// connections; `remove` goes with it at exit.
    pub fn start(
        what: &str,
        data: &str,
        socket_dir: &str,
        remove: &str,
        settings: &[String],
    ) -> PrivateServer {
        let bin = postgres_bin();
        let port = free_port();
        let postgres = bin.join("postgres").display().to_string();
        let script = r#"
            postgres=$1 data=$2 port=$3 sockets=$4 remove=$5
            shift 5
            start() {
              "$postgres" -D "$data" -p "$port" -c listen_addresses=127.0.0.1 \
                -c unix_socket_directories="$sockets" -c fsync=off "$@" \
                >>"$sockets/postgres.log" 2>&1 &
              pid=$!
            }
            start "$@"
            # Each line read restarts it (a fast shutdown, as pg_ctl
            # restart -m fast), and is answered once it stopped.
            while read -r _; do
              kill -INT "$pid"
              wait "$pid"
              start "$@"
              echo stopped
            done
            kill -INT "$pid"
            wait "$pid"
            rm -rf "$remove"
        "#;
        let port_text = port.to_string();
        let mut args = vec![
            "sh", "-c", script, "sh", &postgres, data, &port_text, socket_dir, remove,
        ];
        args.extend(settings.iter().map(String::as_str));
        let mut child = as_postgres(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres starts");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let server = PrivateServer {
            what: what.to_string(),
            port,
            socket_dir: socket_dir.to_string(),
            control: Mutex::new((stdin, stdout)),
            _child: Mutex::new(child),
        };
        server.wait_ready();
        server
    }

    /// Waits until the server accepts connections (30 s at most).
    fn wait_ready(&self) {
        let pg_isready = postgres_bin().join("pg_isready").display().to_string();
        let port = self.port.to_string();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !Command::new(&pg_isready)
            .args(["-q", "-h", &self.socket_dir, "-p", &port])
            .status()
            .is_ok_and(|s| s.success())
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the {} did not start within 30 s: {}",
                self.what,
                std::fs::read_to_string(format!("{}/postgres.log", self.socket_dir))
                    .unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Restarts the server (a fast shutdown, every session cut, then a
    /// start on the same port) and waits until it accepts connections.
    pub fn restart(&self) {
        let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        let (stdin, stdout) = &mut *control;
        writeln!(stdin, "restart").expect("restart asked");
        let mut answer = String::new();
        stdout.read_line(&mut answer).expect("restart answered");
        assert_eq!(answer.trim(), "stopped", "the {} stops", self.what);
        drop(control);
        self.wait_ready();
    }

    /// Runs `sql` with psql as `postgres` over the Unix socket, in
    /// `database`; it must succeed.
    pub fn psql(&self, database: &str, sql: &str) {
        let psql = postgres_bin().join("psql").display().to_string();
        let port = self.port.to_string();
        let status = as_postgres(&[
            &psql,
            "-q",
            "-h",
            &self.socket_dir,
            "-p",
            &port,
            "-U",
            "postgres",
            "-d",
            database,
            "-c",
            sql,
        ])
        .status()
        .expect("psql runs");
        assert!(status.success(), "psql: {sql}");
    }
}

/// A command run as the `postgres` user (initdb refuses root).
pub fn as_postgres(args: &[&str]) -> Command {
    let mut command = Command::new("runuser");
    command.args(["-u", "postgres", "--"]).args(args);
    command
}
