//! outbox-relay: publishes each tenant's committed outbox rows from PostgreSQL
//! to RabbitMQ, in order, at least once. Its contract (table, sweep, message,
//! configuration, endpoints, metrics) is `docs/design.md`.
//!
//! How data flows, bottom up:
//!
//! 1. [`domain`] holds the words every layer shares: the outbox row, the
//!    refusal and its reasons, a sweep's outcome. It imports nothing else.
//! 2. [`config`] merges defaults, a TOML file, `OUTBOX_*` variables and flags,
//!    parses the URLs into connection targets, and refuses a bad configuration
//!    before anything is connected.
//! 3. [`store`] (PostgreSQL: claim, read, mark, lag) and [`publisher`]
//!    (RabbitMQ: connection, confirms, the [`envelope`] of each row) take
//!    their parts of the configuration and know nothing of each other.
//! 4. [`relay`] sweeps one tenant: it claims the tenant in the store (an
//!    advisory lock held by one transaction), has the publisher send its
//!    oldest pending rows, marks the confirmed prefix ahead as it grows, and
//!    settles the claim (marks, a refusal, commit).
//! 5. [`scheduler`] decides when each tenant is swept: one poll per interval
//!    asks the store which tenants have pending rows (and their lag, kept by
//!    [`lag`]); each due tenant gets a sweep, at most `concurrency` at once,
//!    with its own [`backoff`] after a failure of its own (a database or
//!    broker outage is no tenant's failure). [`wakeup`] LISTENs for the
//!    outbox trigger's notifications on a connection of its own, so a
//!    notified tenant is swept at once; the poll stays the safety net.
//! 6. [`http`] serves lag, liveness, readiness and [`metrics`]; [`telemetry`]
//!    writes the logs; [`traces`] gives each published row an OpenTelemetry
//!    span (when an OTLP endpoint is set) and carries it in the message;
//!    [`shutdown`] drains sweeps on SIGTERM; [`migrate`] creates and
//!    upgrades the table (and checks it at start); [`status`] is
//!    the operator's view from the database; [`tail`] prints what the relay
//!    publishes, as a consumer sees it; [`lifecycle`] brings parked rows back
//!    (`requeue`), ends them (`discard`) and sends published rows again
//!    (`replay`); [`retention`] deletes rows published longer ago than
//!    `retention_ms`, in small batches, one relay at a time; [`grants`]
//!    checks at start that the role may do what the configuration asks.
#![forbid(unsafe_code)]

pub mod backoff;
pub mod budget;
pub mod config;
pub mod domain;
pub mod envelope;
pub mod grants;
pub mod http;
pub mod lag;
pub mod lifecycle;
pub mod metrics;
pub mod migrate;
pub mod printable;
pub mod publisher;
pub mod redact;
pub mod relay;
pub mod retention;
pub mod scheduler;
pub mod shutdown;
pub mod sql;
pub mod started;
pub mod status;
pub mod store;
pub mod tail;
pub mod telemetry;
pub mod template;
pub mod traces;
pub mod wakeup;

use std::sync::Arc;
use std::time::Duration;

use crate::backoff::Backoff;
use crate::config::Config;
use crate::relay::{Relay, SetupError};
use crate::shutdown::Shutdown;
use tokio::task::JoinHandle;

/// Why the relay could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// `park_after_attempts` is set, and the table cannot park rows.
    #[error(
        "park_after_attempts = {0}, but the outbox table has no columns parked_at and discarded_at; run `outbox-relay migrate` (or apply the SQL of `outbox-relay migrate --print`), set migrate = true, or set park_after_attempts = 0"
    )]
    NoParking(u64),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// Runs the relay until `shutdown` resolves: HTTP, the broker connection, the
