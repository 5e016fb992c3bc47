//! The scheduler: which tenant is swept when. A sweep's outcome decides its
//! tenant's next turn:
//!
//! - `published` (a full batch): at once, behind the other ready tenants;
//! - `idle`, `skipped`: when the poll next finds rows pending for it, or a
//!   notification names it (`wakeup`);
//! - `failed` by the tenant's own doing (a refused row, a statement the
//!   server refused): after its own back-off, while every other tenant goes on;
//! - `failed` by an outage (the database unreachable, the broker connection
//!   lost, absent or timed out): when the next successful poll finds rows
//!   pending for it, at once. An outage is no tenant's failure: it neither
//!   counts nor grows a back-off.
//!
//! One poll statement per `poll_ms` finds the tenants with pending rows (and
//! their lag, the one source of the lag gauge; see `lag`), so an idle relay
//! costs the same whatever the number of tenants. A notification (see
//! `wakeup`) readies its idle tenant at once; one that arrives while the
//! tenant is being swept asks for one more sweep when that one ends, however
//! many arrive (rows committed after the sweep read its batch). With several
//! replicas, only the tenant's owner among them acts on it. At most
//! `concurrency` sweeps run at once; none starts while the broker is down or
//! the last poll found the database unreachable. Before its first successful poll the scheduler
//! checks the table's `payload` column; an unfit one stops all relaying until
//! it is fixed.
//!
//! The parts, one job each: [`Schedule`] (`schedule`) is the pure part, the
//! tenants' states and ready queues; `poll` starts the poll and reads what
//! its answer says of the database; `pending` takes in what it found
//! pending (lag, parked rows, the replicas' shares, the ready queues);
//! `wakeups` readies tenants between polls (notifications, the id sequence
//! watched); `writers` waits out a deferred tenant's writers in flight;
//! `sweeps` starts sweeps and takes their outcomes. This file holds the loop.

mod pending;
mod poll;
mod schedule;
mod sweeps;
mod wakeups;
mod writers;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::{Id, JoinSet};
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::relay::{Relay, SweepOutcome};
use crate::shutdown::Shutdown;
use crate::store::Drift;
use pending::Seen;
use poll::Poll;
use wakeups::Watch;
use writers::{Candidate, WritersCheck};

pub use pending::{TAKEOVER_IDLE_POLLS, TAKEOVER_POLLS};
pub use poll::{
    BUSY_POLL_EVERY, BUSY_POLL_MAX, BUSY_POLL_SHARE, BUSY_QUEUE, POLL_PAGE, SEQUENCE_CHECK_EVERY,
};
pub use schedule::Schedule;
pub use wakeups::{WATCH_QUIET, WATCH_SPAN, WATCH_TICK, WATCH_WINDOW};
pub use writers::{LOCKS_CHECK_MIN, WRITERS_CHECK_MAX, WRITERS_CHECK_MIN};

/// Runs the scheduler until `shutdown` fires, then drains running sweeps
/// within `shutdown_grace_ms`.
pub async fn run(relay: Arc<Relay>, shutdown: Shutdown) {
    let mut scheduler = Scheduler::new(relay);
    let mut broker = scheduler.relay.publisher.watch_connected();
    // Sweeps wait while the broker blocks publishers, and start at the unblock.
    let mut blocked = scheduler.relay.publisher.watch_blocked();
    let wakeups = scheduler.relay.wakeups.clone();
    let stop = shutdown.fired();
    tokio::pin!(stop);
    loop {
        scheduler.relay.beat();
        let wake_at = scheduler.turn(Instant::now());
        tokio::select! {
            () = &mut stop => break,
            Some(joined) = scheduler.sweeps.join_next_with_id() => scheduler.sweep_done(joined),
            result = async { scheduler.poll.as_mut().expect("guarded by the branch condition").await }, if scheduler.poll.is_some() => {
                scheduler.poll = None;
                scheduler.last_poll_took = scheduler.last_poll.map_or(Duration::ZERO, |at| at.elapsed());
                scheduler.polled(result);
            }
            _ = broker.changed() => {}
            _ = blocked.changed() => {}
            () = wakeups.arrived() => scheduler.woken(Instant::now()),
            checked = async { scheduler.writers_check.as_mut().expect("guarded by the branch condition").await }, if scheduler.writers_check.is_some() => {
                scheduler.writers_check = None;
                scheduler.checked(checked);
            }
            read = async { scheduler.watch.tick.as_mut().expect("guarded by the branch condition").await }, if scheduler.watch.tick.is_some() => {
                scheduler.watch.tick = None;
                scheduler.position_read(read);
            }
            found = async { scheduler.watch.in_flight.as_mut().expect("guarded by the branch condition").await }, if scheduler.watch.in_flight.is_some() => {
                scheduler.watch.in_flight = None;
                // Writers in flight took their ids before the lock: they
                // will not notify, so the relay watches until they are done.
                if found.is_ok_and(|writers| !writers.all.is_empty()) {
                    scheduler.active(Instant::now());
                }
            }
            () = tokio::time::sleep_until(wake_at) => {}
        }
    }
    scheduler.drain().await;
}

/// Whether rows were found pending or published since each periodic check
/// (see `Scheduler::work_since`).
struct WorkSince {
    sequence_check: bool,
    columns_check: bool,
}

impl WorkSince {
    fn seen(&mut self) {
        self.sequence_check = true;
        self.columns_check = true;
    }
}

