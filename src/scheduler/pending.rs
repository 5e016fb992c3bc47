//! What the poll found pending, taken in: each tenant's lag (the one
//! source of the lag gauge) and parked rows, which replica sweeps which
//! pending tenant, and the ready queues brought in line with it.

use std::collections::HashSet;

use tokio::time::Instant;

use super::Scheduler;
use crate::store::{self, Page, PendingTenant};

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

/// How many distinct unconfigured tenants are warned about (once each).
const UNCONFIGURED_WARNINGS: usize = 100;

/// What the polls last found of a pending tenant.
#[derive(Debug, Clone, Copy)]
pub(super) struct Seen {
    /// Its lowest pending id ...
    oldest_id: i64,
    /// ... found by this many polls in a row (see [`TAKEOVER_POLLS`]) ...
    polls: u32,
    /// ... the last time in this cycle of pages.
    cycle: u64,
}

/// What a page of the poll says of the pending tenants this relay relays.
struct PageFound<'a> {
    /// The tenants the page covered.
    in_page: HashSet<usize>,
    /// Their lags, for the gauge.
    lags: Vec<(&'a str, i64)>,
    /// The tenants this relay owns, with their lowest pending ids ...
    due: Vec<(&'a str, i64)>,
    /// ... and those it takes from another replica (see [`TAKEOVER_POLLS`]).
    taken: Vec<(&'a str, i64)>,
    /// The tenants of `due` and `taken`: they stay queued.
    keep: HashSet<usize>,
}

/// Which replica sweeps a pending tenant the poll found.
enum Sweeper {
    /// This relay, the tenant's owner.
    Owner,
    /// This relay, in the owner's place (see [`TAKEOVER_POLLS`]).
    TakingOver,
    /// Its owner, another replica.
    Other,
}

impl Scheduler {
    /// Takes in a page the poll found: the replicas, each tenant's lag and
    /// parked rows, where the next page starts, and the ready queues.
    pub(super) fn take_pending(&mut self, found: store::Polled, page: &Page) {
        let store::Polled {
            pending,
            listeners,
            parked,
        } = found;
        self.learn_members(&listeners);
        if !pending.is_empty() {
            self.work_since.seen();
        }
        let now = Instant::now();
        // A page that was not full ends the cycle; one that started it too
        // saw every pending tenant.
        let last_page = pending.len() < page.limit;
        let whole = last_page && page.after.is_none();
        let PageFound {
            in_page,
            lags,
            due,
            taken,
            keep,
        } = self.sort_pending(&pending, now);
        self.record_lags(lags, last_page, now);
        self.poll_after = if last_page {
            None
        } else {
            pending.last().map(|last| last.tenant.clone())
        };
        self.record_parked(parked);
        let ready_before = self.schedule.ready_len();
        // A tenant the page did not cover may be pending still: it stays.
        self.schedule.unqueue_unfound(self.poll_mark, |i| {
            keep.contains(&i) || (!whole && !in_page.contains(&i))
        });
        let kept = self.schedule.ready_len();
        let due_len = due.len() + taken.len();
        if due_len > 0 {
            self.active(now);
        }
        self.schedule.pending(due);
        self.schedule.taken_over(taken);
        if last_page {
            let pending = &self.last_pending;
            for tenant in self
                .schedule
                .forget_idle(|tenant| pending.contains_key(tenant))
            {
                self.relay.store.forget_tenant(&tenant);
            }
        }
        tracing::debug!(
            pending = pending.len(),
            due = due_len,
            members = self.members.len(),
            member = self.member,
            ready_before,
            unqueued = ready_before - kept,
            ready = self.schedule.ready_len(),
            took_ms = self.last_poll_took.as_millis() as u64,
            "polled"
        );
    }

    /// The replicas, as the relays LISTENing for this table's notifications
    /// (see `wakeup`), and whether this relay is among them: it then knows
    /// which tenants are its own.
    fn learn_members(&mut self, listeners: &[String]) {
        self.members = listeners
            .iter()
            .filter_map(|name| self.relay.wakeups.member_of(name))
            .map(str::to_string)
            .collect();
        self.members.sort_unstable();
        self.members.dedup();
        self.member = self.relay.wakeups.is_member(&self.members);
    }

    /// Goes through the page's pending tenants: an unconfigured one is
    /// warned about and left; each other one has its lag observed, its
    /// polls counted (see [`Scheduler::seen_again`]), and is sorted by who
    /// sweeps it (see [`Scheduler::sweeper`]).
    fn sort_pending<'a>(&mut self, pending: &'a [PendingTenant], now: Instant) -> PageFound<'a> {
        let own_queue_empty = !self.schedule.has_ready();
        let mut found = PageFound {
            in_page: HashSet::with_capacity(pending.len()),
            lags: Vec::with_capacity(pending.len() + self.last_pending.len()),
            due: Vec::with_capacity(pending.len()),
            taken: Vec::new(),
            keep: HashSet::with_capacity(pending.len()),
        };
        for PendingTenant {
            tenant,
            oldest_id,
            lag_ms,
        } in pending
        {
            if !self.schedule.knows(tenant) {
                self.warn_unconfigured(tenant);
                continue;
            }
            let lag = self
                .relay
                .lag
                .observe(tenant, Some(*oldest_id), *lag_ms, now);
            found.lags.push((tenant.as_str(), lag));
            let polls = self.seen_again(tenant, *oldest_id);
            let index = self.schedule.tenant(tenant);
            found.in_page.extend(index);
            let queue = match self.sweeper(tenant, polls, own_queue_empty) {
                Sweeper::Owner => &mut found.due,
                Sweeper::TakingOver => &mut found.taken,
                Sweeper::Other => continue,
            };
            queue.push((tenant.as_str(), *oldest_id));
            found.keep.extend(index);
        }
        found
    }

    /// Rows are pending for a tenant this relay does not relay: warned
    /// about once, for the first [`UNCONFIGURED_WARNINGS`] such tenants.
    fn warn_unconfigured(&mut self, tenant: &str) {
        if self.unconfigured.len() < UNCONFIGURED_WARNINGS
            && self.unconfigured.insert(tenant.to_string())
        {
            tracing::warn!(
                tenant,
                "rows are pending for a tenant this relay is not configured for; they stay pending until a relay lists it in `tenants`"
            );
        }
    }

    /// How many polls in a row have found `oldest_id` as the tenant's lowest
    /// pending id, this one included; remembered as seen in this cycle.
    fn seen_again(&mut self, tenant: &String, oldest_id: i64) -> u32 {
        let polls = match self.last_pending.get(tenant) {
            Some(seen) if seen.oldest_id == oldest_id => seen.polls.saturating_add(1),
            _ => 1,
        };
        self.last_pending.insert(
            tenant.clone(),
            Seen {
                oldest_id,
                polls,
                cycle: self.cycle,
            },
        );
        polls
    }

    /// Who sweeps a pending tenant: this relay when it owns it; this relay
    /// too when its owner has left the same lowest pending id for
    /// [`TAKEOVER_POLLS`] polls, or for [`TAKEOVER_IDLE_POLLS`] while this
    /// relay has nothing queued and is the tenant's successor; otherwise
    /// its owner.
    fn sweeper(&self, tenant: &str, polls: u32, own_queue_empty: bool) -> Sweeper {
        if self.relay.wakeups.sweeps_at_once(tenant, &self.members) {
            Sweeper::Owner
        } else if polls >= TAKEOVER_POLLS
            || (own_queue_empty
                && polls >= TAKEOVER_IDLE_POLLS
                && self.relay.wakeups.succeeds(tenant, &self.members))
        {
            Sweeper::TakingOver
        } else {
            Sweeper::Other
        }
    }

    /// Sets the lag gauges: the page's tenants', and at the end of a cycle
    /// those of the tenants no page of it found (emptied: their lag is 0
    /// now).
    fn record_lags(&mut self, lags: Vec<(&str, i64)>, last_page: bool, now: Instant) {
        let emptied = if last_page {
            self.end_cycle()
        } else {
            Vec::new()
        };
        for tenant in &emptied {
            self.relay.lag.observe(tenant, None, 0, now);
        }
        let emptied = emptied.iter().map(|tenant| (tenant.as_str(), 0));
        self.relay.metrics.set_lags(lags.into_iter().chain(emptied));
    }

    /// Ends a cycle of pages: forgets the pending tenants no page of it
    /// found, and returns them (emptied).
    fn end_cycle(&mut self) -> Vec<String> {
        let mut emptied = Vec::new();
        let cycle = self.cycle;
        self.last_pending.retain(|tenant, seen| {
            let pending = seen.cycle == cycle;
            if !pending {
                emptied.push(tenant.clone());
            }
            pending
        });
        self.cycle += 1;
        emptied
    }

    /// Sets the parked-rows gauges: the parked rows of the tenants this
    /// relay relays, as the database counts them (the same on every
    /// replica, and after a restart).
    fn record_parked(&self, parked: Vec<(String, i64)>) {
        let relays_all = self.relay.config.tenants.discovers();
        let parked: Vec<(String, i64)> = parked
            .into_iter()
            .filter(|(tenant, _)| relays_all || self.schedule.knows(tenant))
            .collect();
        self.relay.metrics.set_parked(&parked);
    }
}
