//! The poll: when it runs (less often while the relay is busy), what it
//! checks besides the pending tenants (the id sequence's settings, the
//! table's columns), and what its answer says of the database. What it
//! found pending is taken in by `pending`.

use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;

use super::Scheduler;
use crate::config::{Config, Wakeup};
use crate::store::{self, Drift, Page, StoreError};

/// While every `concurrency` slot runs a sweep and at least this many
/// tenants wait in this relay's ready queues (or, when wake-ups announce new
/// rows, as many as `concurrency`: see [`busy_queue`]), the poll (whose cost
/// grows with the tenants it finds pending: about 5 µs of the database's time
/// each, 50 ms for 10,000, more while their marked rows are not yet
/// vacuumed) would add little to the queue, so it runs less often: at most
/// once every [`BUSY_POLL_EVERY`] intervals, and no more than a
/// [`BUSY_POLL_SHARE`] of the time its last run took (which grows as the
/// database gets busier), but at least every [`BUSY_POLL_MAX`] (or `poll_ms`
/// if longer). So a pending row is found within `poll_ms` while the relay has
/// little queued, and within `BUSY_POLL_MAX` at the latest (during an outage,
/// or before this relay knows its replicas, the poll runs every interval: it
/// is how the relay sees the database back).
pub const BUSY_QUEUE: usize = 64;
pub const BUSY_POLL_EVERY: u32 = 5;
/// One twentieth: a busy relay spends at most 5 % of its time waiting for
/// the poll.
pub const BUSY_POLL_SHARE: u32 = 20;
pub const BUSY_POLL_MAX: Duration = Duration::from_secs(5);

/// The poll in flight: tenants with pending rows, their lowest pending ids
/// and lag; and what a check of the table's columns that went with it found.
pub(super) type Poll = Pin<Box<dyn Future<Output = Result<Polled, StoreError>> + Send>>;

/// What a successful poll found.
pub(super) struct Polled {
    found: store::Polled,
    /// The page it read.
    page: Page,
    columns: ColumnCheck,
    /// What the check of the id sequence that went with it found, if one did:
    /// fit, or what makes it unfit.
    sequence: Option<Result<(), String>>,
}

/// What the check of the table's columns that went with a poll found.
enum ColumnCheck {
    /// Not run: the columns were found fit before, and no read failed since.
    NotRun,
    /// The table does not exist (yet).
    NoTable,
    Fit,
    Drift(Drift),
}

/// A poll checks the id sequence's settings (see `Store::check_sequence`) at
/// least this often, besides at start.
pub const SEQUENCE_CHECK_EVERY: Duration = Duration::from_secs(10);

/// A poll checks the table's columns at least this often, besides at start
/// and while they are unfit.
pub const COLUMNS_CHECK_EVERY: Duration = Duration::from_secs(60);

/// The most tenants one poll reads (about 50 ms of the database's time);
/// with more pending, the polls page through them in the index's order,
/// each going on after the last one's last tenant, and start again at the
/// first after a page that was not full (a cycle).
pub const POLL_PAGE: usize = 10_000;

impl Scheduler {
    /// Whether the poll due now waits, because enough work is queued (see
    /// [`BUSY_QUEUE`]) behind sweeps taking every slot: only while the
    /// database is up, this relay knows its share, sweeps may start (the
    /// broker takes publishes, and no column check is awaited: the poll is
    /// what ends that wait), and the last poll is more recent than the busy
    /// interval. It then moves the poll a poll interval on.
    pub(super) fn hold_poll_while_busy(&mut self, now: Instant) {
        let poll_interval = self.relay.config.poll_interval();
        if self.poll.is_none()
            && now >= self.next_poll
            && self.database_up == Some(true)
            && self.member
            && is_busy(
                &self.relay.config,
                Load::after_start(
                    self.sweeps.len(),
                    self.schedule.ready_len(),
                    self.relay.config.concurrency,
                    self.sweeps_may_start(),
                ),
            )
            && self
                .last_poll
                .is_some_and(|at| now < at + busy_poll_interval(poll_interval, self.last_poll_took))
        {
            // Enough work is queued: the poll waits (see BUSY_QUEUE).
            self.next_poll = now + poll_interval;
        }
    }