/// The scheduler loop's state: the schedule, the running sweeps and the poll.
struct Scheduler {
    relay: Arc<Relay>,
    schedule: Schedule,
    sweeps: JoinSet<SweepOutcome>,
    running: HashMap<Id, usize>,
    poll: Option<Poll>,
    next_poll: Instant,
    /// What the last poll said of the database, once there was one.
    database_up: Option<bool>,
    /// The table's columns were found fit (checked until they are, and
    /// again after any sweep that failed in the store).
    columns_checked: bool,
    /// A column a read or a check found unfit: no sweep starts until a
    /// check finds the columns fit again (logged once per change).
    drift: Option<Drift>,
    /// What a check or a sweep found unfit in the id sequence: no sweep
    /// starts, and every poll checks it, until a check finds it fit again
    /// (logged once per change).
    sequence_unfit: Option<String>,
    /// A sweep's statement named something the table lacks (SQLSTATE class
    /// 42: a column dropped or retyped under the relay): no sweep starts
    /// until the next poll has checked the columns, so that one failed sweep,
    /// not every queued tenant's, comes before the ERROR naming the column.
    held_for_check: bool,
    /// The error of the poll that last failed with the server answering,
    /// logged once until the poll succeeds or fails otherwise.
    poll_error: Option<String>,
    /// Unconfigured tenants already warned about.
    unconfigured: HashSet<String>,
    /// The instance ids of the relays LISTENing for this table's
    /// notifications, as the last poll found them.
    members: Vec<String>,
    /// The tenants the last poll found pending: their lowest pending id and
    /// how many polls in a row have found that same id. Lag gauges are set
    /// for these and the newly pending ones only; a replica takes a tenant
    /// another one owns by this count (see [`TAKEOVER_POLLS`]).
    last_pending: HashMap<String, Seen>,
    /// Where the next poll's page starts (after this tenant), and the cycle
    /// of pages it belongs to.
    poll_after: Option<String>,
    cycle: u64,
    /// When the last poll started, and how long the last one that answered took.
    last_poll: Option<Instant>,
    last_poll_took: Duration,
    /// When a poll last checked the id sequence's settings.
    sequence_checked: Option<Instant>,
    /// When the poll last checked the table's columns.
    columns_rechecked: Option<Instant>,
    /// Rows were found pending or published since the last periodic check
    /// of the id sequence, and of the columns: those checks are made only
    /// then (one more after the rows stop, none while idle), so an idle
    /// relay's poll stays one transaction; the first due after rows turn up
    /// makes up for any skipped.
    work_since: WorkSince,
    /// Where the ready queues stood when the last poll started (see
    /// [`Schedule::unqueue_unfound`]).
    poll_mark: u64,
    /// The last poll found this relay among the members: it knows which
    /// tenants are its own.
    member: bool,
    /// Deferred tenants' waits for their writers in flight.
    candidates: HashMap<usize, Candidate>,
    writers_check: Option<WritersCheck>,
    /// The next writers' check is not due before.
    next_check: Instant,
    /// The next read of `pg_locks` is not due before.
    next_locks_check: Instant,
    /// The server instance (its start time) the writers' check recorded
    /// holders and positions on.
    writers_instance: Option<String>,
    watch: Watch,
}

impl Scheduler {
    fn new(relay: Arc<Relay>) -> Scheduler {
        let config = &relay.config;
        let backoff = Backoff::new(
            config.poll_interval(),
            Duration::from_millis(config.max_backoff_ms),
        );
        Scheduler {
            schedule: if config.tenants.discovers() {
                Schedule::discovering(backoff)
            } else {
                Schedule::new(config.tenants.listed(), backoff)
            },
            relay,
            sweeps: JoinSet::new(),
            running: HashMap::new(),
            poll: None,
            next_poll: Instant::now(),
            database_up: None,
            columns_checked: false,
            drift: None,
            sequence_unfit: None,
            held_for_check: false,
            poll_error: None,
            unconfigured: HashSet::new(),
            members: Vec::new(),
            last_pending: HashMap::new(),
            poll_after: None,
            cycle: 0,
            last_poll: None,
            last_poll_took: Duration::ZERO,
            sequence_checked: None,
            columns_rechecked: None,
            work_since: WorkSince {
                sequence_check: true,
                columns_check: true,
            },
            poll_mark: 0,
            member: false,
            candidates: HashMap::new(),
            writers_check: None,
            next_check: Instant::now(),
            next_locks_check: Instant::now(),
            writers_instance: None,
            watch: Watch::new(),
        }
    }

    /// Starts what is due: the poll, the writers' check, tenants whose
    /// back-off is over, sweeps up to `concurrency`. Returns when the loop
    /// must look again at the latest.
    fn turn(&mut self, now: Instant) -> Instant {
        self.hold_poll_while_busy(now);
        if self.poll.is_none() && now >= self.next_poll {
            self.start_poll(now);
        }
        if self.writers_check.is_none() && !self.candidates.is_empty() && now >= self.next_check {
            self.start_writers_check(now);
        }
        self.wake_backed_off(now);
        self.start_sweeps();
        // Running sweeps go on to a next batch only while no tenant waits.
        self.relay.set_tenants_waiting(self.schedule.has_ready());
        self.next_look(now)
    }

    /// When the loop must look again at the latest: the next back-off to
    /// end, the next poll (while one runs, its answer wakes the loop), the
    /// next writers' check, the next read of the id sequence (which
    /// `watch_turn` starts when due); a poll interval when none is due.
    fn next_look(&mut self, now: Instant) -> Instant {
        // While a poll runs, its answer wakes the loop; the next one is not due before.
        let poll_due = self.poll.is_none().then_some(self.next_poll);
        let check_due = (self.writers_check.is_none() && !self.candidates.is_empty())
            .then_some(self.next_check);
        let tick_due = self.watch_turn(now);
        [self.schedule.next_wake(), poll_due, check_due, tick_due]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(now + self.relay.config.poll_interval())
    }
}
