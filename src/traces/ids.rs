//! Trace and span ids for the relay's spans: random, never all zeros, from
//! a generator per thread (splitmix64) seeded from the process's random
//! hasher keys, the thread and the time.

use std::cell::Cell;
use std::hash::{BuildHasher, RandomState};
use std::time::Instant;

thread_local! {
    static STATE: Cell<u64> = Cell::new(
        RandomState::new().hash_one((std::thread::current().id(), Instant::now())),
    );
}

fn next() -> u64 {
    STATE.with(|state| {
        let mut z = state.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        state.set(z);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

/// A new span id.
pub fn span_id() -> u64 {
    loop {
        let id = next();
        if id != 0 {
            return id;
        }
    }
}

/// A new trace id.
pub fn trace_id() -> u128 {
    loop {
        let id = (u128::from(next()) << 64) | u128::from(next());
        if id != 0 {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn ids_are_never_zero_and_do_not_repeat() {
        let spans: HashSet<u64> = (0..10_000).map(|_| span_id()).collect();
        assert_eq!(spans.len(), 10_000);
        assert!(!spans.contains(&0));
        let traces: HashSet<u128> = (0..10_000).map(|_| trace_id()).collect();
        assert_eq!(traces.len(), 10_000);
        let other = std::thread::spawn(span_id).join().unwrap();
        assert!(
            !spans.contains(&other),
            "another thread has its own sequence"
        );
    }
}
