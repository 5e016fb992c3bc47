//! The HTTP server cannot be held: half-sent requests neither block `/readyz`
//! nor delay SIGTERM; past the cap the connections idle longest (else in a
//! request longest) make way, so probes answer within 1 s whoever floods the
//! server, scrapers that never read the answers included, and the relay's file
//! descriptors stay bounded; concurrent `/healthz` callers share one lag
//! query, and `/healthz` answers within 2 s whatever the database does. A
//! failed bind of `http_addr` is said once.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::support::{
    AMQP_URL, Broker, DATABASE_URL, Outbox, RelayProcess, config, eventually, http_get, pg_client,
    relay_command, relay_env, set_env, spawn_relay, start_relay,
};

/// The relay's limits (`http::Limits::DEFAULT`).
const CONNECTION_CAP: usize = 512;
const HEADER_READ: Duration = Duration::from_secs(5);
/// Descriptors the relay may open or close beside the test's connections
/// (database pool, broker, a connection being accepted and closed).
const FD_SLACK: usize = 16;

/// The relay process's open file descriptors.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the relay's /proc/<pid>/fd is readable")
        .count()
}

/// `n` connections that each send the start of a request and never finish it.
async fn half_sent(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(b"GET /readyz HTTP/1.1\r\nHost: relay\r\nX-Slow: ")
            .await
            .expect("send part of a request");
        held.push(stream);
    }
    held
}

/// Whether the relay closed `stream` (an answer, an end or a reset) by `deadline`.
async fn closed_by(stream: &mut TcpStream, deadline: Instant) -> bool {
    let mut sink = Vec::new();
    tokio::time::timeout_at(deadline, stream.read_to_end(&mut sink))
        .await
        .is_ok()
}

async fn readyz_ok(addr: SocketAddr) -> bool {
    http_get(addr, "/readyz").await.0 == 200
}

/// The relay started with `env`, once `/readyz` says it is ready.
async fn spawn_ready(env: &[(String, String)]) -> (RelayProcess, SocketAddr) {
    let (relay, addr) = spawn_relay(env).await;
    eventually("the relay is ready", Duration::from_secs(20), || {
        readyz_ok(addr)
    })
    .await;
    (relay, addr)
}

#[tokio::test]
async fn hundreds_of_half_sent_requests_neither_block_readyz_nor_delay_sigterm() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let mut env = relay_env(&outbox, &broker, &["a"]);
    set_env(&mut env, "OUTBOX_SHUTDOWN_GRACE_MS", "3000");
    let (mut relay, addr) = spawn_ready(&env).await;
    let pid = relay.child.id();
    let baseline = fds(pid);

    let opened = Instant::now();
    let held = half_sent(addr, 300).await;
    eventually(
        "the relay holds the 300 half-sent requests",
        Duration::from_secs(10),
        || async { fds(pid) + FD_SLACK >= baseline + 300 },
    )
    .await;
    let (code, body) = http_get(addr, "/readyz").await;
    assert_eq!(code, 200, "/readyz beside 300 half-sent requests: {body}");
    let open_at_term = fds(pid);
    assert!(
        open_at_term + FD_SLACK >= baseline + 300 && opened.elapsed() < HEADER_READ,
        "the half-sent requests are still open at SIGTERM ({open_at_term} fds, baseline {baseline}, {:?} after opening)",
        opened.elapsed()
    );

    let asked = Instant::now();
    relay.signal("TERM");
    let code = relay.wait(Duration::from_secs(20)).await;
    let took = asked.elapsed();
    let output = relay.output();
    assert_eq!(code, Some(0), "clean exit:\n{output}");
    assert!(
        took < Duration::from_millis(3000 + 1500),
        "exited {took:?} after SIGTERM, grace 3 s:\n{output}"
    );
    assert!(output.contains("outbox-relay stopped"), "{output}");
    drop(held);
}

