//! The operator's endpoints on `http_addr`: `/healthz` (lag, from the
//! database), `/livez` (the scheduler turns), `/readyz` (database and broker
//! connected) and `/metrics`. Liveness, readiness and lag are three different
//! questions: a lagging relay is neither dead nor unready.
//!
//! No client can hold the server: [`serve`] reads a request's headers within
//! [`Limits::header_read`], answers within [`Limits::request`], keeps at most
//! [`Limits::connections`] connections open (at the cap, the one idle
//! longest is closed to admit a new one, so a probe is answered whoever
//! holds the others), and on shutdown closes every connection at once,
//! idle, half-sent or in flight. `/healthz` callers share one lag query ([`LagRounds`]).
//! `/metrics` and its shared renders are in `scrape`.

mod scrape;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use hyper::server::conn::http1;
use hyper::service::{Service as _, service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde::Serialize;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinSet};

use crate::relay::Relay;
use crate::shutdown::Shutdown;
use crate::store::TenantLag;
use scrape::Renders;

pub use scrape::{SCRAPE_EVERY, SCRAPE_REUSE_MAX};

/// The scheduler turns at least once per poll interval; a heartbeat older than
/// this many intervals (plus a margin for a slow machine) means it is stuck.
const LIVENESS_POLLS: u32 = 5;
const LIVENESS_MARGIN: Duration = Duration::from_secs(30);

/// How long [`serve`] lets a client take, and how many it serves at once.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// From a connection's opening (or the end of its previous response) to
    /// the last byte of a request's headers; past it the connection is
    /// closed. Bounds idle keep-alive connections too.
    pub header_read: Duration,
    /// From a request's headers to its response; past it the answer is 503.
    /// `/healthz` answers within its own [`HEALTHZ_DEADLINE`].
    pub request: Duration,
    /// Open connections at most; past it, the one idle longest (while all
    /// are in a request, the one in its request longest) is closed to admit
    /// a new one.
    pub connections: usize,
    /// The longest a connection stays open, whatever it does (a client that
    /// stops reading a response is cut off then).
    pub lifetime: Duration,
}

impl Limits {
    /// The relay's limits: probes and scrapers send a whole request at once.
    pub const DEFAULT: Limits = Limits {
        header_read: Duration::from_secs(5),
        request: Duration::from_secs(20),
        connections: 512,
        lifetime: Duration::from_secs(60),
    };
}

/// Pause after a failed `accept` (e.g. out of file descriptors), so that a
/// connection the kernel keeps offering does not spin the loop.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// A flood at the cap is logged once per this period, with how many
/// connections it closed.
const CAP_WARNING_EVERY: Duration = Duration::from_secs(60);

/// Serves `app` on `listener` within `limits` until `stop` resolves, then
/// closes every connection at once and returns.
///
/// At the cap, a new connection is not refused: the connection that has
/// gone longest without a request in progress (an idle keep-alive, a
/// half-sent request, one that never sent anything) is closed to admit it,
/// or, while every one is in a request, the one whose request has gone on
/// longest (scrapes waiting their turn, pipelined by clients that never
/// read). Whoever holds the cap's worth of connections, from whatever
/// address, a probe is admitted and answered; its own connection is the
/// newest, the last to go.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) {
    let app = app.layer(middleware::from_fn_with_state(
        limits.request,
        request_deadline,
    ));
    let epoch = tokio::time::Instant::now();
    let mut connections = JoinSet::new();
    let mut open: HashMap<tokio::task::Id, Open> = HashMap::new();
    // A connection accepted at the cap, admitted once the one closed for it
    // is gone (so the open sockets never pass the cap by more than it).
    let mut waiting: Option<(TcpStream, SocketAddr)> = None;
    // Connections closed at the cap (evicted or refused) since it was last
    // logged, and when.
    let mut closed_at_cap: u64 = 0;
    let mut warned: Option<tokio::time::Instant> = None;
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => break,
            Some(ended) = connections.join_next_with_id(), if !connections.is_empty() => {
                let id = ended.map_or_else(|error| error.id(), |(id, ())| id);
                open.remove(&id);
                if open.len() < limits.connections
                    && let Some((stream, peer)) = waiting.take()
                {
                    admit(&mut connections, &mut open, stream, peer, &app, limits, epoch);
                }
            }
            accepted = listener.accept(), if waiting.is_none() => match accepted {
                Ok((stream, peer)) if open.len() < limits.connections => {
                    admit(&mut connections, &mut open, stream, peer, &app, limits, epoch);
                }
                Ok((stream, peer)) => {
                    closed_at_cap += 1;
                    if warned.is_none_or(|at| at.elapsed() >= CAP_WARNING_EVERY) {
                        tracing::warn!(
                            limit = limits.connections,
                            closed = closed_at_cap,
                            "HTTP connection cap reached: closing the connections idle longest (else in a request longest) to admit new ones"
                        );
                        warned = Some(tokio::time::Instant::now());
                        closed_at_cap = 0;
                    }
                    if evict(&mut open) {
                        waiting = Some((stream, peer));
                    } else {
                        drop(stream);
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot accept an HTTP connection");
                    tokio::select! {
                        () = &mut stop => break,
                        () = tokio::time::sleep(ACCEPT_RETRY) => {}
                    }
                }
            },
        }
    }
    drop(listener);
    drop(waiting);
    // Idle, half-sent or answering: none of them may delay the exit.
    connections.shutdown().await;
}

