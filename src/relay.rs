//! One sweep of one tenant: claim it, publish its batch, settle what the
//! broker confirmed. While no other tenant waits for a sweep (and no twin of
//! the tenant, a name sharing its claim key, has rows pending), a full
//! batch's successor is read ahead in the same transaction as the batch is
//! published, and goes out right behind it, in the same window (up to
//! [`CHAINED_BATCHES`] in one transaction): the broker does not idle while
//! the database reads, nor while a batch's last confirms come back.
//! [`Relay`] holds what every sweep needs; the scheduler (`scheduler`) only
//! decides when to call [`Relay::sweep`] next.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::budget::{ByteBudget, Reservation};
use crate::config::{Config, Wakeup};
use crate::domain::{BatchReport, FailureReason, OutboxRow, Outcome, Refusal};
use crate::lag::LagTracker;
use crate::metrics::Metrics;
use crate::publisher::{Progress, PublishError, Publisher};
use crate::store::{Claim, KeptPending, Settled, Store, StoreError};
use crate::wakeup::Wakeups;

/// At most this many full batches go out in one transaction (one claim).
/// A claim's end empties the window for the commit and the next claim, a few
/// ms in which the broker waits, so longer claims keep it busier; longer
/// still would resend more after a crash (a claim yields the tenant as soon
/// as another tenant waits for a sweep whatever its length).
pub const CHAINED_BATCHES: usize = 16;

/// How often the marks of a settlement that failed after the broker
/// confirmed are tried again, each on a fresh pooled connection, before the
/// rows are left pending (and go out again).
pub const SETTLEMENT_ATTEMPTS: u32 = 5;
/// The pause before the first retry of a failed settlement; doubled before
/// each next one.
const SETTLEMENT_RETRY_PAUSE: Duration = Duration::from_millis(100);
/// How long the retries of one failed settlement may take in all.
pub const SETTLEMENT_RETRY_LIMIT: Duration = Duration::from_secs(15);

/// How one sweep of one tenant ended.
#[derive(Debug)]
pub enum SweepOutcome {
    /// A full batch went out: sweep again at once.
    Published { rows: usize },
    /// Fewer rows than a batch (maybe none): wait for the poll.
    Idle { rows: usize },
    /// Fewer rows than a batch (maybe none) went out, and a writer of the
    /// tenant was in flight at the claim: rows above the safe bound wait
    /// until the writers in flight then have ended (the scheduler checks,
    /// and sweeps the tenant again). Counted as `idle`.
    Deferred { rows: usize, position: i64 },
    /// Another relay holds the tenant.
    Skipped,
    /// Row `id` was refused for its own sake (`too_large`, `invalid`), its
    /// attempts reached `park_after_attempts`, and it is parked (the rows
    /// before it were published): the tenant goes on with its later rows at
    /// once, as after a full batch.
    Parked { id: i64, rows: usize },
    /// Nothing or only a prefix went out: back off.
    Failed(SweepFailure),
}

impl SweepOutcome {
    pub fn kind(&self) -> Outcome {
        match self {
            SweepOutcome::Published { .. } | SweepOutcome::Parked { .. } => Outcome::Published,
            SweepOutcome::Idle { .. } | SweepOutcome::Deferred { .. } => Outcome::Idle,
            SweepOutcome::Skipped => Outcome::Skipped,
            SweepOutcome::Failed(_) => Outcome::Failed,
        }
    }

    /// Whether the sweep failed because the database could not be reached,
    /// the broker connection was lost, absent or timed out, or a column of
    /// the table or its id sequence is unfit: an outage, which is no
    /// tenant's doing and must not grow its back-off. A refusal of the
    /// tenant's own row (nack, unroutable, too large, invalid), a statement
    /// the server refused, a row that did not decode, or the relay's own
    /// trouble is the tenant's failure.
    pub fn is_outage(&self) -> bool {
        match self {
            SweepOutcome::Failed(SweepFailure::Store(error)) => {
                error.is_unreachable()
                    || error.drift().is_some()
                    || error.unfit_sequence().is_some()
            }
            SweepOutcome::Failed(SweepFailure::Refused { refusal, .. }) => matches!(
                refusal.reason,
                FailureReason::Connection | FailureReason::Timeout
            ),
            _ => false,
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
    /// The broker confirmed rows that the table then kept from being marked
    /// published (see [`KeptPending`]): they go out again at the tenant's
    /// next sweep, which its back-off holds off.
    #[error(
        "{} confirmed row(s) from row {} stayed pending: the table kept the mark from \
         setting published_at (a BEFORE UPDATE trigger that returns NULL or keeps \
         published_at NULL, or a row-level security policy that hides the rows from the \
         relay's role); they go out again \
         at the tenant's next sweep",
        .0.rows, .0.first
    )]
    KeptPending(KeptPending),
}

