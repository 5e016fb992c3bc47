//! `cargo bench --bench relay`: the relay against the local PostgreSQL and
//! RabbitMQ, each figure beside its ceiling measured in the same run.
//!
//! Scenarios (each in its own schema, exchange and queue, in database
//! `outbox_bench`):
//! 1. ceiling — the broker alone (the same messages published straight to the
//!    exchange, pipelined with confirms, window `max_in_flight`, sends issued
//!    without awaiting each) and the database alone (the relay's own claim +
//!    read + mark + commit, no broker);
//! 2. drain — N rows for 1 and for 100 tenants, 1 and 3 relay processes. Each
//!    drain run follows a broker-alone run of its own, and its ratio is to
//!    that run (the machine's speed drifts by ±15 % between minutes); the
//!    table gives the median of those ratios, and the whole machine's CPU time
//!    per message beside the broker alone's, which drifts much less. One
//!    tenant is drained in two settings, each beside a ceiling in the same
//!    setting: a consumer keeping the queue empty, and no consumer (the queue
//!    grows, as while consumers are down; arrivals are the queue's message
//!    count, asked every 10 ms; BENCH_DRAIN token `1x1/backlog`);
//! 3. steady — a writer at a fixed rate; delay from `occurred_at` to receipt;
//!    latency — the same at 1,000 rows/s over 10 tenants with `poll_ms` 1000,
//!    once with `OUTBOX_WAKEUP=sequence` (the default, target p99 ≤ 15 ms),
//!    once with `notify` (target p99 ≤ 25 ms) and once with
//!    `poll` (p99 ≤ `poll_ms` + 20 ms); single-row autocommit INSERTs, so
//!    `occurred_at` is within about a millisecond of the commit;
//!    producers — single-row INSERT transactions from 4 connections for 5 s:
//!    (a) without the commit-order trigger, (b) with it and
//!    `outbox_relay.notify = off`, (c) with it and a session LISTENing (no
//!    relay waits, so the shared mode notifies no one), (d) as (c) with every
//!    writer on one tenant, (e) as (d) holding each transaction 2 ms after
//!    its insert (its own ceiling: 4 connections × 1 / (2 ms + a commit));
//!    rows/s and the ratio to (a); then the writers' cost with a
//!    relay running (`tenants = "*"`, the default configuration): 4 writers
//!    on one tenant with 2 ms of work after the insert, and 16 writers over
//!    64 tenants flat out, alternating between a table made by `0001` alone
//!    and the relay's table (every migration: the shared writers' lock):
//!    rows/s of each, the median ratio of the pairs, and the PostgreSQL CPU
//!    per row the relay's table adds;
//!    hot — 8 writers on one tenant, each transaction 5 ms after its insert,
//!    back to back for 10 s, `poll_ms` 1000: commit (as the writer sees it
//!    return) to consumer p50 and p99 (target p99 ≤ 100 ms); and 20 lone
//!    transactions on a quiet table (insert, 50 ms, commit, 300 ms apart),
//!    commit to consumer (target ≤ 15 ms);
//! 4. idle — 1,000 tenants, no rows: transactions per poll, CPU, peak RSS;
//! 5. drain with 4 KiB payloads;
//! 6. memory — peak RSS of one relay (defaults) relaying one 100 MiB row
//!    (refused as `too_large`), six 15 MiB rows, 4 tenants x 4 rows of
//!    15.9 MiB, 2,048 rows of 64 KiB over 4 tenants, and header-heavy rows
//!    over 4 tenants (4,000 keys; the densest table that fits `frame_max`):
//!    the byte budget (`max_bytes_in_flight`) at work, against 120 MiB;
//! 7. scale — 10,000 tenants (`tenants = "*"`), BENCH_ROWS rows: half over
//!    10 hot tenants, half over the 9,990 others; drained by 1, 3 and 6
//!    relays with a consumer: rate, idle sweeps beyond one per tenant and
//!    skipped sweeps per published row, relay and PostgreSQL CPU per
//!    message, the hot tenants' rows in the first second; peak RSS of one
//!    relay with 10,000 listed tenants idle and across a `/metrics` scrape;
//!    a trickle of 500 rows/s over the 10,000 tenants into 3 relays, p99
//!    delay with `wakeup = poll` and `notify`.
//! 8. retention — (a) a writer at BENCH_RATE rows/s for
//!    BENCH_RETENTION_SECS (60) beside a relay, once with `retention_ms` =
//!    10 s and once without: the table's size with its indexes
//!    (`pg_total_relation_size`) every 5 s, flat with retention, growing
//!    without (where the server's autovacuum is off, a VACUUM once a minute
//!    stands in for it); (b) the drain of BENCH_ROWS pending rows behind 3 × BENCH_ROWS
//!    rows published an hour ago, with retention deleting them meanwhile and
//!    without: rows/s.
//!
//! 9. scrape — one relay with the 10,000 scale tenants (each relayed a
//!    row, so each has its series) and a probe tenant writing a row every
//!    25 ms for BENCH_STEADY_SECS, once beside a gzip scrape of `/metrics`
//!    every 1.5 s and once beside two scrapers back to back: the rendered
//!    scrape's median time, the probe's p99 delay (commit returned to
//!    arrival) in each.
//! 10. launch — BENCH_LAUNCH_ROWS (10,000) rows over 10 tenants, pending
//!     before the relay starts: seconds from launching its process to its
//!     last row marked, the measure a standalone peer reports.
//!
//! Knobs (environment): BENCH_ROWS (100000), BENCH_RUNS (3), BENCH_RATE
//! (1000 rows/s), BENCH_STEADY_SECS (20), BENCH_IDLE_SECS (10), BENCH_ONLY
//! (comma-separated scenario names: ceiling, drain, steady, latency,
//! producers, hot, memory, idle, launch, drain4k, scale, retention, scrape), BENCH_DRAIN (drain shapes, of 256 B
//! and 4 KiB alike, e.g. `100x3,1x1,1x1/backlog`), BENCH_RELAY_LOG (the
//! relays' log filter, their logs on stdout: `outbox_relay::relay=debug`
//! gives each sweep's claim, publish and settle times), BENCH_VERBOSE (per run: rates, CPU
//! per message of RabbitMQ, PostgreSQL and the relays, sweeps by outcome,
//! arrival timeline), BENCH_WRAP (a command the relay runs under,
//! e.g. `valgrind --tool=callgrind`), BENCH_RELAY_BIN (another build of the
//! relay to run instead of this one, with its own migrations: A/B against an
//! earlier commit), BENCH_SCALE (the scale scenario's parts: drain, memory,
//! trickle), BENCH_SCALE_RELAYS (its replica counts, `1,3,6`),
//! BENCH_SCALE_LISTED (list the 10,000 names instead of `*`),
//! BENCH_LAUNCH_ROWS (the launch scenario's rows, 10,000),
//! BENCH_CEILING_PLAIN (the broker alone publishes plain messages, three
//! properties and no headers, to set this client beside standalone
//! publishing benchmarks on their own messages), plus OUTBOX_BATCH_SIZE,
//! OUTBOX_MAX_IN_FLIGHT, OUTBOX_CONCURRENCY, OUTBOX_POLL_MS, OUTBOX_WAKEUP passed to the
//! relays. Results: a table on stdout and `target/bench-relay.json`.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Waker};
use std::time::{Duration, Instant, SystemTime};

use futures_util::StreamExt;
use futures_util::future::{MaybeDone, maybe_done};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use outbox_relay::config::Config;
use outbox_relay::domain::BatchReport;
use outbox_relay::store::Store;
use serde_json::json;

/// The integration tests' harness: names, connections, the outbox table,
/// declaring an exchange and queue, probing endpoints, and the cleanup of
/// schemas and exchanges when they go out of scope.
#[path = "../tests/relay/support/mod.rs"]
#[allow(dead_code, unused_imports)]
mod support;

use support::broker::{bind, declare};
use support::db::pg_client_to;
use support::fixture::delete_on_broker;
use support::{AMQP_URL, Outbox, http_get, unique};

const ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const BENCH_DB: &str = "outbox_bench";
const DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/outbox_bench";

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// BENCH_VERBOSE: per-run detail on stderr.
fn verbose() -> bool {
    std::env::var_os("BENCH_VERBOSE").is_some()
}

fn relay_knob(name: &str, default: u64) -> u64 {
    env_num(name, default)
}

struct Knobs {
    rows: u64,
    runs: usize,
    rate: u64,
    steady: Duration,
    idle: Duration,
    only: Option<Vec<String>>,
    drains: Option<Vec<String>>,
    batch_size: u64,
    max_in_flight: u64,
    poll_ms: u64,
}

impl Knobs {
    fn from_env() -> Knobs {
        let batch_size = relay_knob("OUTBOX_BATCH_SIZE", 256);
        Knobs {
            rows: env_num("BENCH_ROWS", 100_000),
            runs: env_num("BENCH_RUNS", 3) as usize,
            rate: env_num("BENCH_RATE", 1_000),
            steady: Duration::from_secs(env_num("BENCH_STEADY_SECS", 20)),
            idle: Duration::from_secs(env_num("BENCH_IDLE_SECS", 10)),
            only: std::env::var("BENCH_ONLY")
                .ok()
                .map(|v| v.split(',').map(str::to_string).collect()),
            drains: std::env::var("BENCH_DRAIN")
                .ok()
                .map(|v| v.split(',').map(str::to_string).collect()),
            batch_size,
            max_in_flight: relay_knob("OUTBOX_MAX_IN_FLIGHT", batch_size),
            poll_ms: relay_knob("OUTBOX_POLL_MS", 200),
        }
    }

    /// BENCH_DRAIN narrows the drain to some of its shapes, e.g.
    /// `100x3,1x1,1x1/backlog`.
    fn wants_drain(&self, shape: Shape) -> bool {
        self.drains
            .as_ref()
            .is_none_or(|d| d.iter().any(|s| *s == shape.token()))
    }

    fn wants(&self, scenario: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|s| s == scenario))
    }
}

/// A drain's shape: tenants, relay processes, and whether the queue is consumed.
#[derive(Debug, Clone, Copy)]
struct Shape {
    tenants: usize,
    relays: usize,
    setting: Setting,
}

impl Shape {
    const fn consumed(tenants: usize, relays: usize) -> Shape {
        Shape {
            tenants,
            relays,
            setting: Setting::Consumed,
        }
    }

    const fn growing(tenants: usize, relays: usize) -> Shape {
        Shape {
            tenants,
            relays,
            setting: Setting::Growing,
        }
    }

    /// Its name in BENCH_DRAIN: `1x1`, or `1x1/backlog` with no consumer.
    fn token(self) -> String {
        let suffix = match self.setting {
            Setting::Consumed => "",
            Setting::Growing => "/backlog",
        };
        format!("{}x{}{suffix}", self.tenants, self.relays)
    }
}

/// A schema with the relay's table, in the bench database (dropped when
/// the table goes out of scope), and the bench's own fills and counts.
struct Table(Outbox);

impl std::ops::Deref for Table {
    type Target = Outbox;

    fn deref(&self) -> &Outbox {
        &self.0
    }
}

/// The relay binary the benchmark runs: this build's, or BENCH_RELAY_BIN
/// (another build, e.g. an earlier commit's, to compare the two on the same
/// machine in the same hour).
fn relay_binary() -> String {
    std::env::var("BENCH_RELAY_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_outbox-relay").to_string())
}