    /// Starts the poll, and decides what it checks besides: the table's
    /// columns until they are fit, while one is unfit, and while the
    /// columns of parking are missing; the id sequence's settings then too,
    /// and at least every [`SEQUENCE_CHECK_EVERY`]. Marks where the ready
    /// queues stand, for its answer (see [`Schedule::unqueue_unfound`]).
    ///
    /// [`Schedule::unqueue_unfound`]: super::Schedule::unqueue_unfound
    pub(super) fn start_poll(&mut self, now: Instant) {
        self.last_poll = Some(now);
        self.poll_mark = self.schedule.mark();
        let relay = self.relay.clone();
        // Checked until fit, while a column is unfit (to see it fixed),
        // and while the table lacks the columns of parking (they appear
        // when `migrate` runs).
        // And at least every COLUMNS_CHECK_EVERY: a change that no read
        // fails on (a `tenant_id` made `char(n)`, or given a
        // case-insensitive collation) would otherwise go unseen.
        // The periodic checks only after rows were seen (see `work_since`).
        let check = !self.columns_checked
            || self.drift.is_some()
            || !self.relay.store.has_parking_columns()
            || (self.work_since.columns_check
                && self
                    .columns_rechecked
                    .is_none_or(|at| now >= at + COLUMNS_CHECK_EVERY));
        if check {
            self.columns_rechecked = Some(now);
            self.work_since.columns_check = false;
        }
        // The id sequence's settings too, and at least every
        // SEQUENCE_CHECK_EVERY: an ALTER SEQUENCE … CACHE 20 under a
        // running relay would otherwise go unseen.
        let check_sequence = check
            || self.sequence_unfit.is_some()
            || (self.work_since.sequence_check
                && self
                    .sequence_checked
                    .is_none_or(|at| now >= at + SEQUENCE_CHECK_EVERY));
        if check_sequence {
            self.sequence_checked = Some(now);
            self.work_since.sequence_check = false;
        }
        let page = Page {
            after: self.poll_after.clone(),
            limit: POLL_PAGE,
        };
        self.poll = Some(Box::pin(async move {
            let sequence = match check_sequence.then(|| relay.store.check_sequence()) {
                None => None,
                Some(checked) => match checked.await {
                    Ok(_) => Some(Ok(())),
                    Err(StoreError::Sequence(unfit)) => Some(Err(unfit)),
                    Err(error) => return Err(error),
                },
            };
            let columns = match check.then(|| relay.store.check_columns()) {
                None => ColumnCheck::NotRun,
                Some(checked) => match checked.await {
                    Ok(true) => ColumnCheck::Fit,
                    Ok(false) => ColumnCheck::NoTable,
                    Err(StoreError::Columns(drift)) => ColumnCheck::Drift(drift),
                    Err(error) => return Err(error),
                },
            };
            let listeners = relay.wakeups.members_pattern();
            let found = relay.store.pending_tenants(&listeners, &page).await?;
            Ok(Polled {
                found,
                page,
                columns,
                sequence,
            })
        }));
        self.next_poll = now + self.relay.config.poll_interval();
    }

    /// The poll answered: the database is reachable or not, each tenant's
    /// lag, and the tenants with rows pending join the ready queue. A poll
    /// that the server answered with an error (a data error, a permission, an
    /// unfit payload column) leaves the database up, and is logged once as
    /// what it is.
    pub(super) fn polled(&mut self, result: Result<Polled, StoreError>) {
        let Polled {
            found,
            page,
            columns,
            sequence,
        } = match result {
            Ok(polled) => polled,
            Err(error) => return self.poll_failed(error),
        };
        self.poll_succeeded(columns);
        if let Some(checked) = sequence {
            self.sequence_checked(checked);
        }
        self.take_pending(found, &page);
    }

