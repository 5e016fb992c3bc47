//! The real binary: configuration errors exit 2 before any connection,
//! `check-config`, `migrate`, and SIGTERM in the middle of a batch.

use std::collections::HashSet;
use std::io::Write;
use std::net::TcpListener;
use std::time::Duration;

use crate::support::{
    AMQP_URL, Broker, DATABASE_URL, Outbox, OwnedSchema, RelayProcess, by_tenant, config,
    eventually, pg_client, relay_command, start_relay, unique,
};

/// Listeners standing in for the database and the broker: a relay that
/// connects anywhere leaves a connection in their backlog.
struct Tripwires {
    database: TcpListener,
    broker: TcpListener,
}

impl Tripwires {
    fn new() -> Tripwires {
        let listen = || {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.set_nonblocking(true).unwrap();
            l
        };
        Tripwires {
            database: listen(),
            broker: listen(),
        }
    }

    fn database_url(&self) -> String {
        format!(
            "postgres://postgres:hunter2@127.0.0.1:{}/test",
            self.database.local_addr().unwrap().port()
        )
    }

    fn amqp_url(&self) -> String {
        format!(
            "amqp://guest:hunter2@127.0.0.1:{}/%2f",
            self.broker.local_addr().unwrap().port()
        )
    }

    fn assert_untouched(&self) {
        assert!(
            self.database.accept().is_err(),
            "a database connection was opened"
        );
        assert!(
            self.broker.accept().is_err(),
            "a broker connection was opened"
        );
    }
}

fn config_file(contents: &str) -> tempfile::TempPath {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(contents.as_bytes()).unwrap();
    file.into_temp_path()
}

