//! One sweep of one tenant: claim it, publish its batch, settle what the
//! broker confirmed. [`Relay`] holds what every sweep needs; the scheduler
//! (`scheduler`) only decides when to call [`Relay::sweep`] next.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::config::Config;
use crate::domain::{BatchReport, OutboxRow, Outcome, Refusal};
use crate::metrics::Metrics;
use crate::publisher::{Progress, PublishError, Publisher};
use crate::store::{Store, StoreError};

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
    pub fn kind(&self) -> Outcome {
        match self {
            SweepOutcome::Published { .. } => Outcome::Published,
            SweepOutcome::Idle { .. } => Outcome::Idle,
            SweepOutcome::Skipped => Outcome::Skipped,
            SweepOutcome::Failed(_) => Outcome::Failed,
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
    pub fn from_config(config: Arc<Config>) -> Result<Relay, SetupError> {
        let metrics = Metrics::new(&config.tenants);
        let store = Store::new(&config)?;
        let publisher = Publisher::new(&config)?;
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

    /// One sweep of one tenant: claim, publish, settle. Records its metrics;
    /// the caller decides when to sweep again.
    pub async fn sweep(&self, tenant: &str) -> SweepOutcome {
        let started = Instant::now();
        let outcome = self.claim_publish_settle(tenant).await;
        self.metrics
            .sweep_finished(tenant, outcome.kind(), started.elapsed());
        outcome
    }

    async fn claim_publish_settle(&self, tenant: &str) -> SweepOutcome {
        // Claim: the tenant's advisory lock and its oldest pending rows.
        let claim = match self.store.claim(tenant).await {
            Ok(Some(claim)) => claim,
            Ok(None) => return SweepOutcome::Skipped,
            Err(error) => return SweepOutcome::Failed(error.into()),
        };
        if claim.rows().is_empty() {
            return match claim.rollback().await {
                Ok(()) => SweepOutcome::Idle { rows: 0 },
                Err(error) => SweepOutcome::Failed(error.into()),
            };
        }
        // Publish, marking the confirmed prefix ahead as it grows, so that
        // the commit has little left to do.
        let mut publishing = self.publisher.publish(tenant, claim.rows(), &claim);
        let report = loop {
            match publishing.next().await {
                Progress::Confirmed(prefix) => claim.mark_ahead(prefix),
                Progress::Settled(report) => break report,
            }
        };
        let cut_short = publishing.cut_short();
        // Settle: mark the confirmed prefix, record a refusal, commit.
        match claim.settle(&report).await {
            Ok(rows) => self.settled(tenant, &rows, report, cut_short),
            // Confirmed but not marked: these rows go out again (at least once).
            Err(error) => SweepOutcome::Failed(error.into()),
        }
    }

    /// Counts a settled batch and says how its sweep ended. A batch `cut_short`
    /// left rows for the next sweep (they go another way, see `publisher`):
    /// like a full batch, it is swept again at once.
    fn settled(
        &self,
        tenant: &str,
        rows: &[OutboxRow],
        report: BatchReport,
        cut_short: bool,
    ) -> SweepOutcome {
        let published = report.confirmed();
        self.metrics.count_published(tenant, published);
        for (row, confirmed_at) in rows.iter().zip(&report.confirmed_at) {
            let occurred_at = SystemTime::from(row.occurred_at);
            let delay = confirmed_at.duration_since(occurred_at).unwrap_or_default();
            self.metrics.delivered_after(delay);
        }
        match report.refusal {
            Some((at, refusal)) => {
                self.metrics.failure(tenant, refusal.reason);
                SweepOutcome::Failed(SweepFailure::Refused {
                    id: rows.get(at).map_or(0, |row| row.id),
                    published,
                    refusal,
                })
            }
            None if cut_short || rows.len() == self.config.batch_size => {
                SweepOutcome::Published { rows: published }
            }
            None => SweepOutcome::Idle { rows: published },
        }
    }
}
