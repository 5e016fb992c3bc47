//! The per-tenant back-off policy: `min(poll · 2^failures, max(poll, max_backoff))`.

use std::time::Duration;

/// How long a tenant waits after consecutive failed sweeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Backoff {
    /// `base` is `poll_ms`; `max` is `max_backoff_ms`. The cap is never below the base.
    pub fn new(base: Duration, max: Duration) -> Backoff {
        Backoff {
            base,
            cap: max.max(base),
        }
    }

    /// The delay before the next sweep after `failures` consecutive failures
    /// (the first failure waits `2 · base`).
    pub fn delay(&self, failures: u32) -> Duration {
        let factor = 1u32.checked_shl(failures.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn doubles_from_the_poll_interval_up_to_the_cap() {
        let b = Backoff::new(ms(200), ms(30_000));
        let delays: Vec<u64> = (0..10).map(|f| b.delay(f).as_millis() as u64).collect();
        assert_eq!(
            delays,
            [
                200, 400, 800, 1600, 3200, 6400, 12_800, 25_600, 30_000, 30_000
            ]
        );
    }

    #[test]
    fn the_cap_is_never_below_the_poll_interval() {
        let b = Backoff::new(ms(5_000), ms(1));
        assert_eq!(b.delay(0), ms(5_000));
        assert_eq!(b.delay(7), ms(5_000));
    }

    #[test]
    fn never_overflows_and_never_decreases() {
        for base in [1u64, 7, 200, 60_000] {
            for cap in [1u64, 999, 30_000, u64::MAX / 2] {
                let b = Backoff::new(ms(base), ms(cap));
                let mut last = Duration::ZERO;
                for failures in 0..200 {
                    let d = b.delay(failures);
                    assert!(d >= last, "base {base} cap {cap} failures {failures}");
                    assert!(d <= ms(cap.max(base)));
                    assert!(d >= ms(base.min(cap.max(base))));
                    last = d;
                }
            }
        }
    }
}