/// Runs the binary to completion with `env` and `args`; returns (code, stderr).
fn run(env: &[(&str, &str)], args: &[&str]) -> (Option<i32>, String, String) {
    let mut command = relay_command();
    command.envs(env.iter().copied()).args(args);
    let output = command.output().expect("the binary runs");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Environment, arguments, and the text stderr must contain.
type Case<'a> = (Vec<(&'a str, &'a str)>, Vec<&'a str>, &'a str);

/// A schema name of 63 bytes, PostgreSQL's longest.
const LONGEST_SCHEMA: &str = "sssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssss";

#[test]
fn each_configuration_error_exits_2_naming_key_and_source_before_connecting() {
    let wires = Tripwires::new();
    let (db, mq) = (wires.database_url(), wires.amqp_url());
    let base = vec![
        ("OUTBOX_DATABASE_URL", db.as_str()),
        ("OUTBOX_AMQP_URL", mq.as_str()),
        ("OUTBOX_HTTP_ADDR", "127.0.0.1:0"),
    ];

    let unknown = config_file("tenants = [\"a\"]\npoll_msec = 100\n");
    let empty_tenants = config_file("tenants = []\n");
    let dup_tenants = config_file("tenants = [\"a\", \"b\", \"a\"]\n");
    let in_flight = config_file("tenants = [\"a\"]\nbatch_size = 10\nmax_in_flight = 20\n");
    let unknown_s = unknown.to_str().unwrap();
    let cases: Vec<Case> = vec![
        (vec![], vec![], "tenants is required"),
        (
            vec![],
            vec!["--config", unknown_s],
            "unknown key `poll_msec` in config file",
        ),
        (
            vec![],
            vec!["--config", empty_tenants.to_str().unwrap()],
            "tenants = [] (config file",
        ),
        // Endless: refused past 64 MiB, not read until memory runs out.
        (
            vec![],
            vec!["--config", "/dev/zero"],
            "config file /dev/zero: larger than 64 MiB",
        ),
        (
            vec![
                ("OUTBOX_TENANTS", "a"),
                (
                    "OUTBOX_DATABASE_URL",
                    "postgres://u@127.0.0.1/d?sslmode=verify-full&sslrootcert=/dev/zero",
                ),
            ],
            vec![],
            "sslrootcert /dev/zero: larger than 16 MiB",
        ),
        (
            vec![],
            vec!["--config", dup_tenants.to_str().unwrap()],
            "tenant \"a\" is listed twice",
        ),
        (
            vec![("OUTBOX_TENANTS", "a,")],
            vec![],
            "tenants = [\"a\", \"\"] (environment variable OUTBOX_TENANTS): tenant names must not be empty",
        ),
        (
            vec![("OUTBOX_TENANTS", "a"), ("OUTBOX_POLL_MS", "0")],
            vec![],
            "poll_ms = 0 (environment variable OUTBOX_POLL_MS): must be a whole number from 1 to 60000",
        ),
        (
            vec![("OUTBOX_TENANTS", "a")],
            vec!["--batch-size", "10001"],
            "batch_size = 10001 (command-line flag --batch-size)",
        ),
        (
            vec![("OUTBOX_TENANTS", "a"), ("OUTBOX_CONCURRENCY", "2000")],
            vec![],
            "concurrency = 2000 (environment variable OUTBOX_CONCURRENCY)",
        ),
        (
            vec![("OUTBOX_TENANTS", "a"), ("OUTBOX_CONFIRM_TIMEOUT_MS", "-1")],
            vec![],
            "confirm_timeout_ms = -1 (environment variable OUTBOX_CONFIRM_TIMEOUT_MS)",
        ),
        (
            vec![],
            vec!["--config", in_flight.to_str().unwrap()],
            "max_in_flight = 20 (config file",
        ),
        (
            vec![
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_CONCURRENCY", "4"),
                ("OUTBOX_POOL_SIZE", "4"),
            ],
            vec![],
            "pool_size = 4 (environment variable OUTBOX_POOL_SIZE): must be greater than concurrency (4)",
        ),
        (
            vec![
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_ROUTING_KEY", "{tenant}.{type}"),
            ],
            vec![],
            "routing_key = {tenant}.{type} (environment variable OUTBOX_ROUTING_KEY): unknown placeholder {type}",
        ),
        (
            vec![("OUTBOX_TENANTS", "a")],
            vec!["--log-format", "xml"],
            "log_format = xml (command-line flag --log-format)",
        ),
        (
            vec![
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_MESSAGE_ID", "{tenant}:{id}"),
            ],
            vec![],
            "message_id = {tenant}:{id} (environment variable OUTBOX_MESSAGE_ID): unknown placeholder {tenant}; known: {id}, {schema}, {table}",
        ),
        (
            vec![("OUTBOX_TENANTS", "a")],
            vec!["--message-id", "{schema}.{table}"],
            "message_id = {schema}.{table} (command-line flag --message-id): has no {id}",
        ),
        (
            vec![("OUTBOX_TENANTS", "a")],
            vec!["--message-id", "{schema}.{id"],
            "message_id = {schema}.{id (command-line flag --message-id): unclosed '{'",
        ),
        (
            vec![
                ("OUTBOX_TENANTS", "a"),
                (
                    "OUTBOX_MESSAGE_ID",
                    "{schema}.{schema}.{schema}.{schema}:{id}",
                ),
                ("OUTBOX_SCHEMA", LONGEST_SCHEMA),
            ],
            vec![],
            "(environment variable OUTBOX_MESSAGE_ID): makes message_ids of up to 276 bytes",
        ),
        (
            vec![("OUTBOX_TENANTS", "a"), ("OUTBOX_RETENTION_MS", "-5")],
            vec![],
            "retention_ms = -5 (environment variable OUTBOX_RETENTION_MS)",
        ),
    ];
    for (env, args, expected) in cases {
        let mut all_env = base.clone();
        all_env.extend(env.iter().copied());
        let (code, _, stderr) = run(&all_env, &args);
        assert_eq!(code, Some(2), "exit code for {env:?} {args:?}: {stderr}");
        assert!(
            stderr.contains(expected),
            "{env:?} {args:?}: expected {expected:?} in {stderr:?}"
        );
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr:?}");
        assert!(!stderr.contains("hunter2"), "no secrets: {stderr}");
        assert!(
            stderr.starts_with("outbox-relay: configuration error: "),
            "{stderr}"
        );
    }
    // A missing file names the file.
    let (code, _, stderr) = run(&base, &["--config", "/nonexistent/relay.toml"]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("config file /nonexistent/relay.toml"),
        "{stderr}"
    );
    wires.assert_untouched();
}

