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

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::{Id, JoinSet};
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::config::Wakeup;
use crate::domain::Outcome;
use crate::relay::{Relay, SweepFailure, SweepOutcome};
use crate::shutdown::Shutdown;
use crate::store::{self, Drift, Page, PendingTenant, StoreError, Watched, Writers};

/// Where a tenant is in the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing known to be pending, or its last sweep met an outage; the poll
    /// wakes it.
    Idle,
    /// Waiting in the ready queue.
    Ready,
    /// A sweep is running.
    Running,
    /// Failed; ready again at this instant.
    Backoff(Instant),
    /// Its last sweep met writers of the tenant in flight: it waits until
    /// the writers' check finds them ended (see [`Scheduler::checked`]).
    Deferred,
}

/// The pure part of scheduling: tenant states, the ready queues, back-off.
///
/// Two ready queues take turns, so a tenant with a backlog gets its share
/// from the first second however many tenants are pending: `fresh` holds the
/// tenants the poll, a notification or the end of a back-off readied, in that
/// order; `busy` holds the tenants whose last sweep published a full batch.
/// While both hold tenants, every other sweep started goes to the head of
/// `busy` (round robin among the busy tenants), the others to the head of
/// `fresh`. A busy tenant so waits for at most as many sweeps as there are
/// busy tenants, times two, never for the whole pending list; a fresh one
/// waits no more than twice as long as with one queue.
#[derive(Debug)]
pub struct Schedule {
    names: Vec<Arc<str>>,
    states: Vec<State>,
    failures: Vec<u32>,
    /// The id bound below which every writer of the tenant has ended, as the
    /// writers' check last found (`i64::MIN`: none known yet).
    safe: Vec<i64>,
    /// Notified while running: swept once more when the running sweep ends.
    follow_up: Vec<bool>,
    /// When each tenant last joined a ready queue, counted in enqueues.
    enqueued: Vec<u64>,
    /// Enqueues so far.
    queued: u64,
    fresh: VecDeque<usize>,
    busy: VecDeque<usize>,
    /// The next sweep started goes to `busy` (when both queues hold tenants).
    busy_turn: bool,
    /// The tenants backing off, by when they are ready again: a turn looks
    /// only at those whose time has come, never at every tenant.
    backing_off: BTreeSet<(Instant, usize)>,
    index: HashMap<Arc<str>, usize>,
    /// Tenants the poll or a notification names are added as they come
    /// (`tenants = "*"`); otherwise only the configured ones are known.
    discovers: bool,
    /// Slots of forgotten tenants, for the next ones (see
    /// [`Schedule::forget_idle`]); their name is `""` meanwhile.
    free: Vec<usize>,
    backoff: Backoff,
}

impl Schedule {
    pub fn new(tenants: &[String], backoff: Backoff) -> Schedule {
        let mut schedule = Schedule {
            names: Vec::new(),
            states: Vec::new(),
            failures: Vec::new(),
            safe: Vec::new(),
            follow_up: Vec::new(),
            enqueued: Vec::new(),
            queued: 0,
            fresh: VecDeque::new(),
            busy: VecDeque::new(),
            busy_turn: false,
            backing_off: BTreeSet::new(),
            index: HashMap::new(),
            discovers: false,
            free: Vec::new(),
            backoff,
        };
        for tenant in tenants {
            schedule.add(tenant);
        }
        schedule
    }

    /// A schedule that learns its tenants from the poll and notifications
    /// (`tenants = "*"`).
    pub fn discovering(backoff: Backoff) -> Schedule {
        Schedule {
            discovers: true,
            ..Schedule::new(&[], backoff)
        }
    }

    fn add(&mut self, tenant: &str) -> usize {
        let name: Arc<str> = Arc::from(tenant);
        if let Some(i) = self.free.pop() {
            self.index.insert(name.clone(), i);
            self.names[i] = name;
            self.states[i] = State::Idle;
            self.failures[i] = 0;
            self.safe[i] = i64::MIN;
            self.follow_up[i] = false;
            return i;
        }
        let i = self.names.len();
        self.index.insert(name.clone(), i);
        self.names.push(name);
        self.states.push(State::Idle);
        self.failures.push(0);
        self.safe.push(i64::MIN);
        self.follow_up.push(false);
        self.enqueued.push(0);
        i
    }

    /// Forgets the discovered tenants that wait for nothing (idle, no
    /// failure counted, no follow-up) unless `keep` names them: a tenant
    /// that wrote once is not remembered for the relay's life. With
    /// `tenants = "*"` and a new tenant per customer, the schedule so holds
    /// the tenants with work, not every tenant ever seen. A forgotten tenant
    /// comes back as new when the poll or a notification names it. Returns
    /// how many it forgot.
    pub fn forget_idle(&mut self, keep: impl Fn(&str) -> bool) -> usize {
        if !self.discovers {
            return 0;
        }
        let empty: Arc<str> = Arc::from("");
        let mut forgotten = 0;
        for i in 0..self.names.len() {
            if self.states[i] != State::Idle
                || self.failures[i] != 0
                || self.follow_up[i]
                || self.index.get(&self.names[i]) != Some(&i)
                || keep(&self.names[i])
            {
                continue;
            }
            self.index.remove(&self.names[i]);
            self.names[i] = empty.clone();
            self.free.push(i);
            forgotten += 1;
        }
        forgotten
    }

    pub fn name(&self, tenant: usize) -> &Arc<str> {
        &self.names[tenant]
    }

    /// The index of `tenant`: a configured one, or any one when tenants are
    /// discovered (added the first time it is named).
    pub fn tenant(&mut self, tenant: &str) -> Option<usize> {
        match self.index.get(tenant) {
            Some(&i) => Some(i),
            None if self.discovers => Some(self.add(tenant)),
            None => None,
        }
    }

