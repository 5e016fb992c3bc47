//! The scheduler: which tenant is swept when. One [`Relay::sweep`] of one
//! tenant claims it, publishes its batch and marks what was confirmed; the
//! scheduler only decides when to call it next:
//!
//! - `published` (a full batch): at once, behind the other ready tenants;
//! - `idle`, `skipped`: when the poll next finds rows pending for it;
//! - `failed`: after its own back-off, while every other tenant goes on.
//!
//! One poll statement per `poll_ms` finds the tenants with pending rows, so an
//! idle relay costs the same whatever the number of tenants. At most
//! `concurrency` sweeps run at once; none starts while the broker is down.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Waker};
use std::time::{Duration, SystemTime};

use futures_util::future::maybe_done;

use tokio::task::{Id, JoinSet};
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::config::Config;
use crate::envelope::Refusal;
use crate::metrics::{FailureReason, Metrics, OutcomeLabel};
use crate::publisher::Publisher;
use crate::shutdown::Shutdown;
use crate::store::{Refused, Settlement, Store, StoreError};

/// How one sweep of one tenant ended.
#[derive(Debug)]
pub enum SweepOutcome {
    /// A full batch went out: sweep again at once.
    Published { rows: usize },
    /// Fewer rows than a batch (maybe none): wait for the poll.
    Idle { rows: usize },
    /// Another relay holds the tenant.
    Skipped,
    /// Nothing or only a prefix went out: back off.
    Failed(SweepFailure),
}

impl SweepOutcome {
    pub fn label(&self) -> OutcomeLabel {
        match self {
            SweepOutcome::Published { .. } => OutcomeLabel::Published,
            SweepOutcome::Idle { .. } => OutcomeLabel::Idle,
            SweepOutcome::Skipped => OutcomeLabel::Skipped,
            SweepOutcome::Failed(_) => OutcomeLabel::Failed,
        }
    }
}

/// Why a sweep failed.
#[derive(Debug, thiserror::Error)]
pub enum SweepFailure {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The sweep's task ended without an outcome (a panic): its transaction
    /// was dropped with it, so nothing was marked.
    #[error("the sweep ended abnormally: {0}")]
    Aborted(String),
    /// The broker refused row `id` (or the connection failed at it); the rows
    /// before it were marked.
    #[error("row {id} not published: {}", refusal.last_error())]
    Refused {
        id: i64,
        published: usize,
        refusal: Refusal,
    },
}

/// Everything a sweep needs. Shared by the scheduler, its tasks and the HTTP side.
pub struct Relay {
    pub config: Arc<Config>,
    pub store: Store,
    pub publisher: Publisher,
    pub metrics: Metrics,
    /// Milliseconds since `started` at the scheduler's last turn; read by `/livez`.
    heartbeat_ms: AtomicU64,
    started: Instant,
}

impl Relay {
    pub fn new(config: Arc<Config>, store: Store, publisher: Publisher, metrics: Metrics) -> Relay {
        Relay {
            config,
            store,
            publisher,
            metrics,
            heartbeat_ms: AtomicU64::new(0),
            started: Instant::now(),
        }
    }

    /// Builds the store, the publisher and the metrics of `config`.
    pub fn from_config(config: Arc<Config>) -> Result<Relay, String> {
        let metrics = Metrics::new(&config.tenants);
        let store = Store::new(&config)?;
        let publisher = Publisher::new(&config, metrics.clone())?;
        Ok(Relay::new(config, store, publisher, metrics))
    }

    /// How long ago the scheduler last turned.
    pub fn heartbeat_age(&self) -> Duration {
        let now = self.started.elapsed();
        now.saturating_sub(Duration::from_millis(
            self.heartbeat_ms.load(Ordering::Relaxed),
        ))
    }

    /// Records that the relay's main loop is turning (see `/livez`).
    pub fn beat(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.heartbeat_ms.store(ms, Ordering::Relaxed);
    }

    /// One sweep of one tenant: claim, read, publish, mark, commit. Records
    /// its metrics; the caller decides when to sweep again.
    pub async fn sweep(&self, tenant: &str) -> SweepOutcome {
        let started = Instant::now();
        let outcome = self.sweep_inner(tenant).await;
        let label = outcome.label();
        self.metrics
            .sweeps
            .with_label_values(&[tenant, label.as_str()])
            .inc();
        self.metrics
            .sweep_duration
            .with_label_values(&[label.as_str()])
            .observe(started.elapsed().as_secs_f64());
        outcome
    }

