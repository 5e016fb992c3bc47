//! How new rows reach the schedule between polls: notifications name their
//! tenants (`wakeup`), and with `wakeup = sequence`, while rows flow, reads
//! of the id sequence list the tenants with rows pending instead.

use std::collections::VecDeque;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;

use super::{Schedule, Scheduler};
use crate::config::Wakeup;
use crate::store::{StoreError, Watched, Writers};

/// `wakeup = sequence`: while rows flow, the id sequence's position is read
/// this often, and a move (and the read after one) lists the tenants with
/// rows pending among the ids drawn since the position of [`WATCH_WINDOW`]
/// ago, the last [`WATCH_SPAN`] at most; they are readied as a notification
/// would ready them ...
pub const WATCH_TICK: Duration = Duration::from_millis(5);
pub const WATCH_WINDOW: Duration = Duration::from_millis(100);
pub const WATCH_SPAN: i64 = 1024;
/// ... or this often after a read that saw it move: while rows flow, a row's
/// commit is mostly found by the read after the one that saw its draw, so
/// these reads set the wake-up's delay (at 1,000 rows/s over 10 tenants, p99
/// 10–11 ms against 16–18 at 5 ms; docs/benchmarks.md), and a drain, which
/// moves nothing, is not charged for them ...
pub const WATCH_TICK_MOVING: Duration = Duration::from_millis(2);
/// ... but only this often while tenants already wait for a sweep (every
/// slot of `concurrency` is taken): a tenant the read would list could not
/// start sooner, only join the queue, and at five-millisecond intervals the
/// reads of three relays cost PostgreSQL and the relays about 4 µs per
/// message of a drain (docs/benchmarks.md). A slot that frees with no tenant
/// waiting brings the next read at once ...
pub const WATCH_TICK_BUSY: Duration = Duration::from_millis(25);
/// ... until it has stood still this long with nothing to sweep, as a read
/// answered that long after the last move found it: then the relay asks
/// writers for a notification again (the wake-up lock) and waits.
pub const WATCH_QUIET: Duration = Duration::from_millis(100);

pub(super) type PositionRead = Pin<Box<dyn Future<Output = Result<Watched, StoreError>> + Send>>;
pub(super) type GlobalCheck = Pin<Box<dyn Future<Output = Result<Writers, StoreError>> + Send>>;

/// `wakeup = sequence`: whether the relay watches the id sequence (rows
/// flow, no writer notifies) or waits for a notification (it holds the
/// wake-up lock, every insert notifies).
pub(super) struct Watch {
    watching: bool,
    /// The position last read, and whether that read saw it move.
    position: i64,
    pub(super) moved: bool,
    /// The positions read in the last [`WATCH_WINDOW`], and the newest
    /// before it: where the lists of pending tenants start.
    history: VecDeque<(Instant, i64)>,
    /// The last sign of rows flowing.
    active_at: Instant,
    /// When the last read was answered, and when the next is due while no
    /// tenant waits for a sweep.
    read_at: Instant,
    next_tick: Instant,
    pub(super) tick: Option<PositionRead>,
    /// Once the wake-up lock is taken: are writers in flight that took their
    /// id before, and so will not notify?
    pub(super) in_flight: Option<GlobalCheck>,
}

impl Watch {
    /// Waiting for a notification, nothing read yet.
    pub(super) fn new() -> Watch {
        Watch {
            watching: false,
            position: 0,
            moved: false,
            history: VecDeque::new(),
            active_at: Instant::now(),
            read_at: Instant::now(),
            next_tick: Instant::now(),
            tick: None,
            in_flight: None,
        }
    }
}

impl Scheduler {
    /// Notifications arrived: each notified tenant this relay owns is swept
    /// at once (or once more after its running sweep); a poll asked for (the
    /// LISTEN connection is back, or a name too long to notify) is due now.
    pub(super) fn woken(&mut self, now: Instant) {
        let woken = self.relay.wakeups.take();
        if woken.poll {
            self.next_poll = self.next_poll.min(now);
        }
        // The wake-up connection keeps no session: no notification comes.
        if self.relay.wakeups.pooled() {
            self.active(now);
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

    /// Rows flow (a notification, a sweep that published, a poll that found
    /// rows): with `wakeup = sequence` (or a wake-up connection that keeps
    /// no session), the relay watches the id sequence and no longer asks
    /// writers to notify.
    pub(super) fn active(&mut self, now: Instant) {
        if self.relay.config.wakeup != Wakeup::Sequence && !self.relay.wakeups.pooled() {
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

    /// Starts the next read of the id sequence's position when due (see
    /// [`WATCH_TICK_BUSY`]), or, once it has stood still for [`WATCH_QUIET`]
    /// with nothing to sweep, goes back to waiting for a notification (but
    /// for a wake-up connection that keeps no session: none would come).
    /// Returns when to look again.
    pub(super) fn watch_turn(&mut self, now: Instant) -> Option<Instant> {
        if !self.watch.watching || self.watch.tick.is_some() {
            return None;
        }
        // Quiet as a read found it: one answered a full WATCH_QUIET after the
        // last sign of rows flowing, not merely that long after (a relay
        // kept off the CPU for a while reads once more before it stops).
        let quiet = !self.relay.wakeups.pooled()
            && self.watch.read_at >= self.watch.active_at + WATCH_QUIET
            && self.sweeps.is_empty()
            && !self.schedule.has_ready()
            && self.candidates.is_empty();
        if quiet {
            self.watch.watching = false;
            self.relay.wakeups.want_notifications(true);
            return None;
        }
        let saturated =
            self.schedule.has_ready() && self.sweeps.len() >= self.relay.config.concurrency;
        let due = if saturated {
            self.watch
                .next_tick
                .max(self.watch.read_at + WATCH_TICK_BUSY)
        } else {
            self.watch.next_tick
        };
        if now >= due {
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
        Some(due)
    }

    /// The id sequence's position was read: on a move (or the read after
    /// one: a row's commit follows its draw) the read listed the tenants
    /// with rows pending, and each is readied as a notification would be.
    pub(super) fn position_read(&mut self, read: Result<Watched, StoreError>) {
        let now = Instant::now();
        self.watch.read_at = now;
        let Ok(Watched { position, tenants }) = read else {
            self.watch.next_tick = now + self.relay.config.poll_interval();
            return;
        };
        let moved = position != self.watch.position;
        self.watch.next_tick = now + if moved { WATCH_TICK_MOVING } else { WATCH_TICK };
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
}