/// migrations (when `migrate = true`) and the scheduler; then drains, closes
/// the broker connection and returns.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    let config = Arc::new(config);
    let relay = Arc::new(Relay::from_config(config.clone())?);
    require_parking(&relay).await?;
    let listener = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .map_err(|source| RunError::Bind {
            addr: config.http_addr,
            source,
        })?;
    tracing::info!(
        addr = %listener.local_addr().map_or(config.http_addr, |a| a),
        tenants = %match &config.tenants {
            config::Tenants::Listed(names) => names.len().to_string(),
            config::Tenants::Discovered => "discovered".to_string(),
        },
        version = env!("CARGO_PKG_VERSION"),
        "outbox-relay started"
    );
    serve(relay, listener, shutdown).await;
    Ok(())
}

/// How long the check at start waits for the database before the relay
/// serves `/livez` without its answer: well within a start-up probe's 30 s.
const START_CHECK_WAIT: Duration = Duration::from_secs(5);

/// With `park_after_attempts` set and no `migrate = true` to add them, the
/// table must have the columns of parking: a relay that would never park
/// what it was told to stops at start, saying how to fix it. A database not
/// answering within [`START_CHECK_WAIT`] is no answer: the relay starts, and
/// parks nothing until its poll finds the columns.
async fn require_parking(relay: &Relay) -> Result<(), RunError> {
    let park_after_attempts = relay.config.park_after_attempts;
    if park_after_attempts == 0 || relay.config.migrate {
        return Ok(());
    }
    match tokio::time::timeout(START_CHECK_WAIT, relay.store.check_columns()).await {
        Ok(Ok(true)) if !relay.store.has_parking_columns() => {
            Err(RunError::NoParking(park_after_attempts))
        }
        _ => Ok(()),
    }
}

/// The least time the broker connection's close gets at shutdown, even
/// once the grace period is spent: a close that answers takes a few ms.
const CLOSE_AT_LEAST: Duration = Duration::from_millis(500);

/// How long past the grace period the scheduler is waited for at shutdown:
/// its drain's own deadline, which abandons its sweeps, comes first.
const SCHEDULER_MARGIN: Duration = Duration::from_millis(250);

/// Waits for `task` until `deadline`, then aborts it, saying `what` was
/// abandoned.
async fn finish_by(deadline: tokio::time::Instant, mut task: JoinHandle<()>, what: &str) {
    if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
        task.abort();
        tracing::warn!("shutdown grace period over: abandoning {what}");
    }
}

/// Runs an already-built relay on an already-bound listener (tests use port 0).
pub async fn serve(
    relay: Arc<Relay>,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()>,
) {
    // The scheduler stops first and drains its sweeps; the broker connection and
    // the HTTP endpoints stay up until it has.
    let (stop_scheduler, scheduler_stop) = shutdown::channel();
    let (stop_rest, rest_stop) = shutdown::channel();
    let http = http::serve_apart(
        listener,
        http::router(relay.clone()),
        http::Limits::DEFAULT,
        rest_stop.clone(),
    );
    let broker = tokio::spawn(relay.publisher.clone().supervise(rest_stop.clone().fired()));
    let connected_gauge = tokio::spawn(mirror_connected(relay.clone()));
    let endpoint_gauge = tokio::spawn(mirror_endpoint(relay.clone()));
    let blocked_gauge = tokio::spawn(mirror_blocked(relay.clone()));
    let wakeup = relay.config.wakeup.listens().then(|| {
        tokio::spawn(wakeup::run(
            relay.config.clone(),
            relay.wakeups.clone(),
            relay.metrics.clone(),
            scheduler_stop.clone(),
        ))
    });
    let retention_denied = Arc::new(retention::Denied::default());
    let retention = retention::spawn(
        &relay.config,
        &relay.store,
        &relay.metrics,
        (scheduler_stop.clone(), retention_denied.clone()),
    );
    let scheduler = tokio::spawn({
        let relay = relay.clone();
        async move {
            if relay.config.migrate && !migrate_at_start(&relay, &scheduler_stop).await {
                return;
            }
            let stop = scheduler_stop.clone();
            tokio::spawn(warn_about_schema(relay.clone(), stop, retention_denied));
            scheduler::run(relay, scheduler_stop).await;
        }
    });

    shutdown.await;
    tracing::info!("shutdown requested");
    // Everything below ends within the grace period (the broker's close
    // gets at least CLOSE_AT_LEAST): what has not ended by then is
    // abandoned, as a pod's kill would, but said.
    let deadline = tokio::time::Instant::now() + relay.config.shutdown_grace();
    stop_scheduler.fire();
    // The scheduler drains its sweeps within the grace period itself; a
    // start-up migration waiting on a silent database does not.
    // (Its own drain ends at the grace period, timed from a moment later.)
    finish_by(
        deadline + SCHEDULER_MARGIN,
        scheduler,
        "the scheduler (a start-up migration)",
    )
    .await;
    if let Some(wakeup) = wakeup {
        finish_by(deadline, wakeup, "the wake-up connection").await;
    }
    if let Some(retention) = retention {
        finish_by(deadline, retention, "retention").await;
    }
    stop_rest.fire();
    let closing = deadline.max(tokio::time::Instant::now() + CLOSE_AT_LEAST);
    finish_by(closing, broker, "the broker connection's close").await;
    connected_gauge.abort();
    endpoint_gauge.abort();
    blocked_gauge.abort();
    relay.metrics.set_amqp_connected(false);
    relay.metrics.set_amqp_blocked(false);
    relay
        .metrics
        .set_amqp_endpoint(&relay.config.amqp_url.addresses(), None);
    let _ = http.await;
    tracing::info!("outbox-relay stopped");
}