    async fn sweep_inner(&self, tenant: &str) -> SweepOutcome {
        let claim = match self.store.claim(tenant).await {
            Ok(Some(claim)) => claim,
            Ok(None) => return SweepOutcome::Skipped,
            Err(error) => return SweepOutcome::Failed(error.into()),
        };
        let rows = claim.rows();
        if rows.is_empty() {
            return match claim.rollback().await {
                Ok(()) => SweepOutcome::Idle { rows: 0 },
                Err(error) => SweepOutcome::Failed(error.into()),
            };
        }
        let count = rows.len();
        // The confirmed prefix is marked ahead, in steps, while the rest of
        // the batch is being confirmed, so the commit has little left to do.
        let mut ahead = Vec::new();
        let mut marked = 0;
        let report = self
            .publisher
            .publish_batch(tenant, rows, &|| claim.is_held(), &mut |prefix| {
                let ids = rows[marked..prefix].iter().map(|r| r.id).collect();
                let mut mark = Box::pin(maybe_done(claim.mark_ahead(ids)));
                // The first poll sends the statement; its outcome is read below.
                let _ = mark.as_mut().poll(&mut Context::from_waker(Waker::noop()));
                ahead.push(mark);
                marked = prefix;
            })
            .await;
        for mut mark in ahead {
            mark.as_mut().await;
            if let Some(Err(error)) = mark.as_mut().take_output() {
                // The transaction is aborted; dropping the claim rolls it back.
                return SweepOutcome::Failed(error.into());
            }
        }
        let published = report.confirmed();
        let refused_id = report.refusal.as_ref().map(|(at, _)| rows[*at].id);
        let refused = report
            .refusal
            .as_ref()
            .zip(refused_id)
            .map(|((_, refusal), id)| (id, refusal));
        // Why the row did not go out is always recorded; a lost connection is
        // not the row's fault, so it does not count as an attempt.
        let last_error =
            refused.map(|(id, r)| (id, r.last_error(), r.reason != FailureReason::Connection));
        let ids = |range: std::ops::Range<usize>| rows[range].iter().map(|r| r.id).collect();
        let settlement = Settlement {
            published: ids(marked.min(published)..published),
            unpublished: ids(published.min(marked)..marked),
            refused: last_error.as_ref().map(|(id, text, attempt)| Refused {
                id: *id,
                last_error: text.as_str(),
                counts_as_attempt: *attempt,
            }),
        };
        let occurred: Vec<_> = rows[..published].iter().map(|r| r.occurred_at).collect();
        if let Err(error) = claim.finish(settlement).await {
            // Confirmed but not marked: these rows go out again (at least once).
            return SweepOutcome::Failed(error.into());
        }

        self.metrics
            .published
            .with_label_values(&[tenant])
            .inc_by(published as u64);
        for (occurred_at, confirmed_at) in occurred.iter().zip(&report.confirmed_at) {
            let occurred_at = SystemTime::from(*occurred_at);
            let delay = confirmed_at.duration_since(occurred_at).unwrap_or_default();
            self.metrics.delivery_delay.observe(delay.as_secs_f64());
        }
        match report.refusal {
            Some((_, refusal)) => {
                self.metrics.failure(tenant, refusal.reason);
                SweepOutcome::Failed(SweepFailure::Refused {
                    id: refused_id.unwrap_or_default(),
                    published,
                    refusal,
                })
            }
            None if count == self.config.batch_size => SweepOutcome::Published { rows: published },
            None => SweepOutcome::Idle { rows: published },
        }
    }
}

/// Where a tenant is in the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing known to be pending; the poll wakes it.
    Idle,
    /// Waiting in the ready queue.
    Ready,
    /// A sweep is running.
    Running,
    /// Failed; ready again at this instant.
    Backoff(Instant),
}

/// The pure part of scheduling: tenant states, the ready queue, back-off.
#[derive(Debug)]
pub struct Schedule {
    names: Vec<Arc<str>>,
    states: Vec<State>,
    failures: Vec<u32>,
    ready: VecDeque<usize>,
    index: HashMap<Arc<str>, usize>,
    backoff: Backoff,
}