impl Table {
    async fn create() -> Table {
        if let Ok(binary) = std::env::var("BENCH_RELAY_BIN") {
            // That build's own migrations, so its statements meet the
            // indexes they were written for.
            let schema = unique("b");
            let status = Command::new(binary)
                .arg("migrate")
                .env("OUTBOX_TENANTS", "bench")
                .env("OUTBOX_DATABASE_URL", DATABASE_URL)
                .env("OUTBOX_AMQP_URL", AMQP_URL)
                .env("OUTBOX_SCHEMA", &schema)
                .env("OUTBOX_EXCHANGE", "bench")
                .env("OUTBOX_LOG", "warn")
                .status()
                .expect("the relay binary runs");
            assert!(status.success(), "migrate with BENCH_RELAY_BIN");
            return Table::adopt(schema).await;
        }
        Table(Outbox::create_in(DATABASE_URL, "b").await)
    }

    /// The table in `schema`, made by the caller.
    async fn adopt(schema: String) -> Table {
        let client = pg_client_to(DATABASE_URL).await;
        Table(Outbox::adopt_in(
            DATABASE_URL,
            schema,
            "outbox_message".into(),
            client,
        ))
    }

    /// `rows` rows spread round-robin over `tenants`, payloads of `size` bytes.
    async fn fill(&self, tenants: &[String], rows: u64, size: usize) {
        self.fill_with_headers(tenants, rows, size, "NULL").await;
    }

    /// As [`Table::fill`], each row's `headers` the SQL expression `headers`.
    async fn fill_with_headers(&self, tenants: &[String], rows: u64, size: usize, headers: &str) {
        let sql = format!(
            "INSERT INTO {} (tenant_id, kind, subject_id, payload, headers)
             SELECT ($1::text[])[1 + (g % cardinality($1::text[]))], 'thing.changed', 's-' || g, repeat('x', $2), h
             FROM generate_series(0, $3::bigint - 1) g, (SELECT ({headers})::jsonb AS h) c",
            self.qualified()
        );
        let size = size as i32;
        self.client
            .execute(&sql, &[&tenants, &size, &(rows as i64)])
            .await
            .expect("fill");
        self.client
            .batch_execute(&format!("ANALYZE {}", self.qualified()))
            .await
            .expect("analyze");
    }

    /// Rows refused at least once (e.g. `too_large`), still pending.
    async fn refused(&self) -> i64 {
        self.count("published_at IS NULL AND attempts > 0").await
    }

    async fn count(&self, condition: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE {condition}",
            self.qualified()
        );
        self.client
            .query_one(&sql, &[])
            .await
            .expect("count")
            .get(0)
    }
}

/// What a consumer saw: arrival times and, from the header, occurred_at.
#[derive(Default)]
struct Arrivals {
    count: usize,
    first: Option<Instant>,
    last: Option<Instant>,
    delays_ms: Vec<f64>,
    /// Arrivals per 10 ms since the first (for BENCH_VERBOSE's timeline).
    bins: Vec<u32>,
    /// The machine's busy CPU time (all processes) at the first arrival.
    busy_at_first: Option<Duration>,
    /// Arrivals the first sighting found beyond the first (a queue's count
    /// is seen only every few ms): not part of the rate.
    counted_before_first: usize,
    /// Arrivals of tenants named `hot…` (the scale scenario) per 10 ms since
    /// the first arrival.
    hot_bins: Vec<u32>,
    /// Each message's id (`message_id`) and when it arrived.
    arrived: Vec<(i64, Instant)>,
}

impl Arrivals {
    /// When (seconds after the first arrival) each fraction had arrived.
    fn timeline(&self, fractions: &[f64]) -> Vec<f64> {
        fractions
            .iter()
            .map(|f| {
                let want = (self.count as f64 * f).ceil() as u64;
                let mut seen = 0u64;
                let bin = self
                    .bins
                    .iter()
                    .position(|n| {
                        seen += u64::from(*n);
                        seen >= want
                    })
                    .unwrap_or(self.bins.len());
                bin as f64 / 100.0
            })
            .collect()
    }
}

/// Whether a consumer keeps the queue empty, or the queue has none and grows
/// (a backlog drained while the consumers are down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setting {
    Consumed,
    Growing,
}

impl Setting {
    fn label(self) -> &'static str {
        match self {
            Setting::Consumed => "with a consumer",
            Setting::Growing => "no consumer, queue growing",
        }
    }
}

/// How often the queue's message count is asked for when it has no consumer.
const QUEUE_COUNT_EVERY: Duration = Duration::from_millis(10);

/// A durable topic exchange bound to a durable queue, with a consumer that
/// records each arrival, or (`Setting::Growing`) none: arrivals are then
/// the queue's message count (`queue.declare`, passive), asked every
/// [`QUEUE_COUNT_EVERY`].
struct Exchange {
    name: String,
    queue: String,
    /// Held open for the consumer's channel.
    _connection: Connection,
    arrivals: Arc<Mutex<Arrivals>>,
}

impl Drop for Exchange {
    /// Deletes the queue and the exchange.
    fn drop(&mut self) {
        delete_on_broker(AMQP_URL, &self.name, vec![self.queue.clone()]);
    }
}

impl Exchange {
    /// Each row's delay, ms, from when its commit returned to its arrival
    /// (`committed`: row ids and those instants; an exchange made with
    /// `record_delay`). Rows that have not arrived are left out.
    fn delays(&self, committed: &[(i64, Instant)]) -> Vec<f64> {
        let arrivals = self.arrivals.lock().unwrap();
        let at: std::collections::HashMap<i64, Instant> =
            arrivals.arrived.iter().copied().collect();
        committed
            .iter()
            .filter_map(|(id, commit)| {
                Some(at.get(id)?.saturating_duration_since(*commit).as_secs_f64() * 1000.0)
            })
            .collect()
    }

    async fn create(record_delay: bool) -> Exchange {
        Exchange::create_as(record_delay, Setting::Consumed).await
    }

    async fn create_as(record_delay: bool, setting: Setting) -> Exchange {
        let name = unique("bx");
        let queue = unique("bq");
        let connection = Connection::connect(AMQP_URL, ConnectionProperties::default())
            .await
            .expect("RabbitMQ is reachable");
        let channel = connection.create_channel().await.expect("channel");
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        declare(&channel, &name, &queue, durable).await;
        bind(&channel, &queue, &name, "#").await;
        let arrivals = Arc::new(Mutex::new(Arrivals::default()));
        if setting == Setting::Growing {
            let counting = connection.create_channel().await.expect("channel");
            tokio::spawn(count_queue(counting, queue.clone(), arrivals.clone()));
            return Exchange {
                name,
                queue,
                _connection: connection,
                arrivals,
            };
        }
        let consumer_channel = connection.create_channel().await.expect("channel");
        let mut consumer = consumer_channel
            .basic_consume(
                queue.as_str().into(),
                "bench".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let sink = arrivals.clone();
        tokio::spawn(async move {
            let _keep = consumer_channel;
            while let Some(Ok(delivery)) = consumer.next().await {
                let now = Instant::now();
                let delay = record_delay
                    .then(|| occurred_delay_ms(&delivery.properties))
                    .flatten();
                let mut a = sink.lock().unwrap();
                a.count += 1;
                if a.first.is_none() {
                    a.busy_at_first = Some(machine_busy());
                }
                let first = *a.first.get_or_insert(now);
                a.last = Some(now);
                let bin = (now - first).as_millis() as usize / 10;
                if a.bins.len() <= bin {
                    a.bins.resize(bin + 1, 0);
                }
                a.bins[bin] += 1;
                if delivery.routing_key.as_str().starts_with("hot") {
                    if a.hot_bins.len() <= bin {
                        a.hot_bins.resize(bin + 1, 0);
                    }
                    a.hot_bins[bin] += 1;
                }
                if let Some(d) = delay {
                    a.delays_ms.push(d);
                }
                if let Some(id) = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|id| id.as_str().parse().ok())
                {
                    a.arrived.push((id, now));
                }
            }
        });
        Exchange {
            name,
            queue,
            _connection: connection,
            arrivals,
        }
    }

    fn count(&self) -> usize {
        self.arrivals.lock().unwrap().count
    }