/// Why the relay could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("cannot set up the database pool: {0}")]
    Store(#[from] StoreError),
    #[error("cannot set up the publisher: {0}")]
    Publisher(#[from] PublishError),
}

/// Everything a sweep needs. Shared by the scheduler, its tasks and the HTTP side.
pub struct Relay {
    pub config: Arc<Config>,
    pub store: Store,
    pub publisher: Publisher,
    pub metrics: Metrics,
    /// Row bytes read and in flight, relay-wide (`max_bytes_in_flight`).
    budget: ByteBudget,
    /// What a sweep reserves of the budget before it reads its batch.
    budget_share: usize,
    /// Since when each tenant's oldest row has waited, as the poll saw it;
    /// `/healthz` reads it (see `lag`).
    pub lag: LagTracker,
    /// Notifications waiting for the scheduler (see `wakeup`).
    pub wakeups: Arc<Wakeups>,
    /// Tenants are ready and wait for a sweep: a sweep goes on to a next
    /// batch only while none does (set by the scheduler).
    tenants_waiting: AtomicBool,
    /// Shutdown has begun: a running sweep takes no further batch, so that
    /// it settles what it sent within the grace period rather than go on
    /// with its claim and be abandoned (its confirmed rows sent again).
    stopping: AtomicBool,
    /// Milliseconds since `started` at the scheduler's last turn; read by `/livez`.
    heartbeat_ms: AtomicU64,
    started: Instant,
}

impl Relay {
    pub fn new(
        config: Arc<Config>,
        store: Store,
        publisher: Publisher,
        metrics: Metrics,
        wakeups: Arc<Wakeups>,
    ) -> Relay {
        metrics.set_max_lag(Duration::from_millis(config.max_lag_ms));
        // Every configured endpoint's series, at 0 until connected.
        metrics.set_amqp_endpoint(&config.amqp_url.addresses(), None);
        Relay {
            budget: ByteBudget::new(config.max_bytes_in_flight),
            budget_share: config.max_bytes_in_flight / config.concurrency,
            wakeups,
            config,
            store,
            publisher,
            metrics,
            lag: LagTracker::new(),
            tenants_waiting: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            heartbeat_ms: AtomicU64::new(0),
            started: Instant::now(),
        }
    }

    /// Builds the store, the publisher and the metrics of `config`.
    pub fn from_config(config: Arc<Config>) -> Result<Relay, SetupError> {
        let metrics = if config.tenants.discovers() {
            Metrics::with_max_tenants(config.max_tenants)
        } else {
            Metrics::new()
        };
        let wakeups = Arc::new(Wakeups::new(&config));
        // Without LISTEN connections, the replicas know each other by their
        // pools' sessions.
        let name = (config.wakeup == Wakeup::Poll).then(|| wakeups.application_name());
        let store = Store::named(&config, name)?;
        let publisher = Publisher::new(&config)?;
        Ok(Relay::new(config, store, publisher, metrics, wakeups))
    }

    /// How long ago the scheduler last turned.
    pub fn heartbeat_age(&self) -> Duration {
        let now = self.started.elapsed();
        now.saturating_sub(Duration::from_millis(
            self.heartbeat_ms.load(Ordering::Relaxed),
        ))
    }

    /// Says whether tenants wait for a sweep (see [`CHAINED_BATCHES`]).
    pub fn set_tenants_waiting(&self, waiting: bool) {
        self.tenants_waiting.store(waiting, Ordering::Relaxed);
    }

    /// Shutdown has begun: running sweeps take no further batch.
    pub fn stop_chaining(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Whether a sweep may go on to a next batch in its transaction: no
    /// other tenant waits for a sweep, and the relay is not stopping.
    fn may_chain(&self) -> bool {
        !self.tenants_waiting.load(Ordering::Relaxed) && !self.stopping.load(Ordering::Relaxed)
    }

    /// Records that the relay's main loop is turning (see `/livez`).
    pub fn beat(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.heartbeat_ms.store(ms, Ordering::Relaxed);
    }

    /// One sweep of one tenant: claim, publish, settle. Records its metrics;
    /// the caller decides when to sweep again. `safe`: an id bound below
    /// which every writer of the tenant has ended, as the caller last found
    /// (see [`Store::claim`]; `i64::MIN` when none is known).
    pub async fn sweep(&self, tenant: &str, safe: i64) -> SweepOutcome {
        let started = Instant::now();
        let outcome = self.claim_publish_settle(tenant, safe).await;
        self.metrics
            .sweep_finished(tenant, outcome.kind(), started.elapsed());
        outcome
    }

    async fn claim_publish_settle(&self, tenant: &str, safe: i64) -> SweepOutcome {
        // Claim: the tenant's advisory lock and its oldest pending rows up to
        // the fence, as many as its share of the byte budget holds (kept
        // until settled).
        let began = Instant::now();
        let (mut claim, mut budget) = match self.claim_within_budget(tenant, safe).await {
            Ok(Some(claimed)) => claimed,
            Ok(None) => return SweepOutcome::Skipped,
            Err(error) => return SweepOutcome::Failed(error.into()),
        };
        let fence = claim.writers().then_some(claim.position());
        if claim.rows().is_empty() {
            return match claim.rollback().await {
                Ok(()) => idle(0, fence),
                Err(error) => SweepOutcome::Failed(error.into()),
            };
        }
        let started = Instant::now();
        // Publish, marking the confirmed prefix ahead as it grows, so that the
        // commit has little left to do. While the batch goes out, the next is
        // read ahead in the same transaction, and joins the run as soon as
        // the last row before it is sent: one window slides across the
        // claim's batches.
        let mut publishing = self.publisher.publish(tenant, claim.rows());
        let mut batches = 1;
        let mut next_budget = self.read_ahead(&claim, batches);
        publishing.expect_more(next_budget.is_some());
        // A failed read ahead or mark has aborted the transaction: the rows
        // in flight are still resolved, then what was confirmed is marked in
        // a transaction of its own.
        let mut aborted = None;
        let report = loop {
            let progress = {
                // The read ahead is driven beside the confirms (the answers
                // on the claim's connection come back in order).
                let step = publishing.next(claim.rows(), &claim);
                tokio::pin!(step);
                loop {
                    tokio::select! {
                        progress = &mut step => break progress,
                        () = claim.read_ahead_progress(), if claim.reading_ahead() => {}
                    }
                }
            };
            match progress {
                Progress::Confirmed(prefix) => claim.mark_ahead(prefix),
                Progress::Sent => {
                    match self.append_ahead(&mut claim, next_budget.take()).await {
                        Ok(Some(reserved)) => {
                            budget.absorb(reserved);
                            publishing.extend(claim.rows());
                            batches += 1;
                            next_budget = self.read_ahead(&claim, batches);
                        }
                        Ok(None) => {}
                        Err(error) => aborted = Some(error),
                    }
                    publishing.expect_more(next_budget.is_some());
                }
                Progress::Resolved(report) => break report,
            }
        };
        let confirmed = started.elapsed();
        // A batch cut short (by the byte budget, or where its rows go
        // another way) is followed at once, like a full one.
        let full = claim.batch().len() == self.config.batch_size
            || claim.cut_by_budget()
            || publishing.cut_short();
        drop(next_budget);
        let confirmed_ids = ids(&report, &claim);
        if let Some(error) = aborted {
            drop(claim);
            return self.settle_again(tenant, confirmed_ids, error).await;
        }
        // Settle: mark the confirmed prefix, record a refusal, commit.
        let settled = claim.settle(&report).await;
        tracing::debug!(
            tenant,
            rows = report.confirmed(),
            batches,
            claim_us = (started - began).as_micros(),
            publish_us = confirmed.as_micros(),
            settle_us = (started.elapsed() - confirmed).as_micros(),
            "sweep settled"
        );
        drop(budget);
        match settled {
            Ok(settled) => self.settled(tenant, settled, full, report, fence),
            Err(error) => self.settle_again(tenant, confirmed_ids, error).await,
        }
    }

    /// Appends the batch read ahead to the claim, if there is one to go on
    /// with, no other tenant waits for a sweep and the relay is not
    /// stopping; the budget it holds.
    async fn append_ahead(
        &self,
        claim: &mut Claim,
        reserved: Option<Reservation>,
    ) -> Result<Option<Reservation>, StoreError> {
        let Some(mut reserved) = reserved else {
            return Ok(None);
        };
        if !self.may_chain() || !claim.append_ahead().await? {
            return Ok(None);
        }
        reserved.keep(claim.cost());
        Ok(Some(reserved))
    }

    /// After the claim's marks or commit failed (a commit error, a lost
    /// connection) once the broker had confirmed rows: marks those rows in
    /// a new transaction on a fresh pooled connection, a few times with a
    /// growing pause, within [`SETTLEMENT_RETRY_LIMIT`], so that a short
    /// database blip does not send a whole confirmed batch again. Given up,
    /// the rows stay pending and go out again (at least once).
    ///
    /// The tenant's claim went with the failed transaction, and another
    /// relay may hold the tenant by now; marking without the claim is still
    /// correct: the rows are exactly what the broker confirmed, in order
    /// from the tenant's lowest pending row, so consumers have them; the
    /// mark only sets `published_at` where it is still NULL (a row marked
    /// already keeps its time), and a relay that read them meanwhile sends
    /// them again at worst, a duplicate at-least-once allows. The refusal
    /// record of the failed transaction, if any, is not written: the row
    /// stays pending and is refused again.
    async fn settle_again(&self, tenant: &str, ids: Vec<i64>, error: StoreError) -> SweepOutcome {
        if ids.is_empty() {
            return SweepOutcome::Failed(error.into());
        }
        let retries = async {
            let mut pause = SETTLEMENT_RETRY_PAUSE;
            let mut attempt = 1;
            loop {
                tokio::time::sleep(pause).await;
                match self.store.mark_confirmed(&ids).await {
                    Ok(_) => return Ok(attempt),
                    Err(error) if attempt >= SETTLEMENT_ATTEMPTS => return Err(error),
                    Err(error) => {
                        tracing::debug!(tenant, attempt, %error, "settlement retry failed");
                    }
                }
                attempt += 1;
                pause *= 2;
            }
        };
        let rows = ids.len();
        match tokio::time::timeout(SETTLEMENT_RETRY_LIMIT, retries).await {
            Ok(Ok(attempts)) => {
                tracing::warn!(
                    tenant,
                    rows,
                    attempts,
                    %error,
                    "settlement failed after the broker confirmed; marked the confirmed rows in a new transaction"
                );
                self.metrics.settlement_retried(true, 0);
                self.metrics.count_published(tenant, rows);
            }
            Ok(Err(retry)) => {
                tracing::warn!(
                    tenant,
                    rows,
                    %error,
                    retry = %retry,
                    "settlement failed after the broker confirmed and could not be retried; the rows go out again"
                );
                self.metrics.settlement_retried(false, rows);
            }
            Err(_) => {
                tracing::warn!(
                    tenant,
                    rows,
                    %error,
                    "settlement failed after the broker confirmed and its retries ran out of time; the rows go out again"
                );
                self.metrics.settlement_retried(false, rows);
            }
        }
        SweepOutcome::Failed(error.into())
    }

    /// Reads the next batch ahead when the claim's last is full and may be
    /// followed in the same transaction: no tenant waits, the relay is not
    /// stopping, no tenant sharing the claim key (a twin) had rows pending
    /// at the claim, the claim holds fewer than [`CHAINED_BATCHES`], and the
    /// byte budget has a share free now (taken without waiting, and never
    /// ahead of a sweep that waits).
    fn read_ahead(&self, claim: &Claim, batches: usize) -> Option<Reservation> {
        let full = claim.batch().len() == self.config.batch_size && !claim.cut_by_budget();
        if !full || batches >= CHAINED_BATCHES || !self.may_chain() || claim.twin_pending() {
            return None;
        }
        let reserved = self.budget.try_reserve(self.budget_share)?;
        claim.read_ahead(reserved.bytes());
        Some(reserved)
    }

    /// Each confirmed row's delay, broker confirm minus `occurred_at`.
    fn delays(&self, rows: &[OutboxRow], report: &BatchReport) -> Vec<Duration> {
        rows.iter()
            .zip(&report.confirmed_at)
            .map(|(row, confirmed_at)| {
                let occurred_at = SystemTime::from(row.occurred_at);
                confirmed_at.duration_since(occurred_at).unwrap_or_default()
            })
            .collect()
    }

    /// Claims `tenant` with the sweep's share of the byte budget and keeps
    /// what the batch costs. A first row larger than the share waits for the
    /// budget to hold it alone (the share is given back first, so no sweep
    /// waits while holding budget another waits for).
    async fn claim_within_budget(
        &self,
        tenant: &str,
        safe: i64,
    ) -> Result<Option<(Claim, Reservation)>, StoreError> {
        let mut budget = self.budget.reserve(self.budget_share).await;
        let Some(mut claim) = self.store.claim(tenant, budget.bytes(), safe).await? else {
            return Ok(None);
        };
        if let Some(cost) = claim.withheld() {
            drop(budget);
            budget = self.budget.reserve(cost).await;
            claim.read_withheld().await?;
        }
        budget.keep(claim.cost());
        Ok(Some((claim, budget)))
    }

    /// Counts a settled sweep (all the batches of its transaction) and says
    /// how it ended: a `full` last batch is followed at once by the next.
    fn settled(
        &self,
        tenant: &str,
        Settled {
            rows,
            parked,
            kept_pending,
        }: Settled,
        full: bool,
        report: BatchReport,
        fence: Option<i64>,
    ) -> SweepOutcome {
        let published = report.confirmed();
        self.metrics.count_published(tenant, published);
        for delay in self.delays(&rows, &report) {
            self.metrics.delivered_after(delay);
        }
        if let Some(kept) = kept_pending {
            return SweepOutcome::Failed(SweepFailure::KeptPending(kept));
        }
        match report.refusal {
            Some((_, refusal)) if let Some(parked) = parked => {
                self.metrics.failure(tenant, refusal.reason);
                tracing::warn!(
                    tenant,
                    row = parked.id,
                    reason = refusal.reason.as_str(),
                    attempts = parked.attempts,
                    "row parked: refused for its own sake at park_after_attempts; the tenant goes on with its later rows (requeue or discard it)"
                );
                SweepOutcome::Parked {
                    id: parked.id,
                    rows: published,
                }
            }
            Some((at, refusal)) => {
                self.metrics.failure(tenant, refusal.reason);
                SweepOutcome::Failed(SweepFailure::Refused {
                    id: rows.get(at).map_or(0, |row| row.id),
                    published,
                    refusal,
                })
            }
            None if full => SweepOutcome::Published { rows: published },
            None => idle(published, fence),
        }
    }
}

/// A sweep that published less than a batch: idle, or deferred when writers
/// of the tenant were in flight at its claim (`fence`: where the id sequence
/// stood then).
fn idle(rows: usize, fence: Option<i64>) -> SweepOutcome {
    match fence {
        Some(position) => SweepOutcome::Deferred { rows, position },
        None => SweepOutcome::Idle { rows },
    }
}

/// The ids of the claim's confirmed prefix.
fn ids(report: &BatchReport, claim: &Claim) -> Vec<i64> {
    claim.rows()[..report.confirmed().min(claim.rows().len())]
        .iter()
        .map(|row| row.id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(reason: FailureReason) -> SweepOutcome {
        SweepOutcome::Failed(SweepFailure::Refused {
            id: 1,
            published: 0,
            refusal: Refusal::new(reason, "detail"),
        })
    }

    #[test]
    fn outages_are_told_from_a_tenants_own_failures() {
        for reason in [FailureReason::Connection, FailureReason::Timeout] {
            assert!(refused(reason).is_outage(), "{reason:?}");
        }
        for reason in [
            FailureReason::Nack,
            FailureReason::Unroutable,
            FailureReason::TooLarge,
            FailureReason::Invalid,
            FailureReason::Other,
        ] {
            assert!(!refused(reason).is_outage(), "{reason:?}");
        }
        let deadline = StoreError::Timeout("the claim", Duration::from_secs(10));
        assert!(SweepOutcome::Failed(deadline.into()).is_outage());
        let unfit = StoreError::Columns(crate::store::Drift {
            table: "\"public\".\"outbox_message\"".into(),
            column: "payload",
            found: Some("bytea".into()),
        });
        assert!(SweepOutcome::Failed(unfit.into()).is_outage());
        assert!(!SweepOutcome::Failed(SweepFailure::Aborted("panic".into())).is_outage());
        assert!(!SweepOutcome::Idle { rows: 0 }.is_outage());
    }
}