#[tokio::test]
async fn at_the_cap_the_connection_idle_longest_makes_way_and_fds_stay_bounded() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let env = relay_env(&outbox, &broker, &["a"]);
    let (mut relay, addr) = spawn_ready(&env).await;
    let pid = relay.child.id();
    let baseline = fds(pid);

    // The cap's worth of half-sent requests, all held by the relay.
    let mut held = half_sent(addr, CONNECTION_CAP).await;
    eventually(
        "the relay holds the cap's worth of connections",
        Duration::from_secs(10),
        || async { fds(pid) + FD_SLACK >= baseline + CONNECTION_CAP },
    )
    .await;
    let held_at = Instant::now();

    // Past the cap: each new connection is admitted, and the oldest held
    // ones (idle longest) are closed for them, well before any timeout.
    let extra_count = 100;
    let mut extra = Vec::new();
    for _ in 0..extra_count {
        extra.push(
            TcpStream::connect(addr)
                .await
                .expect("connect past the cap"),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut most = fds(pid);
    for stream in &mut held[..extra_count] {
        assert!(
            closed_by(stream, deadline).await,
            "a connection idle longer than the new ones was left open past the cap"
        );
        most = most.max(fds(pid));
    }
    // A probe now is admitted the same way, and answered.
    let started = Instant::now();
    let (code, body) = tokio::time::timeout(Duration::from_secs(1), http_get(addr, "/readyz"))
        .await
        .expect("a probe past the cap is answered within 1 s");
    assert_eq!(code, 200, "/readyz past the cap: {body}");
    assert!(started.elapsed() < HEADER_READ, "not after a timeout");
    assert!(
        most <= baseline + CONNECTION_CAP + FD_SLACK,
        "open fds stay bounded by the cap: {most} (baseline {baseline}, cap {CONNECTION_CAP})"
    );
    // The newest ones were kept: the last of the held ones is still open.
    let mut newest = held.pop().expect("held");
    assert!(
        !closed_by(&mut newest, Instant::now() + Duration::from_millis(200)).await,
        "a connection newer than the idle-longest ones was closed"
    );

    // The rest end at the header-read timeout.
    let deadline = held_at + HEADER_READ + Duration::from_secs(3);
    for stream in held[extra_count..].iter_mut().chain([&mut newest]) {
        assert!(
            closed_by(stream, deadline).await,
            "a half-sent request outlived the header-read timeout"
        );
    }
    drop(extra);
    eventually(
        "the relay's fds return to their baseline",
        Duration::from_secs(10),
        || async { fds(pid) <= baseline + FD_SLACK },
    )
    .await;

    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));
    let output = relay.output();
    assert!(
        output.contains("HTTP connection cap reached"),
        "the flood is logged:\n{output}"
    );
}