    async fn wait_for(&self, n: usize, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while self.count() < n {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }

    /// The whole machine's CPU time per message since the first arrival, µs
    /// (call right after the last).
    fn machine_cpu_per_message(&self) -> f64 {
        let a = self.arrivals.lock().unwrap();
        let busy = machine_busy().saturating_sub(a.busy_at_first.unwrap_or_default());
        busy.as_secs_f64() * 1e6 / a.count.max(1) as f64
    }

    /// Messages per second between the first and the last arrival.
    fn rate(&self) -> f64 {
        let a = self.arrivals.lock().unwrap();
        match (a.first, a.last) {
            (Some(f), Some(l)) if a.count > 1 + a.counted_before_first => {
                (a.count - 1 - a.counted_before_first) as f64 / l.duration_since(f).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

/// Follows a queue with no consumer: its message count as arrivals, the
/// first arrival when it first holds a message; stops when the queue is gone.
async fn count_queue(channel: Channel, queue: String, arrivals: Arc<Mutex<Arrivals>>) {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    loop {
        let Ok(declared) = channel
            .queue_declare(queue.as_str().into(), passive, FieldTable::default())
            .await
        else {
            return;
        };
        let now = Instant::now();
        let count = declared.message_count() as usize;
        {
            let mut a = arrivals.lock().unwrap();
            if count > a.count {
                if a.first.is_none() {
                    a.busy_at_first = Some(machine_busy());
                    a.first = Some(now);
                    // Those already there count from here on, not in the rate.
                    a.counted_before_first = count - 1;
                }
                let bin = (now - a.first.unwrap_or(now)).as_millis() as usize / 10;
                if a.bins.len() <= bin {
                    a.bins.resize(bin + 1, 0);
                }
                a.bins[bin] += (count - a.count) as u32;
                a.count = count;
                a.last = Some(now);
            }
        }
        tokio::time::sleep(QUEUE_COUNT_EVERY).await;
    }
}

/// Sweeps by outcome, summed over tenants, from a relay's `/metrics`.
async fn sweep_counts(addr: &str) -> Vec<(String, f64)> {
    let (_, text) = http_get(addr.parse().expect("a relay's address"), "/metrics").await;
    text.lines()
        .filter(|l| l.starts_with("outbox_sweeps_total{"))
        .filter_map(|l| {
            let outcome = l.split("outcome=\"").nth(1)?.split('"').next()?;
            let n = l.rsplit(' ').next()?.parse().ok()?;
            Some((outcome.to_string(), n))
        })
        .collect()
}

/// CPU seconds used so far by RabbitMQ (`beam.smp`) and by PostgreSQL (every
/// `postgres` process, plus the exited backends the postmaster has reaped).
fn service_cpu() -> (f64, f64) {
    let (mut broker, mut database) = (0.0, 0.0);
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return (0.0, 0.0);
    };
    for entry in entries.flatten() {
        let Some(stat) = ProcStat::read(&entry.path()) else {
            continue;
        };
        match stat.comm.as_str() {
            "beam.smp" => broker += stat.cpu_seconds(),
            "postgres" => {
                database += stat.cpu_seconds();
                let parent = std::fs::read_to_string(format!("/proc/{}/comm", stat.ppid))
                    .unwrap_or_default();
                if parent.trim() != "postgres" {
                    database += stat.children_cpu_seconds();
                }
            }
            _ => {}
        }
    }
    (broker, database)
}

/// The parts of `/proc/<pid>/stat` the benchmark reads.
struct ProcStat {
    comm: String,
    ppid: String,
    /// The fields after the command name (state is index 0).
    fields: Vec<f64>,
}

impl ProcStat {
    fn read(process: &std::path::Path) -> Option<ProcStat> {
        let stat = std::fs::read_to_string(process.join("stat")).ok()?;
        let (head, rest) = stat.rsplit_once(')')?;
        Some(ProcStat {
            comm: head.split_once('(').map_or("", |(_, c)| c).to_string(),
            ppid: rest
                .split_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_string(),
            fields: rest
                .split_whitespace()
                .map(|v| v.parse().unwrap_or(0.0))
                .collect(),
        })
    }

    fn seconds(&self, index: usize) -> f64 {
        self.fields.get(index).copied().unwrap_or(0.0) / 100.0
    }

    /// utime + stime.
    fn cpu_seconds(&self) -> f64 {
        self.seconds(11) + self.seconds(12)
    }

    /// cutime + cstime: the children it has reaped.
    fn children_cpu_seconds(&self) -> f64 {
        self.seconds(13) + self.seconds(14)
    }
}

/// CPU time the machine has spent busy (all cores, all processes), from /proc/stat.
fn machine_busy() -> Duration {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let line = stat.lines().next().unwrap_or_default();
    // cpu user nice system idle iowait irq softirq steal …
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let busy: u64 = [0, 1, 2, 5, 6, 7]
        .iter()
        .filter_map(|i| ticks.get(*i))
        .sum();
    Duration::from_millis(busy * 10)
}

fn occurred_delay_ms(properties: &BasicProperties) -> Option<f64> {
    let headers = properties.headers().as_ref()?;
    let AMQPValue::LongString(text) = headers.inner().get("outbox-occurred-at")? else {
        return None;
    };
    let text = std::str::from_utf8(text.as_bytes()).ok()?;
    let occurred =
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    let now = time::OffsetDateTime::from(SystemTime::now());
    Some((now - occurred).as_seconds_f64() * 1000.0)
}

/// The relay binary (release profile under `cargo bench`).
struct RelayProcess(Child);

impl RelayProcess {
    fn spawn(table: &Table, exchange: &Exchange, tenants: &[String]) -> RelayProcess {
        RelayProcess::spawn_on(table, exchange, tenants, "127.0.0.1:0")
    }

    fn spawn_on(
        table: &Table,
        exchange: &Exchange,
        tenants: &[String],
        http_addr: &str,
    ) -> RelayProcess {
        RelayProcess::spawn_with(table, exchange, tenants, http_addr, &[])
    }

    /// As `spawn_on`, with `settings` (e.g. `OUTBOX_POLL_MS`) set last.
    fn spawn_with(
        table: &Table,
        exchange: &Exchange,
        tenants: &[String],
        http_addr: &str,
        settings: &[(&str, String)],
    ) -> RelayProcess {
        let binary = relay_binary();
        // BENCH_WRAP runs the relay under another program, e.g.
        // `valgrind --tool=callgrind` to count its instructions per message.
        let wrap = std::env::var("BENCH_WRAP").unwrap_or_default();
        let mut words = wrap.split_whitespace();
        let mut command = match words.next() {
            Some(program) => {
                let mut command = Command::new(program);
                command.args(words).arg(binary);
                command
            }
            None => Command::new(binary),
        };
        for (name, _) in std::env::vars() {
            if name.starts_with("OUTBOX_")
                && !matches!(
                    name.as_str(),
                    "OUTBOX_BATCH_SIZE"
                        | "OUTBOX_MAX_IN_FLIGHT"
                        | "OUTBOX_CONCURRENCY"
                        | "OUTBOX_POLL_MS"
                        | "OUTBOX_WAKEUP"
                )
            {
                command.env_remove(name);
            }
        }
        command
            .env("OUTBOX_TENANTS", tenants.join(","))
            .env("OUTBOX_DATABASE_URL", DATABASE_URL)
            .env("OUTBOX_AMQP_URL", AMQP_URL)
            .env("OUTBOX_SCHEMA", &table.schema)
            .env("OUTBOX_EXCHANGE", &exchange.name)
            .env("OUTBOX_HTTP_ADDR", http_addr)
            .env("OUTBOX_LOG_FORMAT", "json")
            .envs(settings.iter().map(|(name, value)| (name, value)))
            .stdin(Stdio::null());
        // BENCH_RELAY_LOG: the relays' log filter (e.g.
        // `outbox_relay::relay=debug` for each sweep's phases), their logs
        // on the benchmark's stdout.
        match std::env::var("BENCH_RELAY_LOG") {
            Ok(filter) => command.env("OUTBOX_LOG", filter).stdout(Stdio::inherit()),
            Err(_) => command.env("OUTBOX_LOG", "warn").stdout(Stdio::null()),
        }
        .stderr(Stdio::inherit());
        RelayProcess(command.spawn().expect("the relay binary starts"))
    }

    /// User + system CPU seconds so far.
    fn cpu_seconds(&self) -> f64 {
        ProcStat::read(std::path::Path::new(&format!("/proc/{}", self.0.id())))
            .map_or(0.0, |stat| stat.cpu_seconds())
    }

    /// Peak resident set size, MiB.
    fn peak_rss_mib(&self) -> f64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.0.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(0.0, |kib| kib / 1024.0)
    }

    fn stop(mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.0.id().to_string())
            .status();
        let _ = self.0.wait();
    }
}

fn tenants(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("t{i:04}")).collect()
}

/// BENCH_CEILING_PLAIN: the broker alone publishes messages with three
/// properties and no headers (delivery mode, content type, message id), as
/// the usual standalone publishing benchmarks do, to compare this client with
/// them on the same messages; by default it publishes the relay's envelope.
fn plain_properties(id: i64) -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(id.to_string().into())
}

fn payload_properties(id: i64) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("outbox-id".into(), AMQPValue::LongLongInt(id));
    headers.insert(
        "outbox-tenant-id".into(),
        AMQPValue::LongString(LongString::from("t0000")),
    );
    headers.insert(
        "outbox-subject-id".into(),
        AMQPValue::LongString(LongString::from(format!("s-{id}"))),
    );
    headers.insert(
        "outbox-occurred-at".into(),
        AMQPValue::LongString(LongString::from("2026-11-30T09:00:00.000000Z")),
    );
    BasicProperties::default()
        .with_message_id(id.to_string().into())
        .with_type("thing.changed".into())
        .with_timestamp(1_796_000_000)
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_app_id("outbox-relay".into())
        .with_headers(headers)
}

type Confirm<'a> =
    Pin<Box<MaybeDone<Pin<Box<dyn Future<Output = lapin::Result<Confirmation>> + Send + 'a>>>>>;

/// The broker alone: `rows` messages, at most `window` unconfirmed at once,
/// each publish issued without awaiting its send, and each confirm's slot
/// refilled as soon as it is seen (a sliding window; it measured a few per
/// cent above waiting for a whole window's confirms before the next window,
/// which the standalone publishing benchmarks do).
async fn broker_ceiling(rows: u64, size: usize, window: usize, setting: Setting) -> Run {
    let exchange = Exchange::create_as(false, setting).await;
    let connection = Connection::connect(AMQP_URL, ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let services_before = service_cpu();
    let body = vec![b'x'; size];
    let plain = std::env::var_os("BENCH_CEILING_PLAIN").is_some();
    let check = |mut confirm: Confirm<'_>| {
        let result = confirm.as_mut().take_output().expect("done");
        assert!(
            matches!(result, Ok(Confirmation::Ack(None))),
            "ceiling publish refused: {result:?}"
        );
    };
    let mut in_flight: std::collections::VecDeque<Confirm<'_>> =
        std::collections::VecDeque::with_capacity(window);
    let mut id = 0i64;
    while (id as u64) < rows || !in_flight.is_empty() {
        while in_flight.len() < window && (id as u64) < rows {
            id += 1;
            let send = channel.basic_publish(
                exchange.name.as_str().into(),
                "t0000.thing.changed".into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &body,
                if plain {
                    plain_properties(id)
                } else {
                    payload_properties(id)
                },
            );
            let publish: Pin<Box<dyn Future<Output = lapin::Result<Confirmation>> + Send + '_>> =
                Box::pin(async move { send.await?.await });
            let mut confirm = Box::pin(maybe_done(publish));
            // As the relay does: queue the frames now, with a no-op waker, so
            // only the confirm being awaited wakes this task.
            let _ = confirm
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()));
            in_flight.push_back(confirm);
        }
        // The broker confirms in order: the oldest first, then every later
        // one its (multiple) ack settled too, each slot free at once.
        let mut oldest = in_flight.pop_front().expect("a publish in flight");
        oldest.as_mut().await;
        check(oldest);
        while let Some(next) = in_flight.front_mut() {
            if next
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()))
                .is_pending()
            {
                break;
            }
            check(in_flight.pop_front().expect("the front"));
        }
    }
    assert!(
        exchange
            .wait_for(rows as usize, Duration::from_secs(120))
            .await,
        "ceiling: not all messages arrived"
    );
    let run = Run {
        rate: exchange.rate(),
        cpu_us: exchange.machine_cpu_per_message(),
    };
    if verbose() {
        let services_after = service_cpu();
        eprintln!(
            "  ceiling: {:.0} msg/s; machine CPU {:.1} µs per message; RabbitMQ {:.1} µs",
            run.rate,
            run.cpu_us,
            (services_after.0 - services_before.0) * 1e6 / rows as f64,
        );
    }
    let _ = connection.close(200, "done".into()).await;
    run
}

/// The database alone: the relay's claim + read + mark + commit over `rows` rows of one tenant.
async fn database_ceiling(rows: u64, size: usize, batch_size: u64) -> f64 {
    let table = Table::create().await;
    let names = tenants(1);
    table.fill(&names, rows, size).await;
    let mut config = Config::with_tenants(names.clone());
    config.database_url = DATABASE_URL.parse().expect("database url");
    config.schema = table.schema.clone();
    config.batch_size = batch_size as usize;
    let store = Store::new(&config).expect("store");
    let started = Instant::now();
    let mut done = 0u64;
    loop {
        let claim = store
            .claim(&names[0], config.max_bytes_in_flight, i64::MIN)
            .await
            .expect("claim")
            .expect("taken");
        let ids: Vec<i64> = claim.rows().iter().map(|r| r.id).collect();
        if ids.is_empty() {
            claim.rollback().await.expect("rollback");
            break;
        }
        done += ids.len() as u64;
        claim
            .settle(&BatchReport {
                confirmed_at: vec![std::time::SystemTime::now(); ids.len()],
                refusal: None,
            })
            .await
            .expect("settle");
    }
    done as f64 / started.elapsed().as_secs_f64()
}

/// A measured run: consumer-side rate, and the whole machine's CPU time per message.
#[derive(Debug, Clone, Copy)]
struct Run {
    rate: f64,
    cpu_us: f64,
}

