//! Sweeps: starting them when a tenant is ready and a slot is free, taking
//! each one's outcome to schedule its tenant's next turn, and draining
//! them at shutdown.

use std::time::Duration;

use tokio::task::Id;
use tokio::time::Instant;

use super::Scheduler;
use super::writers::Candidate;
use crate::relay::{SweepFailure, SweepOutcome};

impl Scheduler {
    /// Readies the tenants whose back-off is over; their back-off gauge
    /// goes back to 0.
    pub(super) fn wake_backed_off(&mut self, now: Instant) {
        for woken in self.schedule.wake(now) {
            self.relay
                .metrics
                .set_backoff(self.schedule.name(woken), Duration::ZERO);
        }
    }

    /// Whether sweeps may start: not while the broker is down or blocking,
    /// the last poll found the database unreachable, a column is unfit, or
    /// sweeps are held until the next poll checks the columns.
    pub(super) fn sweeps_may_start(&self) -> bool {
        self.relay.publisher.can_publish()
            && self.database_up != Some(false)
            && self.drift.is_none()
            && self.sequence_unfit.is_none()
            && !self.held_for_check
    }

    /// Starts sweeps of ready tenants, up to `concurrency` running, unless
    /// none may start (see [`Self::sweeps_may_start`]).
    pub(super) fn start_sweeps(&mut self) {
        if !self.sweeps_may_start() {
            return;
        }
        while self.sweeps.len() < self.relay.config.concurrency {
            let Some(tenant) = self.schedule.next_ready() else {
                break;
            };
            let name = self.schedule.name(tenant).clone();
            let safe = self.schedule.safe(tenant);
            let relay = self.relay.clone();
            let handle = self
                .sweeps
                .spawn(async move { relay.sweep(&name, safe).await });
            self.running.insert(handle.id(), tenant);
        }
    }

    /// A sweep's task ended: log it, and schedule its tenant's next turn.
    pub(super) fn sweep_done(
        &mut self,
        joined: Result<(Id, SweepOutcome), tokio::task::JoinError>,
    ) {
        let (id, outcome) = match joined {
            Ok(joined) => joined,
            Err(error) => (
                error.id(),
                SweepOutcome::Failed(SweepFailure::Aborted(error.to_string())),
            ),
        };
        let Some(tenant) = self.running.remove(&id) else {
            return;
        };
        let name = self.schedule.name(tenant).clone();
        report(&name, &outcome);
        // Rows committed during the sweep: the next read of the id sequence
        // lists the pending tenants (see `position_read`).
        self.watch.moved = true;
        if let SweepOutcome::Published { rows }
        | SweepOutcome::Idle { rows }
        | SweepOutcome::Deferred { rows, .. } = outcome
            && rows > 0
        {
            self.work_since.seen();
            self.active(Instant::now());
        }
        if let SweepOutcome::Failed(SweepFailure::Store(error)) = &outcome {
            match error.drift() {
                Some(drift) => self.columns_unfit(drift.clone()),
                None if let Some(unfit) = error.unfit_sequence() => {
                    self.sequence_checked(Err(unfit.to_string()));
                }
                // A statement the server refused may be a column gone or
                // changed under the read, and so may a read that did not
                // answer (the driver looks up a type it does not know, such
                // as an extension's, behind the read's own rows): the next
                // poll checks them.
                None => {
                    self.columns_checked = false;
                    self.held_for_check |= !error.is_unreachable()
                        && error.sqlstate().is_some_and(|code| code.starts_with("42"));
                }
            }
        }
        match outcome {
            SweepOutcome::Deferred { .. } => {
                self.schedule.defer(tenant);
                let now = Instant::now();
                self.candidates.entry(tenant).or_insert(Candidate::new(now));
                // The writers met at the claim have had the sweep's publish
                // and settle to end: the check is due at once.
                self.next_check = self.next_check.min(now);
                return;
            }
            SweepOutcome::Idle { .. } if self.candidates.remove(&tenant).is_some() => {
                self.relay.metrics.set_writer_wait(&name, Duration::ZERO);
            }
            _ => {}
        }
        let delay = if outcome.is_outage() {
            self.schedule.interrupted(tenant);
            Duration::ZERO
        } else {
            self.schedule
                .finished(tenant, outcome.kind(), Instant::now())
        };
        self.relay.metrics.set_backoff(&name, delay);
    }