/// A setting whose derivative is out of range, or a combination the broker
/// or the database can never accept: `check-config` (and `run`) exit 2
/// naming the key, its source and why, and nothing is connected. The value
/// just inside each bound is accepted.
#[test]
fn check_config_refuses_derived_settings_that_could_never_work() {
    let wires = Tripwires::new();
    let (db, mq) = (wires.database_url(), wires.amqp_url());
    let base = vec![
        ("OUTBOX_DATABASE_URL", db.as_str()),
        ("OUTBOX_AMQP_URL", mq.as_str()),
        ("OUTBOX_TENANTS", "a"),
    ];
    let amq_file = config_file("exchange = \"amq.orders\"\n");
    let small_frames = format!("{mq}?frame_max=1024");
    let cases: Vec<Case> = vec![
        (
            vec![("OUTBOX_CONFIRM_TIMEOUT_MS", "1073739324")],
            vec!["check-config"],
            "confirm_timeout_ms = 1073739324 (environment variable OUTBOX_CONFIRM_TIMEOUT_MS): must be at most 1073739323: the claim sets idle_in_transaction_session_timeout",
        ),
        (
            vec![],
            vec!["check-config", "--confirm-timeout-ms", "4000000000"],
            "confirm_timeout_ms = 4000000000 (command-line flag --confirm-timeout-ms)",
        ),
        (
            vec![("OUTBOX_EXCHANGE", "")],
            vec!["check-config"],
            "declare_exchange = true (built-in default): exchange is \"\" (the default exchange), which the broker refuses to declare",
        ),
        (
            vec![("OUTBOX_EXCHANGE", "")],
            vec![],
            "declare_exchange = true (built-in default)",
        ),
        (
            vec![],
            vec!["check-config", "--config", amq_file.to_str().unwrap()],
            "declare_exchange = true (built-in default): exchange \"amq.orders\" starts with amq.",
        ),
        (
            vec![("OUTBOX_EXCHANGE", "amq.fanout")],
            vec!["check-config"],
            "exchange \"amq.fanout\" is the broker's own, of type fanout, but exchange_type is topic",
        ),
        (
            vec![("OUTBOX_RETENTION_MS", "300000000000000")],
            vec!["check-config"],
            "retention_ms = 300000000000000 (environment variable OUTBOX_RETENTION_MS): must be at most 3155760000000 (100 years)",
        ),
        (
            vec![("OUTBOX_AMQP_URL", small_frames.as_str())],
            vec!["check-config"],
            "amqp_url = (not shown: it may hold a password) (environment variable OUTBOX_AMQP_URL): frame_max=1024 is below AMQP's least frame size (4096)",
        ),
    ];
    for (env, args, expected) in cases {
        let mut all_env = base.clone();
        all_env.extend(env.iter().copied());
        let (code, stdout, stderr) = run(&all_env, &args);
        assert_eq!(code, Some(2), "exit code for {env:?} {args:?}: {stderr}");
        assert!(stdout.is_empty(), "no configuration printed: {stdout}");
        assert!(
            stderr.starts_with("outbox-relay: configuration error: ") && stderr.contains(expected),
            "{env:?} {args:?}: expected {expected:?} in {stderr:?}"
        );
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr:?}");
        assert!(!stderr.contains("hunter2"), "no secrets: {stderr}");
    }
    // Just inside the bounds, and the same exchanges used as they are.
    let fits: Vec<Vec<(&str, &str)>> = vec![
        vec![("OUTBOX_CONFIRM_TIMEOUT_MS", "1073739323")],
        vec![
            ("OUTBOX_EXCHANGE", ""),
            ("OUTBOX_DECLARE_EXCHANGE", "false"),
        ],
        vec![("OUTBOX_EXCHANGE", "amq.topic")],
        vec![("OUTBOX_RETENTION_MS", "3155760000000")],
    ];
    for env in fits {
        let mut all_env = base.clone();
        all_env.extend(env.iter().copied());
        let (code, stdout, stderr) = run(&all_env, &["check-config"]);
        assert_eq!(code, Some(0), "{env:?}: {stderr}");
        assert!(stdout.contains("confirm_timeout_ms = "), "{stdout}");
    }
    wires.assert_untouched();
}