    /// The poll failed. Unreachable, the database is down (said once); the
    /// server answering with an error, it is up, and the error is logged
    /// once until the poll succeeds or fails otherwise.
    fn poll_failed(&mut self, error: StoreError) {
        if error.is_unreachable() {
            if self.database_up != Some(false) {
                tracing::warn!(%error, "database unreachable; retrying every poll interval");
            }
            self.poll_error = None;
            self.database_is(false);
            return;
        }
        self.reachable();
        let text = error.to_string();
        if self.poll_error.as_deref() != Some(text.as_str()) {
            tracing::error!(
                error = %text,
                "the poll failed: the database answered with an error; it finds no pending tenant until it succeeds, retrying every poll interval"
            );
            self.poll_error = Some(text);
        }
    }

    /// The poll succeeded: the database is up, a failure logged before is
    /// over, and a check of the columns that went with it decides whether
    /// sweeps may start (fit) or stay stopped (unfit); any check run ends
    /// the hold a sweep's refused statement put on sweeps.
    fn poll_succeeded(&mut self, columns: ColumnCheck) {
        self.reachable();
        if self.poll_error.take().is_some() {
            tracing::info!("the poll succeeds again");
        }
        if !matches!(columns, ColumnCheck::NotRun) {
            self.held_for_check = false;
        }
        match columns {
            ColumnCheck::Fit => self.columns_fit(),
            ColumnCheck::Drift(drift) => self.columns_unfit(drift),
            ColumnCheck::NotRun | ColumnCheck::NoTable => {}
        }
    }

    /// A read or a check found a column the relay cannot read: sweeps stop
    /// until a check finds the columns fit; said once per change.
    pub(super) fn columns_unfit(&mut self, drift: Drift) {
        self.columns_checked = false;
        if self.drift.as_ref() != Some(&drift) {
            tracing::error!(
                column = drift.column,
                found = drift.found.as_deref().unwrap_or("(none)"),
                "{drift}"
            );
            self.drift = Some(drift);
        }
    }

    /// A check of the id sequence (or a sweep's) found it fit, or unfit
    /// (what makes it so): sweeps stop while it is unfit, and every poll
    /// checks it then; said once per change.
    pub(super) fn sequence_checked(&mut self, checked: Result<(), String>) {
        match checked {
            Ok(()) => {
                if self.sequence_unfit.take().is_some() {
                    tracing::info!("the id sequence fits again; relaying resumes");
                }
            }
            Err(unfit) => {
                if self.sequence_unfit.as_deref() != Some(unfit.as_str()) {
                    tracing::error!("{unfit}");
                    self.sequence_unfit = Some(unfit);
                }
            }
        }
    }

    /// A check found the table's columns fit: sweeps go on.
    fn columns_fit(&mut self) {
        self.columns_checked = true;
        if self.drift.take().is_some() {
            tracing::info!("the outbox table's columns fit again; reading resumes");
        }
    }

    /// The database answered the poll, with rows or with an error.
    fn reachable(&mut self) {
        if self.database_up != Some(true) {
            tracing::info!("database reachable");
        }
        self.database_is(true);
    }

    fn database_is(&mut self, up: bool) {
        self.database_up = Some(up);
        self.relay.metrics.set_database_up(up);
    }
}

/// What makes a relay busy or not (see [`BUSY_QUEUE`]).
struct Load {
    /// Sweeps running.
    sweeping: usize,
    /// Tenants waiting in the ready queues.
    waiting: usize,
    sweeps_may_start: bool,
}

impl Load {
    /// The load once the turn's sweeps have started (this check comes
    /// before them): waiting tenants fill the free slots first, so a slot
    /// just freed by a sweep that ended does not let the poll through.
    fn after_start(sweeping: usize, waiting: usize, concurrency: usize, may_start: bool) -> Load {
        let starting = if may_start {
            waiting.min(concurrency.saturating_sub(sweeping))
        } else {
            0
        };
        Load {
            sweeping: sweeping + starting,
            waiting: waiting - starting,
            sweeps_may_start: may_start,
        }
    }
}

/// Whether the relay is busy (see [`BUSY_QUEUE`]): every slot runs a sweep
/// and enough tenants wait behind them. Tenants that wait because no sweep
/// may start (the broker blocking, a column check awaited) do not make it
/// busy: the poll is how it sees that end.
fn is_busy(config: &Config, load: Load) -> bool {
    load.sweeps_may_start
        && load.sweeping >= config.concurrency
        && load.waiting >= busy_queue(config)
}