/// Holds `n` idle connections to `addr` (connected, nothing sent; opened
/// one after another at first, not as one burst of SYNs), each opened again
/// as soon as the relay closes it, until `stop` is set.
async fn flood(
    addr: SocketAddr,
    n: usize,
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut flooders = Vec::with_capacity(n);
    for _ in 0..n {
        let first = TcpStream::connect(addr).await.expect("connect");
        opened.fetch_add(1, Ordering::Relaxed);
        let (stop, opened) = (stop.clone(), opened.clone());
        flooders.push(tokio::spawn(async move {
            let mut stream = first;
            loop {
                // Held until the relay closes it (or the flood ends).
                let mut sink = [0u8; 64];
                loop {
                    let read =
                        tokio::time::timeout(Duration::from_millis(200), stream.read(&mut sink));
                    match read.await {
                        Ok(Ok(0) | Err(_)) => break,
                        Ok(Ok(_)) => {}
                        Err(_) if stop.load(Ordering::Relaxed) => return,
                        Err(_) => {}
                    }
                }
                // Opened again at once (a failed attempt is retried shortly).
                stream = loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    match TcpStream::connect(addr).await {
                        Ok(stream) => break stream,
                        Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                    }
                };
                opened.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    flooders
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_answer_within_1s_while_one_peer_floods_past_the_cap() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let env = relay_env(&outbox, &broker, &["a"]);
    let (mut relay, addr) = spawn_ready(&env).await;

    // More idle connections than the cap, from the probes' own address,
    // opened again as fast as the relay closes them.
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let flooders = flood(addr, CONNECTION_CAP + 64, stop.clone(), opened.clone()).await;
    eventually(
        "the relay holds the cap's worth of the flood's connections",
        Duration::from_secs(60),
        || async { relay.output().contains("HTTP connection cap reached") },
    )
    .await;

    let mut answered = 0;
    for round in 0..20 {
        for path in ["/livez", "/readyz"] {
            let asked = Instant::now();
            let answer =
                tokio::time::timeout_at(asked + Duration::from_secs(1), http_get(addr, path)).await;
            let Ok((code, body)) = answer else {
                panic!("{path} (round {round}) not answered within 1 s during the flood");
            };
            assert_eq!(code, 200, "{path} (round {round}) during the flood: {body}");
            answered += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reopened = opened.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    for flooder in flooders {
        flooder.abort();
    }
    assert_eq!(answered, 40);
    assert!(
        reopened > CONNECTION_CAP + 64 + 40,
        "the flood went on, re-opening what the relay closed ({reopened} connections)"
    );

    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));
    let output = relay.output();
    let warnings = output.matches("HTTP connection cap reached").count();
    assert_eq!(warnings, 1, "the flood is logged once a minute:\n{output}");
}

/// `n` connections that each send `pipelined` scrapes at once and never read
/// an answer (a receive buffer of 4 KiB): each keeps a scrape in progress,
/// waiting its turn, for as long as the relay serves it.
async fn scrapers_that_never_read(addr: SocketAddr, n: usize, pipelined: usize) -> Vec<TcpStream> {
    let requests = "GET /metrics HTTP/1.1\r\nHost: relay\r\n\r\n".repeat(pipelined);
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        let mut stream = socket.connect(addr).await.expect("connect");
        stream
            .write_all(requests.as_bytes())
            .await
            .expect("send the scrapes");
        held.push(stream);
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_answer_within_1s_while_the_cap_is_held_by_scrapes_never_read() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let env = relay_env(&outbox, &broker, &["a"]);
    let (mut relay, addr) = spawn_ready(&env).await;
    let pid = relay.child.id();
    let baseline = fds(pid);

    // Every connection of the cap is in a request: scrapes take turns (one
    // per 50 ms), so each waits its turn, and the next pipelined one follows.
    // More than the cap: those past it find every connection in a request.
    let held = scrapers_that_never_read(addr, CONNECTION_CAP + 16, 50).await;
    eventually(
        "the relay holds the cap's worth of scrapers",
        Duration::from_secs(10),
        || async { fds(pid) + FD_SLACK >= baseline + CONNECTION_CAP },
    )
    .await;

    // Probed as a kubelet would, for 6 s: the scrapers' pipelines keep every
    // connection in a request once the relay has read them all (a second or
    // two in), and they would for their 60 s lifetime.
    for round in 0..24 {
        for path in ["/livez", "/readyz"] {
            let asked = Instant::now();
            let answer =
                tokio::time::timeout_at(asked + Duration::from_secs(1), http_get(addr, path)).await;
            let Ok((code, body)) = answer else {
                panic!("{path} (round {round}) not answered within 1 s beside the scrapers");
            };
            assert_eq!(
                code, 200,
                "{path} (round {round}) beside the scrapers: {body}"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        fds(pid) <= baseline + CONNECTION_CAP + FD_SLACK,
        "open fds stay bounded by the cap"
    );
    drop(held);

    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));
    assert!(
        relay.output().contains("HTTP connection cap reached"),
        "the scrapers filled the cap"
    );
}

/// A scrape from another address (a Prometheus) is answered at once while
/// a local client keeps thousands of scrapes queued: the turns are per
/// address, so the flood waits behind itself. (With one queue for all, the
/// scrape waited behind the 5,000 queued here, 50 ms each, and got 503 at
/// the 20 s request deadline.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_from_another_address_is_not_queued_behind_a_flood_of_scrapes() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let env = relay_env(&outbox, &broker, &["a"]);
    let (mut relay, addr) = spawn_ready(&env).await;
    let held = scrapers_that_never_read(addr, 100, 50).await;
    for round in 0..3 {
        // From 127.0.0.2, another address of the loopback.
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.2:0".parse().unwrap())
            .expect("bind to another loopback address");
        let mut stream = socket.connect(addr).await.expect("connect");
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: relay\r\n\r\n")
            .await
            .expect("send the scrape");
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer));
        assert!(
            read.await.is_ok(),
            "scrape {round} from another address not answered within 5 s beside the flood"
        );
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
        assert!(answer.contains("outbox_database_up"), "{answer}");
    }
    drop(held);
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));
}