/// `migrate = true`: applies the migrations the relay's reads need, then
/// leaves the trigger-only ones that end the list (and the second step, for
/// a table whose trigger this run created) to a task of their own, so that
/// a lock they wait for (an open or prepared transaction that wrote to the
/// table) holds no row back: the trigger in place keeps order meanwhile.
/// Returns `false` if shutdown came first.
async fn migrate_at_start(relay: &Arc<Relay>, stop: &Shutdown) -> bool {
    let (needed, trigger_only) = migrate::relays_after();
    let Some(applied) = migrate_until_done(relay, needed, stop, false).await else {
        return false;
    };
    let mut rest = trigger_only.to_vec();
    if applied.contains(&2) {
        rest.push(migrate::FINISH);
    }
    if !rest.is_empty() {
        let (relay, stop) = (relay.clone(), stop.clone());
        tokio::spawn(async move { migrate_until_done(&relay, &rest, &stop, true).await });
    }
    true
}

/// Applies `migrations`, waiting for any lock they need for as long as it is
/// held and retrying with back-off while the database is unreachable.
/// Returns the versions applied, or `None` if shutdown came first. Before
/// the relay relays, it beats for `/livez` meanwhile, and says whether the
/// database answered; once it relays (`relaying`), the scheduler does both.
async fn migrate_until_done(
    relay: &Relay,
    migrations: &[migrate::Migration],
    stop: &Shutdown,
    relaying: bool,
) -> Option<Vec<i32>> {
    let backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(10));
    let mut failures = 0;
    let mut denied = false;
    loop {
        // A lock wait is an answer: the database is up.
        let reached = || {
            if !relaying {
                relay.metrics.set_database_up(true);
            }
        };
        let applying = migrate::apply_patiently(&relay.store, &relay.config, migrations, &reached);
        let result = tokio::select! {
            result = applying => result,
            never = beat_while(relay), if !relaying => match never {},
            () = stop.clone().fired() => return None,
        };
        match result {
            Ok(applied) => return Some(applied),
            Err(error) if error.sqlstate() == Some("42501") => {
                // A grant comes by hand: said once, then tried again quietly.
                if !std::mem::replace(&mut denied, true) {
                    let meanwhile = if relaying {
                        "the relay relays meanwhile (the trigger in place keeps order)"
                    } else {
                        "the relay relays nothing until they are applied"
                    };
                    tracing::error!(
                        %error,
                        "the relay's role may not apply the migrations: they need the owner of \
                         the table and of the schema's trigger functions; {meanwhile}, and \
                         tries again without saying so each time; fix: run `outbox-relay \
                         migrate` as that owner (or a superuser) once"
                    );
                }
                reached();
            }
            Err(error) => {
                tracing::warn!(%error, "cannot apply migrations; retrying");
                if !relaying {
                    // Up means reached: a server that refused the migration was.
                    relay.metrics.set_database_up(!error.is_unreachable());
                }
            }
        }
        let delay = backoff.delay(failures);
        failures += 1;
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = stop.clone().fired() => return None,
        }
    }
}