    /// Lets running sweeps finish within the grace period, each settling
    /// the batches it has read without taking another, then abandons them
    /// (their transactions roll back; their rows stay pending).
    pub(super) async fn drain(mut self) {
        self.relay.stop_chaining();
        if self.sweeps.is_empty() {
            return;
        }
        let grace = self.relay.config.shutdown_grace();
        tracing::info!(
            sweeps = self.sweeps.len(),
            grace_ms = grace.as_millis() as u64,
            "draining running sweeps"
        );
        let finished = tokio::time::timeout(grace, async {
            while let Some(joined) = self.sweeps.join_next_with_id().await {
                if let Ok((id, outcome)) = joined
                    && let Some(tenant) = self.running.remove(&id)
                {
                    report(self.schedule.name(tenant), &outcome);
                }
            }
        })
        .await;
        if finished.is_err() {
            tracing::warn!(
                abandoned = self.sweeps.len(),
                "grace period over; abandoning sweeps (their rows stay pending)"
            );
            self.sweeps.abort_all();
            while self.sweeps.join_next().await.is_some() {}
        }
    }
}

/// Logs a sweep's outcome: every failure once, with tenant and reason.
fn report(tenant: &str, outcome: &SweepOutcome) {
    match outcome {
        SweepOutcome::Published { rows } => tracing::debug!(tenant, rows, "published a full batch"),
        SweepOutcome::Idle { rows } => tracing::debug!(tenant, rows, "swept"),
        SweepOutcome::Deferred { rows, position } => tracing::debug!(
            tenant,
            rows,
            position,
            "swept up to the safe bound; waiting for the tenant's writers in flight"
        ),
        SweepOutcome::Skipped => tracing::debug!(tenant, "held by another relay; skipped"),
        SweepOutcome::Parked { id, rows } => {
            tracing::debug!(tenant, row = id, rows, "parked a row; going on at once")
        }
        SweepOutcome::Failed(SweepFailure::Refused {
            id,
            published,
            refusal,
        }) => {
            // A channel closed or silent under the row is an outage (see
            // `SweepOutcome::is_outage`), not a refusal of the row.
            let said = if outcome.is_outage() {
                "the channel to the broker closed or went silent with this row in flight; it goes again"
            } else {
                "row refused"
            };
            tracing::warn!(
                tenant,
                row = id,
                published,
                reason = refusal.reason.as_str(),
                error = %refusal.detail,
                "sweep failed: {said}"
            )
        }
        SweepOutcome::Failed(failure @ SweepFailure::KeptPending(kept)) => tracing::error!(
            tenant,
            rows = kept.rows,
            row = kept.first,
            reason = "kept_pending",
            "sweep failed: {failure}"
        ),
        SweepOutcome::Failed(SweepFailure::Aborted(error)) => {
            tracing::error!(tenant, reason = "aborted", %error, "sweep failed")
        }
        SweepOutcome::Failed(SweepFailure::Store(error)) if error.drift().is_some() => {
            // Said once by the scheduler, not once per tenant.
            tracing::debug!(tenant, reason = "columns", %error, "sweep stopped: a column is unfit")
        }
        SweepOutcome::Failed(SweepFailure::Store(error)) if error.unfit_sequence().is_some() => {
            // Said once by the scheduler, not once per tenant.
            tracing::debug!(tenant, reason = "sequence", %error, "sweep stopped: the id sequence is unfit")
        }
        SweepOutcome::Failed(SweepFailure::Store(error)) if error.is_unreachable() => {
            tracing::warn!(
                tenant,
                reason = "database",
                %error,
                "sweep failed: database unreachable; the tenant waits for the next successful poll"
            )
        }
        SweepOutcome::Failed(SweepFailure::Store(error)) => {
            tracing::warn!(tenant, reason = "database", %error, "sweep failed")
        }
    }
}
