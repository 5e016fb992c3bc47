//! The pure part of scheduling: each tenant's state, the two ready queues
//! and the stamps that tell a poll's answer what it knew of them, the
//! back-off of failing tenants, and the tenants known (configured, or
//! discovered and forgotten again). No I/O and no clock of its own: the
//! loop in `scheduler` tells it what happened, and when.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::domain::Outcome;

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
    /// the writers' check finds them ended (see `Scheduler::checked`).
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
    /// the tenants it forgot.
    pub fn forget_idle(&mut self, keep: impl Fn(&str) -> bool) -> Vec<Arc<str>> {
        let mut forgotten = Vec::new();
        if !self.discovers {
            return forgotten;
        }
        let empty: Arc<str> = Arc::from("");
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
            forgotten.push(std::mem::replace(&mut self.names[i], empty.clone()));
            self.free.push(i);
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
    /// [`TAKEOVER_POLLS`](super::TAKEOVER_POLLS)): queued after this relay's own, newest first. The
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
    /// queued before this mark (see [`Schedule::unqueue_unfound`]).
    pub fn mark(&self) -> u64 {
        self.queued
    }

    /// A poll that started at `mark` answered: unqueues what it did not find
    /// for this relay. A tenant queued before the mark stays queued only if `keep` says so (the poll found rows pending for
    /// it, and this relay is to sweep it); the others go back to idle. So a
    /// tenant another replica emptied, or one that a change of replicas gave
    /// to another, is not swept for nothing. Tenants queued after the mark
    /// (a notification, a sweep that ended) stay: the poll may have read
    /// the table before their rows were committed.
    pub fn unqueue_unfound(&mut self, mark: u64, keep: impl Fn(usize) -> bool) {
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

    /// Forgets every safe bound: they were found on another instance of
    /// the server, or the check that keeps them could not run.
    pub fn forget_safe(&mut self) {
        self.safe.fill(i64::MIN);
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
        assert_eq!(
            s.forget_idle(|t| t == "pending"),
            [Arc::from("done")],
            "only \"done\""
        );
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
        assert!(listed.forget_idle(|_| false).is_empty());
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
        s.unqueue_unfound(mark, |t| t == 1);
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