/// `GET /metrics` as Prometheus asks for it (`Accept-Encoding: gzip`):
/// whether the answer was gzip, and its text.
async fn scrape_gzip(addr: SocketAddr) -> (bool, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: relay\r\nAccept-Encoding: gzip\r\n\r\n")
        .await
        .expect("send the scrape");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.expect("read");
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("headers end");
    let head = String::from_utf8_lossy(&response[..split]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.0 200"), "{head}");
    let mut text = String::new();
    std::io::Read::read_to_string(
        &mut flate2::read::GzDecoder::new(&response[split + 4..]),
        &mut text,
    )
    .expect("a gzip body");
    (head.contains("content-encoding: gzip"), text)
}

/// Each tenant's `outbox_published_total` in a scrape.
fn published(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("outbox_published_total{tenant=\"")?;
            let (tenant, value) = rest.rsplit_once("\"} ")?;
            Some((
                tenant.replace("\\\"", "\"").replace("\\\\", "\\"),
                value.parse().ok()?,
            ))
        })
        .collect()
}

/// What a user checks of a scrape with many tenants (rendered off the
/// sweeping thread, written straight from the series): gzip as Prometheus
/// asks, every tenant's count right (odd names escaped), the same as the
/// text scrape, and a row published shows in a scrape within 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_of_many_tenants_is_right_and_fresh() {
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let odd = ["quo\"te", "back\\slash", "ünï {x=\"y\"}"];
    outbox
        .execute(
            "INSERT INTO {outbox} (tenant_id, kind, subject_id, payload)
             SELECT 'many-' || g, 'thing.changed', 's', '{}'
             FROM generate_series(1, 1000) g, generate_series(1, 2)",
        )
        .await;
    for tenant in odd {
        outbox.insert_many(tenant, 2).await;
    }
    let total = 2 * (1000 + odd.len());
    let relay = start_relay(config(&outbox, &broker, &["*"])).await;
    eventually("every row is relayed", Duration::from_secs(60), || async {
        outbox.all_pending().await == 0 && broker.count() >= total
    })
    .await;
    // Marked, then counted: by the deadline every count shows.
    let addr = relay.addr;
    let last = std::sync::Mutex::new(BTreeMap::new());
    let last_ref = &last;
    eventually(
        "every tenant's count shows",
        Duration::from_secs(5),
        || async move {
            let (gzip, text) = scrape_gzip(addr).await;
            assert!(gzip, "gzip when asked");
            let counts = published(&text);
            let complete = counts.len() == 1000 + odd.len();
            *last_ref.lock().unwrap() = counts;
            complete
        },
    )
    .await;
    let counts = last.into_inner().unwrap();
    assert!(counts.values().all(|n| *n == 2.0), "{counts:?}");
    for tenant in odd {
        assert_eq!(counts.get(tenant), Some(&2.0), "{tenant}: {counts:?}");
    }
    let (_, text) = relay.get("/metrics").await;
    assert_eq!(published(&text), counts, "text and gzip scrapes agree");

    // Fresh: a row published now shows in a scrape within 1 s.
    outbox.insert_many(odd[0], 1).await;
    eventually("the row is published", Duration::from_secs(20), || async {
        outbox.all_pending().await == 0
    })
    .await;
    eventually(
        "a scrape shows the new row within 1 s of its mark",
        Duration::from_secs(1),
        || async { published(&scrape_gzip(relay.addr).await.1).get(odd[0]) == Some(&3.0) },
    )
    .await;
    relay.stop().await;
}