impl Schedule {
    pub fn new(tenants: &[String], backoff: Backoff) -> Schedule {
        let names: Vec<Arc<str>> = tenants.iter().map(|t| Arc::from(t.as_str())).collect();
        let index = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i))
            .collect();
        Schedule {
            states: vec![State::Idle; names.len()],
            failures: vec![0; names.len()],
            ready: VecDeque::new(),
            names,
            index,
            backoff,
        }
    }

    pub fn name(&self, tenant: usize) -> &Arc<str> {
        &self.names[tenant]
    }

    /// The poll found rows pending for these tenants. They join the ready
    /// queue starting at `offset` in the poll's order (and wrapping), so
    /// replicas that see the same list do not all reach for the same tenant first.
    pub fn pending<'a>(&mut self, tenants: impl IntoIterator<Item = &'a str>, offset: usize) {
        let tenants: Vec<&str> = tenants.into_iter().collect();
        let start = if tenants.is_empty() {
            0
        } else {
            offset % tenants.len()
        };
        for name in tenants[start..].iter().chain(&tenants[..start]).copied() {
            if let Some(&i) = self.index.get(name)
                && self.states[i] == State::Idle
            {
                self.states[i] = State::Ready;
                self.ready.push_back(i);
            }
        }
    }

    /// Moves tenants whose back-off has passed to the ready queue; returns them.
    pub fn wake(&mut self, now: Instant) -> Vec<usize> {
        let mut woken = Vec::new();
        for i in 0..self.states.len() {
            if let State::Backoff(until) = self.states[i]
                && until <= now
            {
                self.states[i] = State::Ready;
                self.ready.push_back(i);
                woken.push(i);
            }
        }
        woken
    }

    /// The next tenant to sweep, marked running.
    pub fn next_ready(&mut self) -> Option<usize> {
        let i = self.ready.pop_front()?;
        self.states[i] = State::Running;
        Some(i)
    }

    /// Records a sweep's outcome. Returns the back-off now in force (zero if none).
    pub fn finished(&mut self, tenant: usize, outcome: OutcomeLabel, now: Instant) -> Duration {
        match outcome {
            OutcomeLabel::Published => {
                self.failures[tenant] = 0;
                self.states[tenant] = State::Ready;
                self.ready.push_back(tenant);
                Duration::ZERO
            }
            OutcomeLabel::Idle | OutcomeLabel::Skipped => {
                if outcome == OutcomeLabel::Idle {
                    self.failures[tenant] = 0;
                }
                self.states[tenant] = State::Idle;
                Duration::ZERO
            }
            OutcomeLabel::Failed => {
                self.failures[tenant] = self.failures[tenant].saturating_add(1);
                let delay = self.backoff.delay(self.failures[tenant]);
                self.states[tenant] = State::Backoff(now + delay);
                delay
            }
        }
    }

    /// The earliest instant a backing-off tenant becomes ready.
    pub fn next_wake(&self) -> Option<Instant> {
        self.states
            .iter()
            .filter_map(|s| match s {
                State::Backoff(until) => Some(*until),
                _ => None,
            })
            .min()
    }

    /// Whether `tenant` is one of the configured tenants.
    pub fn knows(&self, tenant: &str) -> bool {
        self.index.contains_key(tenant)
    }

    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// How many distinct unconfigured tenants are warned about (once each).
const UNCONFIGURED_WARNINGS: usize = 100;

/// The poll statement in flight: tenants with pending rows and their lag.
type PollFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<Vec<(String, i64)>, StoreError>> + Send>>;