/// An open connection, as [`serve`] keeps track of it.
struct Open {
    activity: Arc<Activity>,
    handle: AbortHandle,
    /// Closed to admit another; gone once its task ends.
    evicted: bool,
}

/// Serves `stream` on a task of its own.
fn admit(
    connections: &mut JoinSet<()>,
    open: &mut HashMap<tokio::task::Id, Open>,
    stream: TcpStream,
    peer: SocketAddr,
    app: &Router,
    limits: Limits,
    epoch: tokio::time::Instant,
) {
    let activity = Arc::new(Activity::new(epoch));
    let handle = connections.spawn(connection(stream, peer, app, limits, activity.clone()));
    open.insert(
        handle.id(),
        Open {
            activity,
            handle,
            evicted: false,
        },
    );
}

/// Closes an open connection to admit another: the one that has gone
/// longest without a request in progress, or, while every one is in a
/// request, the one whose request has gone on longest (a scrape waiting its
/// turn, pipelined requests from a client that never reads). A probe's own
/// request takes a millisecond: it is the newest, the last to go. `false`
/// when every open connection is already closing.
fn evict(open: &mut HashMap<tokio::task::Id, Open>) -> bool {
    let longest = open
        .values_mut()
        .filter(|conn| !conn.evicted)
        .min_by_key(|conn| conn.activity.since());
    let Some(conn) = longest else {
        return false;
    };
    // Dropping the connection's task closes its socket.
    conn.handle.abort();
    conn.evicted = true;
    true
}

/// Whether a connection is in a request, and since when it is or is not.
struct Activity {
    epoch: tokio::time::Instant,
    /// Nanoseconds from `epoch` to when the connection last became idle
    /// (accepted, or its last response given) or last began a request, the
    /// latter with [`Activity::BUSY`] set.
    since: AtomicU64,
}

impl Activity {
    const BUSY: u64 = 1 << 63;

    fn new(epoch: tokio::time::Instant) -> Activity {
        let activity = Activity {
            epoch,
            since: AtomicU64::new(0),
        };
        activity.idle();
        activity
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .min(Activity::BUSY - 1)
    }

    fn idle(&self) {
        self.since.store(self.now(), Ordering::Relaxed);
    }

    /// The order in which connections make way at the cap: every idle one
    /// (longest idle first) before any in a request (longest in it first).
    fn since(&self) -> (bool, u64) {
        let since = self.since.load(Ordering::Relaxed);
        (since & Activity::BUSY != 0, since & !Activity::BUSY)
    }

    /// Marks a request in progress until the guard is dropped.
    fn busy(self: &Arc<Activity>) -> Busy {
        self.since
            .store(self.now() | Activity::BUSY, Ordering::Relaxed);
        Busy(self.clone())
    }
}

/// A request in progress on a connection; idle again when dropped.
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.idle();
    }
}

