//! A tenant's lag as the relay reports it (the `outbox_lag_seconds` gauge and
//! `/healthz`): the longer of two measures of how long its oldest pending row
//! has waited.
//!
//! - **The database's**: `clock_timestamp() - occurred_at` of the tenant's
//!   lowest pending id (clamped to 0 … 10,000 years, see
//!   `src/store/pending_tenants.sql`). A writer whose clock runs fast, or an
//!   `occurred_at` in the future, makes it 0 while the row waits.
//! - **The relay's own**: how long the poll has kept finding that same id as
//!   the tenant's lowest pending one. It starts when this relay first sees the
//!   id (so at the relay's start, for a row already waiting), and it does not
//!   depend on any writer's clock.
//!
//! The poll is the one writer ([`LagTracker::observe`]); `/healthz` reads
//! ([`LagTracker::lag_ms`]). Only configured tenants are tracked, so the map
//! is bounded by the configuration.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::time::Instant;

/// Since when the poll has seen each tenant's lowest pending id.
#[derive(Debug, Default)]
pub struct LagTracker {
    seen: Mutex<HashMap<String, Seen>>,
}

/// A lowest pending id and when the poll first found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    id: i64,
    since: Instant,
}

impl LagTracker {
    pub fn new() -> LagTracker {
        LagTracker::default()
    }

    /// The poll found `oldest_id` as `tenant`'s lowest pending id (`None`:
    /// nothing pending) and the database put its age at `database_lag_ms`.
    /// Remembers since when that id has been the oldest; returns the lag to
    /// report.
    pub fn observe(
        &self,
        tenant: &str,
        oldest_id: Option<i64>,
        database_lag_ms: i64,
        now: Instant,
    ) -> i64 {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let Some(id) = oldest_id else {
            seen.remove(tenant);
            return 0;
        };
        let entry = match seen.get_mut(tenant) {
            Some(entry) if entry.id == id => *entry,
            Some(entry) => {
                *entry = Seen { id, since: now };
                *entry
            }
            None => *seen
                .entry(tenant.to_string())
                .or_insert(Seen { id, since: now }),
        };
        longer(database_lag_ms, entry, now)
    }

    /// The lag to report for `tenant`, whose lowest pending id is now
    /// `oldest_id` at `database_lag_ms` by the database: the relay's own
    /// measure counts only while it is still the id the poll last saw.
    pub fn lag_ms(
        &self,
        tenant: &str,
        oldest_id: Option<i64>,
        database_lag_ms: i64,
        now: Instant,
    ) -> i64 {
        let Some(id) = oldest_id else {
            return 0;
        };
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        match seen.get(tenant) {
            Some(entry) if entry.id == id => longer(database_lag_ms, *entry, now),
            _ => database_lag_ms.max(0),
        }
    }
}

/// The longer of the database's lag and the time since `seen`.
fn longer(database_lag_ms: i64, seen: Seen, now: Instant) -> i64 {
    let waited = now.saturating_duration_since(seen.since).as_millis();
    database_lag_ms
        .max(i64::try_from(waited).unwrap_or(i64::MAX))
        .max(0)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_row_from_a_fast_clock_lags_from_when_the_poll_first_saw_it() {
        let tracker = LagTracker::new();
        let start = Instant::now();
        // occurred_at in the future: the database says 0 each time.
        assert_eq!(tracker.observe("a", Some(7), 0, start), 0);
        assert_eq!(tracker.observe("a", Some(7), 0, start + ms(1_500)), 1_500);
        assert_eq!(tracker.lag_ms("a", Some(7), 0, start + ms(2_000)), 2_000);
        // The database's measure wins when it is the longer one.
        assert_eq!(
            tracker.observe("a", Some(7), 9_000, start + ms(2_500)),
            9_000
        );
    }

    #[test]
    fn a_new_oldest_row_starts_the_count_again() {
        let tracker = LagTracker::new();
        let start = Instant::now();
        tracker.observe("a", Some(7), 0, start);
        assert_eq!(tracker.observe("a", Some(8), 40, start + ms(5_000)), 40);
        assert_eq!(tracker.observe("a", Some(8), 0, start + ms(5_300)), 300);
        // Nothing pending: 0, and the count is forgotten.
        assert_eq!(tracker.observe("a", None, 0, start + ms(6_000)), 0);
        assert_eq!(tracker.observe("a", Some(8), 0, start + ms(7_000)), 0);
    }

    #[test]
    fn healthz_counts_the_wait_only_for_the_row_the_poll_saw() {
        let tracker = LagTracker::new();
        let start = Instant::now();
        tracker.observe("a", Some(7), 0, start);
        assert_eq!(tracker.lag_ms("a", Some(9), 12, start + ms(4_000)), 12);
        assert_eq!(tracker.lag_ms("a", None, 0, start + ms(4_000)), 0);
        assert_eq!(tracker.lag_ms("b", Some(1), 5, start + ms(4_000)), 5);
        assert_eq!(tracker.lag_ms("a", Some(7), 0, start + ms(4_000)), 4_000);
    }

    #[test]
    fn tenants_are_tracked_apart() {
        let tracker = LagTracker::new();
        let start = Instant::now();
        tracker.observe("a", Some(1), 0, start);
        tracker.observe("b", Some(2), 0, start + ms(1_000));
        assert_eq!(tracker.lag_ms("a", Some(1), 0, start + ms(3_000)), 3_000);
        assert_eq!(tracker.lag_ms("b", Some(2), 0, start + ms(3_000)), 2_000);
    }
}