/// How many tenants waiting in the ready queues make the relay busy (see
/// [`BUSY_QUEUE`]). With `wakeup = poll`, the poll is how the relay learns of
/// every new row, so only a long queue ([`BUSY_QUEUE`]) holds it. With
/// notifications or the sequence watch, new rows reach the queues without
/// it: once every slot of `concurrency` has a tenant waiting behind it, a
/// tenant the poll would find could only join the queue, and the poll (one
/// index probe per pending tenant of the whole table, every `poll_ms`, on
/// every replica) is what the database would pay for nothing.
fn busy_queue(config: &Config) -> usize {
    match config.wakeup {
        Wakeup::Poll => BUSY_QUEUE,
        Wakeup::Sequence | Wakeup::Notify => config.concurrency.clamp(1, BUSY_QUEUE),
    }
}

/// How far apart polls are while the relay is busy (see [`BUSY_QUEUE`]).
fn busy_poll_interval(poll_interval: Duration, last_poll_took: Duration) -> Duration {
    (poll_interval * BUSY_POLL_EVERY)
        .max(last_poll_took * BUSY_POLL_SHARE)
        .min(BUSY_POLL_MAX.max(poll_interval))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_wake_ups_a_relay_is_busy_once_every_slot_has_a_tenant_waiting() {
        let mut config = Config::with_tenants(["a"]);
        for (wakeup, concurrency, busy) in [
            (Wakeup::Sequence, 4, 4),
            (Wakeup::Notify, 16, 16),
            (Wakeup::Sequence, 1, 1),
            (Wakeup::Notify, 1_000, BUSY_QUEUE),
            (Wakeup::Poll, 4, BUSY_QUEUE),
            (Wakeup::Poll, 1, BUSY_QUEUE),
        ] {
            config.wakeup = wakeup;
            config.concurrency = concurrency;
            assert_eq!(busy_queue(&config), busy, "{wakeup:?} at {concurrency}");
        }
    }

    #[test]
    fn a_relay_is_busy_only_with_every_slot_sweeping_and_tenants_waiting() {
        let mut config = Config::with_tenants(["a"]);
        config.concurrency = 4;
        let load = |sweeping, waiting, sweeps_may_start| Load {
            sweeping,
            waiting,
            sweeps_may_start,
        };
        assert!(is_busy(&config, load(4, 4, true)));
        assert!(is_busy(&config, load(4, 100, true)));
        // A free slot: the waiting tenants start at once.
        assert!(!is_busy(&config, load(3, 100, true)));
        // Too few waiting: the poll may find more work than the queue holds.
        assert!(!is_busy(&config, load(4, 3, true)));
        // Nothing may start (a column check awaited): the poll ends that.
        assert!(!is_busy(&config, load(0, 100, false)));
        assert!(!is_busy(&config, load(4, 100, false)));
        // A slot just freed: the first waiting tenant takes it this turn.
        assert!(is_busy(&config, Load::after_start(3, 5, 4, true)));
        assert!(!is_busy(&config, Load::after_start(3, 4, 4, true)));
        assert!(!is_busy(&config, Load::after_start(0, 100, 4, false)));
        config.wakeup = Wakeup::Poll;
        assert!(!is_busy(&config, load(4, BUSY_QUEUE - 1, true)));
        assert!(is_busy(&config, load(4, BUSY_QUEUE, true)));
    }

    #[test]
    fn a_busy_relay_polls_less_the_costlier_the_poll_within_a_bound() {
        let ms = Duration::from_millis;
        assert_eq!(busy_poll_interval(ms(200), ms(5)), ms(1_000), "5 intervals");
        assert_eq!(
            busy_poll_interval(ms(200), ms(150)),
            ms(3_000),
            "20 polls' time"
        );
        assert_eq!(
            busy_poll_interval(ms(200), ms(900)),
            BUSY_POLL_MAX,
            "capped"
        );
        assert_eq!(
            busy_poll_interval(ms(10_000), ms(5)),
            ms(10_000),
            "never more often than poll_ms"
        );
    }
}
