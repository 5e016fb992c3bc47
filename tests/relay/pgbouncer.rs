//! The relay through a real PgBouncer (Debian's, which cannot keep prepared
//! statements across server connections): two relays on two tables, with two
//! exchanges, behind one small pool (2 server connections), in transaction
//! pooling and in session pooling. `.ci/run` starts both instances once per
//! run (6432: transaction, 6433: session); without CI, the first test that
//! finds none starts them with `bash .ci/run pgbouncer`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio_postgres::{NoTls, SimpleQueryMessage};

use crate::support::{Broker, Outbox, OwnedSchema, check_history, config, start_relay};

/// Port of the instance pooling by transaction.
pub const TRANSACTION_PORT: u16 = 6432;
/// Port of the instance pooling by session.
pub const SESSION_PORT: u16 = 6433;

/// The `pool_mode` and `default_pool_size` the PgBouncer on `port` reports on
/// its admin console.
async fn pool_mode(port: u16) -> Result<(String, String), String> {
    let url = format!("postgres://postgres@127.0.0.1:{port}/pgbouncer");
    let (client, connection) =
        tokio::time::timeout(Duration::from_secs(5), tokio_postgres::connect(&url, NoTls))
            .await
            .map_err(|_| "connect timed out".to_string())?
            .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    // The admin console speaks the simple protocol only.
    let answer = client
        .simple_query("SHOW CONFIG")
        .await
        .map_err(|e| e.to_string())?;
    let setting = |key: &str| {
        answer
            .iter()
            .find_map(|message| match message {
                SimpleQueryMessage::Row(row) if row.get(0) == Some(key) => {
                    row.get(1).map(str::to_string)
                }
                _ => None,
            })
            .ok_or_else(|| format!("SHOW CONFIG has no {key}"))
    };
    Ok((setting("pool_mode")?, setting("default_pool_size")?))
}

/// The URL of the test database through the PgBouncer pooling by `mode` on
/// `port`, once it answers with that mode. Under CI a missing PgBouncer fails
/// the test; locally it is started once (never skipped).
pub async fn through_pgbouncer(port: u16, mode: &str) -> String {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    let found = match pool_mode(port).await {
        Ok(found) => found,
        Err(error) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI is set and no PgBouncer answers on 127.0.0.1:{port} ({error}): \
                 .ci/run must start it"
            );
            let started = STARTED.get_or_init(|| {
                let script = concat!(env!("CARGO_MANIFEST_DIR"), "/.ci/run");
                let output = std::process::Command::new("bash")
                    .arg(script)
                    .arg("pgbouncer")
                    .output()
                    .map_err(|e| e.to_string())?;
                if output.status.success() {
                    Ok(())
                } else {
                    Err(format!(
                        "{}{}",
                        String::from_utf8_lossy(&output.stdout),
                        String::from_utf8_lossy(&output.stderr)
                    ))
                }
            });
            if let Err(output) = started {
                panic!("could not start PgBouncer with `bash .ci/run pgbouncer`:\n{output}");
            }
            pool_mode(port)
                .await
                .unwrap_or_else(|e| panic!("PgBouncer on {port} still does not answer: {e}"))
        }
    };
    assert_eq!(
        found.0, mode,
        "the PgBouncer on 127.0.0.1:{port} pools by {}, not {mode}",
        found.0
    );
    if mode == "transaction" {
        assert_eq!(
            found.1, "2",
            "the transaction pool on 127.0.0.1:{port} is the small one (2 server connections)"
        );
    }
    format!("postgres://postgres@127.0.0.1:{port}/test")
}

const TENANTS: [&str; 4] = ["acme", "globex", "initech", "umbrella"];