/// N rows over `tenant_count` tenants, drained by `relays` relay processes.
async fn drain(rows: u64, size: usize, shape: Shape) -> Run {
    let Shape {
        tenants: tenant_count,
        relays,
        setting,
    } = shape;
    let table = Table::create().await;
    let exchange = Exchange::create_as(false, setting).await;
    let names = tenants(tenant_count);
    table.fill(&names, rows, size).await;
    let verbose = verbose();
    // Verbose runs give each relay a known port, to read its sweep counts.
    let addrs: Vec<String> = (0..relays)
        .map(|i| {
            if verbose {
                format!("127.0.0.1:{}", 19_400 + i)
            } else {
                "127.0.0.1:0".into()
            }
        })
        .collect();
    let services_before = service_cpu();
    let processes: Vec<RelayProcess> = addrs
        .iter()
        .map(|addr| RelayProcess::spawn_on(&table, &exchange, &names, addr))
        .collect();
    let arrived = exchange
        .wait_for(rows as usize, Duration::from_secs(600))
        .await;
    assert!(arrived, "drain: {} of {rows} arrived", exchange.count());
    let rate = exchange.rate();
    let machine_cpu = exchange.machine_cpu_per_message();
    if verbose {
        let services_after = service_cpu();
        eprintln!(
            "  drain {}: since the relays started, per message: RabbitMQ {:.1} µs, PostgreSQL {:.1} µs",
            shape.token(),
            (services_after.0 - services_before.0) * 1e6 / rows as f64,
            (services_after.1 - services_before.1) * 1e6 / rows as f64,
        );
        let mut outcomes = BTreeMap::<String, f64>::new();
        for addr in &addrs {
            for (outcome, n) in sweep_counts(addr).await {
                *outcomes.entry(outcome).or_default() += n;
            }
        }
        eprintln!("  drain {}: sweeps {outcomes:?}", shape.token());
        let cpu: f64 = processes.iter().map(RelayProcess::cpu_seconds).sum();
        let fractions = [0.1, 0.5, 0.9, 0.99, 0.999, 1.0];
        let at = exchange.arrivals.lock().unwrap().timeline(&fractions);
        let at: Vec<String> = fractions
            .iter()
            .zip(at)
            .map(|(f, t)| format!("{}% {t:.2}s", f * 100.0))
            .collect();
        eprintln!(
            "  drain {}: {rate:.0} msg/s; machine CPU {machine_cpu:.1} µs per message, relays {:.1}; arrived {}",
            shape.token(),
            cpu * 1e6 / rows as f64,
            at.join(", ")
        );
    }
    for p in processes {
        p.stop();
    }
    assert_eq!(table.all_pending().await, 0, "drain: every row marked");
    Run {
        rate,
        cpu_us: machine_cpu,
    }
}

/// `rows` rows of 256 B over `tenant_count` tenants, pending before the
/// relay starts: seconds from launching its process to its last row marked
/// (the whole job as a user sees it, start-up included), asked every 5 ms.
/// The same measure as a standalone peer's `N msgs in S s`.
async fn from_launch(rows: u64, tenant_count: usize) -> f64 {
    let table = Table::create().await;
    let exchange = Exchange::create(false).await;
    let names = tenants(tenant_count);
    table.fill(&names, rows, 256).await;
    let started = Instant::now();
    let relay = RelayProcess::spawn(&table, &exchange, &names);
    let deadline = started + Duration::from_secs(600);
    while table.all_pending().await > 0 {
        assert!(Instant::now() < deadline, "launch: rows still pending");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = started.elapsed().as_secs_f64();
    relay.stop();
    assert!(
        exchange
            .wait_for(rows as usize, Duration::from_secs(60))
            .await,
        "launch: {} of {rows} arrived",
        exchange.count()
    );
    took
}

/// A writer at `rate` rows/s over 10 tenants for `duration`, against a relay
/// with `settings`; delays in ms from each row's commit (its autocommit
/// INSERT returning to the writer) to its receipt. (`occurred_at`, `now()` at
/// the transaction's start, would add the commit's own WAL flush, which on a
/// busy disk is tens of milliseconds.)
async fn steady(rate: u64, duration: Duration, settings: &[(&str, String)]) -> Vec<f64> {
    let table = Table::create().await;
    let exchange = Exchange::create(true).await;
    let names = tenants(10);
    let relay = RelayProcess::spawn_with(&table, &exchange, &names, "127.0.0.1:0", settings);
    tokio::time::sleep(Duration::from_millis(500)).await; // let the relay connect before the clock starts
    let writers: Vec<tokio_postgres::Client> =
        futures_util::future::join_all((0..4).map(|_| pg_client_to(DATABASE_URL))).await;
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'thing.changed', 's', $2) RETURNING id",
        table.qualified()
    );
    let payload = "x".repeat(256);
    let total = rate * duration.as_secs();
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    let writers = Arc::new(writers);
    for i in 0..total {
        tokio::time::sleep_until(started + interval * i as u32).await;
        let writers = writers.clone();
        let tenant = names[(i % 10) as usize].clone();
        let insert = insert.clone();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            let id: i64 = writers[(i % 4) as usize]
                .query_one(&insert, &[&tenant, &payload])
                .await
                .expect("insert")
                .get(0);
            (id, Instant::now())
        }));
    }
    let mut committed = Vec::with_capacity(tasks.len());
    for t in tasks {
        committed.push(t.await.expect("writer"));
    }
    assert!(
        exchange
            .wait_for(total as usize, Duration::from_secs(60))
            .await,
        "steady: not all arrived"
    );
    relay.stop();
    exchange.delays(&committed)
}

/// The table's size with its indexes and TOAST, bytes.
async fn table_bytes(table: &Table) -> i64 {
    table
        .client
        .query_one(
            "SELECT pg_total_relation_size($1::text::regclass)",
            &[&table.qualified()],
        )
        .await
        .expect("table size")
        .get(0)
}

/// Retention (a): a writer at `rate` rows/s over 10 tenants (a multi-row
/// INSERT every 100 ms) for `duration`, beside a relay with `retention_ms`
/// (none: 0); the table's total size, MiB, and its rows, every 5 s. (Space
/// a DELETE frees is reused once autovacuum has passed.)
async fn retention_sizes(rate: u64, duration: Duration, retention_ms: u64) -> Vec<(u64, f64, i64)> {
    let table = Table::create().await;
    let exchange = Exchange::create(false).await;
    let names = tenants(10);
    let settings = [("OUTBOX_RETENTION_MS", retention_ms.to_string())];
    let relay = RelayProcess::spawn_with(&table, &exchange, &names, "127.0.0.1:0", &settings);
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload)
         SELECT ($1::text[])[1 + (g % 10)], 'thing.changed', 's-' || g, repeat('x', 256)
         FROM generate_series(1, $2::bigint) g",
        table.qualified()
    );
    let per_tick = (rate / 10).max(1) as i64;
    // Space a DELETE frees is reused once the table is vacuumed. Where the
    // server's autovacuum is off (as on the machine these figures come
    // from), the benchmark stands in for it: a VACUUM each
    // `autovacuum_naptime` (1 min by default), as autovacuum would run on a
    // table with that many dead rows.
    let autovacuum: String = table
        .client
        .query_one("SHOW autovacuum", &[])
        .await
        .expect("show autovacuum")
        .get(0);
    let stand_in_vacuum = autovacuum != "on";
    if stand_in_vacuum && retention_ms > 0 {
        println!(
            "retention: the server's autovacuum is off; the benchmark runs VACUUM once a minute in its stead"
        );
    }
    let started = tokio::time::Instant::now();
    let mut sizes = Vec::new();
    let mut tick = 0u32;
    while started.elapsed() < duration {
        tokio::time::sleep_until(started + Duration::from_millis(100) * tick).await;
        table
            .client
            .execute(&insert, &[&names, &per_tick])
            .await
            .expect("insert");
        if stand_in_vacuum && tick > 0 && tick.is_multiple_of(600) {
            table
                .client
                .batch_execute(&format!("VACUUM {}", table.qualified()))
                .await
                .expect("vacuum");
        }
        if tick.is_multiple_of(50) {
            let bytes = table_bytes(&table).await;
            let rows = table.count("true").await;
            sizes.push((u64::from(tick / 10), bytes as f64 / (1 << 20) as f64, rows));
        }
        tick += 1;
    }
    relay.stop();
    sizes
}

/// Retention (b): `rows` pending rows over 10 tenants behind 3 × `rows`
/// rows published an hour ago; rows/s of the drain, with a relay whose
/// `retention_ms` (10 s) deletes the old rows meanwhile, or none.
async fn retention_drain(rows: u64, retention: bool) -> f64 {
    let table = Table::create().await;
    let exchange = Exchange::create(false).await;
    let names = tenants(10);
    table.fill(&names, rows * 3, 256).await;
    table
        .client
        .batch_execute(&format!(
            "UPDATE {} SET published_at = now() - interval '1 hour'",
            table.qualified()
        ))
        .await
        .expect("publish the old rows");
    table
        .client
        .batch_execute(&format!("VACUUM ANALYZE {}", table.qualified()))
        .await
        .expect("vacuum");
    table.fill(&names, rows, 256).await;
    let retention_ms = if retention { 10_000 } else { 0 };
    let settings = [("OUTBOX_RETENTION_MS", retention_ms.to_string())];
    let started = Instant::now();
    let relay = RelayProcess::spawn_with(&table, &exchange, &names, "127.0.0.1:0", &settings);
    assert!(
        exchange
            .wait_for(rows as usize, Duration::from_secs(600))
            .await,
        "retention drain: not all arrived"
    );
    let rate = rows as f64 / started.elapsed().as_secs_f64();
    let left = table
        .count("published_at < now() - interval '30 minutes'")
        .await;
    if verbose() {
        eprintln!(
            "retention drain (retention {retention}): {rate:.0} rows/s, old rows left {left}"
        );
    }
    relay.stop();
    rate
}

/// 1,000 idle tenants: (transactions per poll interval, CPU seconds over
/// `duration`, peak RSS MiB). Measured differentially: the relay runs once for
/// 2 s and once for 2 s + `duration`, and each run is counted from before it
/// starts to after it exits (its backends flush their statistics then), so
/// start-up cancels out and no statistics are still in flight.
async fn idle(duration: Duration, poll_ms: u64) -> (f64, f64, f64) {
    let table = Table::create().await;
    let exchange = Exchange::create(false).await;
    let names = tenants(1_000);
    let admin = pg_client_to(ADMIN_URL).await;
    let xacts = || async {
        let _ = admin.batch_execute("SELECT pg_stat_clear_snapshot()").await;
        let row = admin
            .query_one(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1",
                &[&BENCH_DB],
            )
            .await
            .expect("stats");
        row.get::<_, i64>(0)
    };
    let run = |length: Duration| {
        let (table, exchange, names) = (&table, &exchange, &names);
        async move {
            tokio::time::sleep(Duration::from_millis(1_500)).await; // earlier statistics land first
            let before = xacts().await;
            let started = Instant::now();
            let relay = RelayProcess::spawn(table, exchange, names);
            tokio::time::sleep(length).await;
            let cpu = relay.cpu_seconds();
            let rss = relay.peak_rss_mib();
            relay.stop();
            let ran = started.elapsed();
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            ((xacts().await - before) as f64, ran, cpu, rss)
        }
    };
    let (short_tx, short_ran, short_cpu, _) = run(Duration::from_secs(2)).await;
    let (long_tx, long_ran, long_cpu, rss) = run(Duration::from_secs(2) + duration).await;
    let polls = (long_ran - short_ran).as_millis() as f64 / poll_ms as f64;
    ((long_tx - short_tx) / polls, long_cpu - short_cpu, rss)
}