/// Beats for `/livez` every second, until dropped.
async fn beat_while(relay: &Relay) -> std::convert::Infallible {
    loop {
        relay.beat();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Checks the table once the database answers (retrying with back-off until
/// then, or until shutdown) and warns once about each thing it lacks; then
/// the grants the configuration needs (see [`grants`]); then names the
/// configured tenants that share a claim key (see `store::twins`).
async fn warn_about_schema(relay: Arc<Relay>, stop: Shutdown, retention: Arc<retention::Denied>) {
    let backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(10));
    let mut failures = 0;
    let (schema, table) = (&relay.config.schema, &relay.config.table);
    loop {
        match migrate::check_schema(&relay.store, &relay.config).await {
            Ok(report) => {
                for missing in &report.missing {
                    if *missing == migrate::Missing::PartitionedById {
                        tracing::error!(%schema, %table, "{missing}");
                    } else {
                        tracing::warn!(%schema, %table, "{missing}");
                    }
                }
                break;
            }
            Err(error) if error.is_unreachable() => {}
            // Without USAGE on the schema, say so below.
            Err(error) => {
                tracing::warn!(%error, "cannot check the outbox table's columns, index and trigger");
                break;
            }
        }
        let delay = backoff.delay(failures);
        failures += 1;
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = stop.clone().fired() => return,
        }
    }
    match grants::check(&relay.store, &relay.config).await {
        Ok(grants) => {
            for missing in &grants.missing {
                // Retention's, unless a round refused already said it.
                if !missing.for_retention() || retention.refused() {
                    tracing::error!(%schema, %table, "{missing}");
                }
            }
            if let Some(place) = grants.autovacuum_off {
                tracing::warn!(
                    %schema,
                    %table,
                    "retention_ms > 0 but autovacuum is off for {place}: the space of deleted \
                     rows is never reused, and the table keeps its size on disk; turn autovacuum \
                     on, or VACUUM the table regularly"
                );
            }
        }
        Err(error) => tracing::warn!(%error, "cannot check the relay's grants"),
    }
    // Discovered tenants' twins are found by their claims.
    if let config::Tenants::Listed(tenants) = &relay.config.tenants
        && let Err(error) = relay.store.find_twins(tenants).await
    {
        tracing::warn!(%error, "cannot check which tenants share a hashtext value");
    }
}

/// Keeps `outbox_amqp_connected` in step with the broker connection.
async fn mirror_connected(relay: Arc<Relay>) {
    let mut connected = relay.publisher.watch_connected();
    loop {
        relay
            .metrics
            .set_amqp_connected(*connected.borrow_and_update());
        if connected.changed().await.is_err() {
            return;
        }
    }
}

/// Keeps `outbox_amqp_blocked` in step with the broker's blocking of the
/// connection.
async fn mirror_blocked(relay: Arc<Relay>) {
    let mut blocked = relay.publisher.watch_blocked();
    loop {
        relay.metrics.set_amqp_blocked(*blocked.borrow_and_update());
        if blocked.changed().await.is_err() {
            return;
        }
    }
}

/// Keeps `outbox_amqp_endpoint` in step with the endpoint connected to.
async fn mirror_endpoint(relay: Arc<Relay>) {
    let endpoints = relay.config.amqp_url.addresses();
    let mut in_use = relay.publisher.watch_endpoint();
    loop {
        let index = *in_use.borrow_and_update();
        relay.metrics.set_amqp_endpoint(&endpoints, index);
        if in_use.changed().await.is_err() {
            return;
        }
    }
}