#[tokio::test]
async fn concurrent_healthz_callers_share_one_lag_query() {
    let outbox = Outbox::create().await;
    // `stuck`'s rows are unroutable until its key is bound: they stay pending.
    let broker = Broker::create(&["ok.#"]).await;
    outbox
        .execute(
            "INSERT INTO {outbox} (tenant_id, kind, subject_id, payload, occurred_at)
             VALUES ('stuck', 'thing.changed', 's-1', '{}', now() - interval '1 hour')",
        )
        .await;
    let relay = start_relay(config(&outbox, &broker, &["ok", "stuck"])).await;
    eventually("the relay is ready", Duration::from_secs(20), || {
        readyz_ok(relay.addr)
    })
    .await;

    // Lag queries over this table, as PostgreSQL sees them (not this one).
    let observer = pg_client().await;
    let lag_queries = || async {
        let row = observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE pid <> pg_backend_pid() AND state = 'active'
                   AND position('WITH ORDINALITY' IN query) > 0
                   AND position($1 IN query) > 0",
                &[&outbox.schema],
            )
            .await
            .expect("pg_stat_activity");
        row.get::<_, i64>(0)
    };

    // The table locked: every lag query waits, so the callers overlap.
    let locker = pg_client().await;
    locker
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
            outbox.qualified()
        ))
        .await
        .expect("lock the table");
    let callers: Vec<_> = (0..20)
        .map(|_| tokio::spawn(http_get(relay.addr, "/healthz")))
        .collect();
    eventually(
        "a lag query waits on the table",
        Duration::from_secs(10),
        || async { lag_queries().await >= 1 },
    )
    .await;
    // Held past the callers' deadline (the fault's duration): never more
    // than one query, and each caller answered 503 in time.
    let held_until = Instant::now() + Duration::from_secs(2);
    let mut most = 0;
    while Instant::now() < held_until {
        most = most.max(lag_queries().await);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    for caller in callers {
        let (code, body) = caller.await.expect("caller");
        assert_eq!(code, 503, "{body}");
        let health: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(health["status"], "error", "{body}");
    }
    locker.batch_execute("COMMIT").await.expect("unlock");
    assert_eq!(
        most, 1,
        "20 concurrent /healthz callers ran {most} lag queries"
    );

    {
        let (code, body) = relay.get("/healthz").await;
        assert_eq!(code, 503, "lagging: {body}");
        let health: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(health["status"], "lagging", "{body}");
        let tenants = health["tenants"].as_array().expect("tenants");
        assert_eq!(tenants[0]["tenant"], "ok", "{body}");
        assert_eq!(tenants[0]["pending"], false, "{body}");
        assert_eq!(tenants[0]["lag_ms"], 0, "{body}");
        assert_eq!(tenants[1]["tenant"], "stuck", "{body}");
        assert_eq!(tenants[1]["pending"], true, "{body}");
        assert!(
            tenants[1]["lag_ms"].as_i64().expect("lag") >= 3_600_000,
            "{body}"
        );
    }

    // Nothing cached: once the row goes out, the next caller sees it.
    broker.bind("stuck.#").await;
    eventually(
        "/healthz turns 200 once the row is published",
        Duration::from_secs(20),
        || async {
            let (code, body) = relay.get("/healthz").await;
            code == 200 && body.contains("\"status\":\"ok\"")
        },
    )
    .await;
    relay.stop().await;
}