/// Inserts `n` rows per tenant whose payload names the table's schema;
/// returns each inserted id with its tenant and payload.
async fn insert_wave(outbox: &Outbox, wave: i64, n: i64) -> Vec<(i64, String, String)> {
    let sql = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload)
         SELECT t, 'thing.changed', 's-' || g,
                json_build_object('schema', $1::text, 'tenant', t, 'wave', $2::bigint, 'n', g)::text
         FROM unnest($3::text[]) t, generate_series(1, $4::bigint) g
         ORDER BY g, t
         RETURNING id, tenant_id, payload",
        outbox.qualified()
    );
    let tenants: Vec<String> = TENANTS.iter().map(|t| t.to_string()).collect();
    outbox
        .client
        .query(&sql, &[&outbox.schema, &wave, &tenants, &n])
        .await
        .expect("insert a wave")
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect()
}

/// Sum of the series of `name` whose labels contain `label`.
fn metric_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(name) && line.contains(label))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Two relays, each on its own table (own schema) and its own exchange,
/// through the same PgBouncer with 2 server connections, rows written before
/// and while they run: each consumer gets exactly its table's rows (bodies,
/// tenants, ids), once each, in order per tenant; no sweep fails; `/readyz`
/// never turns 503 once it was 200.
async fn two_relays_two_tables_one_small_pool(url: String) {
    let outboxes = [Outbox::create().await, Outbox::create().await];
    let brokers: [Broker; 2] = Broker::create_several(2, &["#"])
        .await
        .try_into()
        .unwrap_or_else(|_| unreachable!("two brokers"));
    let mut expected: [HashMap<i64, (String, String)>; 2] = [HashMap::new(), HashMap::new()];
    let mut committed: [BTreeMap<String, Vec<i64>>; 2] = [BTreeMap::new(), BTreeMap::new()];
    let mut record = |side: usize, rows: Vec<(i64, String, String)>| {
        for (id, tenant, payload) in rows {
            committed[side].entry(tenant.clone()).or_default().push(id);
            expected[side].insert(id, (tenant, payload));
        }
    };
    for (side, outbox) in outboxes.iter().enumerate() {
        record(side, insert_wave(outbox, 0, 250).await);
    }
    let relays = [0, 1].map(|side| {
        let mut config = config(&outboxes[side], &brokers[side], &TENANTS);
        config.database_url = url.parse().expect("the PgBouncer url");
        config.batch_size = 50;
        config
    });
    let [first, second] = relays;
    let relays = [start_relay(first).await, start_relay(second).await];

    // /readyz of both, every 20 ms: once ready, never unready again.
    let stop = Arc::new(AtomicBool::new(false));
    let flaps = Arc::new(Mutex::new(Vec::new()));
    let watchers: Vec<_> = relays
        .iter()
        .enumerate()
        .map(|(side, relay)| {
            let (addr, stop, flaps) = (relay.addr, stop.clone(), flaps.clone());
            tokio::spawn(async move {
                let mut ready = false;
                while !stop.load(Ordering::Relaxed) {
                    let (status, body) = crate::support::http_get(addr, "/readyz").await;
                    if status == 200 {
                        ready = true;
                    } else if ready {
                        flaps
                            .lock()
                            .unwrap()
                            .push(format!("relay {side}: {status} {body}"));
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                ready
            })
        })
        .collect();

    for wave in 1..=3 {
        for (side, outbox) in outboxes.iter().enumerate() {
            record(side, insert_wave(outbox, wave, 100).await);
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }

    for side in 0..2 {
        let duplicates = check_history(
            &outboxes[side],
            &brokers[side],
            &committed[side],
            Duration::from_secs(120),
        )
        .await;
        assert_eq!(duplicates, 0, "relay {side}: no duplicates without a fault");
        for message in brokers[side].received() {
            let (tenant, payload) = expected[side].get(&message.id).unwrap_or_else(|| {
                panic!(
                    "relay {side} published id {} of no row of its table",
                    message.id
                )
            });
            assert_eq!(
                (
                    &message.tenant(),
                    String::from_utf8_lossy(&message.body).as_ref()
                ),
                (tenant, payload.as_str()),
                "relay {side}: message {} is its own table's row",
                message.id
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    for watcher in watchers {
        assert!(watcher.await.expect("watcher"), "each relay became ready");
    }
    let flaps = flaps.lock().unwrap().clone();
    assert!(flaps.is_empty(), "/readyz flapped: {flaps:?}");
    for (side, relay) in relays.iter().enumerate() {
        let (_, metrics) = relay.get("/metrics").await;
        let failed = metric_sum(&metrics, "outbox_sweeps_total{", "outcome=\"failed\"");
        assert_eq!(failed, 0.0, "relay {side}: no sweep failed");
    }
    for relay in relays {
        relay.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_on_two_tables_through_transaction_pooling() {
    let url = through_pgbouncer(TRANSACTION_PORT, "transaction").await;
    two_relays_two_tables_one_small_pool(url.clone()).await;
    // A claim that reads ahead prepares its read and mark: they are closed
    // before its transaction ends, so none is left on the server
    // connections the pool hands to its next clients (in transaction
    // pooling, PgBouncer resets nothing between them).
    let left = on_every_server_connection(&url, "SELECT name FROM pg_prepared_statements").await;
    assert!(left.is_empty(), "statements left in the pool: {left:?}");
}

/// What `sql` answers on each of the 2 server connections of the pool behind
/// `url` (prepared statements, LISTENs left there): a transaction on each at
/// once, so that both are asked.
pub async fn on_every_server_connection(url: &str, sql: &'static str) -> Vec<String> {
    let mut clients = Vec::new();
    for _ in 0..2 {
        let (client, connection) = tokio_postgres::connect(url, NoTls)
            .await
            .expect("connect through PgBouncer");
        tokio::spawn(connection);
        client.batch_execute("BEGIN").await.expect("BEGIN");
        clients.push(client);
    }
    let mut servers = Vec::new();
    let mut left = Vec::new();
    for client in &clients {
        let values = |sql: &'static str| async move {
            let rows = client.simple_query(sql).await.expect(sql);
            rows.iter()
                .filter_map(|message| match message {
                    SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                    _ => None,
                })
                .collect::<Vec<String>>()
        };
        servers.extend(values("SELECT pg_backend_pid()").await);
        left.extend(values(sql).await);
    }
    servers.dedup();
    assert_eq!(servers.len(), 2, "both server connections asked");
    left
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_on_two_tables_through_session_pooling() {
    let url = through_pgbouncer(SESSION_PORT, "session").await;
    two_relays_two_tables_one_small_pool(url).await;
}

/// The migrations and the check at start through transaction pooling: each
/// migration applied and recorded once, a second run finds nothing to do, and
/// the check finds nothing missing (every statement unnamed, nothing kept in
/// the session).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_and_the_schema_check_through_transaction_pooling() {
    let url = through_pgbouncer(TRANSACTION_PORT, "transaction").await;
    let schema = crate::support::unique("pgb_mig");
    let _owned = OwnedSchema::new(crate::support::DATABASE_URL, &schema);
    let mut config = outbox_relay::config::Config::with_tenants(["migrate"]);
    config.database_url = url.parse().expect("database url");
    config.schema = schema.clone();
    let store = outbox_relay::store::Store::new(&config).expect("store");
    for _ in 0..2 {
        outbox_relay::migrate::run(&store, &config)
            .await
            .expect("the migrations apply through PgBouncer");
    }
    let report = outbox_relay::migrate::check_schema(&store, &config)
        .await
        .expect("the check runs through PgBouncer");
    assert!(report.missing.is_empty(), "{report:?}");
    assert!(report.trigger);
    let direct = crate::support::pg_client().await;
    let recorded: i64 = direct
        .query_one(
            &format!("SELECT count(*) FROM \"{schema}\".outbox_relay_migrations"),
            &[],
        )
        .await
        .expect("the record")
        .get(0);
    // A new table is finished at once (the shared writers' lock).
    assert_eq!(recorded, outbox_relay::migrate::MIGRATIONS.len() as i64 + 1);
}