/// One accepted connection, served until it ends, fails or outlives
/// [`Limits::lifetime`]; `activity` follows its requests.
fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    app: &Router,
    limits: Limits,
    activity: Arc<Activity>,
) -> impl Future<Output = ()> + Send + 'static {
    let app = TowerToHyperService::new(app.clone());
    let service = service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
        // The peer, for `/metrics`' turns (see `scrape::Renders`).
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(peer));
        let busy = activity.busy();
        let answer = app.call(request);
        async move {
            let response = answer.await;
            drop(busy);
            response
        }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read)
        .serve_connection(TokioIo::new(stream), service);
    async move {
        match tokio::time::timeout(limits.lifetime, conn).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::debug!(%peer, %error, "HTTP connection ended"),
            Err(_) => tracing::debug!(%peer, "HTTP connection closed at its lifetime limit"),
        }
    }
}

/// Answers 503 for a request whose handler takes longer than `limit`.
async fn request_deadline(State(limit): State<Duration>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no answer within {} ms\n", limit.as_millis()),
        )
            .into_response(),
    }
}

/// What every handler reads.
#[derive(Clone)]
struct Endpoints {
    relay: Arc<Relay>,
    lag: Arc<LagRounds>,
    renders: Arc<Renders>,
}

/// The router, for [`serve`] or an in-process test. Built on the relay's
/// runtime: the database work of `/healthz` runs there.
pub fn router(relay: Arc<Relay>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(scrape::metrics))
        .with_state(Endpoints {
            relay,
            lag: Arc::new(LagRounds {
                current: Mutex::default(),
                runtime: tokio::runtime::Handle::try_current().ok(),
            }),
            renders: Arc::new(Renders::default()),
        })
}

/// Serves `app` on `listener` (see [`serve`]) on a thread of its own, with
/// a runtime of its own, until `stop` fires: scrapes, probes and whatever
/// other clients do are never work on the thread that sweeps, and the
/// operating system shares the cores between the two. Should that thread
/// not start, a task on the caller's runtime serves instead. The returned
/// future ends when the server has.
pub fn serve_apart(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    stop: Shutdown,
) -> BoxFuture<'static, ()> {
    let listener = match listener.into_std() {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(%error, "cannot serve HTTP");
            return async {}.boxed();
        }
    };
    match start_thread(&listener, app.clone(), limits, stop.clone()) {
        Ok(ended) => ended.boxed(),
        Err(error) => {
            tracing::warn!(%error, "no thread for HTTP: it is served on the relay's runtime");
            match TcpListener::from_std(listener) {
                Ok(listener) => {
                    let served = tokio::spawn(serve(listener, app, limits, stop.fired()));
                    async move {
                        let _ = served.await;
                    }
                    .boxed()
                }
                Err(error) => {
                    tracing::error!(%error, "cannot serve HTTP");
                    async {}.boxed()
                }
            }
        }
    }
}

fn start_thread(
    listener: &std::net::TcpListener,
    app: Router,
    limits: Limits,
    stop: Shutdown,
) -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    let listener = listener.try_clone()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (done, ended) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("outbox-relay-http".into())
        .spawn(move || {
            runtime.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(listener) => serve(listener, app, limits, stop.fired()).await,
                    Err(error) => tracing::error!(%error, "cannot serve HTTP"),
                }
            });
            let _ = done.send(());
        })?;
    Ok(async move {
        let _ = ended.await;
    })
}

/// One round of the lag query: its rows, or the error's text.
type LagResult = Result<Arc<Vec<TenantLag>>, Arc<str>>;

/// The `/healthz` lag query, coalesced: a caller that arrives while a round
/// runs waits for that round instead of starting its own, so the database
/// sees at most one lag query from this relay at a time, however many ask.
/// Nothing is cached: the first caller after a round ended starts a new one.
#[derive(Default)]
pub struct LagRounds {
    current: Mutex<Option<Shared<BoxFuture<'static, LagResult>>>>,
    /// Where the rounds run: the relay's runtime, whose pool they use (the
    /// HTTP server has a thread and a runtime of its own; see
    /// [`serve_apart`]). None: the caller's.
    runtime: Option<tokio::runtime::Handle>,
}

impl LagRounds {
    /// The running round's result, or that of a new round `start`s.
    pub async fn join<F>(&self, start: impl FnOnce() -> F) -> LagResult
    where
        F: Future<Output = LagResult> + Send + 'static,
    {
        let round = {
            let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
            match current.as_ref() {
                Some(round) if round.peek().is_none() => round.clone(),
                _ => {
                    // Its own task: a caller that gives up does not cancel the
                    // query half-way for the others.
                    let task = match &self.runtime {
                        Some(runtime) => runtime.spawn(start()),
                        None => tokio::spawn(start()),
                    };
                    let round = async move {
                        task.await.unwrap_or_else(|error| {
                            Err(Arc::from(format!(
                                "the lag query ended abnormally: {error}"
                            )))
                        })
                    }
                    .boxed()
                    .shared();
                    *current = Some(round.clone());
                    round
                }
            }
        };
        round.await
    }
}