/// Runs the scheduler until `shutdown` fires, then drains running sweeps
/// within `shutdown_grace_ms`.
pub async fn schedule(relay: Arc<Relay>, shutdown: Shutdown) {
    let config = relay.config.clone();
    let mut schedule = Schedule::new(
        &config.tenants,
        Backoff::new(
            config.poll_interval(),
            Duration::from_millis(config.max_backoff_ms),
        ),
    );
    let mut sweeps: JoinSet<SweepOutcome> = JoinSet::new();
    let mut running: HashMap<Id, usize> = HashMap::new();
    let mut poll: Option<PollFuture> = None;
    let mut next_poll = Instant::now();
    let mut database_up: Option<bool> = None;
    let mut unconfigured: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut broker = relay.publisher.watch_connected();
    let stop = shutdown.clone().fired();
    tokio::pin!(stop);

    loop {
        relay.beat();
        let now = Instant::now();
        if poll.is_none() && now >= next_poll {
            let relay = relay.clone();
            poll = Some(Box::pin(async move { relay.store.pending_tenants().await }));
            next_poll = now + config.poll_interval();
        }
        for woken in schedule.wake(now) {
            relay
                .metrics
                .tenant_backoff
                .with_label_values(&[schedule.name(woken)])
                .set(0.0);
        }
        if relay.publisher.is_ready() {
            while sweeps.len() < config.concurrency {
                let Some(tenant) = schedule.next_ready() else {
                    break;
                };
                let name = schedule.name(tenant).clone();
                let task_relay = relay.clone();
                let handle = sweeps.spawn(async move { task_relay.sweep(&name).await });
                running.insert(handle.id(), tenant);
            }
        }

        // While a poll runs, its answer wakes the loop; the next one is not due before.
        let poll_due = if poll.is_some() {
            None
        } else {
            Some(next_poll)
        };
        let wake_at = [schedule.next_wake(), poll_due]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(now + config.poll_interval());
        tokio::select! {
            () = &mut stop => break,
            Some(joined) = sweeps.join_next_with_id() => {
                let (id, outcome) = match joined {
                    Ok((id, outcome)) => (id, outcome),
                    Err(error) => {
                        (error.id(), SweepOutcome::Failed(SweepFailure::Aborted(error.to_string())))
                    }
                };
                let Some(tenant) = running.remove(&id) else { continue };
                let name = schedule.name(tenant).clone();
                report(&name, &outcome);
                let delay = schedule.finished(tenant, outcome.label(), Instant::now());
                relay.metrics.tenant_backoff.with_label_values(&[&name]).set(delay.as_secs_f64());
            }
            result = async { poll.as_mut().expect("guarded by the branch condition").await }, if poll.is_some() => {
                poll = None;
                match result {
                    Ok(pending) => {
                        if database_up != Some(true) {
                            tracing::info!("database reachable");
                        }
                        database_up = Some(true);
                        relay.metrics.database_up.set(1);
                        let lags: HashMap<&str, i64> = pending.iter().map(|(t, lag)| (t.as_str(), *lag)).collect();
                        for tenant in &config.tenants {
                            let lag = lags.get(tenant.as_str()).copied().unwrap_or(0);
                            relay.metrics.lag_gauge(tenant).set(lag as f64 / 1000.0);
                        }
                        for (tenant, _) in &pending {
                            if !schedule.knows(tenant) && unconfigured.len() < UNCONFIGURED_WARNINGS && unconfigured.insert(tenant.clone()) {
                                tracing::warn!(
                                    tenant = %tenant,
                                    "rows are pending for a tenant this relay is not configured for; they stay pending until a relay lists it in `tenants`"
                                );
                            }
                        }
                        schedule.pending(pending.iter().map(|(t, _)| t.as_str()), random_offset());
                    }
                    Err(error) => {
                        if database_up != Some(false) {
                            tracing::warn!(%error, "database unreachable; retrying every poll interval");
                        }
                        database_up = Some(false);
                        relay.metrics.database_up.set(0);
                    }
                }
            }
            _ = broker.changed() => {}
            () = tokio::time::sleep_until(wake_at) => {}
        }
    }

    drain(&relay, &mut sweeps, &mut running, &schedule).await;
}

/// A random number, fresh each call (no state, no extra dependency).
fn random_offset() -> usize {
    use std::hash::{BuildHasher, Hasher};
    // Every RandomState is freshly keyed, so an empty hash is already random.
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    usize::try_from(random % (usize::MAX as u64)).unwrap_or(0)
}

/// Lets running sweeps finish within the grace period, then abandons them
/// (their transactions roll back; their rows stay pending).
async fn drain(
    relay: &Relay,
    sweeps: &mut JoinSet<SweepOutcome>,
    running: &mut HashMap<Id, usize>,
    schedule: &Schedule,
) {
    if sweeps.is_empty() {
        return;
    }
    let grace = relay.config.shutdown_grace();
    tracing::info!(
        sweeps = sweeps.len(),
        grace_ms = grace.as_millis() as u64,
        "draining running sweeps"
    );
    let finished = tokio::time::timeout(grace, async {
        while let Some(joined) = sweeps.join_next_with_id().await {
            if let Ok((id, outcome)) = joined
                && let Some(tenant) = running.remove(&id)
            {
                report(schedule.name(tenant), &outcome);
            }
        }
    })
    .await;
    if finished.is_err() {
        tracing::warn!(
            abandoned = sweeps.len(),
            "grace period over; abandoning sweeps (their rows stay pending)"
        );
        sweeps.abort_all();
        while sweeps.join_next().await.is_some() {}
    }
}