/// One row of `tenant` by `insert` (tenant, payload): autocommit, or with
/// `held`, in a transaction held open that long after the insert.
async fn write_row<T>(
    client: &tokio_postgres::Client,
    insert: &T,
    tenant: &str,
    payload: &str,
    held: Option<Duration>,
) where
    T: tokio_postgres::ToStatement + ?Sized,
{
    if held.is_some() {
        client.batch_execute("BEGIN").await.expect("begin");
    }
    client
        .execute(insert, &[&tenant, &payload])
        .await
        .expect("insert");
    if let Some(hold) = held {
        tokio::time::sleep(hold).await;
        client.batch_execute("COMMIT").await.expect("commit");
    }
}

/// How the producers' table and sessions are set up (see `producers`).
#[derive(Debug, Clone, Copy)]
enum Producers {
    /// (a) The table without the commit-order trigger: the baseline.
    NoTrigger,
    /// (b) The trigger, `outbox_relay.notify = off` on the producer sessions.
    TriggerQuiet,
    /// (c) The trigger, a session LISTENing as a relay would; no relay holds
    /// the wake-up lock, so the shared mode notifies no one.
    TriggerNotify,
    /// (d) As (c), all writers on ONE tenant (the shared lock: they do not
    /// wait for each other).
    OneTenant,
    /// (e) As (d), each transaction held open 2 ms after its insert.
    OneTenantHeld,
}

impl Producers {
    const ALL: [Producers; 5] = [
        Producers::NoTrigger,
        Producers::TriggerQuiet,
        Producers::TriggerNotify,
        Producers::OneTenant,
        Producers::OneTenantHeld,
    ];

    fn label(self) -> &'static str {
        match self {
            Producers::NoTrigger => "(a) no trigger",
            Producers::TriggerQuiet => "(b) trigger, notify off",
            Producers::TriggerNotify => "(c) trigger, a listener, no relay waiting",
            Producers::OneTenant => "(d) as (c), one tenant",
            Producers::OneTenantHeld => "(e) as (d), held 2 ms before commit",
        }
    }
}

/// Producers: single-row INSERT transactions from 4 connections (each over
/// its own tenants, or all on one) for `duration`; rows committed per second.
async fn producers(setup: Producers, duration: Duration) -> f64 {
    const WRITERS: usize = 4;
    let table = Table::create().await;
    if matches!(setup, Producers::NoTrigger) {
        table
            .client
            .batch_execute(&format!(
                "DROP TRIGGER outbox_relay_commit_order ON {}",
                table.qualified()
            ))
            .await
            .expect("drop the trigger");
    }
    // A relay's LISTEN: NOTIFY's cost at commit is paid with a listener.
    let listener = pg_client_to(DATABASE_URL).await;
    let channel = outbox_relay::migrate::wakeup_channel(&table.schema, "outbox_message");
    listener
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await
        .expect("listen");
    let one_tenant = matches!(setup, Producers::OneTenant | Producers::OneTenantHeld);
    let held = matches!(setup, Producers::OneTenantHeld).then_some(Duration::from_millis(2));
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'thing.changed', 's', $2)",
        table.qualified()
    );
    let deadline = Instant::now() + duration;
    let writers = (0..WRITERS).map(|w| {
        let insert = insert.clone();
        async move {
            let client = pg_client_to(DATABASE_URL).await;
            if matches!(setup, Producers::TriggerQuiet) {
                client
                    .batch_execute("SET outbox_relay.notify = off")
                    .await
                    .expect("set");
            }
            let payload = "x".repeat(256);
            let (mut rows, mut n) = (0u64, 0usize);
            while Instant::now() < deadline {
                let tenant = if one_tenant {
                    "t0000".to_string()
                } else {
                    format!("t{:04}", w + WRITERS * (n % 10))
                };
                n += 1;
                write_row(&client, &insert, &tenant, &payload, held).await;
                rows += 1;
            }
            rows
        }
    });
    let started = Instant::now();
    let rows: u64 = futures_util::future::join_all(writers)
        .await
        .into_iter()
        .sum();
    let rate = rows as f64 / started.elapsed().as_secs_f64();
    drop(listener);
    rate
}

/// A hot tenant: `writers` connections writing one tenant back to back, each
/// transaction `held` after its insert, for `duration`, against a relay on
/// the default configuration with `poll_ms`; each row's delay in ms from its
/// COMMIT returning to the writer to its arrival at the consumer.
async fn hot_tenant(writers: usize, held: Duration, duration: Duration, poll_ms: u64) -> Vec<f64> {
    let table = Table::create().await;
    let exchange = Exchange::create(false).await;
    let names = vec!["hot".to_string()];
    let relay = RelayProcess::spawn_with(
        &table,
        &exchange,
        &names,
        "127.0.0.1:0",
        &[("OUTBOX_POLL_MS", poll_ms.to_string())],
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ('hot', 'thing.changed', 's', $1) RETURNING id",
        table.qualified()
    );
    let deadline = Instant::now() + duration;
    let tasks = (0..writers).map(|_| {
        let insert = insert.clone();
        async move {
            let client = pg_client_to(DATABASE_URL).await;
            let statement = client.prepare(&insert).await.expect("prepare");
            let payload = "x".repeat(256);
            let mut committed = Vec::new();
            while Instant::now() < deadline {
                client.batch_execute("BEGIN").await.expect("begin");
                let id: i64 = client
                    .query_one(&statement, &[&payload])
                    .await
                    .expect("insert")
                    .get(0);
                tokio::time::sleep(held).await;
                client.batch_execute("COMMIT").await.expect("commit");
                committed.push((id, Instant::now()));
            }
            committed
        }
    });
    let committed: Vec<(i64, Instant)> = futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .flatten()
        .collect();
    let arrived = exchange
        .wait_for(committed.len(), Duration::from_secs(120))
        .await;
    assert!(arrived, "hot tenant: not every row arrived");
    relay.stop();
    exchange.delays(&committed)
}

/// Lone transactions on a quiet table: `n` times, after 300 ms of quiet (the
/// relay waits for a notification by then), one transaction inserts a row,
/// does 50 ms of other work and commits; each row's delay in ms from its
/// COMMIT returning to its arrival. `poll_ms` 1000, the default wake-up.
async fn lone_transactions(n: usize) -> Vec<f64> {
    let table = Table::create().await;
    let exchange = Exchange::create(false).await;
    let names = vec!["lone".to_string()];
    let relay = RelayProcess::spawn_with(
        &table,
        &exchange,
        &names,
        "127.0.0.1:0",
        &[("OUTBOX_POLL_MS", "1000".to_string())],
    );
    let client = pg_client_to(DATABASE_URL).await;
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ('lone', 'thing.changed', 's', '{{}}') RETURNING id",
        table.qualified()
    );
    let mut delays = Vec::new();
    for i in 0..n {
        tokio::time::sleep(Duration::from_millis(300)).await;
        client.batch_execute("BEGIN").await.expect("begin");
        client.query_one(&insert, &[]).await.expect("insert");
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.batch_execute("COMMIT").await.expect("commit");
        let committed = Instant::now();
        assert!(
            exchange.wait_for(i + 1, Duration::from_secs(10)).await,
            "lone: the row arrived"
        );
        let arrived = exchange.arrivals.lock().unwrap().last.unwrap_or(committed);
        delays.push(arrived.saturating_duration_since(committed).as_secs_f64() * 1000.0);
    }
    relay.stop();
    delays
}

/// What writers do in the writers' cost scenario.
#[derive(Debug, Clone, Copy)]
enum WriterLoad {
    /// 4 writers on one tenant, each transaction 2 ms of other work after
    /// its insert.
    OneTenantHeld,
    /// 16 writers over 64 tenants, single-row autocommit inserts flat out.
    Spread,
}

impl WriterLoad {
    fn label(self) -> &'static str {
        match self {
            WriterLoad::OneTenantHeld => "4 writers, one tenant, 2 ms after insert",
            WriterLoad::Spread => "16 writers over 64 tenants, flat out",
        }
    }
}

/// The writers' cost: rows/s and PostgreSQL CPU µs per row of `load` for
/// `duration`, on a table made by `0001` alone (`relayed` false: no trigger,
/// no later index or column, the application's own table) or by every
/// migration (the writers' lock in its shared mode), with a relay on the
/// default configuration relaying every tenant written (`tenants = "*"`).
async fn writer_cost(load: WriterLoad, relayed: bool, duration: Duration) -> (f64, f64) {
    let table = if relayed {
        Table::create().await
    } else {
        let schema = unique("b");
        let mut config = Config::with_tenants(["bench"]);
        config.database_url = DATABASE_URL.parse().expect("database url");
        config.schema = schema.clone();
        let store = Store::new(&config).expect("store");
        outbox_relay::migrate::apply(&store, &config, &outbox_relay::migrate::MIGRATIONS[..1])
            .await
            .expect("migrate 0001");
        Table::adopt(schema).await
    };
    let exchange = Exchange::create(false).await;
    let relay = RelayProcess::spawn(&table, &exchange, &["*".to_string()]);
    // The relay connects and has polled once.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (writers, held) = match load {
        WriterLoad::OneTenantHeld => (4, Some(Duration::from_millis(2))),
        WriterLoad::Spread => (16, None),
    };
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'thing.changed', 's', $2)",
        table.qualified()
    );
    let (_, pg_before) = service_cpu();
    let deadline = Instant::now() + duration;
    let tasks = (0..writers).map(|w: usize| {
        let insert = insert.clone();
        async move {
            let client = pg_client_to(DATABASE_URL).await;
            let statement = client.prepare(&insert).await.expect("prepare");
            let payload = "x".repeat(256);
            let (mut rows, mut n) = (0u64, 0usize);
            while Instant::now() < deadline {
                let tenant = match load {
                    WriterLoad::OneTenantHeld => "t00".to_string(),
                    WriterLoad::Spread => format!("t{:02}", (w + 16 * (n % 4)) % 64),
                };
                n += 1;
                write_row(&client, &statement, &tenant, &payload, held).await;
                rows += 1;
            }
            rows
        }
    });
    let started = Instant::now();
    let rows: u64 = futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .sum();
    let rate = rows as f64 / started.elapsed().as_secs_f64();
    let (_, pg_after) = service_cpu();
    let pg_us = (pg_after - pg_before) * 1e6 / rows.max(1) as f64;
    // Every row written is relayed (the relay keeps up or catches up).
    let relayed_all = exchange
        .wait_for(rows as usize, Duration::from_secs(120))
        .await;
    if verbose() {
        println!(
            "  writers {}, {}: {rate:.0} rows/s, PostgreSQL {pg_us:.1} µs/row, relayed all: {relayed_all}",
            load.label(),
            if relayed {
                "every migration, relay"
            } else {
                "0001 alone, relay"
            },
        );
    }
    relay.stop();
    (rate, pg_us)
}

/// The writers' cost of each load: runs alternating between the table made
/// by `0001` alone and the relay's table, the ratio of each pair's rates.
async fn writer_costs(report: &mut Report, runs: usize) {
    let duration = Duration::from_secs(5);
    for load in [WriterLoad::OneTenantHeld, WriterLoad::Spread] {
        let (mut plain, mut ours, mut ratios, mut cpu) = (
            Figure { runs: Vec::new() },
            Figure { runs: Vec::new() },
            Figure { runs: Vec::new() },
            Figure { runs: Vec::new() },
        );
        for _ in 0..runs {
            let (base, base_cpu) = writer_cost(load, false, duration).await;
            let (rate, rate_cpu) = writer_cost(load, true, duration).await;
            plain.runs.push(base);
            ours.runs.push(rate);
            ratios.runs.push(rate / base);
            cpu.runs.push(rate_cpu - base_cpu);
        }
        let name = format!("writers, {}", load.label());
        report.add(&format!("{name}: 0001 alone"), "rows/s", &plain, None);
        report.add(&format!("{name}: the relay's table"), "rows/s", &ours, None);
        report.add(&format!("{name}: ratio of pairs"), "×", &ratios, None);
        report.add(
            &format!("{name}: PostgreSQL CPU added"),
            "µs/row",
            &cpu,
            None,
        );
    }
}