#[derive(Debug, Serialize)]
struct Health {
    status: &'static str,
    max_lag_ms: u64,
    tenants: Vec<TenantHealth>,
    error: Option<String>,
}

#[derive(Debug, Serialize)]
struct TenantHealth {
    tenant: String,
    lag_ms: i64,
    pending: bool,
}

/// `/healthz` answers within this, whatever the database does (a stalled
/// path, a lock, a dead host): past it, 503 saying the lag could not be read
/// in time. Its lag query goes on in its own task within the store's
/// deadlines, and a caller meanwhile joins it (see [`LagRounds`]). Below
/// the 2 s a probe's `timeoutSeconds` may allow.
pub const HEALTHZ_DEADLINE: Duration = Duration::from_millis(1500);

/// Up to this many tenants, `/healthz` lists each one; past it, only those
/// past `max_lag_ms`, the longest lag first, at most this many (the status
/// and the code still answer for every tenant).
pub const HEALTHZ_TENANTS: usize = 100;

/// The tenants `/healthz` lists (see [`HEALTHZ_TENANTS`]).
fn listed(mut lags: Vec<TenantHealth>, max_lag_ms: u64) -> Vec<TenantHealth> {
    if lags.len() <= HEALTHZ_TENANTS {
        return lags;
    }
    lags.retain(|t| u64::try_from(t.lag_ms).unwrap_or(0) > max_lag_ms);
    lags.sort_by_key(|t| std::cmp::Reverse(t.lag_ms));
    lags.truncate(HEALTHZ_TENANTS);
    lags
}