    /// The poll found rows pending for these tenants, each with its lowest
    /// pending id. The idle ones join the ready queue oldest first: the
    /// tenant whose row has waited longest goes first, and in a backlog (an
    /// outage, a relay that was down) the tenants that write most are those
    /// whose first pending row is oldest, so they reach the busy queue in the
    /// first sweeps, not behind every tenant with a row or two.
    pub fn pending<'a>(&mut self, tenants: impl IntoIterator<Item = (&'a str, i64)>) {
        self.enqueue(tenants, false);
    }

    /// Tenants another replica owns but has not swept for a while (see
    /// [`TAKEOVER_POLLS`]): queued after this relay's own, newest first. The
    /// owner works through its queue oldest first, so the two meet in the
    /// middle instead of sweeping the same tenants twice.
    pub fn taken_over<'a>(&mut self, tenants: impl IntoIterator<Item = (&'a str, i64)>) {
        self.enqueue(tenants, true);
    }

    fn enqueue<'a>(
        &mut self,
        tenants: impl IntoIterator<Item = (&'a str, i64)>,
        newest_first: bool,
    ) {
        let mut tenants: Vec<(&str, i64)> = tenants.into_iter().collect();
        tenants.sort_by_key(|&(_, oldest)| oldest);
        if newest_first {
            tenants.reverse();
        }
        for (name, _) in tenants {
            if let Some(i) = self.tenant(name)
                && self.states[i] == State::Idle
            {
                self.states[i] = State::Ready;
                self.push_fresh(i);
            }
        }
    }

    /// Where the queues stand: a poll started now knows of every tenant
    /// queued before this mark (see [`Schedule::settle`]).
    pub fn mark(&self) -> u64 {
        self.queued
    }

    /// A poll that started at `mark` answered: a tenant queued before the mark
    /// stays queued only if `keep` says so (the poll found rows pending for
    /// it, and this relay is to sweep it); the others go back to idle. So a
    /// tenant another replica emptied, or one that a change of replicas gave
    /// to another, is not swept for nothing. Tenants queued after the mark
    /// (a notification, a sweep that ended) stay: the poll may have read
    /// the table before their rows were committed.
    pub fn settle(&mut self, mark: u64, keep: impl Fn(usize) -> bool) {
        let Schedule {
            states,
            enqueued,
            fresh,
            busy,
            ..
        } = self;
        for queue in [fresh, busy] {
            queue.retain(|&i| {
                let stays = enqueued[i] >= mark || keep(i);
                if !stays {
                    states[i] = State::Idle;
                }
                stays
            });
        }
    }

    /// Records when `tenant` was queued (see [`Schedule::mark`]).
    fn stamp(&mut self, tenant: usize) {
        self.enqueued[tenant] = self.queued;
        self.queued += 1;
    }

    fn push_fresh(&mut self, tenant: usize) {
        self.stamp(tenant);
        self.fresh.push_back(tenant);
    }

    fn push_busy(&mut self, tenant: usize) {
        self.stamp(tenant);
        self.busy.push_back(tenant);
    }

    /// A notification named `tenant`: an idle one is ready at once; a
    /// running one is swept once more when its sweep ends, whatever its
    /// outcome; a ready or backing-off one stays as it is (a back-off
    /// stands). Returns whether it started or flagged a sweep.
    pub fn notified(&mut self, tenant: usize) -> bool {
        match self.states[tenant] {
            State::Idle => {
                self.states[tenant] = State::Ready;
                self.push_fresh(tenant);
                true
            }
            State::Running => !std::mem::replace(&mut self.follow_up[tenant], true),
            State::Ready | State::Backoff(_) | State::Deferred => false,
        }
    }

    /// A read of the id sequence listed the tenant among those with rows
    /// pending: an idle one is ready at once; any other stays as it is (a
    /// running sweep reads the rows, or the read after it lists them again).
    /// Returns whether it started a sweep.
    pub fn listed(&mut self, tenant: usize) -> bool {
        if self.states[tenant] != State::Idle {
            return false;
        }
        self.states[tenant] = State::Ready;
        self.push_fresh(tenant);
        true
    }

    /// The tenant's last sweep met writers in flight: it waits for the
    /// writers' check (a notification meanwhile changes nothing: the check
    /// readies it once they have ended).
    pub fn defer(&mut self, tenant: usize) {
        self.failures[tenant] = 0;
        self.follow_up[tenant] = false;
        self.states[tenant] = State::Deferred;
    }

    /// The id bound below which every writer of `tenant` has ended, as last
    /// found (`i64::MIN` when none is known).
    pub fn safe(&self, tenant: usize) -> i64 {
        self.safe[tenant]
    }

    /// The writers' check found every id of `tenant` up to `safe` committed
    /// or gone: a deferred tenant is ready again, ahead of the tenants that
    /// became ready meanwhile (its rows have waited longer).
    pub fn cleared(&mut self, tenant: usize, safe: i64) {
        self.safe[tenant] = self.safe[tenant].max(safe);
        if self.states[tenant] == State::Deferred {
            self.states[tenant] = State::Ready;
            self.stamp(tenant);
            self.fresh.push_front(tenant);
        }
    }

    /// Whether `tenant` waits for the writers' check.
    pub fn is_deferred(&self, tenant: usize) -> bool {
        self.states[tenant] == State::Deferred
    }

    /// Moves tenants whose back-off has passed to the ready queue; returns
    /// them. Looks only at those.
    pub fn wake(&mut self, now: Instant) -> Vec<usize> {
        let mut woken = Vec::new();
        while let Some(&(until, i)) = self.backing_off.first()
            && until <= now
        {
            self.backing_off.pop_first();
            self.states[i] = State::Ready;
            self.push_fresh(i);
            woken.push(i);
        }
        woken
    }

    /// The next tenant to sweep, marked running: the two queues take turns
    /// while both hold tenants.
    pub fn next_ready(&mut self) -> Option<usize> {
        let from_busy = match (self.busy.is_empty(), self.fresh.is_empty()) {
            (true, true) => return None,
            (false, true) => true,
            (true, false) => false,
            (false, false) => self.busy_turn,
        };
        let i = if from_busy {
            self.busy.pop_front()
        } else {
            self.fresh.pop_front()
        }?;
        self.busy_turn = !from_busy;
        self.states[i] = State::Running;
        Some(i)
    }

    /// Records a sweep's outcome. Returns the back-off now in force (zero if none).
    pub fn finished(&mut self, tenant: usize, outcome: Outcome, now: Instant) -> Duration {
        let follow_up = std::mem::take(&mut self.follow_up[tenant]);
        match outcome {
            Outcome::Published => {
                self.failures[tenant] = 0;
                self.states[tenant] = State::Ready;
                self.push_busy(tenant);
                Duration::ZERO
            }
            Outcome::Idle | Outcome::Skipped => {
                if outcome == Outcome::Idle {
                    self.failures[tenant] = 0;
                }
                self.states[tenant] = State::Idle;
                if follow_up {
                    self.notified(tenant);
                }
                Duration::ZERO
            }
            Outcome::Failed => {
                self.failures[tenant] = self.failures[tenant].saturating_add(1);
                let delay = self.backoff.delay(self.failures[tenant]);
                self.states[tenant] = State::Backoff(now + delay);
                self.backing_off.insert((now + delay, tenant));
                delay
            }
        }
    }

    /// Records a sweep that failed because the database or the broker could
    /// not be reached: not the tenant's failure. Its count of failures and its
    /// back-off stay as they were; it waits for the next poll that finds its
    /// rows, and is ready at once then.
    pub fn interrupted(&mut self, tenant: usize) {
        self.follow_up[tenant] = false;
        self.states[tenant] = State::Idle;
    }

    /// The earliest instant a backing-off tenant becomes ready.
    pub fn next_wake(&self) -> Option<Instant> {
        self.backing_off.first().map(|&(until, _)| until)
    }

    /// Whether `tenant` is relayed: configured, or any tenant when they are
    /// discovered.
    pub fn knows(&self, tenant: &str) -> bool {
        self.discovers || self.index.contains_key(tenant)
    }

    pub fn has_ready(&self) -> bool {
        !self.fresh.is_empty() || !self.busy.is_empty()
    }

    /// Tenants waiting in the ready queues.
    pub fn ready_len(&self) -> usize {
        self.fresh.len() + self.busy.len()
    }

    /// Tenants known (configured, or discovered and not forgotten).
    pub fn len(&self) -> usize {
        self.names.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// With several replicas (they know each other by their sessions' names, see
/// `wakeup`), a replica sweeps at once, from the poll, only the pending
/// tenants it owns; it takes a tenant another replica owns when this many
/// polls in a row have found the same lowest pending id for it (its owner is
/// gone, or is behind) ...
pub const TAKEOVER_POLLS: u32 = 10;
/// ... or already when this many have, it has nothing of its own queued, and
/// it is the tenant's successor (the replica that would own it next: each of
/// the owner's tenants has its own, so they spread over the idle replicas
/// instead of all going to each). Taken tenants queue newest first, while
/// the owner works oldest first. So no replica re-sweeps tenants another
/// one emptied, an idle replica helps a busy one within two polls, and a
/// dead replica's tenants move within [`TAKEOVER_POLLS`] polls at the latest
/// (sooner: at the first poll after its sessions end, when it is no longer
/// a member).
pub const TAKEOVER_IDLE_POLLS: u32 = 2;

/// While at least this many tenants wait in this relay's ready queues, the
/// poll (whose cost grows with the tenants it finds pending: about 5 µs of
/// the database's time each, 50 ms for 10,000) would add little to the
/// queue, so it runs less often: at most once every [`BUSY_POLL_EVERY`]
/// intervals, and no more than a [`BUSY_POLL_SHARE`] of the time its last run
/// took (which grows as the database gets busier), but at least every
/// [`BUSY_POLL_MAX`] (or `poll_ms` if longer). So a pending row is found within `poll_ms` while the
/// relay has little queued, and within `BUSY_POLL_MAX` at the latest (during
/// an outage, or before this relay knows its replicas, the poll runs every
/// interval: it is how the relay sees the database back).
pub const BUSY_QUEUE: usize = 64;
pub const BUSY_POLL_EVERY: u32 = 5;
/// One twentieth: a busy relay spends at most 5 % of its time waiting for
/// the poll.
pub const BUSY_POLL_SHARE: u32 = 20;
pub const BUSY_POLL_MAX: Duration = Duration::from_secs(5);

/// How many distinct unconfigured tenants are warned about (once each).
const UNCONFIGURED_WARNINGS: usize = 100;

/// The poll in flight: tenants with pending rows, their lowest pending ids
/// and lag; and what a check of the table's columns that went with it found.
type Poll = Pin<Box<dyn Future<Output = Result<Polled, StoreError>> + Send>>;

/// What a successful poll found.
struct Polled {
    found: store::Polled,
    /// The page it read.
    page: Page,
    columns: ColumnCheck,
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

/// The most tenants one poll reads (about 50 ms of the database's time);
/// with more pending, the polls page through them in the index's order,
/// each going on after the last one's last tenant, and start again at the
/// first after a page that was not full (a cycle).
pub const POLL_PAGE: usize = 10_000;

/// The writers' check in flight (see [`Store::writers`]): the tenants it asked
/// about, and its answer.
///
/// [`Store::writers`]: crate::store::Store::writers
type WritersCheck = Pin<Box<dyn Future<Output = WritersFound> + Send>>;

/// What a writers' check found: the tenants it asked about; whether each is
/// free now and the position before (the cheap check); and, when `pg_locks`
/// was read too, who holds each tenant's lock.
struct WritersFound {
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

/// `wakeup = sequence`: while rows flow, the id sequence's position is read
/// this often, and a move (and the read after one) lists the tenants with
/// rows pending among the ids drawn since the position of [`WATCH_WINDOW`]
/// ago, the last [`WATCH_SPAN`] at most; they are readied as a notification
/// would ready them ...
pub const WATCH_TICK: Duration = Duration::from_millis(5);
pub const WATCH_WINDOW: Duration = Duration::from_millis(100);
pub const WATCH_SPAN: i64 = 1024;
/// ... until it has stood still this long with nothing to sweep: then the
/// relay asks writers for a notification again (the wake-up lock) and waits.
pub const WATCH_QUIET: Duration = Duration::from_millis(100);

type PositionRead = Pin<Box<dyn Future<Output = Result<Watched, StoreError>> + Send>>;
type GlobalCheck = Pin<Box<dyn Future<Output = Result<Writers, StoreError>> + Send>>;

/// `wakeup = sequence`: whether the relay watches the id sequence (rows
/// flow, no writer notifies) or waits for a notification (it holds the
/// wake-up lock, every insert notifies).
struct Watch {
    watching: bool,
    /// The position last read, and whether that read saw it move.
    position: i64,
    moved: bool,
    /// The positions read in the last [`WATCH_WINDOW`], and the newest
    /// before it: where the lists of pending tenants start.
    history: VecDeque<(Instant, i64)>,
    /// The last sign of rows flowing.
    active_at: Instant,
    next_tick: Instant,
    tick: Option<PositionRead>,
    /// Once the wake-up lock is taken: are writers in flight that took their
    /// id before, and so will not notify?
    in_flight: Option<GlobalCheck>,
}

/// A deferred tenant's wait for its writers in flight.
#[derive(Debug)]
struct Candidate {
    /// Where the id sequence stood at the check that found `holders` (none
    /// before the first check).
    position: Option<i64>,
    /// The transactions that held the tenant's writers' lock then: once all
    /// have ended, every id up to `position` is committed or gone.
    holders: Vec<String>,
    /// Since when the tenant has waited.
    since: Instant,
}

/// What the polls last found of a pending tenant.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// Its lowest pending id ...
    oldest_id: i64,
    /// ... found by this many polls in a row (see [`TAKEOVER_POLLS`]) ...
    polls: u32,
    /// ... the last time in this cycle of pages.
    cycle: u64,
}

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
    /// Where the ready queues stood when the last poll started (see
    /// [`Schedule::settle`]).
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
            poll_mark: 0,
            member: false,
            candidates: HashMap::new(),
            writers_check: None,
            next_check: Instant::now(),
            next_locks_check: Instant::now(),
            watch: Watch {
                watching: false,
                position: 0,
                moved: false,
                history: VecDeque::new(),
                active_at: Instant::now(),
                next_tick: Instant::now(),
                tick: None,
                in_flight: None,
            },
        }
    }

    /// Rows flow (a notification, a sweep that published, a poll that found
    /// rows): with `wakeup = sequence`, the relay watches the id sequence and
    /// no longer asks writers to notify.
    fn active(&mut self, now: Instant) {
        if self.relay.config.wakeup != Wakeup::Sequence {
            return;
        }
        self.watch.active_at = now;
        if !self.watch.watching {
            self.watch.watching = true;
            self.watch.history.clear();
            self.watch.next_tick = now + WATCH_TICK;
            self.relay.wakeups.want_notifications(false);
        }
    }

    /// Starts the next read of the id sequence's position when due, or, once
    /// it has stood still for [`WATCH_QUIET`] with nothing to sweep, goes
    /// back to waiting for a notification. Returns when to look again.
    fn watch_turn(&mut self, now: Instant) -> Option<Instant> {
        if !self.watch.watching || self.watch.tick.is_some() {
            return None;
        }
        let quiet = now >= self.watch.active_at + WATCH_QUIET
            && self.sweeps.is_empty()
            && !self.schedule.has_ready()
            && self.candidates.is_empty();
        if quiet {
            self.watch.watching = false;
            self.relay.wakeups.want_notifications(true);
            return None;
        }
        if now >= self.watch.next_tick {
            let relay = self.relay.clone();
            let (watched, moved) = (self.watch.position, self.watch.moved);
            let since = self
                .watch
                .history
                .front()
                .map_or(0, |&(_, position)| position);
            self.watch.tick = Some(Box::pin(async move {
                relay.store.watch(watched, moved, since, WATCH_SPAN).await
            }));
            return None;
        }
        Some(self.watch.next_tick)
    }

    /// The id sequence's position was read: on a move (or the read after
    /// one: a row's commit follows its draw) the read listed the tenants
    /// with rows pending, and each is readied as a notification would be.
    fn position_read(&mut self, read: Result<Watched, StoreError>) {
        let now = Instant::now();
        self.watch.next_tick = now + WATCH_TICK;
        let Ok(Watched { position, tenants }) = read else {
            self.watch.next_tick = now + self.relay.config.poll_interval();
            return;
        };
        let moved = position != self.watch.position;
        if moved {
            self.watch.position = position;
            self.watch.active_at = now;
        }
        self.watch.moved = moved;
        let history = &mut self.watch.history;
        history.push_back((now, position));
        while history.len() > 1 && history[1].0 + WATCH_WINDOW <= now {
            history.pop_front();
        }
        // Listed tenants this relay owns are swept at once if idle. One
        // being swept is not asked for a follow-up (the rows listed are
        // mostly those its sweep reads): when a sweep ends, the next read
        // lists again.
        self.wake_tenants(tenants.unwrap_or_default(), Schedule::listed);
    }

    /// Starts what is due: the poll, tenants whose back-off is over, sweeps
    /// up to `concurrency`. Returns when the loop must look again at the latest.
    fn turn(&mut self, now: Instant) -> Instant {
        let poll_interval = self.relay.config.poll_interval();
        if self.poll.is_none()
            && now >= self.next_poll
            && self.schedule.ready_len() >= BUSY_QUEUE
            && self.database_up == Some(true)
            && self.member
            && self.relay.publisher.can_publish()
            && self
                .last_poll
                .is_some_and(|at| now < at + busy_poll_interval(poll_interval, self.last_poll_took))
        {
            // Enough work is queued: the poll waits (see BUSY_QUEUE).
            self.next_poll = now + poll_interval;
        }
        if self.poll.is_none() && now >= self.next_poll {
            self.last_poll = Some(now);
            self.poll_mark = self.schedule.mark();
            let relay = self.relay.clone();
            // Checked until fit, while a column is unfit (to see it fixed),
            // and while the table lacks the columns of parking (they appear
            // when `migrate` runs).
            let check = !self.columns_checked
                || self.drift.is_some()
                || !self.relay.store.has_parking_columns();
            // The id sequence's settings too, and at least every
            // SEQUENCE_CHECK_EVERY: an ALTER SEQUENCE … CACHE 20 under a
            // running relay would otherwise go unseen.
            let check_sequence = check
                || self
                    .sequence_checked
                    .is_none_or(|at| now >= at + SEQUENCE_CHECK_EVERY);
            if check_sequence {
                self.sequence_checked = Some(now);
            }
            let page = Page {
                after: self.poll_after.clone(),
                limit: POLL_PAGE,
            };
            self.poll = Some(Box::pin(async move {
                if check_sequence {
                    relay.store.check_sequence().await?;
                }
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
                })
            }));
            self.next_poll = now + poll_interval;
        }
        if self.writers_check.is_none() && !self.candidates.is_empty() && now >= self.next_check {
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
        for woken in self.schedule.wake(now) {
            self.relay
                .metrics
                .set_backoff(self.schedule.name(woken), Duration::ZERO);
        }
        if self.relay.publisher.can_publish()
            && self.database_up != Some(false)
            && self.drift.is_none()
            && !self.held_for_check
        {
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
        // Running sweeps go on to a next batch only while no tenant waits.
        self.relay.set_tenants_waiting(self.schedule.has_ready());
        // While a poll runs, its answer wakes the loop; the next one is not due before.
        let poll_due = self.poll.is_none().then_some(self.next_poll);
        let check_due = (self.writers_check.is_none() && !self.candidates.is_empty())
            .then_some(self.next_check);
        let tick_due = self.watch_turn(now);
        [self.schedule.next_wake(), poll_due, check_due, tick_due]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(now + poll_interval)
    }

    /// Notifications arrived: each notified tenant this relay owns is swept
    /// at once (or once more after its running sweep); a poll asked for (the
    /// LISTEN connection is back, or a name too long to notify) is due now.
    fn woken(&mut self, now: Instant) {
        let woken = self.relay.wakeups.take();
        if woken.poll {
            self.next_poll = self.next_poll.min(now);
        }
        if woken.held && self.relay.config.wakeup == Wakeup::Sequence {
            let relay = self.relay.clone();
            self.watch.in_flight = Some(Box::pin(async move { relay.store.writers(&[]).await }));
        }
        if !woken.tenants.is_empty() {
            self.active(now);
        }
        self.wake_tenants(woken.tenants, Schedule::notified);
    }

    /// Tenants with new rows (notified, or listed by a read of the id
    /// sequence): `wake` readies each one this relay owns (see
    /// [`Schedule::notified`], [`Schedule::listed`]), counted when it
    /// started or asked for a sweep.
    fn wake_tenants(&mut self, names: Vec<String>, wake: fn(&mut Schedule, usize) -> bool) {
        for name in names {
            let Some(tenant) = self.schedule.tenant(&name) else {
                continue;
            };
            if self.relay.wakeups.sweeps_at_once(&name, &self.members)
                && wake(&mut self.schedule, tenant)
            {
                self.relay.metrics.count_wakeup();
            }
        }
    }

    /// A sweep's task ended: log it, and schedule its tenant's next turn.
    fn sweep_done(&mut self, joined: Result<(Id, SweepOutcome), tokio::task::JoinError>) {
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
            self.active(Instant::now());
        }
        if let SweepOutcome::Failed(SweepFailure::Store(error)) = &outcome {
            match error.drift() {
                Some(drift) => self.columns_unfit(drift.clone()),
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
                self.candidates.entry(tenant).or_insert(Candidate {
                    position: None,
                    holders: Vec::new(),
                    since: now,
                });
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

    /// The poll answered: the database is reachable or not, each tenant's
    /// lag, and the tenants with rows pending join the ready queue. A poll
    /// that the server answered with an error (a data error, a permission, an
    /// unfit payload column) leaves the database up, and is logged once as
    /// what it is.
    fn polled(&mut self, result: Result<Polled, StoreError>) {
        let Polled {
            found:
                store::Polled {
                    pending,
                    listeners,
                    parked,
                },
            page,
            columns,
        } = match result {
            Ok(polled) => polled,
            Err(error) if error.is_unreachable() => {
                if self.database_up != Some(false) {
                    tracing::warn!(%error, "database unreachable; retrying every poll interval");
                }
                self.poll_error = None;
                self.database_is(false);
                return;
            }
            Err(error) => {
                self.reachable();
                let text = error.to_string();
                if self.poll_error.as_deref() != Some(text.as_str()) {
                    tracing::error!(
                        error = %text,
                        "the poll failed: the database answered with an error; nothing is swept until a poll succeeds, retrying every poll interval"
                    );
                    self.poll_error = Some(text);
                }
                return;
            }
        };
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
        self.members = listeners
            .iter()
            .filter_map(|name| self.relay.wakeups.member_of(name))
            .map(str::to_string)
            .collect();
        self.members.sort_unstable();
        self.members.dedup();
        self.member = self.relay.wakeups.is_member(&self.members);
        let now = Instant::now();
        let own_queue_empty = !self.schedule.has_ready();
        // A page that was not full ends the cycle; one that started it too
        // saw every pending tenant.
        let last_page = pending.len() < page.limit;
        let whole = last_page && page.after.is_none();
        let mut in_page = HashSet::with_capacity(pending.len());
        let mut lags = Vec::with_capacity(pending.len() + self.last_pending.len());
        let mut due = Vec::with_capacity(pending.len());
        let mut taken = Vec::new();
        let mut keep = HashSet::with_capacity(pending.len());
        for PendingTenant {
            tenant,
            oldest_id,
            lag_ms,
        } in &pending
        {
            if !self.schedule.knows(tenant) {
                if self.unconfigured.len() < UNCONFIGURED_WARNINGS
                    && self.unconfigured.insert(tenant.clone())
                {
                    tracing::warn!(
                        tenant = ?tenant,
                        "rows are pending for a tenant this relay is not configured for; they stay pending until a relay lists it in `tenants`"
                    );
                }
                continue;
            }
            let lag = self
                .relay
                .lag
                .observe(tenant, Some(*oldest_id), *lag_ms, now);
            lags.push((tenant.as_str(), lag));
            let polls = match self.last_pending.get(tenant) {
                Some(seen) if seen.oldest_id == *oldest_id => seen.polls.saturating_add(1),
                _ => 1,
            };
            self.last_pending.insert(
                tenant.clone(),
                Seen {
                    oldest_id: *oldest_id,
                    polls,
                    cycle: self.cycle,
                },
            );
            let index = self.schedule.tenant(tenant);
            in_page.extend(index);
            let queue = if self.relay.wakeups.sweeps_at_once(tenant, &self.members) {
                &mut due
            } else if polls >= TAKEOVER_POLLS
                || (own_queue_empty
                    && polls >= TAKEOVER_IDLE_POLLS
                    && self.relay.wakeups.succeeds(tenant, &self.members))
            {
                &mut taken
            } else {
                continue;
            };
            queue.push((tenant.as_str(), *oldest_id));
            keep.extend(index);
        }
        // At the end of a cycle, the tenants no page of it found were
        // emptied: their lag is 0 now.
        let mut emptied = Vec::new();
        if last_page {
            let cycle = self.cycle;
            self.last_pending.retain(|tenant, seen| {
                let pending = seen.cycle == cycle;
                if !pending {
                    emptied.push(tenant.clone());
                }
                pending
            });
            self.cycle += 1;
        }
        for tenant in &emptied {
            self.relay.lag.observe(tenant, None, 0, now);
            lags.push((tenant.as_str(), 0));
        }
        self.relay.metrics.set_lags(lags);
        self.poll_after = if last_page {
            None
        } else {
            pending.last().map(|last| last.tenant.clone())
        };
        // Parked rows of the tenants this relay relays, as the database
        // counts them (the same on every replica, and after a restart).
        let relays_all = self.relay.config.tenants.discovers();
        let parked: Vec<(String, i64)> = parked
            .into_iter()
            .filter(|(tenant, _)| relays_all || self.schedule.knows(tenant))
            .collect();
        self.relay.metrics.set_parked(&parked);
        let ready_before = self.schedule.ready_len();
        // A tenant the page did not cover may be pending still: it stays.
        self.schedule.settle(self.poll_mark, |i| {
            keep.contains(&i) || (!whole && !in_page.contains(&i))
        });
        let settled = self.schedule.ready_len();
        let due_len = due.len() + taken.len();
        if due_len > 0 {
            self.active(now);
        }
        self.schedule.pending(due);
        self.schedule.taken_over(taken);
        if last_page {
            let pending = &self.last_pending;
            self.schedule
                .forget_idle(|tenant| pending.contains_key(tenant));
        }
        tracing::debug!(
            pending = pending.len(),
            due = due_len,
            members = self.members.len(),
            member = self.member,
            ready_before,
            unqueued = ready_before - settled,
            ready = self.schedule.ready_len(),
            took_ms = self.last_poll_took.as_millis() as u64,
            "polled"
        );
    }

    /// The writers' check answered: a deferred tenant whose writers in flight
    /// (as an earlier check found them) have all ended is ready again, with
    /// that check's position as its safe bound; one with no writer in flight
    /// now, with this check's. The next check is paced by the youngest wait.
    fn checked(&mut self, found: WritersFound) {
        let now = Instant::now();
        let WritersFound {
            tenants,
            free,
            holders,
        } = found;
        let (position, free) = match free {
            Ok(free) => free,
            Err(error) => {
                tracing::debug!(%error, "the writers' check failed; trying again at the next poll interval");
                self.next_check = now + self.relay.config.poll_interval();
                return;
            }
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
            Some(Err(error)) => {
                tracing::debug!(%error, "the writers' check failed; trying again at the next poll interval");
                self.next_check = now + self.relay.config.poll_interval();
                return;
            }
            None => {
                self.pace_checks(now);
                return;
            }
        };
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
                && candidate.holders.iter().all(|held| !holders.contains(held))
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
                }
                self.relay
                    .metrics
                    .set_writer_wait(&name, now - candidate.since);
            }
        }
        self.pace_checks(now);
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

    /// A read or a check found a column the relay cannot read: sweeps stop
    /// until a check finds the columns fit; said once per change.
    fn columns_unfit(&mut self, drift: Drift) {
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

    /// Lets running sweeps finish within the grace period, then abandons them
    /// (their transactions roll back; their rows stay pending).
    async fn drain(mut self) {
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

/// How far apart polls are while the relay is busy (see [`BUSY_QUEUE`]).
fn busy_poll_interval(poll_interval: Duration, last_poll_took: Duration) -> Duration {
    (poll_interval * BUSY_POLL_EVERY)
        .max(last_poll_took * BUSY_POLL_SHARE)
        .min(BUSY_POLL_MAX.max(poll_interval))
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
        SweepOutcome::Failed(SweepFailure::Store(error)) if error.drift().is_some() => {
            // Said once by the scheduler, not once per tenant.
            tracing::debug!(tenant, reason = "columns", %error, "sweep stopped: a column is unfit")
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Names with ascending lowest pending ids, so they queue in this order.
    fn ids<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<(&'a str, i64)> {
        names.into_iter().zip(0..).collect()
    }

    fn tenants(n: usize) -> Schedule {
        let tenants: Vec<String> = (0..n).map(|i| format!("t{i}")).collect();
        Schedule::new(
            &tenants,
            Backoff::new(Duration::from_millis(100), Duration::from_millis(1000)),
        )
    }

    #[test]
    fn a_deferred_tenant_waits_for_the_writers_check_alone() {
        let mut s = tenants(2);
        assert_eq!(s.safe(0), i64::MIN, "no safe bound known at first");
        s.pending(ids(["t0"]));
        assert_eq!(s.next_ready(), Some(0));
        s.defer(0);
        assert!(s.is_deferred(0));
        // Neither a notification nor the poll readies it: the check does.
        assert!(!s.notified(0));
        s.pending(ids(["t0"]));
        assert_eq!(s.next_ready(), None);
        s.cleared(0, 41);
        assert_eq!(s.safe(0), 41);
        assert_eq!(s.next_ready(), Some(0), "ready once its writers ended");
        // A later, lower bound (an older check) never moves it back.
        s.cleared(0, 7);
        assert_eq!(s.safe(0), 41);
        assert_eq!(
            s.next_ready(),
            None,
            "clearing a running tenant queues nothing"
        );
    }

    #[test]
    fn pending_tenants_become_ready_once_in_poll_order() {
        let mut s = tenants(3);
        s.pending(ids(["t2", "t0", "t2", "unknown"]));
        assert_eq!(s.next_ready(), Some(2));
        assert_eq!(s.next_ready(), Some(0));
        assert_eq!(s.next_ready(), None);
        // Running tenants are not queued again by a poll.
        s.pending(ids(["t2"]));
        assert_eq!(s.next_ready(), None);
    }

    #[test]
    fn busy_and_fresh_tenants_take_turns() {
        let mut s = tenants(4);
        let now = Instant::now();
        s.pending(ids(["t0", "t1", "t2", "t3"]));
        let first = s.next_ready().unwrap();
        assert_eq!(s.finished(first, Outcome::Published, now), Duration::ZERO);
        let mut order = Vec::new();
        for _ in 0..4 {
            let t = s.next_ready().unwrap();
            order.push(t);
            if t == 0 {
                s.finished(t, Outcome::Published, now);
            }
        }
        assert_eq!(
            order,
            [0, 1, 0, 2],
            "the busy tenant goes every other sweep, not behind the whole pending list"
        );
        assert_eq!(s.next_ready(), Some(0));
        assert_eq!(s.next_ready(), Some(3), "and no one starves");
    }

    #[test]
    fn hot_tenants_get_half_the_sweeps_from_the_start() {
        // 10 hot tenants and 10,000 with a few rows: the hot ones are
        // swept every other time as soon as their first batch is full.
        let mut s = tenants(10_010);
        let now = Instant::now();
        let names: Vec<String> = (0..10_010).map(|i| format!("t{i}")).collect();
        s.pending(ids(names.iter().map(String::as_str)));
        let mut hot_sweeps = 0;
        for _ in 0..1_000 {
            let t = s.next_ready().unwrap();
            if t < 10 {
                hot_sweeps += 1;
                s.finished(t, Outcome::Published, now);
            } else {
                s.finished(t, Outcome::Idle, now);
            }
        }
        assert!(
            (495..=515).contains(&hot_sweeps),
            "{hot_sweeps} of the first 1,000 sweeps went to the hot tenants"
        );
    }

    #[test]
    fn a_discovering_schedule_learns_tenants_from_the_poll_and_notifications() {
        let mut s = Schedule::discovering(Backoff::new(
            Duration::from_millis(100),
            Duration::from_millis(1000),
        ));
        assert!(s.is_empty() && s.knows("anyone"));
        s.pending(ids(["new"]));
        let t = s.next_ready().unwrap();
        assert_eq!(&**s.name(t), "new");
        let later = s.tenant("later").unwrap();
        assert!(s.notified(later));
        assert_eq!(s.next_ready(), Some(later));
        assert_eq!(s.tenant("new"), Some(t), "known once");
        assert_eq!(s.len(), 2);
        assert_eq!(tenants(1).tenant("other"), None, "configured tenants only");
    }

    #[test]
    fn discovered_tenants_that_wait_for_nothing_are_forgotten_and_their_slots_reused() {
        let mut s = Schedule::discovering(Backoff::new(
            Duration::from_millis(100),
            Duration::from_millis(1000),
        ));
        let now = Instant::now();
        s.pending(ids(["done", "failing", "pending", "queued"]));
        for _ in 0..2 {
            let t = s.next_ready().unwrap();
            let outcome = if &**s.name(t) == "failing" {
                Outcome::Failed
            } else {
                Outcome::Idle
            };
            s.finished(t, outcome, now);
        }
        // "pending" was swept and the poll still finds it pending (kept by
        // the caller); "queued" waits in the queue.
        let pending = s.next_ready().unwrap();
        assert_eq!(&**s.name(pending), "pending");
        s.finished(pending, Outcome::Idle, now);
        assert_eq!(s.forget_idle(|t| t == "pending"), 1, "only \"done\"");
        assert_eq!(s.len(), 3);
        // A new tenant takes the forgotten slot; the forgotten one comes
        // back as new when named again.
        let slots = s.names.len();
        s.tenant("newcomer").unwrap();
        assert_eq!(s.names.len(), slots, "the slot was reused");
        let again = s.tenant("done").unwrap();
        assert_eq!(&**s.name(again), "done");
        assert_eq!(s.len(), 5);
        // Configured tenants are never forgotten.
        let mut listed = tenants(2);
        assert_eq!(listed.forget_idle(|_| false), 0);
        assert_eq!(listed.len(), 2);
    }

    #[test]
    fn a_failing_tenant_backs_off_alone_and_doubles() {
        let mut s = tenants(2);
        let now = Instant::now();
        s.pending(ids(["t0", "t1"]));
        let t0 = s.next_ready().unwrap();
        assert_eq!(
            s.finished(t0, Outcome::Failed, now),
            Duration::from_millis(200)
        );
        assert_eq!(s.next_ready(), Some(1), "the other tenant is not held up");
        s.finished(1, Outcome::Idle, now);
        s.pending(ids(["t0"]));
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
            s.finished(0, Outcome::Failed, now),
            Duration::from_millis(400)
        );
        s.wake(now + Duration::from_secs(1));
        s.next_ready();
        assert_eq!(
            s.finished(0, Outcome::Failed, now),
            Duration::from_millis(800)
        );
        s.wake(now + Duration::from_secs(1));
        s.next_ready();
        assert_eq!(
            s.finished(0, Outcome::Failed, now),
            Duration::from_millis(1000),
            "capped"
        );
        s.wake(now + Duration::from_secs(2));
        s.next_ready();
        assert_eq!(
            s.finished(0, Outcome::Published, now),
            Duration::ZERO,
            "reset on success"
        );
        s.next_ready();
        assert_eq!(
            s.finished(0, Outcome::Failed, now),
            Duration::from_millis(200)
        );
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

    #[test]
    fn the_oldest_pending_row_goes_first() {
        let mut s = tenants(4);
        s.pending([("t0", 40), ("t1", 7), ("t2", 12), ("t3", 3)]);
        let order: Vec<usize> = std::iter::from_fn(|| s.next_ready()).collect();
        assert_eq!(
            order,
            [3, 1, 2, 0],
            "by lowest pending id, every tenant once"
        );
    }

    #[test]
    fn a_poll_unqueues_what_it_no_longer_finds_for_this_relay() {
        let mut s = tenants(5);
        let now = Instant::now();
        s.pending(ids(["t0", "t1", "t2"]));
        let t0 = s.next_ready().unwrap();
        s.finished(t0, Outcome::Published, now);
        // A poll starts; then a notification queues t3.
        let mark = s.mark();
        assert!(s.notified(3));
        // The poll finds t1 pending for this relay; t0 (busy) and t2 were
        // emptied by another replica, or belong to one now.
        s.settle(mark, |t| t == 1);
        let order: Vec<usize> = std::iter::from_fn(|| s.next_ready()).collect();
        assert_eq!(order, [1, 3], "t3 came after the poll started: kept");
        // The unqueued ones are idle: the next poll or notification readies them.
        s.pending(ids(["t0", "t2"]));
        assert_eq!(s.ready_len(), 2);
    }

    #[test]
    fn an_outage_is_no_tenants_failure_and_they_resume_at_the_next_poll() {
        let mut s = tenants(3);
        let now = Instant::now();
        s.pending(ids(["t0", "t1", "t2"]));
        // Every running sweep meets the outage (database or broker gone).
        for _ in 0..3 {
            let t = s.next_ready().unwrap();
            s.interrupted(t);
        }
        assert_eq!(s.next_wake(), None, "no tenant backs off");
        assert!(!s.has_ready(), "they wait for a poll, not a timer");
        // However long the outage, the first successful poll readies them all.
        s.wake(now + Duration::from_secs(60));
        assert!(!s.has_ready());
        s.pending(ids(["t0", "t1", "t2"]));
        let order: Vec<usize> = std::iter::from_fn(|| s.next_ready()).collect();
        assert_eq!(order, [0, 1, 2], "every tenant at once");
        // Their first failure of their own afterwards is a first failure.
        assert_eq!(
            s.finished(0, Outcome::Failed, now),
            Duration::from_millis(200),
            "nothing was counted against t0"
        );
    }

    #[test]
    fn an_outage_keeps_a_tenants_own_back_off_as_it_was() {
        let mut s = tenants(1);
        let now = Instant::now();
        s.pending(ids(["t0"]));
        s.next_ready();
        assert_eq!(
            s.finished(0, Outcome::Failed, now),
            Duration::from_millis(200)
        );
        s.wake(now + Duration::from_millis(200));
        s.next_ready();
        s.interrupted(0);
        s.pending(ids(["t0"]));
        assert_eq!(s.next_ready(), Some(0), "ready at the poll, no back-off");
        assert_eq!(
            s.finished(0, Outcome::Failed, now),
            Duration::from_millis(400),
            "its own refusals still count: neither grown nor reset by the outage"
        );
    }

    #[test]
    fn a_notification_readies_an_idle_tenant_at_once() {
        let mut s = tenants(3);
        assert!(s.notified(1));
        assert!(!s.notified(1), "already ready: queued once");
        assert_eq!(s.next_ready(), Some(1));
        assert_eq!(s.next_ready(), None);
    }

    #[test]
    fn notifications_during_a_sweep_ask_for_one_follow_up_whatever_its_outcome() {
        for outcome in [Outcome::Idle, Outcome::Skipped, Outcome::Published] {
            let mut s = tenants(1);
            s.notified(0);
            s.next_ready();
            assert!(s.notified(0), "flagged");
            assert!(!s.notified(0), "coalesced into the one follow-up");
            s.finished(0, outcome, Instant::now());
            assert_eq!(s.next_ready(), Some(0), "{outcome:?}: swept once more");
            assert_eq!(s.next_ready(), None, "{outcome:?}: once");
            s.finished(0, Outcome::Idle, Instant::now());
            assert!(!s.has_ready(), "{outcome:?}: the flag was used up");
        }
    }

    #[test]
    fn a_back_off_stands_against_notifications() {
        let mut s = tenants(1);
        let now = Instant::now();
        s.notified(0);
        s.next_ready();
        s.notified(0);
        s.finished(0, Outcome::Failed, now);
        assert!(
            !s.has_ready(),
            "the failure's back-off wins over the follow-up"
        );
        assert!(!s.notified(0));
        assert!(!s.has_ready());
        s.wake(now + Duration::from_secs(1));
        assert_eq!(s.next_ready(), Some(0));
        s.interrupted(0);
        assert!(!s.has_ready());
    }

    #[test]
    fn an_outage_drops_the_follow_up() {
        let mut s = tenants(1);
        s.notified(0);
        s.next_ready();
        s.notified(0);
        s.interrupted(0);
        assert!(!s.has_ready(), "an outage waits for the poll");
        s.pending(ids(["t0"]));
        assert_eq!(s.next_ready(), Some(0));
        s.finished(0, Outcome::Idle, Instant::now());
        assert!(!s.has_ready(), "no stale follow-up");
    }

    #[test]
    fn skipped_tenants_wait_for_the_next_poll() {
        let mut s = tenants(1);
        s.pending(ids(["t0"]));
        let t = s.next_ready().unwrap();
        s.finished(t, Outcome::Skipped, Instant::now());
        assert!(!s.has_ready());
        s.pending(ids(["t0"]));
        assert_eq!(s.next_ready(), Some(0));
    }
}
