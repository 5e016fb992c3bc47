//! The writers' check: a tenant whose sweep met writers of the tenant in
//! flight (deferred) waits until they have ended: then every id of the
//! tenant up to a known position is committed or gone (its safe bound).
//! The check finds when, and paces itself by how long the youngest wait
//! has lasted. What it records (holders, positions, safe bounds) belongs to
//! one instance of the server: a restart or a promotion, or a check that
//! cannot run, drops it all, and the check starts again.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Scheduler;
use crate::store::{Holder, StoreError, Writers};

/// The writers' check in flight (see [`Store::writers`]): the tenants it asked
/// about, and its answer.
///
/// [`Store::writers`]: crate::store::Store::writers
pub(super) type WritersCheck = Pin<Box<dyn Future<Output = WritersFound> + Send>>;

/// What a writers' check found: the tenants it asked about; whether each is
/// free now and the position before (the cheap check); and, when `pg_locks`
/// was read too, who holds each tenant's lock.
pub(super) struct WritersFound {
    tenants: Vec<usize>,
    free: Result<(i64, Vec<bool>), StoreError>,
    holders: Option<Result<Writers, StoreError>>,
}

/// The writers' check runs at most this often while tenants wait for it:
/// a try of each deferred tenant's writers' key, which clears a tenant whose
/// writers have all ended ...
pub const WRITERS_CHECK_MIN: Duration = Duration::from_millis(2);
/// ... and, at most this often, a read of `pg_locks` (which holds up every
/// lock request of the server for a moment), which clears a tenant that
/// always has some writer in flight once those of an earlier read ended ...
pub const LOCKS_CHECK_MIN: Duration = Duration::from_millis(5);
/// ... and at least this often; in between, a quarter of how long the
/// youngest wait has lasted: a busy tenant's writers end within milliseconds,
/// a long transaction (or a prepared one left open) is looked at less and
/// less often.
pub const WRITERS_CHECK_MAX: Duration = Duration::from_millis(100);

/// A deferred tenant's wait for its writers in flight.
#[derive(Debug)]
pub(super) struct Candidate {
    /// Where the id sequence stood at the check that found `holders` (none
    /// before the first check).
    position: Option<i64>,
    /// The transactions that held the tenant's writers' lock then: once all
    /// have ended, every id up to `position` is committed or gone.
    holders: Vec<Holder>,
    /// Since when the tenant has waited.
    since: Instant,
}

impl Candidate {
    /// A wait that starts at `since`, before any check.
    pub(super) fn new(since: Instant) -> Candidate {
        Candidate {
            position: None,
            holders: Vec::new(),
            since,
        }
    }
}

impl Scheduler {
    /// Starts the writers' check of the deferred tenants (see
    /// [`Store::writers_free`], [`Store::writers`]): a try of each one's
    /// writers' key, and a read of `pg_locks` too when one is due (at most
    /// every [`LOCKS_CHECK_MIN`]).
    ///
    /// [`Store::writers_free`]: crate::store::Store::writers_free
    /// [`Store::writers`]: crate::store::Store::writers
    pub(super) fn start_writers_check(&mut self, now: Instant) {
        let tenants: Vec<usize> = self.candidates.keys().copied().collect();
        let names: Vec<Arc<str>> = tenants
            .iter()
            .map(|&t| self.schedule.name(t).clone())
            .collect();
        let relay = self.relay.clone();
        let locks = now >= self.next_locks_check;
        if locks {
            self.next_locks_check = now + LOCKS_CHECK_MIN;
        }
        self.writers_check = Some(Box::pin(async move {
            let names: Vec<&str> = names.iter().map(|name| &**name).collect();
            let free = relay.store.writers_free(&names).await;
            let holders = if locks {
                Some(relay.store.writers(&names).await)
            } else {
                None
            };
            WritersFound {
                tenants,
                free,
                holders,
            }
        }));
    }