#[test]
fn a_failed_bind_is_reported_once() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let output = relay_command()
        .envs([
            ("OUTBOX_TENANTS", "a"),
            ("OUTBOX_DATABASE_URL", DATABASE_URL),
            ("OUTBOX_AMQP_URL", AMQP_URL),
            ("OUTBOX_HTTP_ADDR", addr.as_str()),
            ("OUTBOX_LOG_FORMAT", "text"),
        ])
        .output()
        .expect("the binary runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert_eq!(output.status.code(), Some(1), "{stdout}{stderr}");
    let said = format!("cannot listen on {addr}");
    assert_eq!(
        stdout.matches(&said).count() + stderr.matches(&said).count(),
        1,
        "said once:\nstdout: {stdout}\nstderr: {stderr}"
    );
    assert!(
        stderr.starts_with("outbox-relay: cannot listen on"),
        "{stderr}"
    );
}

/// `/healthz` within the probe's 2 s, whatever the database does: a table
/// locked by another session, a path that stalls (nothing forwarded, no
/// close), a host that refuses connections. 503, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_within_2_s_whatever_the_database_does() {
    use crate::proxy::{Mode, Proxy};
    let outbox = Outbox::create().await;
    let broker = Broker::create(&["#"]).await;
    let path = Proxy::start("127.0.0.1:5432".parse().unwrap(), Mode::Pass).await;
    let mut config = config(&outbox, &broker, &["a"]);
    config.database_url = format!("postgres://postgres@127.0.0.1:{}/test", path.addr.port())
        .parse()
        .unwrap();
    config.listen_database_url = config.database_url.clone();
    let relay = start_relay(config).await;
    eventually("the relay is ready", Duration::from_secs(20), || {
        readyz_ok(relay.addr)
    })
    .await;
    assert_eq!(relay.get("/healthz").await.0, 200);

    let answered_in_time = || async {
        let asked = Instant::now();
        let (code, body) = tokio::time::timeout(Duration::from_secs(2), relay.get("/healthz"))
            .await
            .unwrap_or_else(|_| panic!("/healthz did not answer within 2 s"));
        (code, body, asked.elapsed())
    };
    let locker = pg_client().await;
    locker
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
            outbox.qualified()
        ))
        .await
        .expect("lock the table");
    for fault in ["locked", "stalled", "refused"] {
        match fault {
            "stalled" => path.set(Mode::Stall),
            "refused" => path.kill(),
            _ => {}
        }
        // Twice: the second caller may join the first one's query.
        for _ in 0..2 {
            let (code, body, took) = answered_in_time().await;
            assert_eq!(code, 503, "{fault}: {body}");
            let health: serde_json::Value = serde_json::from_str(&body).expect("JSON");
            assert_eq!(health["status"], "error", "{fault}: {body}");
            assert!(
                health["error"].as_str().is_some_and(|e| !e.is_empty()),
                "{fault}: {body}"
            );
            eprintln!("{fault}: 503 in {took:?}: {}", health["error"]);
        }
        if fault == "locked" {
            locker.batch_execute("COMMIT").await.expect("unlock");
            // The lag query that waited on the lock answers first.
            eventually(
                "/healthz 200 once unlocked",
                Duration::from_secs(20),
                || async { relay.get("/healthz").await.0 == 200 },
            )
            .await;
        }
    }
    path.set(Mode::Pass);
    eventually(
        "/healthz 200 once the path is back",
        Duration::from_secs(30),
        || async { relay.get("/healthz").await.0 == 200 },
    )
    .await;
    relay.stop().await;
}