#[test]
fn unknown_outbox_variables_are_ignored_and_check_config_redacts() {
    let file = config_file("tenants = [\"a\", \"b\"]\npoll_ms = 150\n");
    let (code, stdout, stderr) = run(
        &[
            ("OUTBOX_CONFIG", file.to_str().unwrap()),
            ("OUTBOX_PORT", "tcp://10.0.0.7:80"),
            (
                "OUTBOX_DATABASE_URL",
                "postgres://app:s3cret@db.internal:5432/app",
            ),
            ("AMQP_URL", "amqps://relay:t0ken@mq.internal/%2f"),
        ],
        &["check-config", "--batch-size", "64"],
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        !stdout.contains("s3cret") && !stdout.contains("t0ken"),
        "{stdout}"
    );
    assert!(
        stdout.contains("tenants = [\"a\", \"b\"]  # config file"),
        "{stdout}"
    );
    assert!(stdout.contains("poll_ms = 150  # config file"), "{stdout}");
    assert!(
        stdout.contains("batch_size = 64  # command-line flag --batch-size"),
        "{stdout}"
    );
    assert!(
        stdout.contains("max_in_flight = 64  # built-in default"),
        "{stdout}"
    );
    assert!(stdout.contains("database_url = \"postgres://app:***@db.internal:5432/app\"  # environment variable OUTBOX_DATABASE_URL"), "{stdout}");
    assert!(
        stdout.contains(
            "amqp_url = \"amqps://relay:***@mq.internal:5671/%2f\"  # environment variable AMQP_URL"
        ),
        "{stdout}"
    );
    let (code, stdout, _) = run(&[("OUTBOX_TENANTS", "a")], &["--version"]);
    assert_eq!(code, Some(0));
    // Each release has its own version (0.1.0 is the relay of ce86eac).
    assert_eq!(stdout.trim(), "outbox-relay 0.2.0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_creates_the_configured_table_idempotently() {
    let schema = unique("m");
    let _owned = OwnedSchema::new(DATABASE_URL, &schema);
    for _ in 0..2 {
        let (code, _, stderr) = run(
            &[
                ("OUTBOX_TENANTS", "a"),
                ("OUTBOX_DATABASE_URL", DATABASE_URL),
                ("OUTBOX_SCHEMA", &schema),
                ("OUTBOX_TABLE", "orders_outbox"),
                ("OUTBOX_LOG_FORMAT", "json"),
            ],
            &["migrate"],
        );
        assert_eq!(code, Some(0), "{stderr}");
    }
    let client = pg_client().await;
    let index: String = client
        .query_one(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'orders_outbox_pending'",
            &[&schema],
        )
        .await
        .expect("the partial index exists")
        .get(0);
    assert!(
        index.contains("(tenant_id, id) WHERE ((published_at IS NULL) AND (parked_at IS NULL))"),
        "{index}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_batch_exits_0_and_loses_nothing() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let ids = outbox.insert_many("bulk", 30_000).await;
    let mut command = relay_command();
    command.envs([
        ("OUTBOX_TENANTS", "bulk"),
        ("OUTBOX_DATABASE_URL", DATABASE_URL),
        ("OUTBOX_AMQP_URL", AMQP_URL),
        ("OUTBOX_SCHEMA", outbox.schema.as_str()),
        ("OUTBOX_EXCHANGE", broker.exchange.as_str()),
        ("OUTBOX_HTTP_ADDR", "127.0.0.1:0"),
        ("OUTBOX_BATCH_SIZE", "10000"),
        // Room for the batch to finish on a loaded machine (the whole suite at
        // once): it takes about 6 s alone here.
        ("OUTBOX_SHUTDOWN_GRACE_MS", "40000"),
        ("OUTBOX_LOG_FORMAT", "json"),
    ]);
    let mut relay = RelayProcess::spawn(command);
    eventually(
        "the first batch is being published",
        Duration::from_secs(30),
        || async { broker.count() > 0 },
    )
    .await;
    relay.signal("TERM");
    let code = relay.wait(Duration::from_secs(50)).await;
    let output = relay.output();
    assert_eq!(code, Some(0), "clean exit:\n{output}");
    assert!(
        output.contains("shutdown requested") && output.contains("broker connection closed"),
        "{output}"
    );
    assert!(!output.contains("\"level\":\"ERROR\""), "{output}");

    // Everything marked published was received; the rest is still pending.
    let published = outbox.published_ids().await;
    assert!(
        !published.is_empty(),
        "the in-flight batch was allowed to finish:\n{output}"
    );
    let received: HashSet<i64> = broker.received().iter().map(|r| r.id).collect();
    // The test's consumer trails the marks on a loaded machine (30,000 rows).
    eventually("marked rows received", Duration::from_secs(90), || async {
        let received: HashSet<i64> = broker.received().iter().map(|r| r.id).collect();
        published.iter().all(|id| received.contains(id))
    })
    .await;
    assert_eq!(
        outbox.all_pending().await as usize,
        ids.len() - published.len()
    );
    drop(received);

    // A new relay sends the rest: every row arrives, in order, at least once.
    let next = start_relay(config(&outbox, &broker, &["bulk"])).await;
    eventually("the rest drains", Duration::from_secs(60), || async {
        outbox.all_pending().await == 0
    })
    .await;
    eventually("all received", Duration::from_secs(90), || async {
        broker
            .received()
            .iter()
            .map(|r| r.id)
            .collect::<HashSet<_>>()
            .len()
            == ids.len()
    })
    .await;
    next.stop().await;
    let order = &by_tenant(&broker.received())["bulk"];
    let mut seen = HashSet::new();
    let firsts: Vec<i64> = order
        .iter()
        .copied()
        .filter(|id| seen.insert(*id))
        .collect();
    assert_eq!(firsts, ids, "first occurrences in outbox order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_each_tenants_blocking_row_and_exits_1_when_lagging() {
    let outbox = Outbox::create().await;
    let stuck = outbox.insert("stuck", "k", "s-1", Some("{}"), None).await;
    outbox.insert("stuck", "k", "s-2", Some("{}"), None).await;
    outbox.insert("fresh", "k", "s-1", Some("{}"), None).await;
    outbox
        .execute(&format!(
            "UPDATE {{outbox}} SET occurred_at = now() - interval '5 minutes', attempts = 4,
             last_error = 'unroutable: returned by the broker: 312 NO_ROUTE' WHERE id = {stuck}"
        ))
        .await;
    let env = |tenants: &'static str| {
        vec![
            ("OUTBOX_TENANTS", tenants),
            ("OUTBOX_DATABASE_URL", DATABASE_URL),
            ("OUTBOX_SCHEMA", outbox.schema.as_str()),
            ("OUTBOX_LOG_FORMAT", "json"),
        ]
    };
    let (code, stdout, stderr) = run(&env("idle,stuck,fresh"), &["status", "--json"]);
    assert_eq!(code, Some(1), "a tenant is past max_lag_ms: {stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("only JSON on stdout");
    assert_eq!(report["lagging"], true);
    let tenants = report["tenants"].as_array().unwrap();
    assert_eq!(tenants[0]["tenant"], "idle");
    assert_eq!(tenants[0]["pending"], 0);
    assert_eq!(tenants[0]["oldest_id"], serde_json::Value::Null);
    assert_eq!(tenants[1]["tenant"], "stuck");
    assert_eq!(tenants[1]["pending"], 2);
    assert_eq!(tenants[1]["oldest_id"], stuck);
    assert_eq!(tenants[1]["attempts"], 4);
    assert_eq!(
        tenants[1]["last_error"],
        "unroutable: returned by the broker: 312 NO_ROUTE"
    );
    assert_eq!(tenants[1]["lagging"], true);
    assert!(tenants[1]["lag_ms"].as_i64().unwrap() >= 300_000);
    assert_eq!(tenants[2]["lagging"], false);

    let (code, stdout, _) = run(&env("idle,fresh"), &["status"]);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.starts_with("TENANT"), "{stdout}");
    assert!(
        stdout.contains("fresh") && !stdout.contains("stuck"),
        "{stdout}"
    );

    let (code, _, stderr) = run(
        &[
            ("OUTBOX_TENANTS", "a"),
            (
                "OUTBOX_DATABASE_URL",
                "postgres://postgres@127.0.0.1:1/test",
            ),
        ],
        &["status"],
    );
    assert_eq!(code, Some(1));
    assert!(stderr.contains("cannot read the outbox"), "{stderr}");
}

#[test]
fn database_errors_carry_the_servers_message_and_sqlstate() {
    let role = unique("role");
    let wrong_role = format!("postgres://{role}@127.0.0.1:5432/test");
    let table = unique("absent");
    let cases = [
        (
            vec![("OUTBOX_DATABASE_URL", wrong_role.as_str())],
            vec!["status"],
            format!("role \"{role}\" does not exist (SQLSTATE 28000)"),
        ),
        (
            vec![("OUTBOX_DATABASE_URL", wrong_role.as_str())],
            vec!["migrate"],
            format!("role \"{role}\" does not exist (SQLSTATE 28000)"),
        ),
        (
            vec![
                ("OUTBOX_DATABASE_URL", DATABASE_URL),
                ("OUTBOX_TABLE", table.as_str()),
            ],
            vec!["status"],
            format!("relation \"public.{table}\" does not exist (SQLSTATE 42P01)"),
        ),
    ];
    for (mut env, args, expected) in cases {
        env.extend([("OUTBOX_TENANTS", "a"), ("OUTBOX_LOG_FORMAT", "json")]);
        let (code, _, stderr) = run(&env, &args);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(&expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("db error"), "{args:?}: {stderr}");
    }
}

/// `tail` shows a newcomer what the relay publishes, with no queue of their
/// own: start the relay, `tail` beside it, insert a row, see it. Given
/// several broker endpoints, `tail` takes the first that answers. Its
/// `--routing-key` is a binding key, never checked as a template.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_prints_each_message_the_relay_publishes() {
    let outbox = Outbox::create().await;
    // No queue bound: tail's own temporary queue is the only one.
    let broker = Broker::create(&[]).await;
    let env = [
        ("OUTBOX_TENANTS", "shop"),
        ("OUTBOX_AMQP_URL", AMQP_URL),
        ("OUTBOX_EXCHANGE", broker.exchange.as_str()),
    ];
    let mut lines = relay_command();
    lines.envs(env).args(["tail"]);
    let lines = RelayProcess::spawn(lines);
    // This one is given a list whose first endpoint is dead (a closed
    // port): it connects to the next.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .unwrap();
    let listed = format!("amqp://guest:guest@{dead}/%2f,{AMQP_URL}");
    let mut json = relay_command();
    json.envs(env).env("OUTBOX_AMQP_URL", &listed).args([
        "tail",
        "--json",
        "--routing-key",
        "shop.order.*",
    ]);
    let mut json = RelayProcess::spawn(json);
    // A binding key is not the relay's routing_key template: braces are
    // fine in it.
    let mut braces = relay_command();
    braces
        .envs(env)
        .args(["tail", "--routing-key", "{not-a-placeholder}.#"]);
    let mut braces = RelayProcess::spawn(braces);
    eventually(
        "the tails are listening",
        Duration::from_secs(20),
        || async {
            [&lines, &json, &braces]
                .iter()
                .all(|tail| tail.output().contains("Ctrl-C to stop"))
        },
    )
    .await;
    assert!(
        braces
            .output()
            .contains("routing key \"{not-a-placeholder}.#\""),
        "{}",
        braces.output()
    );
    braces.signal("TERM");
    assert_eq!(braces.wait(Duration::from_secs(10)).await, Some(0));

    let relay = start_relay(config(&outbox, &broker, &["shop"])).await;
    let id = outbox
        .insert(
            "shop",
            "order.created",
            "o-1",
            Some("{\"total\":\"12.50\"}\nsecond line"),
            Some(serde_json::json!({"traceparent": "00-abc-01"})),
        )
        .await;
    let other = outbox
        .insert("shop", "stock.moved", "s-1", Some("{}"), None)
        .await;
    eventually(
        "the rows are published",
        Duration::from_secs(20),
        || async { outbox.pending("shop").await == 0 },
    )
    .await;
    eventually("tail prints both", Duration::from_secs(20), || async {
        let text = lines.output();
        text.contains(&format!("message_id={id} "))
            && text.contains(&format!("message_id={other} "))
    })
    .await;
    let text = lines.output();
    let line = text
        .lines()
        .find(|l| l.contains(&format!("message_id={id} ")))
        .unwrap();
    assert!(line.starts_with("shop.order.created message_id="), "{line}");
    assert!(line.contains("type=order.created"), "{line}");
    assert!(line.contains("\"traceparent\":\"00-abc-01\""), "{line}");
    assert!(
        line.contains("body={\"total\":\"12.50\"}\\nsecond line"),
        "the body on one line: {line}"
    );

    eventually(
        "the JSON tail prints its match",
        Duration::from_secs(20),
        || async { json.output().lines().any(|l| l.starts_with('{')) },
    )
    .await;
    let objects: Vec<serde_json::Value> = json
        .output()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(objects.len(), 1, "only shop.order.* messages");
    assert_eq!(objects[0]["message_id"], id.to_string());
    assert_eq!(objects[0]["body"], "{\"total\":\"12.50\"}\nsecond line");
    assert_eq!(objects[0]["headers"]["outbox-tenant-id"], "shop");

    json.signal("TERM");
    assert_eq!(json.wait(Duration::from_secs(10)).await, Some(0));
    lines.signal("TERM");
    relay.stop().await;
}

/// SIGHUP (a closed terminal, a process manager's "reload") stops the relay
/// as SIGTERM does: within its grace, exit 0, rather than killing it.
#[tokio::test]
async fn sighup_stops_the_relay_as_sigterm_does() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let env = crate::support::relay_env(&outbox, &broker, &["hup"]);
    let (mut relay, addr) = crate::support::spawn_relay(&env).await;
    eventually("the relay is ready", Duration::from_secs(20), || async {
        crate::support::http_get(addr, "/readyz").await.0 == 200
    })
    .await;
    relay.signal("HUP");
    let code = relay.wait(Duration::from_secs(20)).await;
    let output = relay.output();
    assert_eq!(code, Some(0), "clean exit:\n{output}");
    assert!(
        output.contains("shutdown requested") && output.contains("outbox-relay stopped"),
        "{output}"
    );
}

/// A reader that stopped reading (`check-config | head -1`) ends the output
/// quietly, exit 0: no panic (exit 101) and no backtrace.
#[test]
fn a_closed_stdout_ends_the_output_quietly() {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let output = relay_command()
        .env("OUTBOX_TENANTS", "a")
        .arg("check-config")
        .stdout(writer)
        .output()
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