    /// The writers' check answered: a deferred tenant whose writers in flight
    /// (as an earlier check found them) have all ended is ready again, with
    /// that check's position as its safe bound; one with no writer in flight
    /// now, with this check's. The next check is paced by the youngest wait.
    pub(super) fn checked(&mut self, found: WritersFound) {
        let now = Instant::now();
        let WritersFound {
            tenants,
            free,
            holders,
        } = found;
        let (position, free) = match free {
            Ok(free) => free,
            Err(error) => return self.check_failed(now, &error),
        };
        // A tenant with no writer in flight now: its ids up to the position
        // are committed or gone.
        for (&tenant, free) in tenants.iter().zip(free) {
            if free && self.candidates.remove(&tenant).is_some() {
                self.schedule.cleared(tenant, position);
                let name = self.schedule.name(tenant).clone();
                self.relay.metrics.set_writer_wait(&name, Duration::ZERO);
            }
        }
        let writers = match holders {
            Some(Ok(writers)) => writers,
            Some(Err(error)) => return self.check_failed(now, &error),
            None => {
                self.pace_checks(now);
                return;
            }
        };
        if self.writers_instance.as_ref() != Some(&writers.started) {
            // Another instance of the server (restarted, or another one
            // promoted): what the last one held says nothing of this one.
            self.forget_writers();
            self.writers_instance = Some(writers.started);
        }
        for (tenant, holders) in tenants.into_iter().zip(writers.tenants) {
            let Some(candidate) = self.candidates.get_mut(&tenant) else {
                continue;
            };
            let name = self.schedule.name(tenant).clone();
            if holders.is_empty() {
                self.candidates.remove(&tenant);
                self.schedule.cleared(tenant, writers.position);
                self.relay.metrics.set_writer_wait(&name, Duration::ZERO);
            } else if let Some(position) = candidate.position
                && candidate
                    .holders
                    .iter()
                    .all(|held| !holders.iter().any(|holder| holder.is(held)))
            {
                *candidate = Candidate {
                    position: Some(writers.position),
                    holders,
                    since: now,
                };
                self.schedule.cleared(tenant, position);
                self.relay.metrics.set_writer_wait(&name, Duration::ZERO);
            } else {
                if candidate.position.is_none() {
                    candidate.position = Some(writers.position);
                    candidate.holders = holders;
                } else {
                    // A holder recorded before its xid is known by it now.
                    for held in &mut candidate.holders {
                        if let Some(holder) = holders.iter().find(|holder| holder.is(held)) {
                            *held = holder.clone();
                        }
                    }
                }
                self.relay
                    .metrics
                    .set_writer_wait(&name, now - candidate.since);
            }
        }
        self.pace_checks(now);
    }

    /// The writers' check could not run: what it recorded is dropped (see
    /// [`Scheduler::forget_writers`]), and it runs again at the next poll
    /// interval.
    fn check_failed(&mut self, now: Instant, error: &StoreError) {
        tracing::debug!(%error, "the writers' check failed; trying again at the next poll interval");
        self.forget_writers();
        self.writers_instance = None;
        self.next_check = now + self.relay.config.poll_interval();
    }

    /// Drops every holder, position and safe bound the writers' check has
    /// recorded: the deferred tenants wait on, and the check starts again.
    fn forget_writers(&mut self) {
        for candidate in self.candidates.values_mut() {
            *candidate = Candidate::new(candidate.since);
        }
        self.schedule.forget_safe();
    }

    /// The next writers' check: a quarter of how long the youngest wait has
    /// lasted, within [`WRITERS_CHECK_MIN`] and [`WRITERS_CHECK_MAX`].
    fn pace_checks(&mut self, now: Instant) {
        let youngest = self.candidates.values().map(|c| now - c.since).min();
        self.next_check = now
            + youngest.map_or(WRITERS_CHECK_MIN, |waited| {
                (waited / 4).clamp(WRITERS_CHECK_MIN, WRITERS_CHECK_MAX)
            });
    }
}