/// The relay's default `max_payload_bytes`.
const DEFAULT_MAX_PAYLOAD_BYTES: usize = 16 << 20;

/// Headers of 4,000 small keys (about 83 KB of JSON).
const HEADERS_4000_KEYS: &str = "SELECT jsonb_object_agg('key' || lpad(k::text, 5, '0'), 'v' || k) FROM generate_series(1, 4000) k";
/// The densest header table that fits RabbitMQ's default frame_max: 14,000
/// boolean keys of 2 to 6 bytes, about 8 bytes each on the wire.
const HEADERS_DENSEST: &str =
    "SELECT jsonb_object_agg('h' || k, true) FROM generate_series(1, 14000) k";

/// Peak RSS (MiB) of one relay with the default configuration relaying
/// `rows` rows of `size` bytes, with `headers` (a SQL expression), spread
/// over `tenant_count` tenants: those within `max_payload_bytes` until they
/// have arrived, larger ones until refused.
async fn memory_peak(tenant_count: usize, rows: u64, size: usize, headers: &str) -> f64 {
    let table = Table::create().await;
    let exchange = Exchange::create(false).await;
    let names = tenants(tenant_count);
    table.fill_with_headers(&names, rows, size, headers).await;
    let relay = RelayProcess::spawn(&table, &exchange, &names);
    if size <= DEFAULT_MAX_PAYLOAD_BYTES {
        let arrived = exchange
            .wait_for(rows as usize, Duration::from_secs(600))
            .await;
        assert!(arrived, "memory: {} of {rows} arrived", exchange.count());
    } else {
        let deadline = Instant::now() + Duration::from_secs(120);
        while table.refused().await < rows as i64 {
            assert!(
                Instant::now() < deadline,
                "memory: the large rows were not refused"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let peak = relay.peak_rss_mib();
    relay.stop();
    peak
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// One figure over several runs.
struct Figure {
    runs: Vec<f64>,
}

impl Figure {
    fn median(&self) -> f64 {
        median(&mut self.runs.clone())
    }
    fn spread(&self) -> (f64, f64) {
        let min = self.runs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = self.runs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (min, max)
    }
}

async fn repeat<F, Fut>(runs: usize, mut f: F) -> Figure
where
    F: FnMut() -> Fut,
    Fut: Future<Output = f64>,
{
    let mut figure = Figure { runs: Vec::new() };
    for _ in 0..runs {
        figure.runs.push(f().await);
    }
    figure
}

/// A figure with one decimal, or four below 1 (per-row counts are small).
fn places(value: f64) -> String {
    if value != 0.0 && value.abs() < 1.0 {
        format!("{value:.4}")
    } else {
        format!("{value:.1}")
    }
}

struct Report {
    json: BTreeMap<String, serde_json::Value>,
}

impl Report {
    fn add(&mut self, name: &str, unit: &str, figure: &Figure, ceiling: Option<(&str, f64)>) {
        let (min, max) = figure.spread();
        let median = figure.median();
        let ratio = ceiling
            .map(|(label, c)| format!("{:.2} × {label}", median / c))
            .unwrap_or_default();
        let (median_text, low, high) = (places(median), places(min), places(max));
        println!("{name:<44} {median_text:>12} {unit:<8} [{low} – {high}]  {ratio}");
        self.json.insert(
            name.into(),
            json!({"median": median, "min": min, "max": max, "unit": unit, "runs": figure.runs,
                   "ratio": ceiling.map(|(_, c)| median / c), "ceiling": ceiling.map(|(l, _)| l)}),
        );
    }

    /// A drain beside the broker ceiling of the same runs: the ratio is the
    /// median of the per-run ratios (each drain over the ceiling run just
    /// before it); then the machine's CPU time per message, drain and ceiling.
    fn add_paired(&mut self, name: &str, pairs: &[(Run, Run)]) {
        let figure = |f: &dyn Fn(&(Run, Run)) -> f64| Figure {
            runs: pairs.iter().map(f).collect(),
        };
        let drain = figure(&|(_, d)| d.rate);
        let ratios = figure(&|(c, d)| d.rate / c.rate);
        let drain_cpu = figure(&|(_, d)| d.cpu_us);
        let ceiling_cpu = figure(&|(c, _)| c.cpu_us);
        let (min, max) = drain.spread();
        let (rmin, rmax) = ratios.spread();
        let (median, ratio) = (drain.median(), ratios.median());
        println!(
            "{name:<44} {median:>12.1} {:<8} [{min:.1} – {max:.1}]  {ratio:.2} × broker [{rmin:.2} – {rmax:.2}]",
            "msg/s"
        );
        println!(
            "{:<44} {:>12.1} {:<8} (broker alone: {:.1})",
            "  machine CPU time per message",
            drain_cpu.median(),
            "µs",
            ceiling_cpu.median()
        );
        self.json.insert(
            name.into(),
            json!({"median": median, "min": min, "max": max, "unit": "msg/s", "runs": drain.runs,
                   "ceiling_runs": pairs.iter().map(|(c, _)| c.rate).collect::<Vec<_>>(),
                   "ratio": ratio, "ratio_runs": ratios.runs,
                   "ceiling": "broker alone, the run just before",
                   "machine_cpu_us_per_message": drain_cpu.median(),
                   "ceiling_machine_cpu_us_per_message": ceiling_cpu.median()}),
        );
    }
}

/// Delivery delays of `knobs.runs` steady runs against relays with
/// `settings`: p50, p95, p99 and max, each beside `target`.
async fn delays(
    report: &mut Report,
    knobs: &Knobs,
    name: &str,
    settings: &[(&str, String)],
    target: (&str, f64),
) {
    let mut p = BTreeMap::<&str, Vec<f64>>::new();
    for _ in 0..knobs.runs {
        let mut delays = steady(knobs.rate, knobs.steady, settings).await;
        delays.sort_by(|a, b| a.total_cmp(b));
        for (label, q) in [("p50", 50.0), ("p95", 95.0), ("p99", 99.0), ("max", 100.0)] {
            p.entry(label).or_default().push(percentile(&delays, q));
        }
    }
    for (label, values) in p {
        report.add(
            &format!("{name}: delay {label}"),
            "ms",
            &Figure { runs: values },
            Some(target),
        );
    }
}

/// The drains of `shapes` with payloads of `size` bytes, each paired with
/// its own broker-alone runs in the same setting (consumer or none); then
/// those runs together, per setting.
async fn drains(report: &mut Report, knobs: &Knobs, shapes: &[Shape], size: usize) {
    let label = if size >= 1024 {
        format!("{} KiB", size / 1024)
    } else {
        format!("{size} B")
    };
    let mut ceilings = BTreeMap::<&str, Vec<f64>>::new();
    for &shape in shapes {
        if !knobs.wants_drain(shape) {
            continue;
        }
        let window = knobs.max_in_flight as usize;
        let pairs = paired(knobs.runs, knobs.rows, size, window, shape).await;
        let setting = shape.setting.label();
        ceilings
            .entry(setting)
            .or_default()
            .extend(pairs.iter().map(|(c, _)| c.rate));
        let name = match shape.setting {
            Setting::Consumed => format!(
                "drain: {} tenant(s), {} relay(s), {label}",
                shape.tenants, shape.relays
            ),
            Setting::Growing => format!(
                "drain, no consumer: {} tenant(s), {} relay(s), {label}",
                shape.tenants, shape.relays
            ),
        };
        report.add_paired(&name, &pairs);
    }
    for (setting, runs) in ceilings {
        report.add(
            &format!("ceiling: broker alone, {label}, {setting}"),
            "msg/s",
            &Figure { runs },
            None,
        );
    }
}

/// `runs` pairs of (broker ceiling, drain), each drain right after its own
/// ceiling run in the same setting, so a drift in the machine's speed moves
/// both alike.
async fn paired(
    runs: usize,
    rows: u64,
    size: usize,
    window: usize,
    shape: Shape,
) -> Vec<(Run, Run)> {
    let mut pairs = Vec::new();
    for _ in 0..runs {
        let ceiling = broker_ceiling(rows, size, window, shape.setting).await;
        let drain = drain(rows, size, shape).await;
        pairs.push((ceiling, drain));
    }
    pairs
}

/// The scale scenario's tenants: 10 hot ones and 9,990 others.
const SCALE_HOT: usize = 10;
const SCALE_TENANTS: usize = 10_000;

fn scale_tenants() -> (Vec<String>, Vec<String>) {
    let hot = (0..SCALE_HOT).map(|i| format!("hot{i}")).collect();
    let cold = (0..SCALE_TENANTS - SCALE_HOT)
        .map(|i| format!("t{i:04}"))
        .collect();
    (hot, cold)
}

/// One scale drain's figures.
#[derive(Debug, Clone, Copy)]
struct ScaleRun {
    rate: f64,
    /// Idle sweeps beyond one per tenant (each tenant's last sweep is idle),
    /// per published row: sweeps that found nothing.
    empty_per_row: f64,
    skipped_per_row: f64,
    relay_cpu_us: f64,
    database_cpu_us: f64,
    /// The hot tenants' rows that arrived in the first second.
    hot_first_second: f64,
}

/// `rows` rows (half over the hot tenants) drained by `relays` relays with
/// `tenants = "*"`.
async fn scale_drain(rows: u64, relays: usize) -> ScaleRun {
    let table = Table::create().await;
    let exchange = Exchange::create(false).await;
    let (hot, cold) = scale_tenants();
    table.fill(&hot, rows / 2, 256).await;
    table.fill(&cold, rows - rows / 2, 256).await;
    let addrs: Vec<String> = (0..relays)
        .map(|i| format!("127.0.0.1:{}", 19_500 + i))
        .collect();
    let services_before = service_cpu();
    // BENCH_SCALE_LISTED=1 lists the 10,000 names instead of "*" (for builds
    // that predate discovery).
    let tenants: Vec<String> = if std::env::var_os("BENCH_SCALE_LISTED").is_some() {
        hot.iter().chain(&cold).cloned().collect()
    } else {
        vec!["*".to_string()]
    };
    let processes: Vec<RelayProcess> = addrs
        .iter()
        .map(|addr| RelayProcess::spawn_on(&table, &exchange, &tenants, addr))
        .collect();
    let arrived = exchange
        .wait_for(rows as usize, Duration::from_secs(600))
        .await;
    assert!(arrived, "scale: {} of {rows} arrived", exchange.count());
    let rate = exchange.rate();
    let services_after = service_cpu();
    let relay_cpu: f64 = processes.iter().map(RelayProcess::cpu_seconds).sum();
    let mut outcomes = BTreeMap::<String, f64>::new();
    for addr in &addrs {
        for (outcome, n) in sweep_counts(addr).await {
            *outcomes.entry(outcome).or_default() += n;
        }
    }
    let idle = outcomes.get("idle").copied().unwrap_or(0.0);
    let skipped = outcomes.get("skipped").copied().unwrap_or(0.0);
    let hot_first_second = {
        let a = exchange.arrivals.lock().unwrap();
        a.hot_bins.iter().take(100).map(|n| f64::from(*n)).sum()
    };
    let run = ScaleRun {
        rate,
        empty_per_row: (idle - SCALE_TENANTS as f64).max(0.0) / rows as f64,
        skipped_per_row: skipped / rows as f64,
        relay_cpu_us: relay_cpu * 1e6 / rows as f64,
        database_cpu_us: (services_after.1 - services_before.1) * 1e6 / rows as f64,
        hot_first_second,
    };
    if verbose() {
        eprintln!("  scale {relays} relays: {run:?}; sweeps {outcomes:?}");
    }
    for p in processes {
        p.stop();
    }
    assert_eq!(table.all_pending().await, 0, "scale: every row marked");
    run
}

/// Peak RSS (MiB) of one relay with the 10,000 tenants listed: idle for 3 s
/// with nothing pending, then across one `/metrics` scrape without gzip;
/// then after each tenant relayed a row (so each has its series), idle and
/// across a scrape again.
async fn scale_memory() -> [f64; 4] {
    let table = Table::create().await;
    let exchange = Exchange::create(false).await;
    let (hot, cold) = scale_tenants();
    let names: Vec<String> = hot.into_iter().chain(cold).collect();
    let addr = "127.0.0.1:19490".to_string();
    let relay = RelayProcess::spawn_on(&table, &exchange, &names, &addr);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = relay.peak_rss_mib();
    let _ = sweep_counts(&addr).await;
    let scraped = relay.peak_rss_mib();
    table.fill(&names, SCALE_TENANTS as u64, 256).await;
    assert!(
        exchange
            .wait_for(SCALE_TENANTS, Duration::from_secs(120))
            .await,
        "scale memory: every tenant's row arrives"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let active = relay.peak_rss_mib();
    let _ = sweep_counts(&addr).await;
    let active_scraped = relay.peak_rss_mib();
    relay.stop();
    [idle, scraped, active, active_scraped]
}

/// One gzip scrape of `/metrics` at `addr`, as Prometheus asks for it:
/// how long it took, ms (NaN when it failed).
async fn scrape_gzip(addr: &str) -> f64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let started = Instant::now();
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return f64::NAN;
    };
    let request = "GET /metrics HTTP/1.1\r\nHost: relay\r\nAccept: text/plain;version=0.0.4\r\n\
                   Accept-Encoding: gzip\r\nConnection: close\r\n\r\n";
    if stream.write_all(request.as_bytes()).await.is_err() {
        return f64::NAN;
    }
    let mut body = Vec::new();
    let _ = stream.read_to_end(&mut body).await;
    if !body.starts_with(b"HTTP/1.1 200") {
        return f64::NAN;
    }
    started.elapsed().as_secs_f64() * 1000.0
}

/// Scrapes beside delivery: one relay lists the 10,000 scale tenants and a
/// probe tenant, and each tenant relays a row first (so each has its
/// series). Then the probe writes a row every 25 ms for `duration`, once
/// beside one scraper every 1.5 s and once beside two scrapers back to back
/// (gzip). Returns the first's scrape times (each one rendered) and the
/// probe's delays (commit returned to arrival) in each, ms.
async fn scrape_beside_delivery(duration: Duration) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let table = Table::create().await;
    let exchange = Exchange::create(true).await;
    let (hot, cold) = scale_tenants();
    let mut names: Vec<String> = hot.into_iter().chain(cold).collect();
    names.push("probe".into());
    let addr = "127.0.0.1:19491".to_string();
    let relay = RelayProcess::spawn_on(&table, &exchange, &names, &addr);
    table.fill(&names, names.len() as u64, 256).await;
    assert!(
        exchange
            .wait_for(names.len(), Duration::from_secs(120))
            .await,
        "scrape: every tenant's row arrives"
    );
    let writer = pg_client_to(DATABASE_URL).await;
    let insert = writer
        .prepare(&format!(
            "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ('probe', 'thing.changed', 's', $1) RETURNING id",
            table.qualified()
        ))
        .await
        .expect("prepare");
    let payload = "x".repeat(256);
    // `pause`: between one scraper's scrapes (none: back to back).
    let probe = |scrapers: usize, pause: Option<Duration>| {
        let (writer, insert, payload, addr) = (&writer, &insert, &payload, &addr);
        async move {
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let scraping: Vec<_> = (0..scrapers)
                .map(|_| {
                    let (stop, addr) = (stop.clone(), addr.clone());
                    tokio::spawn(async move {
                        let mut took = Vec::new();
                        while !stop.load(Ordering::Relaxed) {
                            took.push(scrape_gzip(&addr).await);
                            if let Some(pause) = pause {
                                tokio::time::sleep(pause).await;
                            }
                        }
                        took
                    })
                })
                .collect();
            let started = tokio::time::Instant::now();
            let mut committed = Vec::new();
            let mut n = 0u32;
            while started.elapsed() < duration {
                tokio::time::sleep_until(started + Duration::from_millis(25) * n).await;
                let id: i64 = writer
                    .query_one(insert, &[payload])
                    .await
                    .expect("probe insert")
                    .get(0);
                committed.push((id, Instant::now()));
                n += 1;
            }
            stop.store(true, Ordering::Relaxed);
            let mut took = Vec::new();
            for scraper in scraping {
                took.extend(scraper.await.expect("scraper"));
            }
            (committed, took)
        }
    };
    // A scrape every 1.5 s, as Prometheus would: never served from the
    // cache (kept at most 250 ms), so each one is rendered.
    let (quiet, took) = probe(1, Some(Duration::from_millis(1_500))).await;
    let (scraped, _) = probe(2, None).await;
    let total = names.len() + quiet.len() + scraped.len();
    assert!(
        exchange.wait_for(total, Duration::from_secs(60)).await,
        "scrape: every probe row arrives"
    );
    relay.stop();
    let (quiet, scraped) = (exchange.delays(&quiet), exchange.delays(&scraped));
    (took, quiet, scraped)
}

/// A writer at 500 rows/s over the 10,000 tenants for `duration`, into 3
/// relays (`tenants = "*"`) with `wakeup`: delays in ms from `occurred_at`
/// to receipt.
async fn scale_trickle(duration: Duration, wakeup: &str) -> Vec<f64> {
    const RATE: u64 = 500;
    let table = Table::create().await;
    let exchange = Exchange::create(true).await;
    let (hot, cold) = scale_tenants();
    let names: Vec<String> = hot.into_iter().chain(cold).collect();
    let settings = [("OUTBOX_WAKEUP", wakeup.to_string())];
    let relays: Vec<RelayProcess> = (0..3)
        .map(|_| {
            RelayProcess::spawn_with(
                &table,
                &exchange,
                &["*".to_string()],
                "127.0.0.1:0",
                &settings,
            )
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let writers: Vec<tokio_postgres::Client> =
        futures_util::future::join_all((0..4).map(|_| pg_client_to(DATABASE_URL))).await;
    let writers = Arc::new(writers);
    let insert = format!(
        "INSERT INTO {} (tenant_id, kind, subject_id, payload) VALUES ($1, 'thing.changed', 's', $2)",
        table.qualified()
    );
    let payload = "x".repeat(256);
    let total = RATE * duration.as_secs();
    let interval = Duration::from_secs_f64(1.0 / RATE as f64);
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for i in 0..total {
        tokio::time::sleep_until(started + interval * i as u32).await;
        let writers = writers.clone();
        // Spread over every tenant, not in name order.
        let tenant = names[((i * 7_919) % SCALE_TENANTS as u64) as usize].clone();
        let insert = insert.clone();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            writers[(i % 4) as usize]
                .execute(&insert, &[&tenant, &payload])
                .await
                .expect("insert");
        }));
    }
    for t in tasks {
        t.await.expect("writer");
    }
    assert!(
        exchange
            .wait_for(total as usize, Duration::from_secs(60))
            .await,
        "scale trickle: not all arrived"
    );
    for relay in relays {
        relay.stop();
    }
    std::mem::take(&mut exchange.arrivals.lock().unwrap().delays_ms)
}

/// The scale scenario (see the header): medians of `knobs.runs`. Two cores
/// are shared by the broker, the database and the relays: differences
/// under about 15 % are within the run-to-run spread.
async fn scale(report: &mut Report, knobs: &Knobs) {
    let parts = std::env::var("BENCH_SCALE").unwrap_or_else(|_| "drain,memory,trickle".into());
    let wants = |part: &str| parts.split(',').any(|p| p.trim() == part);
    let replicas: Vec<usize> = std::env::var("BENCH_SCALE_RELAYS")
        .unwrap_or_else(|_| "1,3,6".into())
        .split(',')
        .map(|n| n.trim().parse().expect("BENCH_SCALE_RELAYS: numbers"))
        .collect();
    for &relays in replicas.iter().filter(|_| wants("drain")) {
        let mut runs = Vec::new();
        for _ in 0..knobs.runs {
            runs.push(scale_drain(knobs.rows, relays).await);
        }
        let figure = |f: fn(&ScaleRun) -> f64| Figure {
            runs: runs.iter().map(f).collect(),
        };
        let name = |what: &str| format!("scale 10000 tenants x{relays}: {what}");
        report.add(&name("drain"), "msg/s", &figure(|r| r.rate), None);
        report.add(
            &name("empty sweeps per row"),
            "",
            &figure(|r| r.empty_per_row),
            None,
        );
        report.add(
            &name("skipped sweeps per row"),
            "",
            &figure(|r| r.skipped_per_row),
            None,
        );
        report.add(
            &name("relay CPU per msg"),
            "µs",
            &figure(|r| r.relay_cpu_us),
            None,
        );
        report.add(
            &name("PostgreSQL CPU per msg"),
            "µs",
            &figure(|r| r.database_cpu_us),
            None,
        );
        report.add(
            &name("hot rows in the first second"),
            "rows",
            &figure(|r| r.hot_first_second),
            None,
        );
    }
    if wants("memory") {
        scale_memory_figures(report).await;
    }
    if wants("trickle") {
        scale_trickle_figures(report, knobs).await;
    }
}

async fn scale_memory_figures(report: &mut Report) {
    let figures = scale_memory().await;
    for (what, mib) in [
        "peak RSS idle",
        "across a scrape",
        "after each relayed a row",
        "after each relayed a row, across a scrape",
    ]
    .into_iter()
    .zip(figures)
    {
        report.add(
            &format!("scale 10000 listed tenants: {what}"),
            "MiB",
            &Figure { runs: vec![mib] },
            None,
        );
    }
}

async fn scale_trickle_figures(report: &mut Report, knobs: &Knobs) {
    for wakeup in ["poll", "notify"] {
        let mut p99s = Vec::new();
        for _ in 0..knobs.runs {
            let mut delays = scale_trickle(Duration::from_secs(10), wakeup).await;
            delays.sort_by(|a, b| a.total_cmp(b));
            p99s.push(percentile(&delays, 99.0));
        }
        report.add(
            &format!("scale trickle 500/s, 10000 tenants x3, wakeup={wakeup}: p99"),
            "ms",
            &Figure { runs: p99s },
            None,
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this
    // binary without it, and a benchmark is not a test: say so and stop.
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "benches/relay.rs: a benchmark, run by `cargo bench --bench relay`; nothing to test"
        );
        return;
    }
    let knobs = Knobs::from_env();
    let admin = pg_client_to(ADMIN_URL).await;
    let exists = admin
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&BENCH_DB])
        .await
        .expect("query")
        .is_some();
    if !exists {
        admin
            .batch_execute(&format!("CREATE DATABASE {BENCH_DB}"))
            .await
            .expect("create the bench database");
    }
    let rows = knobs.rows;
    let window = knobs.max_in_flight as usize;
    println!(
        "outbox-relay benchmark — {} — rows {rows}, runs {}, batch_size {}, max_in_flight {window}, poll_ms {}",
        time::OffsetDateTime::now_utc().date(),
        knobs.runs,
        knobs.batch_size,
        knobs.poll_ms
    );
    println!(
        "{:<44} {:>12} {:<8} {:<17}  ratio (drains: median of the per-run ratios to the broker-alone run just before)",
        "figure", "median", "unit", "[min – max]"
    );
    let mut report = Report {
        json: BTreeMap::new(),
    };
    let runs = knobs.runs;

    if knobs.wants("ceiling") {
        let f = repeat(runs, || async {
            broker_ceiling(rows, 256, window, Setting::Consumed)
                .await
                .rate
        })
        .await;
        report.add("ceiling: broker alone, 256 B", "msg/s", &f, None);
        let f = repeat(runs, || database_ceiling(rows, 256, knobs.batch_size)).await;
        report.add(
            "ceiling: database alone (claim+read+mark), 256 B",
            "rows/s",
            &f,
            None,
        );
    }
    if knobs.wants("drain") {
        drains(
            &mut report,
            &knobs,
            &[
                Shape::consumed(1, 1),
                Shape::growing(1, 1),
                Shape::consumed(1, 3),
                Shape::consumed(100, 1),
                Shape::consumed(100, 3),
            ],
            256,
        )
        .await;
    }
    if knobs.wants("steady") {
        let name = format!("steady {}/s over 10 tenants", knobs.rate);
        let target = knobs.poll_ms as f64 + 20.0;
        delays(
            &mut report,
            &knobs,
            &name,
            &[],
            ("(poll_ms + 20 ms)", target),
        )
        .await;
    }
    if knobs.wants("latency") {
        println!(
            "latency: commit to consumer (single-row autocommit INSERTs: occurred_at is within ~1 ms of the commit)"
        );
        let poll_ms = 1_000;
        for (wakeup, target) in [
            ("sequence", 15.0),
            ("notify", 25.0),
            ("poll", poll_ms as f64 + 20.0),
        ] {
            let name = format!(
                "latency {}/s, 10 tenants, poll_ms {poll_ms}, wakeup {wakeup}",
                knobs.rate
            );
            let settings = [
                ("OUTBOX_POLL_MS", poll_ms.to_string()),
                ("OUTBOX_WAKEUP", wakeup.to_string()),
            ];
            let label = match wakeup {
                "sequence" => "target 15 ms",
                "notify" => "target 25 ms",
                _ => "target poll_ms + 20 ms",
            };
            delays(&mut report, &knobs, &name, &settings, (label, target)).await;
        }
    }
    if knobs.wants("hot") {
        // A tenant that always has a writer mid-transaction still moves.
        let mut p99 = Figure { runs: Vec::new() };
        let mut p50 = Figure { runs: Vec::new() };
        for _ in 0..runs {
            let mut delays =
                hot_tenant(8, Duration::from_millis(5), Duration::from_secs(10), 1_000).await;
            delays.sort_by(|a, b| a.total_cmp(b));
            p50.runs.push(percentile(&delays, 50.0));
            p99.runs.push(percentile(&delays, 99.0));
        }
        let mut lone = lone_transactions(20).await;
        lone.sort_by(|a, b| a.total_cmp(b));
        for (p, label) in [(50.0, "p50"), (99.0, "p99")] {
            report.add(
                &format!("lone transaction on a quiet table, commit to consumer, {label}"),
                "ms",
                &Figure {
                    runs: vec![percentile(&lone, p)],
                },
                Some(("target 15 ms", 15.0)),
            );
        }
        let name = "hot tenant: 8 writers, 5 ms after insert, commit to consumer";
        report.add(&format!("{name}, p50"), "ms", &p50, None);
        report.add(
            &format!("{name}, p99"),
            "ms",
            &p99,
            Some(("target 100 ms", 100.0)),
        );
    }
    if knobs.wants("producers") {
        writer_costs(&mut report, runs).await;
        let duration = Duration::from_secs(5);
        let mut baseline = Vec::new();
        for setup in Producers::ALL {
            let mut runs_of = Vec::new();
            for _ in 0..runs {
                runs_of.push(producers(setup, duration).await);
            }
            let figure = Figure { runs: runs_of };
            let name = format!("producers, 4 connections: {}", setup.label());
            if matches!(setup, Producers::NoTrigger) {
                baseline = figure.runs.clone();
                report.add(&name, "rows/s", &figure, None);
            } else {
                report.add(
                    &name,
                    "rows/s",
                    &figure,
                    Some(("(a)", median(&mut baseline.clone()))),
                );
            }
        }
    }
    if knobs.wants("memory") {
        // The manifests give the relay 128 MiB; the target leaves 8 MiB.
        let limit = Some(("120 MiB (the manifests give 128)", 120.0));
        for (name, tenants, rows, size, headers) in [
            (
                "memory: one 100 MiB row (refused): peak RSS",
                1,
                1,
                100 << 20,
                "NULL",
            ),
            ("memory: six 15 MiB rows: peak RSS", 1, 6, 15 << 20, "NULL"),
            (
                "memory: 15.9 MiB rows, 4 tenants x 4: peak RSS",
                4,
                16,
                16_672_358,
                "NULL",
            ),
            (
                "memory: 64 KiB rows, 4 tenants x 512: peak RSS",
                4,
                2048,
                64 << 10,
                "NULL",
            ),
            (
                "memory: 4,000-key headers, 4 tenants x 300: peak RSS",
                4,
                1200,
                2,
                HEADERS_4000_KEYS,
            ),
            (
                "memory: densest headers (14,000 keys), 4 tenants x 100: peak RSS",
                4,
                400,
                2,
                HEADERS_DENSEST,
            ),
        ] {
            let f = repeat(runs, || memory_peak(tenants, rows, size, headers)).await;
            report.add(name, "MiB", &f, limit);
        }
    }
    if knobs.wants("idle") {
        let mut tx = Vec::new();
        let mut cpu = Vec::new();
        let mut rss = Vec::new();
        for _ in 0..runs {
            let (t, c, r) = idle(knobs.idle, knobs.poll_ms).await;
            tx.push(t);
            cpu.push(c);
            rss.push(r);
        }
        report.add(
            "idle, 1000 tenants: transactions per poll",
            "tx",
            &Figure { runs: tx },
            None,
        );
        report.add(
            &format!(
                "idle, 1000 tenants: CPU seconds in {} s",
                knobs.idle.as_secs()
            ),
            "s",
            &Figure { runs: cpu },
            None,
        );
        report.add(
            "idle, 1000 tenants: peak RSS",
            "MiB",
            &Figure { runs: rss },
            None,
        );
    }
    if knobs.wants("launch") {
        // As a standalone peer is measured: 10,000 rows over 10 tenants.
        let rows = env_num("BENCH_LAUNCH_ROWS", 10_000);
        let mut took = Figure { runs: Vec::new() };
        for _ in 0..runs {
            took.runs.push(from_launch(rows, 10).await);
        }
        report.add(
            &format!("from launch to the last of {rows} rows marked, 10 tenants"),
            "s",
            &took,
            None,
        );
        report.add(
            "  the same, as a rate",
            "msg/s",
            &Figure {
                runs: took.runs.iter().map(|s| rows as f64 / s).collect(),
            },
            None,
        );
    }

    if knobs.wants("drain4k") {
        drains(
            &mut report,
            &knobs,
            &[Shape::consumed(1, 1), Shape::consumed(100, 3)],
            4096,
        )
        .await;
    }

    if knobs.wants("scale") {
        scale(&mut report, &knobs).await;
    }
    if knobs.wants("scrape") {
        // `/metrics` never slows delivery: 10,000 tenants with their series.
        let mut took = Figure { runs: Vec::new() };
        let mut quiet = Figure { runs: Vec::new() };
        let mut scraped = Figure { runs: Vec::new() };
        let mut scraped_p50 = Figure { runs: Vec::new() };
        let mut scrapes = Figure { runs: Vec::new() };
        for _ in 0..runs {
            let (mut t, mut q, mut s) = scrape_beside_delivery(knobs.steady).await;
            let failed = t.iter().filter(|t| t.is_nan()).count();
            assert_eq!(failed, 0, "scrape: {failed} scrapes failed");
            for v in [&mut t, &mut q, &mut s] {
                v.sort_by(|a, b| a.total_cmp(b));
            }
            took.runs.push(percentile(&t, 50.0));
            scrapes.runs.push(t.len() as f64);
            quiet.runs.push(percentile(&q, 99.0));
            scraped.runs.push(percentile(&s, 99.0));
            scraped_p50.runs.push(percentile(&s, 50.0));
        }
        let name = "scrape, 10,000 tenants with series";
        report.add(
            &format!("{name}: gzip scrape p50 (rendered)"),
            "ms",
            &took,
            Some(("target 30 ms", 30.0)),
        );
        report.add(
            &format!("{name}: scrapes (1 every 1.5 s)"),
            "",
            &scrapes,
            None,
        );
        report.add(
            &format!("{name}: probe p99, 1 scraper every 1.5 s"),
            "ms",
            &quiet,
            None,
        );
        report.add(
            &format!("{name}: probe p50, 2 scrapers"),
            "ms",
            &scraped_p50,
            None,
        );
        report.add(
            &format!("{name}: probe p99, 2 scrapers"),
            "ms",
            &scraped,
            Some(("target 50 ms", 50.0)),
        );
    }
    if knobs.wants("retention") {
        let duration = Duration::from_secs(env_num("BENCH_RETENTION_SECS", 60));
        for (label, retention_ms) in [("with retention_ms 10 s", 10_000), ("without", 0)] {
            let sizes = retention_sizes(knobs.rate, duration, retention_ms).await;
            let shown: Vec<String> = sizes
                .iter()
                .map(|(at, mib, rows)| format!("{at}s {mib:.1} MiB/{rows} rows"))
                .collect();
            println!(
                "retention, {} rows/s, {label}: table + indexes: {}",
                knobs.rate,
                shown.join(", ")
            );
            report.json.insert(
                format!("retention: table + indexes over time, {label}"),
                json!({"unit": "MiB", "rate": knobs.rate, "sizes": sizes}),
            );
        }
        let with = repeat(runs, || retention_drain(rows, true)).await;
        let without = repeat(runs, || retention_drain(rows, false)).await;
        report.add("retention: drain while cleanup runs", "rows/s", &with, None);
        report.add("retention: drain without cleanup", "rows/s", &without, None);
    }

    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-relay.json");
    let document = json!({
        "date": time::OffsetDateTime::now_utc().date().to_string(),
        "knobs": {"rows": rows, "runs": runs, "batch_size": knobs.batch_size, "max_in_flight": knobs.max_in_flight, "poll_ms": knobs.poll_ms, "rate": knobs.rate},
        "figures": report.json,
    });
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&document).expect("json"),
    )
    .expect("write the JSON report");
    println!("\nJSON: {}", path.display());
}