/// Each relayed tenant's lag (with `tenants = "*"`, each one with pending
/// rows), as the gauge reports it: the database's
/// measure of its oldest pending row, or how long the poll has seen that row
/// waiting, whichever is longer (see `lag`).
async fn healthz(State(endpoints): State<Endpoints>) -> Response {
    let relay = &endpoints.relay;
    let max_lag_ms = relay.config.max_lag_ms;
    let round = endpoints.lag.join(|| {
        let relay = relay.clone();
        async move {
            relay
                .store
                .relayed_lag(&relay.config.tenants)
                .await
                .map(Arc::new)
                .map_err(|error| Arc::from(error.to_string()))
        }
    });
    let lags = tokio::time::timeout(HEALTHZ_DEADLINE, round)
        .await
        .unwrap_or_else(|_| {
            Err(Arc::from(format!(
                "the database did not answer the lag query within {} ms",
                HEALTHZ_DEADLINE.as_millis()
            )))
        });
    match lags {
        Ok(lags) => {
            let now = tokio::time::Instant::now();
            let lags: Vec<TenantHealth> = lags
                .iter()
                .map(|t| TenantHealth {
                    lag_ms: relay.lag.lag_ms(&t.tenant, t.oldest_id, t.lag_ms, now),
                    pending: t.oldest_id.is_some(),
                    tenant: t.tenant.clone(),
                })
                .collect();
            let lagging = lags
                .iter()
                .any(|t| u64::try_from(t.lag_ms).unwrap_or(0) > max_lag_ms);
            let body = Health {
                status: if lagging { "lagging" } else { "ok" },
                max_lag_ms,
                tenants: listed(lags, max_lag_ms),
                error: None,
            };
            let code = if lagging {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::OK
            };
            (code, Json(body)).into_response()
        }
        Err(error) => {
            let body = Health {
                status: "error",
                max_lag_ms,
                tenants: Vec::new(),
                error: Some(error.to_string()),
            };
            (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
        }
    }
}

async fn livez(State(Endpoints { relay, .. }): State<Endpoints>) -> Response {
    let limit = relay.config.poll_interval() * LIVENESS_POLLS + LIVENESS_MARGIN;
    let age = relay.heartbeat_age();
    if age <= limit {
        (StatusCode::OK, "alive\n").into_response()
    } else {
        let text = format!("scheduler stuck: last turn {} ms ago\n", age.as_millis());
        (StatusCode::SERVICE_UNAVAILABLE, text).into_response()
    }
}

#[derive(Debug, Serialize)]
struct Readiness {
    ready: bool,
    database: bool,
    broker: bool,
}

async fn readyz(State(Endpoints { relay, .. }): State<Endpoints>) -> Response {
    let database = relay.metrics.database_is_up();
    let broker = relay.publisher.is_ready();
    let ready = database && broker;
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        code,
        Json(Readiness {
            ready,
            database,
            broker,
        }),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const TIGHT: Limits = Limits {
        header_read: Duration::from_millis(300),
        request: Duration::from_millis(300),
        connections: 4,
        lifetime: Duration::from_secs(30),
    };

    /// `serve` with `TIGHT` limits over a router with a handler that never
    /// answers in time; returns its address, its stop and its task.
    async fn slow_server() -> (
        SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(60)).await;
                "late"
            }),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, app, TIGHT, async {
            let _ = stopped.await;
        }));
        (addr, stop, task)
    }

    /// Sends `request` and reads until the server closes (at most 5 s).
    async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut response = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut response))
            .await
            .expect("the server closes the connection")
            .unwrap();
        String::from_utf8_lossy(&response).into_owned()
    }

    #[test]
    fn past_100_tenants_healthz_lists_the_lagging_ones_longest_first() {
        let tenant = |i: i64, lag_ms: i64| TenantHealth {
            tenant: format!("t{i}"),
            lag_ms,
            pending: true,
        };
        let few: Vec<TenantHealth> = (0..100).map(|i| tenant(i, 0)).collect();
        assert_eq!(listed(few, 1_000).len(), 100, "up to 100: every one");
        let many: Vec<TenantHealth> = (0..10_000)
            .map(|i| tenant(i, if i % 1_000 == 7 { 5_000 + i } else { 10 }))
            .collect();
        let shown: Vec<String> = listed(many, 1_000).into_iter().map(|t| t.tenant).collect();
        assert_eq!(shown.len(), 10);
        assert_eq!(shown[0], "t9007");
        assert_eq!(shown[9], "t7");
    }

    #[tokio::test]
    async fn a_request_past_its_deadline_is_answered_503() {
        let (addr, stop, task) = slow_server().await;
        let started = tokio::time::Instant::now();
        let response = exchange(addr, b"GET /slow HTTP/1.0\r\n\r\n").await;
        assert!(response.starts_with("HTTP/1.0 503"), "{response}");
        assert!(started.elapsed() < Duration::from_secs(2));
        let _ = stop.send(());
        task.await.unwrap();
    }

    #[tokio::test]
    async fn headers_not_sent_in_time_close_the_connection() {
        let (addr, stop, task) = slow_server().await;
        let started = tokio::time::Instant::now();
        exchange(addr, b"GET /slow HTTP/1.1\r\nHost: x\r\n").await;
        assert!(started.elapsed() < Duration::from_secs(2));
        let _ = stop.send(());
        task.await.unwrap();
    }

    #[tokio::test]
    async fn stopping_closes_connections_in_flight_at_once() {
        let (addr, stop, task) = slow_server().await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /slow HTTP/1.0\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_millis(200), task)
            .await
            .expect("serve returns at once")
            .unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "no answer after the stop");
    }

    #[tokio::test]
    async fn callers_that_overlap_share_one_round() {
        let rounds = LagRounds::default();
        let started = AtomicUsize::new(0);
        let release = Arc::new(tokio::sync::Notify::new());
        let round = || {
            started.fetch_add(1, Ordering::SeqCst);
            let release = release.clone();
            async move {
                release.notified().await;
                Ok(Arc::new(Vec::new()))
            }
        };
        // All ten join before the round can end: it waits for the release.
        let callers = async {
            tokio::join!(
                futures_util::future::join_all((0..10).map(|_| rounds.join(round))),
                async { release.notify_one() },
            )
        };
        let (results, ()) = tokio::time::timeout(Duration::from_secs(5), callers)
            .await
            .expect("one release ends every caller: they share one round");
        assert!(results.iter().all(Result::is_ok));
        assert_eq!(started.load(Ordering::SeqCst), 1);
        // Nothing cached: the next caller starts a new round.
        release.notify_one();
        rounds.join(round).await.unwrap();
        assert_eq!(started.load(Ordering::SeqCst), 2);
    }
}
