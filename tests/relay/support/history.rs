//! Checking a history: what the consumer received against what was
//! committed, for liveness (L), order (O) and duplicates (D).

use std::collections::BTreeMap;
use std::time::Duration;

use super::{Broker, Outbox, by_tenant, eventually};

/// Checks a history against what was committed: **L** every committed row was
/// received at least once and is marked published, **O** per tenant the first
/// occurrences of ids are exactly the committed ids in increasing order.
/// Returns the number of duplicate deliveries (for **D**).
pub async fn check_history(
    outbox: &Outbox,
    broker: &Broker,
    committed: &BTreeMap<String, Vec<i64>>,
    limit: Duration,
) -> usize {
    let total: usize = committed.values().map(Vec::len).sum();
    eventually("L: every committed row marked published", limit, || async {
        outbox.all_pending().await == 0
    })
    .await;
    // The consumer may trail the marks on a loaded machine: the same limit.
    eventually("L: every committed row received", limit, || async {
        broker
            .received()
            .iter()
            .map(|r| r.id)
            .collect::<std::collections::HashSet<_>>()
            .len()
            >= total
    })
    .await;
    let received = broker.received();
    for (tenant, ids) in by_tenant(&received) {
        let mut seen = std::collections::HashSet::new();
        let firsts: Vec<i64> = ids.into_iter().filter(|id| seen.insert(*id)).collect();
        let expected = committed
            .get(&tenant)
            .unwrap_or_else(|| panic!("unexpected tenant {tenant}"));
        assert!(
            firsts.windows(2).all(|w| w[0] < w[1]),
            "O: {tenant}'s first occurrences are not increasing"
        );
        assert_eq!(
            &firsts, expected,
            "L/O: {tenant} received exactly its committed rows, in order"
        );
    }
    assert_eq!(
        committed.len(),
        by_tenant(&received).len(),
        "L: every tenant received"
    );
    received.len() - total
}