/// Logs a sweep's outcome: every failure once, with tenant and reason.
fn report(tenant: &str, outcome: &SweepOutcome) {
    match outcome {
        SweepOutcome::Published { rows } => tracing::debug!(tenant, rows, "published a full batch"),
        SweepOutcome::Idle { rows } => tracing::debug!(tenant, rows, "swept"),
        SweepOutcome::Skipped => tracing::debug!(tenant, "held by another relay; skipped"),
        SweepOutcome::Failed(SweepFailure::Refused {
            id,
            published,
            refusal,
        }) => tracing::warn!(
            tenant,
            row = id,
            published,
            reason = refusal.reason.as_str(),
            error = %refusal.detail,
            "sweep failed: row refused"
        ),
        SweepOutcome::Failed(SweepFailure::Aborted(error)) => {
            tracing::error!(tenant, reason = "aborted", %error, "sweep failed")
        }
        SweepOutcome::Failed(SweepFailure::Store(error)) => {
            tracing::warn!(tenant, reason = "database", %error, "sweep failed")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(n: usize) -> Schedule {
        let tenants: Vec<String> = (0..n).map(|i| format!("t{i}")).collect();
        Schedule::new(
            &tenants,
            Backoff::new(Duration::from_millis(100), Duration::from_millis(1000)),
        )
    }

    #[test]
    fn pending_tenants_become_ready_once_in_poll_order() {
        let mut s = schedule(3);
        s.pending(["t2", "t0", "t2", "unknown"], 0);
        assert_eq!(s.next_ready(), Some(2));
        assert_eq!(s.next_ready(), Some(0));
        assert_eq!(s.next_ready(), None);
        // Running tenants are not queued again by a poll.
        s.pending(["t2"], 0);
        assert_eq!(s.next_ready(), None);
    }

    #[test]
    fn a_full_batch_goes_to_the_back_of_the_queue() {
        let mut s = schedule(3);
        let now = Instant::now();
        s.pending(["t0", "t1", "t2"], 0);
        let first = s.next_ready().unwrap();
        assert_eq!(
            s.finished(first, OutcomeLabel::Published, now),
            Duration::ZERO
        );
        assert_eq!(s.next_ready(), Some(1));
        assert_eq!(s.next_ready(), Some(2));
        assert_eq!(
            s.next_ready(),
            Some(0),
            "the busy tenant waits its turn, no one starves"
        );
    }

    #[test]
    fn a_failing_tenant_backs_off_alone_and_doubles() {
        let mut s = schedule(2);
        let now = Instant::now();
        s.pending(["t0", "t1"], 0);
        let t0 = s.next_ready().unwrap();
        assert_eq!(
            s.finished(t0, OutcomeLabel::Failed, now),
            Duration::from_millis(200)
        );
        assert_eq!(s.next_ready(), Some(1), "the other tenant is not held up");
        s.finished(1, OutcomeLabel::Idle, now);
        s.pending(["t0"], 0);
        assert_eq!(
            s.next_ready(),
            None,
            "a backing-off tenant ignores the poll"
        );
        assert_eq!(s.next_wake(), Some(now + Duration::from_millis(200)));
        s.wake(now + Duration::from_millis(199));
        assert!(!s.has_ready());
        s.wake(now + Duration::from_millis(200));
        assert_eq!(s.next_ready(), Some(0));
        assert_eq!(
            s.finished(0, OutcomeLabel::Failed, now),
            Duration::from_millis(400)
        );
        s.wake(now + Duration::from_secs(1));
        s.next_ready();
        assert_eq!(
            s.finished(0, OutcomeLabel::Failed, now),
            Duration::from_millis(800)
        );
        s.wake(now + Duration::from_secs(1));
        s.next_ready();
        assert_eq!(
            s.finished(0, OutcomeLabel::Failed, now),
            Duration::from_millis(1000),
            "capped"
        );
        s.wake(now + Duration::from_secs(2));
        s.next_ready();
        assert_eq!(
            s.finished(0, OutcomeLabel::Published, now),
            Duration::ZERO,
            "reset on success"
        );
        s.next_ready();
        assert_eq!(
            s.finished(0, OutcomeLabel::Failed, now),
            Duration::from_millis(200)
        );
    }

    #[test]
    fn replicas_start_at_different_tenants() {
        let mut s = schedule(4);
        s.pending(["t0", "t1", "t2", "t3"], 6);
        let order: Vec<usize> = std::iter::from_fn(|| s.next_ready()).collect();
        assert_eq!(
            order,
            [2, 3, 0, 1],
            "rotated by the offset, every tenant once"
        );
    }

    #[test]
    fn skipped_tenants_wait_for_the_next_poll() {
        let mut s = schedule(1);
        s.pending(["t0"], 0);
        let t = s.next_ready().unwrap();
        s.finished(t, OutcomeLabel::Skipped, Instant::now());
        assert!(!s.has_ready());
        s.pending(["t0"], 0);
        assert_eq!(s.next_ready(), Some(0));
    }
}
